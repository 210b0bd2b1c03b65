"""Our engine refuses multi-modal inputs, and only those: verl's trainer (main_ppo) hands text-only batches
a `multi_modal_inputs` entry of one empty dict per sample, which must run."""

import subprocess
import sys
import textwrap


def test_text_only_batches_with_empty_multi_modal_entries_run():
    code = textwrap.dedent("""
        from ps_bridge.compat.verl_on_cpu import prepare_cpu_process
        prepare_cpu_process()
        import torch
        from ps_bridge.verl.engine import _has_multi_modal_inputs
        assert not _has_multi_modal_inputs({})
        assert not _has_multi_modal_inputs({"multi_modal_inputs": [{}, {}, {}]})
        assert not _has_multi_modal_inputs({"multi_modal_inputs": [None, {}]})
        assert _has_multi_modal_inputs({"multi_modal_inputs": [{}, {"pixel_values": torch.ones(2, 3)}]})
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
