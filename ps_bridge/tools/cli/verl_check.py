"""`ps-bridge verl-check`: verl's own trainer step with the stock engine and the prefix-shared one.

Builds verl 0.9.1's Megatron engine twice on the same weights (an HF checkpoint, or a random
checkpoint of a bench-catalogue shape), runs T trainer steps of synthetic GRPO data through each
(old log-probs, ref log-probs, the policy update over mini-batches, verl's loss), and reports per
step how far apart they are and how long each phase took (`ps_bridge.tools.verl_check`). verl settings
are OmegaConf dotlist overrides of verl's trainer config, e.g.
`actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384`.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

from ps_bridge.tools.cli.errors import UsageError

SMOKE = dict(model="tiny-qwen2.5", prompts=4, n=4, prompt_len=24, response_len=8, steps=3, dtype="float32")
SMOKE_OVERRIDES = [
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=96",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=128",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=128",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.optim.clip_grad=0.0",  # megatron clips with CUDA-only code; the norm is still reported
    "actor_rollout_ref.actor.entropy_coeff=0.01",
]


def add_parser(sub) -> None:
    p = sub.add_parser("verl-check", help="verl's trainer step, stock engine vs prefix-shared: same? how much faster?")
    p.add_argument("--model", help="HF checkpoint directory, or a shape of the bench catalogue (random weights)")
    p.add_argument("--layers", type=int, default=None, help="layers of a catalogue shape (default: the bench's)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", "--responses", dest="n", type=int, default=8, help="responses per prompt")
    p.add_argument("--prompt-len", type=int, default=2048, help="P (each prompt's own tokens, after the system prompt)")
    p.add_argument("--system-prompt-len", type=int, default=0, metavar="N",
                   help="every prompt begins with the same N tokens (a prefix tree shares them once per "
                        "micro-batch)")
    p.add_argument("--no-tree", dest="tree", action="store_false", default=None,
                   help="the prefix-shared engine shares identical prompts only (one level, PS_BRIDGE_TREE=0); "
                        "default: every common prefix (a prefix tree)")
    p.add_argument("--images", type=int, default=0, metavar="K",
                   help="a vision-language checkpoint (e.g. --model qwen3.5-9b-vl): every prompt carries K random "
                        "images of its own after the system prompt, handed to the engines as verl's "
                        "multi_modal_inputs (pixel_values, image_grid_thw per sample)")
    p.add_argument("--image-size", default=None, metavar="HxW",
                   help="pixels of each --images image (default 1024x1024; 16x24 with --smoke)")
    p.add_argument("--response-len", type=int, default=512, help="mean R; lengths drawn from [R/2, 3R/2]")
    p.add_argument("--steps", type=int, default=5, help="trainer steps T")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise-floor", action="store_true",
                   help="also run the stock engine at 3/4 of the token budgets: stock vs stock with other "
                        "micro-batch boundaries, the noise floor of the curves (JSON key noise_floor)")
    p.add_argument("--baseline", default="stock", choices=("stock", "off"),
                   help="the first engine: verl's stock engine where it runs the family (default), or 'off': "
                        "ps-bridge's engine with prefix sharing off (sharing on vs off, same model code)")
    p.add_argument("--baseline-graphs", default=None, choices=("on", "off"),
                   help="with --baseline off: that engine's CUDA graphs (default: PS_BRIDGE_CUDA_GRAPHS, as the "
                        "prefix-shared engine's), e.g. 'off' to compare graphs and sharing against neither")
    p.add_argument("--interleave", action="store_true",
                   help="hold both engines at once and run their steps in turns (A B, B A, ...), so neither gains "
                        "from running second (more memory: peaks include the other engine)")
    p.add_argument("--workdir", default=None, help="where a random checkpoint is written (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the per-step results here")
    p.add_argument("--plot", default=None, help="draw the curves into this image")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, fp32, 3 steps, on the CPU: checks exactness, exits 1 if it does not hold")
    p.add_argument("overrides", nargs="*", help="verl trainer-config overrides, key=value (OmegaConf dotlist)")
    p.set_defaults(func=run_verl_check)


def _on_off(value):
    """An optional on/off choice as None / True / False."""
    return None if value is None else value == "on"


def run_verl_check(args) -> int:
    # imported here: torch is heavy
    from ps_bridge.tools import verl_check as check

    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise UsageError(f"verl settings are key=value overrides of verl's trainer config; got {bad}")
    if args.system_prompt_len < 0:
        raise UsageError(f"--system-prompt-len {args.system_prompt_len}: give 0 (no system prompt) or more tokens")
    if args.images < 0:
        raise UsageError(f"--images {args.images}: give 0 (text prompts) or more images per prompt")
    images = _image_settings(args)
    if args.smoke:
        smoke = dict(SMOKE, **(SMOKE_IMAGES if args.images else {}))
        settings = check.CheckSettings(**smoke, **images, seed=args.seed, system_prompt_len=args.system_prompt_len, tree=args.tree, overrides=SMOKE_OVERRIDES + list(args.overrides),
                                       workdir=args.workdir, noise_floor=args.noise_floor,
                                       baseline=args.baseline, interleave=args.interleave,
                                       baseline_graphs=_on_off(args.baseline_graphs))
    else:
        if not args.model:
            raise UsageError("--model is required (an HF checkpoint directory or a catalogue shape), or --smoke")
        settings = check.CheckSettings(
            model=args.model, layers=args.layers, prompts=args.prompts, n=args.n, prompt_len=args.prompt_len,
            system_prompt_len=args.system_prompt_len, tree=args.tree,
            response_len=args.response_len, steps=args.steps, dtype=args.dtype, seed=args.seed,
            overrides=list(args.overrides), noise_floor=args.noise_floor, workdir=args.workdir,
            baseline=args.baseline, interleave=args.interleave, baseline_graphs=_on_off(args.baseline_graphs),
            **images)
    _prepare_process()
    total = (3 if settings.noise_floor else 2) * settings.steps * len(check.PHASES) + 1
    bar = None
    if not args.no_progress:
        bar = tqdm(total=total, desc="verl-check", unit="phase", file=sys.stderr, dynamic_ncols=True)

    def progress(message: str) -> None:
        if bar is not None:
            bar.set_postfix_str(message)
            bar.update(1)

    def write(doc: dict) -> None:  # as soon as there is a comparison, and again with the noise floor
        if args.json:
            check.write_json(doc, args.json)
        if args.plot:
            check.write_plot(doc, args.plot)

    try:
        doc = check.run_check(settings, progress, on_result=write)
    except ValueError as e:
        raise UsageError(str(e)) from None
    finally:
        if bar is not None:
            bar.close()
    print(check.format_report(doc))
    if args.smoke:
        failures = check.check_failures(doc)
        for line in failures:
            print(f"ps-bridge verl-check --smoke: {line}", file=sys.stderr)
        return 1 if failures else 0
    return 0


# --smoke --images: the tiny vision-language shape (a two-layer tower), images of 6 vision tokens
SMOKE_IMAGES = dict(model="tiny-qwen3.5-vl", prompt_len=12)


def _image_settings(args) -> dict:
    """`CheckSettings`' image fields from --images / --image-size."""
    if not args.images:
        return {}
    text = args.image_size or ("16x24" if args.smoke else "1024x1024")
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--image-size {text!r} is not 'HxW' (pixels, e.g. 1024x1024)") from None
    return dict(images=args.images, image_size=(h, w))


def _prepare_process() -> None:
    """verl's engine imports in the order that works without TE (and, on a CPU, without CUDA);
    then the plugin with sharing on (its engine registered, the stock bridges remembered)."""
    # imported here: torch is heavy
    from ps_bridge.tools.verl_check.side_by_side import prepare_side_by_side

    prepare_side_by_side()
