"""Parallel settings of a prefix-shared run and their refusals.

Prefix sharing supports tensor parallelism (TP), TP-bound sequence parallelism (SP), physical
pipeline parallelism (PP) and context parallelism (CP: head-parallel over contiguous shards of the
pack, see `models/context_parallel.py`); it refuses virtual pipeline stages and dynamic CP. The
model is parallelised from outside, by megatron-core: this module checks the settings up front
(`ParallelSettings.check_supported`, the one place that knows what is refused, and
`check_model`, against the checkpoint's shapes; a refused setting fails before any process group
exists, on every rank alike, without hanging) and sets them on the provider (with the vocabulary
padding and the uneven pipeline split a checkpoint's shapes may need). Process groups are in
`ps_bridge.parallel.groups`, gradient finishing in `ps_bridge.parallel.gradients`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ps_bridge.parallel.groups import launched_world_size


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
        depth run under every supported setting (docs/how-it-works.md), so nothing here depends on them."""
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
    # imported here: heavy, Megatron-Bridge, only where the vocabulary is padded
    from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size

    return calculate_padded_vocab_size(
        int(provider.vocab_size), int(provider.make_vocab_size_divisible_by),
        int(provider.tensor_model_parallel_size), logging_enabled=False,
    )
