"""Test-only verl `external_lib` (tests/test_grpo_e2e.py): ps-bridge exactly as `external_lib=ps_bridge.verl`
loads it, except that the actor's weight export to the rollout engine keeps sending the tensors of its first
call. vLLM then samples every step with the initial weights while the actor trains: the failure the grpo
verdict must catch (its rollout-vs-actor check). Importable only with tests/ on PYTHONPATH."""

import ps_bridge.verl  # noqa: F401  (registers ps-bridge's bridges and engine, as external_lib=ps_bridge.verl)
from ps_bridge.verl.engine import PrefixSharedMegatronEngine

_first_export = []
_export = PrefixSharedMegatronEngine.get_per_tensor_param


def _stale_export(self, *args, **kwargs):
    params, peft_config = _export(self, *args, **kwargs)
    if not _first_export:
        # clones: the export may hand out views of the live parameters, which the optimizer changes in place
        _first_export.extend((name, tensor.detach().clone()) for name, tensor in params)
        print(f"[grpo_stale_export] weight export frozen at its first result ({len(_first_export)} tensors)",
              flush=True)
    else:
        for _ in params:  # run the real export through (its side effects), send the first one's tensors
            pass
    return iter(list(_first_export)), peft_config


PrefixSharedMegatronEngine.get_per_tensor_param = _stale_export
