"""verl-check's run: T trainer steps of each engine kind (old log-probs, ref log-probs, the update), as
verl's trainer runs them, then the comparison document."""

from __future__ import annotations

import tempfile
import time
from functools import partial
from typing import Callable, Dict, Iterator, List, Optional

import torch

from ps_bridge import cuda_graphs
from ps_bridge.compat.verl_on_cpu import engine_call_on_cpu
from ps_bridge.tools.verl_check.compare import compare, speedups
from ps_bridge.tools.verl_check.compiles import counting_compiles
from ps_bridge.tools.verl_check.config import CheckSettings, role_configs, scaled_budgets, trainer_config
from ps_bridge.tools.verl_check.data import VisionInputs, ideal_ratio, synthetic_batch
from ps_bridge.tools.verl_check.flops import PhaseFlops, checkpoint_flop_shape, flop_ratios
from ps_bridge.tools.verl_check.model import (
    checkpoint_config, checkpoint_for, checkpoint_text_config, free_memory, stock_description,
)
from ps_bridge.tools.verl_check.roles import Role, build_role_engines, shared_backend, shared_tree


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_reset():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> Optional[float]:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def run_kind(kind: str, settings: CheckSettings, ckpt: str, cfg, batches, progress: Callable[[str], None]) -> List[dict]:
    """T trainer steps with engines of `kind`; per step the padded old/ref log-probs and entropy
    (float32, CPU), the update's per-mini-batch loss / grad norm / KL, phase times, micro-batch
    counts, peak memory per phase."""
    return list(kind_steps(kind, settings, ckpt, cfg, batches, progress))


def run_interleaved(kinds, settings: CheckSettings, ckpt: str, cfg, batches,
                    progress: Callable[[str], None]) -> Dict[str, List[dict]]:
    """Both kinds' engines resident at once, their steps alternating A B, B A, A B, ...: whatever
    the process warms up as it goes (the caching allocator's blocks, library autotuning, clocks)
    favours neither, where one kind after the other favours the second (measured:
    docs/how-it-works.md). Peak memory then includes the other engine's."""
    a, b = kinds
    gens = {k: kind_steps(k, settings, ckpt, cfg, batches, progress) for k in kinds}
    runs: Dict[str, List[dict]] = {k: [] for k in kinds}
    try:
        for t in range(len(batches)):
            for k in ((a, b) if t % 2 == 0 else (b, a)):
                runs[k].append(next(gens[k]))
    finally:
        for g in gens.values():
            g.close()  # runs its `finally`: the engines freed
    return runs


