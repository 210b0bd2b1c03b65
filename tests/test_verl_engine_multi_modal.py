"""verl's trainer (main_ppo) hands text-only batches a `multi_modal_inputs` entry of one empty dict per
sample: our engine reads them as text-only batches, and only real inputs as images."""

import subprocess
import sys
import textwrap


def test_text_only_batches_with_empty_multi_modal_entries_run():
    code = textwrap.dedent("""
        from ps_bridge.compat.verl_on_cpu import prepare_cpu_process
        prepare_cpu_process()
        import torch
        from ps_bridge.verl.batch import has_multi_modal_inputs
        assert not has_multi_modal_inputs({})
        assert not has_multi_modal_inputs({"multi_modal_inputs": [{}, {}, {}]})
        assert not has_multi_modal_inputs({"multi_modal_inputs": [None, {}]})
        assert has_multi_modal_inputs({"multi_modal_inputs": [{}, {"pixel_values": torch.ones(2, 3)}]})
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
