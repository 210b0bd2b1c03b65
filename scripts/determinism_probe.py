"""Issue 10 item 7 on another CPU: repeat the reported shared-path run in one process and count the
distinct results. The reported case: a tiny Qwen2 checkpoint with MQA (one KV head), 23 samples in 6
groups, float32, torch_ref attention, 2 CPU threads. Prints the CPU model, torch's parallel/MKL
configuration, and for each thread count how many distinct results N shared runs (and a few
unshared ones) gave, with the largest difference from the first run.

    python scripts/determinism_probe.py [--runs 100] [--threads 1,2,4]
    CUDA_VISIBLE_DEVICES= python scripts/determinism_probe.py   # on a GPU machine: its CPU
"""

from __future__ import annotations

import argparse
import logging
import platform
import tempfile

from ps_bridge.compat.quiet import quiet_third_party

quiet_third_party(False)

import torch  # noqa: E402

from ps_bridge.config import PrefixSharingConfig  # noqa: E402
from ps_bridge.tools.runtime import load_model  # noqa: E402
from ps_bridge.tools.schedule import logprob_pass  # noqa: E402
from ps_bridge.tools.tiny_checkpoints import build_tiny_qwen2, grpo_like_samples  # noqa: E402


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--threads", default="1,2,4")
    args = parser.parse_args()
    logging.getLogger("ps_bridge").setLevel(logging.WARNING)  # no [PS] layout line per run
    print("cpu:", cpu_model(), "| cores visible:", torch.get_num_threads())
    print(torch.__config__.parallel_info().strip().replace("\n", " | "))
    path = tempfile.mkdtemp()
    build_tiny_qwen2(path, num_key_value_heads=1)
    loaded = load_model(path, PrefixSharingConfig(enabled=True, backend="torch_ref"))
    samples = grpo_like_samples(loaded.vocab_size, num_prompts=6, n=4, prompt_len=(10, 60), response_len=(3, 30), seed=3)[:23]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for share, runs in ((True, args.runs), (False, max(5, args.runs // 10))):
            with torch.no_grad():
                results = [torch.cat(logprob_pass(loaded, [samples], share=share)[0]) for _ in range(runs)]
            distinct = []
            for r in results:
                if not any(torch.equal(r, d) for d in distinct):
                    distinct.append(r)
            worst = max(float((r - results[0]).abs().max()) for r in results)
            print(f"threads={threads} {'shared' if share else 'unshared'}: {runs} runs, {len(distinct)} distinct "
                  f"result(s), max |diff| from run 0 {worst:.2e}", flush=True)


if __name__ == "__main__":
    main()
