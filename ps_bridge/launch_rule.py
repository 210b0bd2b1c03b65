"""The one rule that decides, per micro-batch, whether prefix sharing pays.

Sharing stores each group's prompt once: the GPU does the work of `T_shared` tokens instead of
`T_unshared`, and the output layer skips the prompt positions nobody reads. It costs kernel launches:
per Gated DeltaNet layer a second delta-rule call (prompts, then responses from the prompts' states)
with its state fork, per softmax-attention layer a second flash call (responses against their prompt)
and the log-sum-exp merge. A step takes about the larger of its host time (Python, launches, syncs)
and its GPU time. At small shapes (a 0.8B model, 4 prompts of 128 tokens with 8 responses of 32 per
micro-batch) even the unshared step is host-bound, and the shared path's extra launches make it
slower (measured 0.70x on an H200). Sharing pays once the unshared micro-batch's GPU work exceeds
what the shared path costs on the host, by a margin (near the break-even noise decides):

    share  iff  gpu_unshared_ns > MARGIN * host_shared_ns      (MARGIN = 3/2)
    gpu_unshared_ns = F * (T_unshared * (layer_weights + hidden * vocab)) / (1000 * TFLOPS[kind, backward])
    host_shared_ns  = sum over layers of HOST_NS[layer kind, backend, device, backward]

F = 6 with the backward (forward + backward as 3 x the forward's 2 FLOPs per weight), 2 without.
`layer_weights` are the matmul weights a token passes through in all decoder layers (the active
experts of an MoE layer, `ModelCost.from_hf_config`), `hidden * vocab` the output layer, which the
unshared step runs at every position. The constants were fitted on one H200 to `ps-bridge bench`
rows of the small shapes (docs/how-it-works.md gives the rows and the fit): `TFLOPS` is the
throughput the unshared step reaches there, by the model's mixer kind (`gdn` for a model with any
Gated DeltaNet layer); `HOST_NS` the shared step's time per layer where it is host-bound. A
(backend, device) pair without a measured cost always shares (the reason says so): the reference
backends and any backend on a CPU are there for exactness, not speed, and must run the shared path
they test.

The decision uses host-side integers and flags only (token counts of the micro-batch from its
samples, the model's config, the configured backend names, the device type, whether gradients are
enabled) and integer arithmetic, so every rank that sees the same micro-batch (the TP, CP and PP
ranks of one data-parallel rank) takes the same path, whatever its own layers or shard.

Where the model's passes replay CUDA graphs (`cuda_graphs`, on bucketed layouts: `graphs=True`), a
step's host time is one replay whatever its launches, so the shared path costs no host time of its
own: the rule shares every micro-batch that has something to share, on a bucketed pack
(`SharingDecision.bucketed`). A bucketed pack pads each tree level to its longest segment's bucket and
computes every position, so with responses of uneven length it can hold nearly as many tokens as the
samples themselves: where it holds more than `BUCKET_PAYS` (9/10) of them (counted before packing:
`tree.materialize.bucketed_tokens`, `MicroBatchCounts.tokens_bucketed`), the micro-batch runs eagerly,
unbucketed, and the rule decides as it does without graphs.

`PrefixSharingConfig.sharing` (`PS_BRIDGE_SHARING`) forces it: `on` shares whenever a prompt has two
or more responses, `off` never shares, `auto` (default) applies the rule. `measured` applies it with
`host_shared_ns` scaled by this process's host (`HOST_NS` are one host's, and hosts of one kind differ):
`HostCalibration` keeps, per pass kind, the median ratio of the measured to the predicted host time
of the process's recent host-bound shared micro-batches, which the verl engine times where no other
rank runs them (docs/how-it-works.md, "The sharing rule").
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence, Tuple

import numpy as np

logger = logging.getLogger("ps_bridge")

# Effective throughput (TFLOP/s) of the unshared step's GPU work on an H200 at the small shapes, by
# the model's mixer kind and whether the step runs the backward (docs/how-it-works.md: the unshared
# rows of 12288-17408 tokens, GPU-bound).
TFLOPS: Mapping[Tuple[str, bool], int] = {
    ("attention", True): 220, ("attention", False): 150,
    ("gdn", True): 165, ("gdn", False): 155,
}
# Host time of the shared step per decoder layer where it is host-bound (nanoseconds), by (layer kind,
# concrete backend, device type, backward): the measured step time over the layer count, an
# attention layer's share taken from the attention-only Qwen2.5 rows (docs/how-it-works.md).
HOST_NS: Mapping[Tuple[str, str, str, bool], int] = {
    ("attention", "flash_atten_gpu", "cuda", True): 4_400_000,
    ("attention", "flash_atten_gpu", "cuda", False): 2_650_000,
    ("gdn", "fla", "cuda", True): 13_100_000,
    ("gdn", "fla", "cuda", False): 4_700_000,
}
# Share only where the unshared GPU work exceeds the shared host time by this ratio (3/2): near the
# break-even both paths take about as long and run-to-run noise decides which is faster, so such a
# micro-batch runs unshared, the path that is sharing off. 5/4 let Qwen3.5-0.8B's (128, 256) update
# micro-batches share, which measured 1.16x in `ps-bridge bench` but 0.92x in verl-check
# (docs/how-it-works.md).
MARGIN: Tuple[int, int] = (3, 2)
# Under CUDA graphs a bucketed shared pack runs where it holds at most 9/10 of the samples' tokens
BUCKET_PAYS: Tuple[int, int] = (9, 10)
MODES = ("auto", "measured", "on", "off")
# `measured`: the first micro-batches of a process are not counted (Triton compiles and autotunes,
# lazy initialisations), then the median of the last `CALIBRATION_WINDOW` ratios, each clamped to
# `CALIBRATION_RANGE` (thousandths) so that one stalled step cannot turn sharing off for good
CALIBRATION_SKIP = 2
CALIBRATION_WINDOW = 9
CALIBRATION_RANGE: Tuple[int, int] = (250, 4000)
# a shared micro-batch is counted only where its predicted host time is at least half its predicted GPU
# work (the prediction overstates the GPU work of short packs: at Qwen3.5-0.8B (128, 256) x 8 layers
# 128 ms against 61 ms measured): there the step is mostly the host's. Where the GPU's part is larger,
# the measured time exceeds the host's and the ratio grows, which only makes the rule share less.
HOST_BOUND: Tuple[int, int] = (1, 2)


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
    def try_from_hf_config(cls, config) -> Optional["ModelCost"]:
        """`from_hf_config`, or None (said once in the log) for a config without the fields it reads:
        the rule is then not applied and every micro-batch with a shared prompt shares."""
        try:
            return cls.from_hf_config(config)
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("[PS][prepare] the sharing rule cannot read the model config (%s: %s); "
                           "every micro-batch with a shared prompt shares", type(e).__name__, e)
            return None

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

    def pass_flops(self, tokens: int, outputs: int, backward: bool) -> int:
        """The matmul FLOPs the rule counts for a pass over `tokens` packed tokens whose output layer
        runs on `outputs` positions: F = 6 with the backward, 2 without (module docstring)."""
        return (6 if backward else 2) * (tokens * self.layer_weights + outputs * self.hidden * self.vocab)


@dataclass(frozen=True)
class MicroBatchCounts:
    """Host-side token counts of one micro-batch, packed unshared and shared."""

    samples: int
    groups: int  # distinct prompts
    tokens_unshared: int  # sum of P_i + R_i
    tokens_shared: int  # each distinct prompt once, plus every response
    outputs_shared: int  # positions the shared output layer runs on
    tokens_bucketed: Optional[int] = None  # the bucketed shared pack's tokens (CUDA graphs), where counted

    @classmethod
    def of(cls, samples: Sequence, prompt_values: bool = False, tree: bool = False,
           min_shared: Optional[int] = None, max_depth: Optional[int] = None, trie=None,
           tokens_bucketed: Optional[int] = None) -> "MicroBatchCounts":
        """Counts of the packing sharing would run: identical prompts (`tree=False`), or the prefix tree
        (`tree=True`: `tokens_shared` is the trie's tokens, as `build_layout(share="tree")` stores them;
        `trie`: that tree already decided, `layout.decide_tree`, read instead of built again).
        `tokens_bucketed`: the bucketed pack's tokens, counted by the caller (`tree.materialize.
        bucketed_tokens`)."""
        # imported here: torch is heavy
        from ps_bridge.layout import find_groups

        groups = find_groups(samples)
        prompts = sum(len(samples[g[0]].prompt) for g in groups)
        responses = sum(len(s.response) for s in samples)
        unshared = sum(len(s.prompt) for s in samples) + responses
        shared = prompts + responses
        if tree:
            shared = trie.trie_tokens if trie is not None else tree_tokens(samples, min_shared, max_depth)
        return cls(len(samples), len(groups), unshared, shared, shared if prompt_values else len(groups) + responses,
                   tokens_bucketed)

    @property
    def nothing_shared(self) -> bool:
        return self.tokens_shared >= self.tokens_unshared


def tree_tokens(samples: Sequence, min_shared: Optional[int], max_depth: Optional[int]) -> int:
    """The tokens the prefix tree of `samples` stores (`ps_bridge.tree.decide.token_trie`)."""
    # imported here: torch is heavy
    from ps_bridge.layout import DEFAULT_MIN_SHARED
    from ps_bridge.tree.decide import sequence_offsets, token_trie

    sequences = [list(s.prompt) + list(s.response) for s in samples]
    offsets = sequence_offsets([len(x) for x in sequences])
    flat = np.fromiter((t for x in sequences for t in x), dtype=np.int64, count=int(offsets[-1]))
    trie = token_trie(flat, offsets, min_shared=DEFAULT_MIN_SHARED if min_shared is None else min_shared,
                      max_depth=max_depth, prompt_lengths=np.array([len(s.prompt) for s in samples], dtype=np.int64))
    return trie.trie_tokens


@dataclass(frozen=True)
class SharingDecision:
    share: bool
    reason: str
    gpu_unshared_ns: Optional[int] = None
    host_shared_ns: Optional[int] = None
    bucketed: bool = False  # a shared pack is bucketed: its passes replay CUDA graphs
    priced: bool = True  # False: shared because no cost is known for the model, kernels or device
    gpu_shared_ns: Optional[int] = None  # the shared pack's GPU work, as gpu_unshared_ns counts it
    host_permille: int = 1000  # the host calibration `host_shared_ns` includes (`measured`)
    backward: Optional[bool] = None  # the pass the decision was made for, where priced

    def describe(self) -> str:
        return f"{'shared' if self.share else 'unshared'}: {self.reason}"


class HostCalibration:
    """This process's host against the one `HOST_NS` were fitted on, per pass kind (with a backward or
    without): the median ratio, in thousandths, of the measured to the predicted host time of its
    recent host-bound shared micro-batches (1000 until there is one)."""

    def __init__(self):
        self._ratios = {True: deque(maxlen=CALIBRATION_WINDOW), False: deque(maxlen=CALIBRATION_WINDOW)}
        self._skipped = {True: 0, False: 0}

    def ratios(self, backward: bool) -> Tuple[int, ...]:
        """The ratios counted, oldest first (thousandths)."""
        return tuple(self._ratios[backward])

    def permille(self, backward: bool) -> int:
        ratios = sorted(self._ratios[backward])
        return ratios[len(ratios) // 2] if ratios else 1000

    def observe(self, decision: SharingDecision, measured_ns: int) -> bool:
        """Count the measured host time of a micro-batch run as `decision` says (its forward step to
        the next); False where that says nothing of the host: not shared, no cost known, a bucketed
        pack (CUDA graph replays), or a step not host-bound (the GPU's time, not the host's)."""
        d = decision
        if not (d.share and d.priced and not d.bucketed and d.backward is not None
                and d.host_shared_ns and d.gpu_shared_ns is not None):
            return False
        num, den = HOST_BOUND
        if d.host_shared_ns * den < d.gpu_shared_ns * num:
            return False
        if self._skipped[d.backward] < CALIBRATION_SKIP:
            self._skipped[d.backward] += 1
            return False
        predicted = d.host_shared_ns * 1000 // d.host_permille  # HOST_NS's own, uncalibrated
        lo, hi = CALIBRATION_RANGE
        self._ratios[d.backward].append(min(hi, max(lo, measured_ns * 1000 // max(predicted, 1))))
        return True


# this process's host, fed by the verl engine (`PrefixSharingEngineMixin`) where it runs a micro-batch
# on one rank alone, read by the rule in mode `measured`
HOST_CALIBRATION = HostCalibration()


def concrete_backends(attention: str, gdn: str, device_type: str, dtype_name: str, head_dim: int) -> Tuple[str, str]:
    """The kernels `auto` stands for (as `resolve_attention_backend` / `resolve_gdn_backend` pick them),
    from names and integers only."""
    if attention == "auto":
        flash = device_type == "cuda" and dtype_name in ("bfloat16", "float16") and head_dim <= 256 and head_dim % 8 == 0
        attention = "flash_atten_gpu" if flash else "torch_ref"
    if gdn == "auto":
        gdn = "fla" if device_type == "cuda" else "torch_ref"
    return attention, gdn


def sharing_pays(counts: MicroBatchCounts, model: Optional[ModelCost], *, mode: str = "auto",
                   attention_backend: str = "auto", gdn_backend: str = "auto", device_type: str = "cuda",
                   dtype_name: str = "bfloat16", backward: bool = True, graphs: bool = False) -> SharingDecision:
    """Whether this micro-batch runs shared; see the module docstring. Integers in, the same answer on
    every rank (in mode `measured` also this process's `HOST_CALIBRATION`, which is fed only where no
    other rank runs the micro-batch)."""
    if mode not in MODES:
        raise ValueError(f"prefix-sharing mode {mode!r} is not one of {', '.join(MODES)} (PS_BRIDGE_SHARING)")
    if counts.nothing_shared:
        return SharingDecision(False, "nothing to share (no token is stored once for several samples)")
    if mode == "off":
        return SharingDecision(False, "forced off (PS_BRIDGE_SHARING=off)")
    if mode == "on":
        return SharingDecision(True, "forced on (PS_BRIDGE_SHARING=on)", bucketed=graphs)
    host_permille = HOST_CALIBRATION.permille(backward) if mode == "measured" else 1000
    padded = ""
    if graphs:
        bucketed = counts.tokens_bucketed
        if bucketed is None or bucketed_pack_runs(bucketed, counts.tokens_unshared):
            return SharingDecision(True, "pays (the passes replay CUDA graphs: no host-bound cost)", bucketed=True)
        # runs eagerly: decided as without graphs
        padded = (f"the bucketed shared pack would hold {bucketed} tokens, the samples {counts.tokens_unshared}; "
                  "without graphs: ")
    decision = eager_decision(counts, model, attention_backend, gdn_backend, device_type, dtype_name, backward,
                              host_permille)
    return replace(decision, reason=padded + decision.reason) if padded else decision


def bucketed_pack_runs(tokens_bucketed: int, tokens_unshared: int) -> bool:
    """Under CUDA graphs: whether a bucketed shared pack of `tokens_bucketed` tokens runs, holding at
    most `BUCKET_PAYS` of its samples' own `tokens_unshared` (else the micro-batch runs eagerly)."""
    num, den = BUCKET_PAYS
    return tokens_bucketed * den <= tokens_unshared * num


def eager_decision(counts: MicroBatchCounts, model: Optional[ModelCost], attention_backend: str,
                   gdn_backend: str, device_type: str, dtype_name: str, backward: bool,
                   host_permille: int = 1000, tflops: Optional[Mapping] = None,
                   host_ns: Optional[Mapping] = None) -> SharingDecision:
    """The rule where each launch costs host time: the unshared GPU work against the shared host time
    (`HOST_NS` scaled by `host_permille` thousandths: the host calibration of mode `measured`).
    `tflops` / `host_ns` replace `TFLOPS` / `HOST_NS` (tools/fit_sharing_rule.py tries a fit's)."""
    tflops = TFLOPS if tflops is None else tflops
    host_ns = HOST_NS if host_ns is None else host_ns
    if model is None:
        return SharingDecision(True, "no model cost known (rule not applied)", priced=False)
    attention, gdn = concrete_backends(attention_backend, gdn_backend, device_type, dtype_name, model.head_dim)
    host = 0
    for kind, backend, layers in (("attention", attention, model.attention_layers), ("gdn", gdn, model.gdn_layers)):
        if layers == 0:
            continue
        cost = host_ns.get((kind, backend, device_type, backward))
        if cost is None:
            return SharingDecision(True, f"no launch cost measured for {kind} backend {backend} on {device_type} "
                                         "(rule not applied)", priced=False)
        host += layers * cost
    host = host * host_permille // 1000
    per_ns = 1000 * tflops[("gdn" if model.gdn_layers else "attention", backward)]
    # the unshared pass runs the output layer at every position
    gpu = model.pass_flops(counts.tokens_unshared, counts.tokens_unshared, backward) // per_ns
    gpu_shared = model.pass_flops(counts.tokens_shared, counts.outputs_shared, backward) // per_ns
    what = (f"{'forward+backward' if backward else 'forward'}, tokens {counts.tokens_unshared} -> "
            f"{counts.tokens_shared}: unshared GPU work ~{gpu / 1e6:.0f} ms")
    num, den = MARGIN
    measured = f" (x{host_permille / 1000:.2f}, measured on this host)" if host_permille != 1000 else ""
    bar = f"{num}/{den} x ~{host / 1e6:.0f} ms shared host time{measured}, {attention}/{gdn}"
    fields = dict(gpu_unshared_ns=gpu, host_shared_ns=host, gpu_shared_ns=gpu_shared,
                  host_permille=host_permille, backward=backward)
    if gpu * den > host * num:
        return SharingDecision(True, f"pays ({what} > {bar})", **fields)
    return SharingDecision(False, f"does not pay ({what} <= {bar})", **fields)


def sharing_for(samples: Sequence, config, model: Optional[ModelCost], device_type: str,
                dtype_name: str, backward: Optional[bool] = None, trie=None, graphs: bool = False,
                tokens_bucketed: Optional[int] = None) -> SharingDecision:
    """The decision for `samples` under a `PrefixSharingConfig`: what the verl engine and
    `runtime.make_layout` (`ps-bridge logprobs`, the schedule) call. `backward` defaults to whether
    gradients are enabled (verl's log-prob passes and `ps-bridge logprobs` run under `no_grad`).
    `trie`: with `config.tree`, the prefix tree already decided for `samples` (`layout.decide_tree`),
    whose token count the rule reads; the same tree then goes to `build_layout(tree=...)`. `graphs`:
    the passes replay CUDA graphs (the layouts are bucketed: `plan.SharingPlan.bucket`), and
    `tokens_bucketed` is the bucketed shared pack's token count."""
    # imported here: torch is heavy (the rule's integer arithmetic imports without it)
    import torch

    backward = torch.is_grad_enabled() if backward is None else backward
    if not config.enabled:
        return SharingDecision(False, "prefix sharing disabled")
    counts = MicroBatchCounts.of(samples, prompt_values=config.prompt_values, tree=config.tree,
                                 min_shared=config.tree_min_shared, max_depth=config.tree_max_depth, trie=trie,
                                 tokens_bucketed=tokens_bucketed)
    return sharing_pays(counts, model, mode=config.sharing, attention_backend=config.backend,
                          gdn_backend=config.gdn_backend, device_type=device_type, dtype_name=dtype_name,
                          backward=backward, graphs=graphs)
