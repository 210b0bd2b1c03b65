"""Quiet third-party output for the `ps-bridge` commands.

Importing the Megatron stack without Transformer Engine / Apex (and on a CPU) prints a page of
notices that are not the user's problem: `UserWarning`s that an optional package is absent and a
fallback is used, deprecation notes between the third-party packages, Megatron-Bridge's INFO log of
a failed optional import (with its traceback: `Import of FP8GlobalStateManager ... failed`), torch's
"No CUDA runtime is found", transformers' warnings and progress bars. `quiet_third_party(False)`
silences exactly those, where they are raised (warning filters by module and message, levels and
filters on the named third-party loggers, transformers' and huggingface_hub's own switches); it must
run before the heavy imports. Our own logger (`ps_bridge`) and every third-party ERROR still show.
`quiet_third_party(True)` (`ps-bridge -v`) changes nothing.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings

# Packages whose import-time notices are silenced (a warning's module is where it is raised).
_THIRD_PARTY_MODULES = (
    r"(megatron|transformer_engine|apex|fla|modelopt|nvidia_resiliency_ext|transformers|huggingface_hub|"
    r"torch|triton|absl|verl)(\..*)?"
)
# UserWarnings of those packages that say an optional part is absent, something is deprecated, or
# (megatron's tensor-parallel layers, on every rank) that CUDA_DEVICE_MAX_CONNECTIONS=1 is advised.
_NOTICE_MESSAGES = (
    r".*(not installed|falling back|fall back|roll back|not supported on current platform|"
    r"only transformer-engine|deprecated|recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS|"
    r"engine is not available|is experimental and still under active development|"
    r"large number of experts .* without fp32 routing|"
    # modelopt (imported by Megatron-Bridge 0.5.x): its optional transformers plugin, its tested range
    r"failed to import modelopt .* plugin|is not tested with nvidia-modelopt)"
)
# Third-party loggers whose records below ERROR are dropped. A logger that sets its own level at
# import (megatron.bridge.utils.import_utils: INFO, with its own handler) is held by the filter.
_QUIET_LOGGERS = (
    "megatron",
    "megatron.bridge.utils.import_utils",
    "transformer_engine",
    "fla",
    "modelopt",
    "torch.utils.cpp_extension",
    "tilelang",  # fla's Hopper GDN backward: an INFO line per kernel it compiles
)


class _BelowErrorFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


_FILTER = _BelowErrorFilter()


def quiet_third_party(verbose: bool) -> None:
    """Silence third-party import notices unless `verbose`; idempotent. Call before importing torch,
    megatron or transformers (the environment switches are read at their import)."""
    if verbose:
        return
    _QUIET["active"] = True
    warnings.filterwarnings("ignore", message=_NOTICE_MESSAGES, module=_THIRD_PARTY_MODULES)
    # verl's engine config (a generated dataclass __post_init__, so the warning's module is "<string>")
    warnings.filterwarnings("ignore", message="set sequence parallel to false as TP size is 1")
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=_THIRD_PARTY_MODULES)
    # invalid escapes in third-party docstrings, reported when a fresh install first compiles them
    # (the warning's module is then the source file's path, so it is matched by category)
    warnings.filterwarnings("ignore", category=SyntaxWarning)
    for name in _QUIET_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    # transformers and huggingface_hub read these at import; a value the user set is kept
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # imported already (e.g. main() called in a test process)
        # imported here: transformers is heavy
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


_QUIET = {"active": False}


@contextlib.contextmanager
def third_party_prints():
    """Around calls into megatron / Megatron-Bridge that `print` progress (megatron's
    "number of parameters on ... rank" line, the bridge's weight-loading progress): their stdout and
    stderr are dropped once `quiet_third_party(False)` ran, shown otherwise. Exceptions propagate."""
    if not _QUIET["active"]:
        yield
        return
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield
