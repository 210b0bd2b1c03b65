"""Gated DeltaNet (Qwen3.5) with each prompt's final states forked into its responses, by named backend.

One module per part:
- `forked.py`: the algorithm (`prefix_shared_gated_delta_net`: forked causal conv, forked delta rule,
  `fork_states`);
- `inputs.py`: the decay and beta gates and the q/k l2 norm, plain and fused (`gates`, `l2_normalize`);
- `plan.py`: where the kernels find prompts, responses and the fork between them (`GDNPlan`);
- `torch_ref.py`: the `torch_ref` backend, plain PyTorch, exact, any device (the reference);
- `fla.py`: the `fla` backend, fla-core's Triton kernels (CUDA);
- `registry.py`: `GDN_BACKENDS` by name, `auto` (fla on CUDA, else torch_ref), and
  `check_gdn_backend_usable`.
"""

from ps_bridge.kernels.gdn.forked import (
    fork_states,
    forked_causal_conv1d,
    forked_gated_delta_rule,
    prefix_shared_gated_delta_net,
)
from ps_bridge.kernels.gdn.inputs import gates, l2_normalize
from ps_bridge.kernels.gdn.plan import GDNPlan, plan_from_layout
from ps_bridge.kernels.gdn.registry import (
    GDN_BACKENDS,
    GDNBackend,
    check_gdn_backend_usable,
    choose_gdn_backend,
    resolve_gdn_backend,
)

__all__ = [
    "GDN_BACKENDS",
    "GDNBackend",
    "GDNPlan",
    "check_gdn_backend_usable",
    "choose_gdn_backend",
    "fork_states",
    "forked_causal_conv1d",
    "forked_gated_delta_rule",
    "gates",
    "l2_normalize",
    "plan_from_layout",
    "prefix_shared_gated_delta_net",
    "resolve_gdn_backend",
]
