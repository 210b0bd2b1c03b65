"""verl-check's two engines, sharing disabled vs enabled with every micro-batch run unshared, on the CPU:
are their computations the same? (issue 21, Qwen3.5-0.8B (128, 32)'s 0.66-0.80x with identical decisions)

    PYTHONPATH=$PWD python scripts/verl_check_paths.py qwen3.5    # or qwen2.5

Runs `ps_bridge.tools.verl_check.run_check` on a tiny random checkpoint of the family (fp32, CPU), the first
engine our engine with `PrefixSharingConfig(enabled=False)`, the second `enabled=True` with
`PS_BRIDGE_SHARING=off` (every micro-batch unshared, as the rule decided on the H200). For every
forward step it records the layout (tokens, padded cu_seqlens, positions, output positions, row
sources: hence the micro-batch's samples and their order) and the number of each op the model ran
(torch.profiler, CPU), and prints per forward step which of them differ between the two engines.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile


def main() -> int:
    family = sys.argv[1] if len(sys.argv) > 1 else "qwen3.5"
    os.environ["PS_BRIDGE_SHARING"] = "off"
    from ps_bridge.tools.cli.verl_check import _prepare_process

    _prepare_process()
    import torch
    from torch.profiler import ProfilerActivity, profile

    import ps_bridge.tools.verl_check.side_by_side as vt
    from ps_bridge.tools import verl_check as check
    from ps_bridge.verl import engine as E

    check.stock_kind = lambda ckpt: "ps-bridge-unshared"  # the first engine: ours, sharing disabled
    records = collections.defaultdict(list)
    current = {}
    run_kind, run_packed = check.run_kind, E.run_packed

    def kind_recorded(kind, *a, **k):
        current["kind"] = kind
        return run_kind(kind, *a, **k)

    def packed_recorded(model, layout, cfg):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = run_packed(model, layout, cfg)
        ops = collections.Counter(ev.name for ev in prof.events())
        records[current["kind"]].append(dict(
            grad=torch.is_grad_enabled(), shared=layout.shared, tokens=layout.tokens.tolist(),
            cu_seqlens_padded=layout.cu_seqlens_padded.tolist(), positions=layout.positions.tolist(),
            output_positions=None if layout.output_positions is None else layout.output_positions.tolist(),
            row_source=layout.row_source.tolist(), ops=dict(ops)))
        return out

    check.run_kind, E.run_packed = kind_recorded, packed_recorded
    workdir = tempfile.mkdtemp(prefix="ps-bridge-paths-")
    vt.tiny_checkpoint(workdir, family)
    settings = check.CheckSettings(
        model=workdir, prompts=4, n=4, prompt_len=24, response_len=8, steps=2, dtype="float32", workdir=workdir,
        overrides=["actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.optim.clip_grad=0.0"])
    print(check.format_report(check.run_check(settings)))
    off, on = records["stock"], records["shared"]
    print(f"forward steps: disabled {len(off)}, enabled {len(on)}")
    same = len(off) == len(on)
    for i, (a, b) in enumerate(zip(off, on)):
        fields = [k for k in a if a[k] != b[k]]
        same &= not fields
        print(f"{i}: {'fwd+bwd' if a['grad'] else 'fwd'} tokens {len(a['tokens'])}/{len(b['tokens'])} "
              f"ops {sum(a['ops'].values())}/{sum(b['ops'].values())} differing: {fields or 'none'}")
    print("identical computations" if same else "DIFFERENT computations")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