def kind_steps(kind: str, settings: CheckSettings, ckpt: str, cfg, batches,
               progress: Callable[[str], None]) -> Iterator[dict]:
    """`run_kind`'s steps one at a time (the engines are built at the first and freed when the
    generator ends or is closed)."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.workers.utils.losses import ppo_loss

    if kind == "stock-split":  # the noise floor: stock with different micro-batch boundaries
        cfg = scaled_budgets(cfg, 0.75)
    actor_cfg, ref_cfg, rollout = role_configs(cfg)
    resident_before = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
    actor_engine, ref_engine = build_role_engines(kind, ckpt, settings, actor_cfg, ref_cfg, rollout)
    flops = None
    if kind == "shared":  # the model FLOPs of the micro-batches it packs (F)
        flops = PhaseFlops(checkpoint_flop_shape(ckpt))
        actor_engine.layout_observer = ref_engine.layout_observer = flops
    actor_cfg.model_config = actor_engine.model_config
    actor = Role(actor_engine, partial(ppo_loss, config=actor_cfg))
    ref = Role(ref_engine, None)
    arr = cfg.actor_rollout_ref
    try:
        for step, batch in enumerate(batches):
            yield _one_step(kind, step, batch, settings, arr, actor, ref, actor_cfg, resident_before, progress, flops)
    finally:
        del actor, ref, actor_engine, ref_engine
        free_memory()


def _one_step(kind, step, batch, settings, arr, actor, ref, actor_cfg, resident_before, progress, flops=None) -> Dict:
    """One trainer step (old log-probs, ref log-probs, the update) of one engine kind: its record."""
    # imported here: verl is optional (requirements-verl.txt)
    from verl.protocol import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    batch.meta_info["temperature"] = arr.rollout.temperature  # as the rollout leaves it
    # resident_before: what an earlier engine kind left allocated (included in this kind's peaks)
    record: Dict = {"phase_seconds": {}, "peak_memory_gib": {"resident_before": resident_before},
                    "micro_batches": {}, "compiles": {}, "flops": {}, "cuda_graphs": {}}

    def phase(name, fn, role):
        _sync()
        _peak_reset()
        before = role.micro_batches
        graphs_before = dict(cuda_graphs.COUNTS)
        t0 = time.perf_counter()
        with engine_call_on_cpu(), counting_compiles() as compiled:
            out = fn()
            _sync()
        record["phase_seconds"][name] = time.perf_counter() - t0
        record["compiles"][name] = compiled
        record["cuda_graphs"][name] = {k: cuda_graphs.COUNTS[k] - graphs_before[k] for k in graphs_before}
        if flops is not None:
            record["flops"][name] = flops.take()
        record["peak_memory_gib"][name] = _peak_gib()
        record["micro_batches"][name] = role.micro_batches - before
        progress(f"{kind} step {step + 1}: {name}")
        return out

    # old log-probs (RayPPOTrainer._compute_old_log_prob)
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
    out = phase("old_log_prob", lambda: actor.infer(td), actor)
    old = no_padding_2_padding(out["log_probs"], td).float()
    entropy = no_padding_2_padding(out["entropy"], td).float()
    # ref log-probs (RayPPOTrainer._compute_ref_log_prob)
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
    out = phase("ref", lambda: ref.infer(td), ref)
    ref_lp = no_padding_2_padding(out["log_probs"], td).float()
    # the update (RayPPOTrainer._update_actor)
    upd = DataProto.from_dict(tensors=dict(batch.batch.items(), old_log_probs=old, ref_log_prob=ref_lp),
                              non_tensors=dict(batch.non_tensor_batch), meta_info=dict(batch.meta_info))
    td = left_right_2_no_padding(upd.to_tensordict())
    mini = int(arr.actor.ppo_mini_batch_size) * settings.n
    tu.assign_non_tensor(
        td, calculate_entropy=bool(arr.actor.calculate_entropy or arr.actor.entropy_coeff != 0.0),
        distillation_use_topk=False, distillation_only=False, global_batch_size=mini, mini_batch_size=mini,
        epochs=int(arr.actor.ppo_epochs), seed=int(arr.actor.data_loader_seed),
        dataloader_kwargs={"shuffle": bool(arr.actor.shuffle)}, compute_loss=True,
    )
    metrics = phase("update", lambda: actor.train(td), actor)
    # the comparison runs on the CPU, whatever device the engines returned their rows on
    old, ref_lp, entropy = old.cpu(), ref_lp.cpu(), entropy.cpu()
    mask = batch.batch["response_mask"].bool().cpu()
    losses = [float(x) for x in _as_list(metrics.get("loss"))]
    norms = [float(x) for x in _as_list(metrics.get("grad_norm"))]
    kls = metrics.get("kl_loss", [])
    record.update(
        old=old.masked_fill(~mask, 0.0), ref=ref_lp.masked_fill(~mask, 0.0),
        entropy=entropy.masked_fill(~mask, 0.0), losses=losses, grad_norms=norms,
        kl=(sum(kls) / len(kls)) if kls else _kl(old, ref_lp, mask, actor_cfg.kl_loss_type),
    )
    return record


def _as_list(value):
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _kl(old, ref, mask, kind: str) -> float:
    # imported here: verl is optional (requirements-verl.txt)
    from verl.trainer.ppo.core_algos import kl_penalty

    return float(kl_penalty(old, ref, kl_penalty=kind)[mask].mean())


def checkpoint_vision_inputs(settings: CheckSettings, ckpt: str) -> Optional[VisionInputs]:
    """`--images`' inputs for the checkpoint (None without --images)."""
    if not settings.images:
        return None
    return VisionInputs.of(checkpoint_config(ckpt), settings.images, settings.image_size)


