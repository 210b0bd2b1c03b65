"""Run a script under Triton's interpreter (`TRITON_INTERPRET=1`: the kernels execute on CPU tensors)
in a child process, the variable being read when Triton is imported; the script prints one line
`RESULT <json>`, which comes back as a dict."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_interpreted(code: str, timeout: int = 600) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    print(result)
    return result
