"""`ps-bridge logprobs`: log-probs of each response token of a batch, from an HF checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.providers.registry import resolve_provider
from ps_bridge.tools.cli.errors import UsageError


def add_parser(sub) -> None:
    # imported here: torch is heavy
    from ps_bridge.kernels.attention import BACKENDS
    from ps_bridge.tools.cli.parallel_args import add_parallel_arguments

    lp = sub.add_parser("logprobs", help="log-probs of each response token of a batch, from an HF checkpoint")
    lp.add_argument("--hf-path", required=True, help="Hugging Face checkpoint directory")
    lp.add_argument("--batch", required=True, help='JSON {"samples": [{"prompt": [ids], "response": [ids]}, ...]}; '
                    'a sample of a vision-language checkpoint may add "images": [image files, relative to the batch file]')
    lp.add_argument("--out", required=True, help="output JSON path")
    lp.add_argument("--no-prefix-sharing", action="store_true", help="run every sample unshared")
    lp.add_argument("--sharing", default="auto", choices=["auto", "on", "off"],
                    help="auto (default): share where the rule of ps_bridge.launch_rule finds it pays "
                         "(docs/how-it-works.md); on: always share; off: never")
    lp.add_argument("--tree", action=argparse.BooleanOptionalAction, default=None,
                    help="share every common prefix as a prefix tree (the default: system prompts across prompts, "
                         "samples that are prefixes of others; a GRPO group is a tree of depth one); --no-tree: "
                         "identical prompts only (one level)")
    lp.add_argument("--tree-min-shared", type=int, default=None,
                    help="the tree's shortest shared run (default: ps_bridge.layout.DEFAULT_MIN_SHARED; a whole "
                         "prompt shared by its responses is shared whatever its length)")
    lp.add_argument("--tree-max-depth", type=int, default=None, help="the tree's depth limit (default: none)")
    lp.add_argument("--backend", default="torch_ref", help=f"attention backend ({', '.join(sorted(BACKENDS))})")
    lp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    lp.add_argument("--provider", default=None, help="provider name (default: detected from the checkpoint)")
    add_parallel_arguments(lp)
    lp.set_defaults(func=run_logprobs)


def read_batch(path: str):
    # imported here: torch is heavy
    from ps_bridge.layout import Sample

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"batch file not found: {path}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise UsageError(f'{path}: expected an object {{"samples": [{{"prompt": [...], "response": [...]}}, ...]}}')
    samples, image_paths = [], []
    for i, s in enumerate(data["samples"]):
        if not isinstance(s, dict) or "prompt" not in s or "response" not in s:
            raise UsageError(f'{path}: sample {i} must be an object with "prompt" and "response" lists')
        for key in ("prompt", "response"):
            ids = s[key]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise UsageError(f"{path}: sample {i}: {key} must be a list of integer token ids")
        images = s.get("images")
        if images is not None and (not isinstance(images, list) or not all(isinstance(f, str) for f in images)):
            raise UsageError(f"{path}: sample {i}: images must be a list of image file paths")
        samples.append(Sample(list(s["prompt"]), list(s["response"]), s.get("uid")))
        image_paths.append(images)
    if not samples:
        raise UsageError(f"{path}: no samples")
    return samples, image_paths


def _hf_vocab_size(hf_config: dict, hf_path: str) -> int:
    vocab = hf_config.get("vocab_size") or (hf_config.get("text_config") or {}).get("vocab_size")
    if vocab is None:
        raise UsageError(f"{hf_path}/config.json has no vocab_size")
    return int(vocab)


def run_logprobs(args) -> int:
    # imported here: torch is heavy (not loaded for argument parsing)
    import torch

    # imported here: these import torch, which is heavy (not loaded for argument parsing)
    from ps_bridge.tools.data_parallel import dp_logprob_pass
    from ps_bridge.layout import build_layout
    from ps_bridge.parallel.groups import is_output_rank
    from ps_bridge.tools.cli.parallel_args import settings_from_args
    from ps_bridge.plan import SharingPlan
    from ps_bridge.prepare import rule_decision
    from ps_bridge.tools.runtime import DTYPES, load_model, read_hf_config

    samples, image_paths = read_batch(args.batch)
    try:
        parallel = settings_from_args(args)
        hf_config = read_hf_config(args.hf_path)
        parallel.check(hf_config=hf_config)  # before any process group exists: every rank fails alike, nothing hangs
        archs = list(hf_config.get("architectures") or [])
        if any(image_paths) or hf_config.get("image_token_id") is not None:
            # images placed at their placeholders, counts checked (a vision-language checkpoint's batch, or images given)
            # imported here: only a batch with images needs it (it reads them with Pillow and transformers)
            from ps_bridge.tools.image_files import samples_with_image_files

            samples = samples_with_image_files(samples, image_paths, args.hf_path, hf_config, Path(args.batch).parent)
        config = PrefixSharingConfig(
            enabled=not args.no_prefix_sharing, backend=args.backend, provider=args.provider, sharing=args.sharing,
            tree_min_shared=args.tree_min_shared, tree_max_depth=args.tree_max_depth,
            **({} if args.tree is None else {"tree": args.tree}),  # unset: the config's default
        )
        resolve_provider(config.provider, archs)
        # the whole batch goes through `prepare` (its one owner of deciding what is shared): the tree
        # first, before the (slow) conversion, so bad ids or tree options fail at once; decided once, it
        # serves the report and the sharing rule
        vocab_size = _hf_vocab_size(hf_config, args.hf_path)
        plan = SharingPlan.from_config(config).for_samples(samples, vocab_size=vocab_size) if config.enabled else None
        layout = build_layout(samples, share=config.layout_share(), vocab_size=vocab_size,
                              tree=plan.tree if plan else None, order=plan.order if plan else None)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None

    loaded = load_model(
        args.hf_path, config, dtype=DTYPES[args.dtype], tp=parallel.tp, pp=parallel.pp,
        sequence_parallel=parallel.sequence_parallel, cp=parallel.cp, ep=parallel.ep,
    )
    # the sharing rule, once for the whole batch (the same on every rank: each rank sees the batch),
    # logged by `prepare`; every rank then runs that packing
    decision = rule_decision(samples, config, loaded.model_cost, loaded.device.type, loaded.dtype,
                             tree=plan.tree if plan else None, backward=False)
    try:
        # data-parallel ranks (with --ep, world / (tp x pp) of them) each run whole prompt groups
        # (whole subtrees of a prefix tree); the rows come back in input order on data-parallel rank 0
        with torch.no_grad():
            rows = dp_logprob_pass(loaded, [samples], share=decision.share)
    except ValueError as e:  # refusals that depend on the model, e.g. image tokens for a VLM
        raise UsageError(str(e)) from None
    if not is_output_rank():
        return 0
    [per_sample] = rows
    out = dict(
        samples=[{"logprobs": lp.float().cpu().tolist()} for lp in per_sample],
        tokens_unshared=layout.tokens_unshared,
        tokens_shared=layout.tokens_shared,
        groups=layout.num_groups,
        tree_depth=layout.tree_depth,
        tree_nodes=layout.num_segments,
        prefix_sharing=config.enabled,
        shared_path=decision.share,
        sharing_reason=decision.reason,
        tree=config.enabled and config.tree,
        backend=config.backend,
    )
    Path(args.out).write_text(json.dumps(out))
    print(
        f"wrote {args.out}: {len(samples)} samples, {layout.num_groups} groups, "
        f"tokens {layout.tokens_unshared} unshared -> {layout.tokens_shared} packed"
        + (f" (tree depth {layout.tree_depth}, {layout.num_segments} nodes)" if config.enabled and config.tree else "")
        + f"; {decision.describe()}"
    )
    return 0