def synthetic_batches(settings: CheckSettings, cfg, ckpt: str):
    """Every step's synthetic GRPO batch for the checkpoint's vocabulary, and all response lengths."""
    # imported here: omegaconf comes with verl (optional)
    from omegaconf import OmegaConf

    vocab = checkpoint_text_config(ckpt).vocab_size
    vision = checkpoint_vision_inputs(settings, ckpt)
    algo = OmegaConf.to_container(cfg.algorithm, resolve=True)
    batches, lengths = [], []
    for t in range(settings.steps):
        b, ls = synthetic_batch(settings, vocab, t, algo, vision)
        batches.append(b)
        lengths.extend(ls)
    return batches, lengths


def run_check(settings: CheckSettings, progress: Optional[Callable[[str], None]] = None,
              on_result: Optional[Callable[[dict], None]] = None) -> dict:
    """Build both engines in turn, run the steps, compare: the `--json` document. `on_result` gets the
    document as soon as stock and shared are compared, and again with the noise floor (so a run cut
    short during the noise floor still leaves the comparison)."""
    progress = progress or (lambda msg: None)
    if settings.dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"--dtype {settings.dtype!r}: use bfloat16, float16 or float32")
    workdir = settings.workdir or tempfile.mkdtemp(prefix="ps-bridge-verl-check-")
    cfg = trainer_config(settings)
    ckpt = checkpoint_for(settings, workdir)
    progress("checkpoint ready")
    mini = int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    if settings.prompts % mini:
        raise ValueError(f"--prompts {settings.prompts} is not a multiple of actor_rollout_ref.actor."
                         f"ppo_mini_batch_size={mini} (prompts per mini-batch)")
    batches, lengths = synthetic_batches(settings, cfg, ckpt)
    vision = checkpoint_vision_inputs(settings, ckpt)
    image_tokens = vision.prompt_tokens if vision else 0
    images = None if vision is None else dict(
        per_prompt=settings.images, size=list(settings.image_size), grid_thw=list(vision.images.grid(vision.vision)),
        tokens_per_image=vision.images.tokens_per_image(vision.vision))
    names = ("stock", "shared")
    # the engines run one after the other (`shared_first` swaps their order), or step by step in turns
    order = ("shared", "stock") if settings.shared_first else ("stock", "shared")
    if settings.interleave:
        runs = run_interleaved(order, settings, ckpt, cfg, batches, progress)
    else:
        runs = {kind: run_kind(kind, settings, ckpt, cfg, batches, progress) for kind in order}
    steps = compare(runs["stock"], runs["shared"], names)
    arr = cfg.actor_rollout_ref
    config = {
        "model": settings.model, "checkpoint": ckpt, "layers": settings.layers, "prompts": settings.prompts,
        "n": settings.n, "prompt_len": settings.prompt_len, "system_prompt_len": settings.system_prompt_len,
        "tree": shared_tree(settings), "response_len_mean": settings.response_len,
        "engine_order": list(order) + (["interleaved"] if settings.interleave else []), "baseline": settings.baseline,
        "baseline_graphs": settings.baseline_graphs,
        "steps": settings.steps, "dtype": settings.dtype, "seed": settings.seed,
        "overrides": list(settings.overrides), "ideal_speedup_S": ideal_ratio(settings, lengths, image_tokens),
        "images": images,
        "mini_batch_prompts": mini,
        "ppo_max_token_len_per_gpu": arr.actor.ppo_max_token_len_per_gpu,
        "log_prob_max_token_len_per_gpu": arr.rollout.log_prob_max_token_len_per_gpu,
        "ref_log_prob_max_token_len_per_gpu": arr.ref.log_prob_max_token_len_per_gpu,
        "stock_engine": stock_description(ckpt, settings),
        "shared_backend": shared_backend(settings),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "speedup": speedups(steps, names),
        "speedup_median": speedups(steps, names, statistic="median"),
        "flop_ratio_F": flop_ratios(steps),
    }
    doc = {"config": config, "steps": steps}
    if settings.noise_floor:
        if on_result is not None:
            on_result(doc)
        runs["stock-split"] = run_kind("stock-split", settings, ckpt, cfg, batches, progress)
        # the same schema, "shared" standing for the stock engine at 3/4 of the token budgets
        floor = compare(runs["stock"], runs["stock-split"], names)
        doc["noise_floor"] = {"second_engine": "stock, every token budget x 3/4 (other micro-batch boundaries)",
                              "steps": floor}
    if on_result is not None:
        on_result(doc)
    return doc
