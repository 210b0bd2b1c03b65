"""Run a script under Triton's interpreter (`TRITON_INTERPRET=1`: the kernels execute on CPU tensors)
in a child process, the variable being read when Triton is imported. The script finds `torch`, the
tests' helper modules on its path, a dict `result` to fill and `rel(a, b)` (the largest difference relative to the largest |b|); the
filled `result` comes back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


PRELUDE = textwrap.dedent(
    f"""
    import json
    import sys
    sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})  # the tests' helper modules
    import torch

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))

    result = {{}}
    """
)
EPILOGUE = '\nprint("RESULT " + json.dumps(result))\n'


def run_interpreted(code: str, timeout: int = 600) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", PRELUDE + code + EPILOGUE], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    print(result)
    return result
