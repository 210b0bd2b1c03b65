"""The one rule that decides, per micro-batch, whether prefix sharing pays (issue 21).

Sharing stores each group's prompt once: it saves the work of `T_unshared - T_shared` tokens in every
decoder layer, and the output layer skips the prompt positions nobody reads (`T_unshared - O_shared`
rows of the vocabulary projection). It costs kernel launches: per Gated DeltaNet layer a second
delta-rule call (prompts, then responses from the prompts' states) with its state fork, per
softmax-attention layer a second flash call (responses against their prompt) and the log-sum-exp
merge, forward and backward. At small shapes (a 0.8B model, 8 prompts of 128 tokens, responses of
32) the step is launch-bound and those extra launches cost more than the saved work: sharing loses.

    share  iff  saved_ns > extra_ns
    saved_ns = 6 * (T_unshared - T_shared) * layer_weights / (1000 * TFLOPS)
             + 6 * (T_unshared - O_shared) * hidden * vocab  / (1000 * TFLOPS)
    extra_ns = gdn_layers * EXTRA_NS[gdn backend] + attention_layers * EXTRA_NS[attention backend]

`layer_weights` is the matmul weights a token passes through in the decoder layers (all of them,
`ModelCost.from_hf_config`), 6 = forward + backward as 3 x the forward's 2 FLOPs per weight. The
constants (`TFLOPS`, `EXTRA_NS`) were measured on one H200 with `ps-bridge bench` rows of the
small shapes (docs/never-slower.md gives the rows and the fit). A (backend, device) pair without a
measured cost always shares (the reason says so): the reference backends on a CPU are there for
exactness, not speed, and must run the shared path they test.

The decision uses host-side integers only (token counts of the micro-batch from its samples, the
model's config, the configured backend names and the device type) and integer arithmetic, so every
rank that sees the same micro-batch (TP, CP and PP ranks of one data-parallel rank) takes the same
path, whatever its own layers or shard.

`PrefixSharingConfig.sharing` (`PS_BRIDGE_SHARING`) forces it: `on` shares whenever a prompt has two
or more responses, `off` never shares, `auto` (default) applies the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

# Effective bf16 matmul throughput at these sizes, TFLOP/s (= 1000 FLOP per nanosecond).
TFLOPS = 250
# Extra host + GPU time of the shared path per layer and micro-batch (forward + backward), nanoseconds,
# by (layer kind, concrete backend, device type).
EXTRA_NS: Mapping[Tuple[str, str, str], int] = {
    ("gdn", "fla", "cuda"): 2_000_000,
    ("attention", "flash_atten_gpu", "cuda"): 300_000,
}
MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class ModelCost:
    """What the rule needs of a model, from its Hugging Face config (the same on every rank)."""

    attention_layers: int
    gdn_layers: int
    layer_weights: int  # matmul weights per token over all decoder layers
    hidden: int
    vocab: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, config) -> "ModelCost":
        """From a transformers config or its dict (a multimodal config's `text_config` is used)."""
        d = config if isinstance(config, Mapping) else config.to_dict()
        d = d.get("text_config") or d
        hidden, layers = int(d["hidden_size"]), int(d["num_hidden_layers"])
        heads = int(d["num_attention_heads"])
        kv = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        types = list(d.get("layer_types") or [])
        gdn = sum(t == "linear_attention" for t in types)
        attention = layers - gdn
        # Qwen3.5's attention has an output gate: its q projection is twice as wide
        q_width = heads * head_dim * (2 if gdn else 1)
        attn_w = hidden * (q_width + 2 * kv * head_dim) + heads * head_dim * hidden
        gdn_w = 0
        if gdn:
            kh, kd = int(d["linear_num_key_heads"]), int(d["linear_key_head_dim"])
            vh, vd = int(d["linear_num_value_heads"]), int(d["linear_value_head_dim"])
            gdn_w = hidden * (2 * kh * kd + 2 * vh * vd + 2 * vh) + vh * vd * hidden
        if d.get("num_experts"):
            top_k = int(d.get("num_experts_per_tok") or 1)
            mlp_w = 3 * hidden * (int(d["moe_intermediate_size"]) * top_k
                                  + int(d.get("shared_expert_intermediate_size") or 0)) + hidden * int(d["num_experts"])
        else:
            mlp_w = 3 * hidden * int(d["intermediate_size"])
        return cls(attention_layers=attention, gdn_layers=gdn,
                   layer_weights=attention * attn_w + gdn * gdn_w + layers * mlp_w,
                   hidden=hidden, vocab=int(d["vocab_size"]), head_dim=head_dim)


@dataclass(frozen=True)
class MicroBatchCounts:
    """Host-side token counts of one micro-batch, packed unshared and shared."""

    samples: int
    groups: int  # distinct prompts
    tokens_unshared: int  # sum of P_i + R_i
    tokens_shared: int  # each distinct prompt once, plus every response
    outputs_shared: int  # positions the shared output layer runs on

    @classmethod
    def of(cls, samples: Sequence, prompt_values: bool = False) -> "MicroBatchCounts":
        from ps_bridge.layout import find_groups

        groups = find_groups(samples)
        prompts = sum(len(samples[g[0]].prompt) for g in groups)
        responses = sum(len(s.response) for s in samples)
        unshared = sum(len(s.prompt) for s in samples) + responses
        shared = prompts + responses
        return cls(len(samples), len(groups), unshared, shared, shared if prompt_values else len(groups) + responses)


@dataclass(frozen=True)
class SharingDecision:
    share: bool
    reason: str
    saved_ns: Optional[int] = None
    extra_ns: Optional[int] = None

    def describe(self) -> str:
        return f"{'shared' if self.share else 'unshared'}: {self.reason}"


def concrete_backends(attention: str, gdn: str, device_type: str, dtype_name: str, head_dim: int) -> Tuple[str, str]:
    """The kernels `auto` stands for (as `resolve_attention_backend` / `resolve_gdn_backend` pick them),
    from names and integers only."""
    if attention == "auto":
        flash = device_type == "cuda" and dtype_name in ("bfloat16", "float16") and head_dim <= 256 and head_dim % 8 == 0
        attention = "flash_atten_gpu" if flash else "torch_ref"
    if gdn == "auto":
        gdn = "fla" if device_type == "cuda" else "torch_ref"
    return attention, gdn


def decide_sharing(counts: MicroBatchCounts, model: Optional[ModelCost], *, mode: str = "auto",
                   attention_backend: str = "auto", gdn_backend: str = "auto", device_type: str = "cuda",
                   dtype_name: str = "bfloat16") -> SharingDecision:
    """Whether this micro-batch runs shared; see the module docstring. Integers in, the same answer on
    every rank."""
    if mode not in MODES:
        raise ValueError(f"prefix-sharing mode {mode!r} is not one of {', '.join(MODES)} (PS_BRIDGE_SHARING)")
    if counts.groups == counts.samples:
        return SharingDecision(False, "nothing to share (every prompt has one response)")
    if mode == "off":
        return SharingDecision(False, "forced off (PS_BRIDGE_SHARING=off)")
    if mode == "on":
        return SharingDecision(True, "forced on (PS_BRIDGE_SHARING=on)")
    if model is None:
        return SharingDecision(True, "no model cost known (rule not applied)")
    attention, gdn = concrete_backends(attention_backend, gdn_backend, device_type, dtype_name, model.head_dim)
    kinds = [("attention", attention, model.attention_layers), ("gdn", gdn, model.gdn_layers)]
    extra = 0
    for kind, backend, layers in kinds:
        if layers == 0:
            continue
        cost = EXTRA_NS.get((kind, backend, device_type))
        if cost is None:
            return SharingDecision(True, f"no launch cost measured for {kind} backend {backend} on {device_type} "
                                         "(rule not applied)")
        extra += layers * cost
    flops = 6 * ((counts.tokens_unshared - counts.tokens_shared) * model.layer_weights
                 + (counts.tokens_unshared - counts.outputs_shared) * model.hidden * model.vocab)
    saved = flops // (1000 * TFLOPS)
    tokens = f"tokens {counts.tokens_unshared} -> {counts.tokens_shared}"
    if saved > extra:
        return SharingDecision(True, f"pays: {tokens} saves ~{saved / 1e6:.2f} ms > {extra / 1e6:.2f} ms of extra "
                                     f"launches ({attention}/{gdn})", saved, extra)
    return SharingDecision(False, f"does not pay: {tokens} saves ~{saved / 1e6:.2f} ms <= {extra / 1e6:.2f} ms "
                                  f"of extra launches ({attention}/{gdn})", saved, extra)


def sharing_for(samples: Sequence, config, model: Optional[ModelCost], device_type: str,
                dtype_name: str) -> SharingDecision:
    """The decision for `samples` under a `PrefixSharingConfig`: what the verl engine and
    `runtime.make_layout` (`ps-bridge logprobs`, the schedule) call."""
    if not config.enabled:
        return SharingDecision(False, "prefix sharing disabled")
    counts = MicroBatchCounts.of(samples, prompt_values=config.prompt_values)
    return decide_sharing(counts, model, mode=config.sharing, attention_backend=config.backend,
                          gdn_backend=config.gdn_backend, device_type=device_type, dtype_name=dtype_name)
