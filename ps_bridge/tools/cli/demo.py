"""`ps-bridge demo`: the main job on an embedded default.

Builds a small random checkpoint in a temp dir, converts it through our Megatron-Bridge provider,
makes a GRPO-like micro-batch (several prompts, n responses each, uneven lengths, interleaved) and
runs forward and backward prefix-shared and unshared, plus Hugging Face's own model, then prints
how far apart they are and how many tokens sharing saved.
"""

from __future__ import annotations

import json
import tempfile

from ps_bridge.tools.cli.errors import UsageError


def add_parser(sub) -> None:
    dm = sub.add_parser("demo", help="the main job on a tiny random checkpoint: shared vs unshared vs HF")
    add_demo_arguments(dm)
    dm.set_defaults(func=run_demo)


def add_demo_arguments(parser) -> None:
    # imported here: torch is heavy
    from ps_bridge.tools.cli.parallel_args import add_parallel_arguments
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS

    parser.add_argument("--model", default="qwen2.5", choices=sorted(TINY_BUILDERS), help="model family")
    parser.add_argument("--prompts", type=int, default=3, help="number of prompts (groups)")
    # --responses: torchrun rejects "--n" anywhere on its command line as an ambiguous abbreviation
    parser.add_argument("--n", "--responses", dest="n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--backend", default="torch_ref", help="attention backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_parallel_arguments(parser)


def demo_result(
    model: str = "qwen2.5", prompts: int = 3, n: int = 8, backend: str = "torch_ref", seed: int = 0,
    tp: int = 1, pp: int = 1, sp: bool = False, cp: int = 1,
) -> dict:
    """Under torchrun every rank runs this (each builds the same seeded checkpoint); only global
    rank 0 compares against Hugging Face, so only its result has the `*_vs_hf` entries."""
    # imported here: torch is heavy
    from ps_bridge.tools.compare import compare
    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.parallel.groups import is_output_rank
    from ps_bridge.tools.runtime import load_model
    from ps_bridge.tools.tiny_checkpoints import TINY_BUILDERS, grpo_like_samples

    with tempfile.TemporaryDirectory(prefix="ps-bridge-demo-") as path:
        hf_model = TINY_BUILDERS[model](path, seed=seed)
        loaded = load_model(path, PrefixSharingConfig(enabled=True, backend=backend), tp=tp, pp=pp, sequence_parallel=sp, cp=cp)
        vocab = hf_model.config.get_text_config().vocab_size
        samples = grpo_like_samples(vocab, num_prompts=prompts, n=n, prompt_len=(24, 64), response_len=(2, 16), seed=seed)
        result = compare(loaded, samples, hf_model if is_output_rank() else None)
    result.update(model=model, provider=loaded.provider_name, backend=backend, groups=prompts, n=n, dtype="float32")
    result.update(tp=tp, pp=pp, sp=sp, cp=cp)
    return result


def format_table(r: dict) -> str:
    rows = [
        ("model / provider", f"{r['model']} / {r['provider']}  (backend {r['backend']}, {r['dtype']}, CPU)"),
        ("micro-batch", f"{r['samples']} samples = {r['groups']} prompts x {r['n']} responses"),
        ("tokens unshared / shared", f"{r['tokens_unshared']} / {r['tokens_shared']}"),
        ("ideal ratio n(P+R)/(P+nR)", f"{r['ideal_ratio']:.2f}x"),
        ("max |logp| diff shared vs HF", f"{r['max_logprob_diff_shared_vs_hf']:.2e}"),
        ("max |logp| diff unshared vs HF", f"{r['max_logprob_diff_unshared_vs_hf']:.2e}"),
        ("max |logp| diff shared vs unshared", f"{r['max_logprob_diff_shared_vs_unshared']:.2e}"),
        ("max rel grad diff shared vs unshared", f"{r['max_rel_grad_diff_shared_vs_unshared']:.2e}"),
        ("fwd+bwd CPU time shared / unshared", f"{r['seconds_shared']:.3f} s / {r['seconds_unshared']:.3f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["ps-bridge demo: prefix-shared vs unshared vs Hugging Face", "-" * (width + 40)]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def run_demo(args) -> int:
    # imported here: torch is heavy
    from ps_bridge.parallel.groups import is_output_rank
    from ps_bridge.parallel.settings import ModelShapeError
    from ps_bridge.tools.cli.parallel_args import settings_from_args

    parallel = settings_from_args(args)
    try:
        parallel.check()  # before any process group exists: every rank fails alike, nothing hangs
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:  # load_model refuses the tiny model's shapes that no split holds, before any process group
        result = demo_result(args.model, args.prompts, args.n, args.backend, args.seed, parallel.tp, parallel.pp, parallel.sequence_parallel, parallel.cp)
    except ModelShapeError as e:
        raise UsageError(str(e)) from None
    if is_output_rank():
        print(json.dumps(result) if args.json else format_table(result))
    return 0
