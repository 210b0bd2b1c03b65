"""What differs between the megatron-core releases ps-bridge runs on (0.18.0 - 0.19.2).

Models and providers import these names from here, never by version ("0.19" below: 0.19.2, the
release read; 0.19.0 - 0.19.1 were not read):
- the Gated DeltaNet context-parallel collectives (`tensor_a2a_cp2hp`, `tensor_a2a_hp2cp`,
  `get_parameter_local_cp`): `megatron.core.ssm.gated_delta_net.common` from 0.19 on, the module
  `megatron.core.ssm.gated_delta_net` itself in 0.18 (same signatures) (`gdn_cp_collectives`);
- `TEGroupedMLP.offload_fused_group_mlp` (fine-grained activation offloading of the fused group
  MLP, `offload_modules=["fused_group_mlp"]`): set by 0.19's `TEGroupedMLP.__init__`; 0.18 has no
  such offloading (`offloads_fused_group_mlp`).

A fault of 0.19, mended where it bites: a forward that raises inside a `TransformerLayer`'s MLP (out of
memory) leaves the layer holding that MLP's input, and with it the autograd graph of every earlier layer
(`release_failed_forward`; 0.18's layer keeps no such reference).

Differences that need no adapter, because our code is written to hold on both:
- `TEGroupedMLP.forward`: 0.19 takes `output_buffer` / `grad_input_buffer` (NCCL-EP zero-copy), which
  its `MoELayer` passes by keyword and only when set; 0.18 takes neither. `GroupedMMExperts.forward`
  (`models/experts.py`) hands any keyword buffers it gets to megatron's forward.
- `TransformerLayer._forward_mlp`: 0.19's `forward` passes it `packed_seq_params`, 0.18's does not.
  `PrefixSharedMoETransformerLayer` (`models/moe.py`) keeps its call's `packed_seq_params` for the
  MLP step itself, the same object 0.19 passes.
- `GatedDeltaNet`: 0.19's base class sets `tp_group` (from `pg_collection.tp`) and
  `num_k_heads_local_tp`; 0.18 sets neither. `models/gdn.py` reads `pg_collection.tp` and computes the
  local key heads from `num_key_heads` and the TP size, which both have.
"""

from __future__ import annotations


def gdn_cp_collectives():
    """`(tensor_a2a_cp2hp, tensor_a2a_hp2cp, get_parameter_local_cp)` of this megatron-core."""
    try:
        # imported here: megatron-core is heavy
        from megatron.core.ssm.gated_delta_net.common import (
            get_parameter_local_cp,
            tensor_a2a_cp2hp,
            tensor_a2a_hp2cp,
        )
    except ImportError:  # megatron-core 0.18: a module, not yet a package
        # imported here: megatron-core is heavy
        from megatron.core.ssm.gated_delta_net import get_parameter_local_cp, tensor_a2a_cp2hp, tensor_a2a_hp2cp
    return tensor_a2a_cp2hp, tensor_a2a_hp2cp, get_parameter_local_cp


def offloads_fused_group_mlp(experts) -> bool:
    """Whether megatron's grouped experts module `experts` (a `TEGroupedMLP`) offloads its fused group
    MLP's activations: its `offload_fused_group_mlp` flag (megatron-core 0.19); 0.18 has no such
    offloading and no flag: False."""
    return bool(getattr(experts, "offload_fused_group_mlp", False))


def release_failed_forward(model) -> int:
    """After a forward of `model` raised: drop what its megatron-core layers still hold of it. Returns
    how many layers held something.

    0.19's `TransformerLayer._forward_pre_mlp_layernorm` (megatron/core/transformer/transformer_layer.py,
    `self.mlp_norm_manager = self.off_interface(self.offload_mlp_norm, hidden_states, "mlp_norm")`)
    keeps the MLP's input in `mlp_norm_manager`, and `_forward_mlp` sets it back to None only after the
    MLP (`self.mlp_norm_manager = None`). A forward that raises in between, out of memory in the MLP,
    leaves it set: on an H200 (Qwen2.5-7B shape, 270k tokens) 134 GiB of activations stayed allocated,
    held by no Python object the collector reaches, and every later attempt ran out of memory."""
    held = 0
    for module in model.modules():
        if getattr(module, "mlp_norm_manager", None) is not None:
            module.mlp_norm_manager = None
            held += 1
    return held
