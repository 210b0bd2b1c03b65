"""What differs between the megatron-core releases ps-bridge runs on (0.18.0 - 0.19.2).

Models and providers import these names from here, never by version:
- the Gated DeltaNet context-parallel collectives (`tensor_a2a_cp2hp`, `tensor_a2a_hp2cp`,
  `get_parameter_local_cp`): `megatron.core.ssm.gated_delta_net.common` from 0.19 on, the module
  `megatron.core.ssm.gated_delta_net` itself in 0.18 (same signatures).
"""

from __future__ import annotations


def gdn_cp_collectives():
    """`(tensor_a2a_cp2hp, tensor_a2a_hp2cp, get_parameter_local_cp)` of this megatron-core."""
    try:
        from megatron.core.ssm.gated_delta_net.common import (
            get_parameter_local_cp,
            tensor_a2a_cp2hp,
            tensor_a2a_hp2cp,
        )
    except ImportError:  # megatron-core 0.18: a module, not yet a package
        from megatron.core.ssm.gated_delta_net import get_parameter_local_cp, tensor_a2a_cp2hp, tensor_a2a_hp2cp
    return tensor_a2a_cp2hp, tensor_a2a_hp2cp, get_parameter_local_cp
