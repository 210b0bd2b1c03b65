"""The stacks ps-bridge is tested on, and the versions below which it is known not to work.

The ONE place that names the newest and the oldest tested version of each package: `ps-bridge
doctor` compares the installed versions against it, docs/install.md describes it.
A tested range is `[min, max]` of a package's pins over `TESTED_STACKS`:
- a version equal to one of the pins is tested;
- a version between the endpoints is expected to work, not tested (a warning);
- a version newer than the newest is not tested (a warning);
- a version older than the oldest is not tested (a warning), unless the package has a `Limit` here,
  a version below which ps-bridge is known not to work (an error, with the reason and the fix; for a
  package only the GPU kernels use, a warning on a machine without CUDA).

The stacks are Python 3.12 (every Megatron-Bridge release with the Qwen3.5 bridges requires it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from packaging.version import Version

# package -> version pinned in that stack (None: not part of it). Names are distribution names as
# `importlib.metadata` knows them; "python" is the interpreter.
TESTED_STACKS: Dict[str, Dict[str, Optional[str]]] = {
    # `make venv` (requirements*.txt): CI's default suite
    "newest": {
        "python": "3.12",
        "torch": "2.14.1",
        "megatron-core": "0.19.2",
        "megatron-bridge": "0.6.2",
        "transformers": "5.10.2",
        "fla-core": "0.6.0",
        "verl": "0.9.1",
        "numpy": "2.5.5",
        "triton": "3.8.0",
    },
    # `make venv STACK=oldest`: CI's core subset
    "oldest": {
        "python": "3.12",
        "torch": "2.9.1",
        "megatron-core": "0.18.0",
        "megatron-bridge": "0.5.0",
        "transformers": "5.8.1",
        "fla-core": "0.4.2",
        "verl": "0.8.0",
        "numpy": "1.26.4",
        "triton": "3.5.1",
    },
    # the H200 machine's image (DESIGN.md section 7) with the newest stack's megatron packages:
    # the GPU tests and the bench ran there (BENCHMARKS.md)
    "gpu": {
        "python": "3.12",
        "torch": "2.11.0",
        "megatron-core": "0.19.2",
        "megatron-bridge": "0.6.2",
        "transformers": "5.17.0",
        "fla-core": "0.6.0",
        "triton": "3.6.0",
        "tilelang": "0.1.15",
    },
}


@dataclass(frozen=True)
class Limit:
    """A bound ps-bridge is known not to work beyond (a floor: below `version`; a ceiling: at or
    above it): `reason` says why, `fix` what to install."""

    version: str
    reason: str
    fix: str


@dataclass(frozen=True)
class Package:
    """name: distribution name; module: its import name; role: what ps-bridge uses it for; needed:
    "required" (nothing runs without it), "verl" (only the verl integration), "gpu" (only the GPU
    kernels), "optional"; floor / ceiling: see `Limit`; absent: what its absence means (for a package
    that is not required)."""

    name: str
    module: str
    role: str
    needed: str
    floor: Optional[Limit] = None
    ceiling: Optional[Limit] = None
    absent: str = ""


_MB_PYTHON = "every Megatron-Bridge release (0.4.0-0.6.2) declares Requires-Python >=3.12,<3.13"
_USE_312 = "use Python 3.12 (a verl image with Python 3.12, or a Python 3.12 virtualenv)"

PACKAGES: Tuple[Package, ...] = (
    Package(
        "python", "", "the interpreter", "required",
        floor=Limit("3.12", f"{_MB_PYTHON}: none installs on this Python", _USE_312),
        ceiling=Limit("3.13", f"{_MB_PYTHON}: none installs on this Python", _USE_312),
    ),
    Package("torch", "torch", "tensors, autograd, the flash-attention kernels", "required"),
    Package(
        "megatron-core", "megatron.core", "the model layers", "required",
        floor=Limit("0.18.0", "Megatron-Bridge 0.5.0 (the oldest with the Qwen3.5 text bridge) imports "
                    "`megatron.core._rank_utils.safe_get_world_size`, which megatron-core 0.17.1 and older lack",
                    "pip install --no-deps 'megatron-core>=0.18,<0.20' (`ps-bridge doctor` shows the tested range)"),
    ),
    Package(
        "megatron-bridge", "megatron.bridge", "the HF <-> Megatron conversion our providers extend", "required",
        floor=Limit("0.5.0", "ps-bridge's Qwen3.5 providers import `megatron.bridge.models.qwen.qwen35_bridge` "
                    "(first in Megatron-Bridge 0.5.0; 0.4.x has only the VL bridge) and every model family "
                    "is registered at once", "pip install --no-deps 'megatron-bridge>=0.5.0,<0.7'"),
    ),
    Package("transformers", "transformers", "checkpoint configs, the HF reference model", "required"),
    Package("numpy", "numpy", "megatron-core's and the verl check's arrays", "required"),
    Package(
        "verl", "verl", "the GRPO trainer ps-bridge plugs into", "verl",
        floor=Limit("0.8.0", "the prefix-shared engine plugs into verl's Megatron engine path "
                    "(workers/engine/megatron), the only Megatron path from verl 0.8.0 on; older verl is "
                    "not adapted", "pip install --no-deps 'verl>=0.8.0' (see docs/verl.md)"),
        absent="not installed: needed only for training in verl (docs/verl.md)",
    ),
    Package(
        "fla-core", "fla", "the Gated DeltaNet kernels (Qwen3.5) on CUDA", "gpu",
        floor=Limit("0.4.2", "ps-bridge passes `cu_seqlens_cpu` to fla's chunk_gated_delta_rule, which "
                    "fla-core takes from 0.4.2 on", "pip install --no-deps fla-core==0.6.0"),
        absent="not installed: Qwen3.5 on CUDA needs it for the `fla` Gated DeltaNet backend "
               "(pip install --no-deps fla-core==0.6.0); CPU runs use the torch_ref backend",
    ),
    Package("triton", "triton", "the compiler of fla's kernels", "gpu",
            absent="not installed: fla's kernels cannot run (fine on a CPU)"),
    Package(
        "tilelang", "tilelang", "fla's GDN backward on Hopper with Triton < 3.7.1", "optional",
        absent="not installed: needed only on Hopper with Triton 3.4-3.7.0 (see the GDN line)",
    ),
    Package(
        "flash-attn", "flash_attn", "the varlen flash kernels of the cascade, when installed", "optional",
        absent="not installed: the cascade uses torch's own flash kernels",
    ),
    Package(
        "transformer-engine", "transformer_engine", "not used by the prefix-shared path", "optional",
        absent="not installed: fine (Megatron-Bridge is imported with a placeholder; the prefix-shared "
               "path builds megatron's local layer spec)",
    ),
)


@dataclass(frozen=True)
class Companion:
    """`package` (import name `module`) must be installed wherever `when` is installed at a version in
    `versions` (a specifier set); `reason` says why, `fix` what to install."""

    when: str
    versions: str
    package: str
    module: str
    reason: str
    fix: str


COMPANIONS: Tuple[Companion, ...] = (
    Companion(
        "megatron-bridge", "<0.6", "nvidia-modelopt", "modelopt",
        "Megatron-Bridge 0.5.x imports modelopt when it is imported (megatron.bridge.models.conversion.auto_bridge; "
        "0.6 imports it lazily)", "pip install --no-deps nvidia-modelopt==0.43.0",
    ),
)


def version_range(package: str) -> Optional[Tuple[str, str]]:
    """(oldest, newest) tested version of `package`, or None when no stack pins it."""
    pins = sorted({s[package] for s in TESTED_STACKS.values() if s.get(package)}, key=Version)
    return (pins[0], pins[-1]) if pins else None


def pinned_versions(package: str) -> Tuple[str, ...]:
    """The versions of `package` some tested stack pins."""
    return tuple(sorted({s[package] for s in TESTED_STACKS.values() if s.get(package)}))
