"""Parallel settings of a prefix-shared run, and what a run needs beyond the model itself.

Prefix sharing supports tensor parallelism (TP), TP-bound sequence parallelism (SP), physical
pipeline parallelism (PP) and context parallelism (CP: head-parallel over contiguous shards of the
pack, see `models/context_parallel.py`); it refuses virtual pipeline stages and dynamic CP. The
model is parallelised from outside, by megatron-core: this module checks the settings up front
(`ParallelSettings.check_supported`, the one place that knows what is refused, and
`check_model`, against the checkpoint's shapes; a refused setting fails before any process group
exists, on every rank alike, without hanging), sets them on the provider (with the vocabulary
padding and the uneven pipeline split a checkpoint's shapes may need), sets up the process
groups, finishes gradients the way megatron's `finalize_model_grads` would without a DDP wrapper,
and gathers sharded gradients under Hugging Face names for comparisons.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelSettings:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    vpp: Optional[int] = None
    dynamic_cp: bool = False
    ep: int = 1  # expert-parallel size (MoE); its ranks are carved out of the data-parallel ranks

    @classmethod
    def from_config(cls, config) -> "ParallelSettings":
        """The settings of a megatron `TransformerConfig` / provider, or of verl's `McoreEngineConfig`."""
        return cls(
            tp=getattr(config, "tensor_model_parallel_size", 1) or 1,
            pp=getattr(config, "pipeline_model_parallel_size", 1) or 1,
            cp=getattr(config, "context_parallel_size", 1) or 1,
            sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
            vpp=getattr(config, "virtual_pipeline_model_parallel_size", None),
            dynamic_cp=bool(getattr(config, "dynamic_context_parallel", False)),
            ep=getattr(config, "expert_model_parallel_size", 1) or 1,
        )

    def check_supported(self) -> None:
        """Refuse, naming the setting and the fix, what prefix sharing does not support. The only
        place that knows: the CLI (before any process group), our providers (when the model is
        built) and the verl engine (before it builds anything) all call this. Prefix trees of any
        depth run under every supported setting (docs/tree.md), so nothing here depends on them."""
        sizes = (
            ("tensor_model_parallel_size", self.tp),
            ("pipeline_model_parallel_size", self.pp),
            ("context_parallel_size", self.cp),
            ("expert_model_parallel_size", self.ep),
        )
        for name, value in sizes:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.dynamic_cp:
            raise ValueError(
                "prefix sharing does not support dynamic context parallelism: dynamic_context_parallel=True; "
                f"leave it off (a fixed context_parallel_size={self.cp} is supported)"
            )
        if self.vpp is not None and self.vpp > 1:
            raise ValueError(
                f"prefix sharing does not support virtual pipeline stages: "
                f"virtual_pipeline_model_parallel_size={self.vpp}; leave it unset (physical PP is supported)"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True needs tensor_model_parallel_size > 1 (SP is bound to TP)")

    def check(self, world_size: Optional[int] = None, hf_config: Optional[dict] = None) -> None:
        """`check_supported`, that the checkpoint (`hf_config`, its config.json as a dict:
        `check_model`) can be split so, and that the world (torchrun's, by default) can hold the
        settings. Needs no process group; a shape problem is reported before the world size (no
        launch would fix it)."""
        self.check_supported()
        if hf_config is not None:
            self.check_model(hf_config)
        world_size = launched_world_size() if world_size is None else world_size
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor x pipeline x context parallel size "
                f"{self.tp} x {self.pp} x {self.cp} = {model_parallel}"
            )
        if (world_size // self.pp) % (self.ep * self.tp):
            raise ValueError(
                f"world size {world_size} cannot hold expert_model_parallel_size={self.ep} (--ep): megatron needs "
                f"world / pipeline size ({world_size // self.pp}) divisible by expert x tensor parallel size "
                f"({self.ep} x {self.tp}); launch {self.ep * self.tp * self.pp} processes or a multiple"
            )


    def check_model(self, hf_config: dict) -> None:
        """Raise `ModelShapeError` naming the setting and the fix if no split of the checkpoint
        (its config.json, as a dict) fits these settings. Needs no process group.

        Refused, as megatron cannot build them: fewer layers than pipeline stages; attention heads
        not divisible by TP; KV heads neither a multiple nor a divisor of TP (megatron replicates
        KV heads when TP is a multiple of their number); Gated DeltaNet key/value heads or MLP
        widths not divisible by TP. Accepted: a vocabulary TP does not divide (padded) and a layer
        count PP does not divide (uneven stages), see `configure_provider`.
        """
        shape = ModelShape.from_hf_config(hf_config)
        if shape.num_layers is not None and self.pp > shape.num_layers:
            raise ModelShapeError(
                f"pipeline_model_parallel_size={self.pp} (--pp {self.pp}) is larger than the checkpoint's "
                f"{shape.num_layers} layers (num_hidden_layers) and every stage needs one: "
                f"use --pp {shape.num_layers} or fewer"
            )
        problem = shape.tp_problem(self.tp)
        if problem is None and self.cp > 1:
            problem = shape.cp_problem(self.tp, self.cp)
            if problem is not None:
                raise ModelShapeError(
                    f"context_parallel_size={self.cp} (--cp {self.cp}) cannot split the checkpoint's heads "
                    f"at tensor_model_parallel_size={self.tp}: {problem}; use a --cp that divides them"
                )
        if problem is not None:
            fits = [str(t) for t in range(1, (shape.num_attention_heads or self.tp) + 1) if shape.tp_problem(t) is None]
            raise ModelShapeError(
                f"tensor_model_parallel_size={self.tp} (--tp {self.tp}) cannot split the checkpoint's "
                f"{problem}: use --tp {' or '.join(fits)}"
            )


class ModelShapeError(ValueError):
    """A parallel setting no split of the checkpoint can hold (see `ParallelSettings.check_model`)."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a checkpoint that the parallel settings split, from its config.json (the
    `text_config` of a ConditionalGeneration checkpoint). A size the config lacks is None and not
    checked here: the conversion reports what it needs."""

    num_layers: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    tp_split: Tuple[Tuple[str, int], ...] = ()  # (config key, size) that TP must divide

    # what TP splits besides the attention heads: Qwen3.5's Gated DeltaNet heads, the MLP widths
    TP_SPLIT_KEYS = (
        "linear_num_key_heads", "linear_num_value_heads",
        "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
    )

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "ModelShape":
        text = hf_config.get("text_config") or hf_config
        heads = text.get("num_attention_heads")
        return cls(
            num_layers=text.get("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=text.get("num_key_value_heads") or heads,
            tp_split=tuple((key, int(text[key])) for key in cls.TP_SPLIT_KEYS if text.get(key)),
        )

    def cp_problem(self, tp: int, cp: int) -> Optional[str]:
        """What of this shape (split by `tp` first) head-parallel CP over `cp` ranks cannot split, or
        None. Query heads and Gated DeltaNet heads per TP rank must divide by `cp`; softmax KV heads
        need not (they are repeated up to a multiple of `cp` before the all-to-all)."""
        heads = self.num_attention_heads
        if heads is not None and (heads // tp) % cp:
            return f"num_attention_heads={heads} gives {heads // tp} query heads per TP rank, not divisible by {cp}"
        for key, size in self.tp_split:
            if key.startswith("linear_num_") and (size // tp) % cp:
                return f"{key}={size} gives {size // tp} heads per TP rank, not divisible by {cp}"
        return None

    def tp_problem(self, tp: int) -> Optional[str]:
        """What of this shape `tp` tensor-parallel ranks cannot split (megatron's rules), or None."""
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and heads % tp:
            return f"num_attention_heads={heads} (not divisible by {tp})"
        if kv is not None and kv % tp and tp % kv:
            return f"num_key_value_heads={kv} (neither a multiple nor a divisor of {tp})"
        for key, size in self.tp_split:
            if size % tp:
                return f"{key}={size} (not divisible by {tp})"
        return None


def pipeline_stage_layers(num_layers: int, pp: int) -> Tuple[Optional[int], Optional[int]]:
    """The split policy: megatron's (`num_layers_in_first_pipeline_stage`,
    `num_layers_in_last_pipeline_stage`) for `num_layers` on `pp` stages; (None, None) when `pp`
    divides the layers evenly.

    Megatron gives every middle stage the same number of layers; only the first and last stage
    may differ. The largest stage is made as small as possible; among equal choices the middle
    stages get more and the ends less (the first stage also embeds, the last also runs the
    output layer and the loss), and the first stage takes the larger half of the ends.
    3 layers on 2 stages: 2 + 1; 10 on 4: 2 + 3 + 3 + 2; 5 on 4: 2 + 1 + 1 + 1.
    """
    if pp < 1 or num_layers < pp:
        raise ModelShapeError(
            f"pipeline_model_parallel_size={pp} (--pp {pp}) is larger than the {num_layers} layers: "
            f"use --pp {num_layers} or fewer"
        )
    if num_layers % pp == 0:
        return None, None
    if pp == 2:
        return (num_layers + 1) // 2, num_layers // 2
    best = None
    for middle in range(1, (num_layers - 2) // (pp - 2) + 1):
        ends = num_layers - (pp - 2) * middle  # >= 2: one layer or more on each end
        first, last = (ends + 1) // 2, ends // 2
        key = (max(first, middle), -middle)
        if best is None or key < best[0]:
            best = (key, first, last)
    return best[1], best[2]


def configure_provider(provider, settings: ParallelSettings) -> None:
    """Set the parallel settings on a Megatron-Bridge provider, before its `finalize()`.

    Beyond the TP / PP / SP sizes: a vocabulary TP does not divide is padded the way
    Megatron-Bridge pads it (`should_pad_vocab`: up to a multiple of the bridge's
    `make_vocab_size_divisible_by` x TP; the bridge loads the HF embedding and output layer with
    zero rows appended), and a layer count PP does not divide gets megatron's uneven first and
    last stages (`pipeline_stage_layers`). `provider.vocab_size` stays the checkpoint's;
    `padded_vocab_size(provider)` is the one the model is built with.
    """
    provider.tensor_model_parallel_size = settings.tp
    provider.pipeline_model_parallel_size = settings.pp
    provider.context_parallel_size = settings.cp
    provider.sequence_parallel = settings.sequence_parallel
    provider.expert_model_parallel_size = settings.ep
    if int(provider.vocab_size) % settings.tp:
        provider.should_pad_vocab = True
    first, last = pipeline_stage_layers(int(provider.num_layers), settings.pp)
    provider.num_layers_in_first_pipeline_stage = first
    provider.num_layers_in_last_pipeline_stage = last


def padded_vocab_size(provider) -> int:
    """The vocabulary size megatron builds the embedding and output layer with."""
    if not getattr(provider, "should_pad_vocab", False):
        return int(provider.vocab_size)
    from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size

    return calculate_padded_vocab_size(
        int(provider.vocab_size), int(provider.make_vocab_size_divisible_by),
        int(provider.tensor_model_parallel_size), logging_enabled=False,
    )


# ---- process groups (torchrun's variables are read here) ------------------------------------------


def launched_world_size() -> int:
    """The world size torchrun launched (1 when run as a plain process)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_parallel(
    tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234, ep: int = 1, timeout_s: Optional[float] = None
) -> None:
    """torch.distributed (gloo on CPU, NCCL on GPU; world size 1 when not launched by torchrun) and
    megatron's model-parallel groups, seeded; idempotent. `timeout_s`: how long a collective may
    wait before it fails (torch's default when None)."""
    import datetime

    from ps_bridge.compat import cuda_on_cpu

    cuda_on_cpu.enable()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:  # launched by torchrun
            dist.init_process_group(backend, **timeout)
        else:  # a single process: a private store on a free port, the environment left alone
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **timeout)
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
            expert_model_parallel_size=ep,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def is_output_rank() -> bool:
    """Global rank 0 writes files and prints results; every rank logs its own `[PS]` lines."""
    return not dist.is_initialized() or dist.get_rank() == 0


def max_over_ranks(value: float) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _collective_device() -> torch.device:
    # NCCL collectives need CUDA tensors; gloo takes CPU tensors
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


# ---- gradients ---------------------------------------------------------------------------------


def _needs_tp_sum(name: str, param: torch.nn.Parameter, config) -> bool:
    """Replicated parameters whose gradient is partial on each TP rank: norms under SP (each rank saw
    its share of the tokens) and q/k norms (each rank saw its share of the heads). The same rule as
    megatron's `_allreduce_non_tensor_model_parallel_grads`."""
    if getattr(config, "sequence_parallel", False) and getattr(param, "sequence_parallel", False):
        return True
    return bool(getattr(config, "qk_layernorm", False)) and ("q_layernorm" in name or "k_layernorm" in name)


def finish_gradients(model: torch.nn.Module, config, data_parallel_mean: bool = False) -> None:
    """Reduce the partial gradients of replicated parameters after a backward pass.

    megatron's `finalize_model_grads` does this inside its DDP wrapper; verl training uses that.
    Our runs (CLI, demo, bench, tests) call the model without DDP, so they finish gradients here,
    the one place that does:
    - the replicas' sum: every gradient summed over the ranks that hold the same parameter and ran
      other tokens, the data-parallel-with-CP group, for expert weights (`allreduce=False`) the
      expert-data-parallel group (under EP x CP the data-parallel-with-CP group's CP ranks hold
      other experts). Megatron's schedule scales each CP rank's loss (its own shard's rows) by the
      CP size; that is divided out, so the gradient is that of the sum of every rank's loss (our
      losses are plain sums over samples: the whole batch's gradient). `data_parallel_mean` then
      divides by the data-parallel size, as megatron's DDP averages per-rank mean losses;
    - TP sum for SP norms and q/k norms, mean across TP for `average_gradients_across_tp_domain`
      parameters, the tied word-embedding sum between the first and last pipeline stage;
    - for MoE the routers' end of step (expert-bias update, token counts reset).
    """
    from megatron.core import parallel_state

    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(dp_cp_group) > 1:
        expert_dp_group = parallel_state.get_expert_data_parallel_group()
        scale = parallel_state.get_context_parallel_world_size()
        if data_parallel_mean:
            scale *= parallel_state.get_data_parallel_world_size()
        for param in model.parameters():
            if param.grad is not None:
                group = dp_cp_group if getattr(param, "allreduce", True) else expert_dp_group
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(param.grad, group=group)
                if scale > 1:
                    param.grad /= scale

    tp_group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(tp_group) > 1:
        for name, param in model.named_parameters():
            if param.grad is None:
                continue
            if getattr(param, "average_gradients_across_tp_domain", False):
                dist.all_reduce(param.grad, group=tp_group)
                param.grad /= dist.get_world_size(tp_group)
            elif _needs_tp_sum(name, param, config):
                dist.all_reduce(param.grad, group=tp_group)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1 and parallel_state.is_rank_in_embedding_group():
        embedding_group = parallel_state.get_embedding_group()
        if dist.get_world_size(embedding_group) > 1:
            for param in model.parameters():
                if getattr(param, "shared_embedding", False) and param.grad is not None:
                    dist.all_reduce(param.grad, group=embedding_group)
    from ps_bridge.models.moe import finish_router_statistics  # MoE: the routers' part of finalize_model_grads

    finish_router_statistics(model, config)


def broadcast_replicas(model: torch.nn.Module) -> None:
    """Make the replicas of a randomly initialised model identical, as megatron's DDP wrapper
    broadcasts them at the start of training (`broadcast_params`): every parameter from rank 0 of
    the data-parallel-with-CP group (the CP replicas, and under expert parallelism the
    data-parallel ranks), expert weights (`allreduce=False`) over the expert data-parallel group
    (the ranks that hold the same experts); without expert parallelism the buffers too. Weights
    loaded from a checkpoint are identical already."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) == 1:
        return
    expert_group = parallel_state.get_expert_data_parallel_group()
    tensors = [(p.data, group if getattr(p, "allreduce", True) else expert_group) for p in model.parameters()]
    if parallel_state.get_expert_model_parallel_world_size() == 1:
        tensors += [(b, group) for b in model.buffers()]
    for tensor, g in tensors:
        if dist.get_world_size(g) > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(g, 0), group=g)


def hf_named_gradients(bridge, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Full (unsharded) gradients under Hugging Face names, on every rank.

    Megatron-Bridge's export already knows how each parameter is split across TP ranks and PP
    stages (fused QKV, gated MLP halves, GDN heads), so the gradients are exported as if they were
    the weights: swap each parameter's data for its gradient, export, swap back. Every rank must
    call this (the export gathers across TP and PP).

    Some mappings are affine, not linear: Qwen3.5's GDN output norm is zero-centred in megatron and
    a plain scale in HF, so its export adds 1. The gradient is therefore export(grad) - export(0),
    both computed in float64 so that adding and removing the 1 loses nothing of a small gradient.

    A padded vocabulary (`configure_provider`) exports the embedding and output layer with their
    padded rows; those rows are cut, so every gradient has its HF parameter's shape.
    """
    params = list(model.parameters())
    saved = [p.data for p in params]

    def export(fill) -> Dict[str, torch.Tensor]:
        for p in params:
            p.data = fill(p)
        return {name: t.detach().double().cpu().clone() for name, t in bridge.export_hf_weights([model], cpu=True, show_progress=False)}

    try:
        grads = export(lambda p: p.grad.detach().double() if p.grad is not None else torch.zeros_like(p.data, dtype=torch.float64))
        offsets = export(lambda p: torch.zeros_like(p.data, dtype=torch.float64))
    finally:
        for p, data in zip(params, saved):
            p.data = data
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)  # the provider's: the true size
    out = {}
    for name, g in grads.items():
        g = (g - offsets[name]).float()
        if vocab and _is_vocab_parameter(name) and g.shape[0] > vocab:
            g = g[:vocab].clone()
        out[name] = g
    return out


def _is_vocab_parameter(hf_name: str) -> bool:
    """The HF embedding and LM head: the parameters a padded vocabulary pads."""
    return hf_name.endswith(("embed_tokens.weight", "lm_head.weight"))


# ---- command line --------------------------------------------------------------------------------


def add_parallel_arguments(parser) -> None:
    """`--tp`, `--pp`, `--sp`, `--cp` for a command that runs under `torchrun --nproc-per-node N`."""
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (physical stages)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (head-parallel over contiguous shards)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE; out of the data-parallel ranks)")


def settings_from_args(args) -> ParallelSettings:
    return ParallelSettings(tp=args.tp, pp=args.pp, cp=args.cp, sequence_parallel=args.sp, ep=args.ep)
