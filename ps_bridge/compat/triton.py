"""What differs between Triton releases, for the kernels ps-bridge runs with Triton (fla's).

- fla's gated `chunk_bwd_dqkwg` backward kernel (the Gated DeltaNet backward) is computed wrongly on
  Hopper (sm_90) by Triton 3.4.0 up to 3.7.0; 3.7.1 is the first release that computes it right
  (`wrong_hopper_gdn_backward`; the refusal and its fix are `ps_bridge/kernels/gdn/fla.py`'s).
- the JIT's compile hooks (`jit_runtime_hooks`, read by `ps-bridge verl-check`'s compile count):
  `triton.knobs.runtime.jit_cache_hook` / `jit_post_compile_hook` exist in 3.5.1 (the oldest stack),
  3.6.0 (the GPU machine) and 3.8.0 (the newest stack); releases before the `knobs` module (3.3 and
  older) have none.
"""

from __future__ import annotations

from typing import Optional

from packaging.version import Version

WRONG_HOPPER_GDN_BACKWARD = ("3.4.0", "3.7.1")  # [first wrong, first right again)


def wrong_hopper_gdn_backward() -> Optional[str]:
    """The installed Triton's version where it computes fla's gated `chunk_bwd_dqkwg` kernel wrongly
    on Hopper (3.4.0 <= version < 3.7.1), else None (another version, or no Triton: fla cannot run
    then, and its own import error says so)."""
    try:
        # imported here: triton is heavy (GPU kernels only)
        import triton

        version = Version(triton.__version__.split("+")[0])
    except Exception:
        return None
    first_wrong, first_right = (Version(v) for v in WRONG_HOPPER_GDN_BACKWARD)
    return triton.__version__ if first_wrong <= version < first_right else None


def jit_runtime_hooks():
    """Triton's `knobs.runtime` (its `jit_cache_hook`, called before a kernel is compiled, and
    `jit_post_compile_hook`, after), or None where Triton or these hooks are absent."""
    try:
        # imported here: triton is heavy (GPU kernels only)
        import triton
    except Exception:  # no Triton on this machine
        return None
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook") or not hasattr(runtime, "jit_cache_hook"):
        return None
    return runtime
