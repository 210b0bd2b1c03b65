"""verl Megatron engine whose forward step packs each micro-batch prefix-shared.

`PrefixSharingEngineMixin.forward_step` replaces `MegatronEngineWithLMHead.forward_step` only; model
building (through Megatron-Bridge and our provider), optimizer, weight export, micro-batching and the
loss all stay verl's. Per micro-batch it

1. rebuilds every sample `prompt + response` from verl's nested `input_ids` and the prompt lengths,
2. packs them with `build_layout` (one prompt per group, `pad_multiple` = TP size),
3. runs the prefix-aware model on the packed THD sequence (`ps_bridge.forward.run_packed`), whatever
   verl's data format (`use_remove_padding` only changes how the *stock* engine pads; our model
   always takes the pack),
4. turns the packed logits into per-sample rows with the one row extractor (`ps_bridge.rows`), given
   verl's labels and temperatures: log-probs with megatron's vocab-parallel cross entropy (as verl's
   own function), entropy and sum of squared probabilities with verl's vocab-parallel functions,
5. hands back the nested per-sample rows of length `P_i + R_i` that the stock engine returns.

Labels are taken from verl's own label roll for the stock data format, so even the unlabelled
last position of every row holds what the stock engine puts there (at CP=1).

Context parallelism (static `context_parallel_size > 1`): each CP rank runs its contiguous shard of
the pack (padded to equal shards), takes the rows of its shard from the whole rows' labels, and
`PackedRows.complete` hands verl the full rows on every CP rank, as verl's own CP output gather does
(`postprocess_thd_engine`): the other ranks' values without gradient. verl's loss of the full rows
then sends gradient to this rank's own rows only; megatron's schedule scales the loss by the CP size
and its DDP averages gradients over data-parallel-with-CP, so the gradient is that of CP=1.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from functools import partial
from typing import List, Optional, Sequence

import torch

from ps_bridge.config import PrefixSharingConfig
from ps_bridge.forward import cp_total_multiple, local_shard, run_packed, shard_tag
from ps_bridge.launch_rule import ModelCost, SharingDecision, sharing_for
from ps_bridge.layout import PackedPrefixLayout, Sample, build_layout, log_layout
from ps_bridge.parallel import ParallelSettings
from ps_bridge.parallel_info import rank_tag
from ps_bridge.rows import PackedRows

logger = logging.getLogger("ps_bridge")

UNSUPPORTED_BATCH_KEYS = {
    "distillation_use_topk": "top-k distillation",
    "distillation_only": "distillation",
}


def _refuse(what: str) -> None:
    raise NotImplementedError(
        f"prefix sharing (ps_bridge.verl) does not support {what}; turn it off for this run "
        "(ENABLE_PREFIX_SHARING=0) or disable that feature"
    )


def uid_list(batch) -> Optional[list]:
    """verl's per-sample `uid` (a non-tensor column of the TensorDict), or None."""
    if "uid" not in batch.keys():
        return None
    return [str(u) for u in batch["uid"]]


def samples_from_micro_batch(batch) -> List[Sample]:
    """Each sample's own tokens from verl's nested `input_ids` (the exact tokens the stock engine
    feeds), cut at the prompt length given by the left-padded `prompts` block of `attention_mask`."""
    input_ids = batch["input_ids"]
    prompts = batch["prompts"]
    if prompts.is_nested:
        prompt_lengths = prompts.offsets().diff().tolist()
    else:
        prompt_lengths = batch["attention_mask"][:, : prompts.shape[1]].sum(dim=1).tolist()
    uids = uid_list(batch)
    offsets = input_ids.offsets().tolist()
    flat = input_ids.values().tolist()
    samples = []
    for i, P in enumerate(prompt_lengths):
        tokens = flat[offsets[i] : offsets[i + 1]]
        samples.append(Sample(tokens[:P], tokens[P:], None if uids is None else uids[i]))
    return samples


@contextmanager
def _context_parallel_off():
    """megatron's parallel state reporting one CP rank of one, while verl's preprocess functions form
    the labels: they slice by CP rank, and the labels are wanted whole (`stock_row_labels`)."""
    from megatron.core import parallel_state as mpu

    saved = mpu.get_context_parallel_world_size, mpu.get_context_parallel_rank
    mpu.get_context_parallel_world_size, mpu.get_context_parallel_rank = (lambda *a, **k: 1), (lambda *a, **k: 0)
    try:
        yield
    finally:
        mpu.get_context_parallel_world_size, mpu.get_context_parallel_rank = saved


def stock_row_labels(engine, model, batch, data_format: str) -> torch.Tensor:
    """The label of every row position, flattened in sample order, exactly as the stock engine
    forms it at CP=1: `input_ids` rolled by one with verl's own preprocess function for
    `data_format`, with the same padding options (they decide what the unlabelled last position of
    a row reads). Under context parallelism too the whole rows' labels (as at CP=1): verl's functions
    would slice them by CP rank, our rows (`PackedRows(cp_shard=...)`) take the shard themselves."""
    with _context_parallel_off():
        return _stock_row_labels(engine, model, batch, data_format)


def _stock_row_labels(engine, model, batch, data_format: str) -> torch.Tensor:
    from verl.utils import tensordict_utils as tu
    from verl.utils.megatron_utils import unwrap_model

    from ps_bridge.compat import verl as verl_compat

    labels = batch["input_ids"]
    lengths = labels.offsets().diff().tolist()
    use_fp8_padding = unwrap_model(model).config.fp8 in ["e4m3", "hybrid"]
    if data_format == "thd":
        rolled, params = verl_compat.roll_thd_labels(labels, use_fp8_padding,
                                                     verl_compat.length_bucket(engine.engine_config))
        starts = params.cu_seqlens_q_padded.tolist()
        return torch.cat([rolled[0, s : s + n] for s, n in zip(starts, lengths)])
    forced = tu.get_non_tensor_data(data=batch, key="forced_max_seqlen", default=None)
    rolled = verl_compat.roll_bshd_labels(labels, use_fp8_padding, forced)
    return torch.cat([rolled[i, :n] for i, n in enumerate(lengths)])


def per_sample_temperature(batch, num_samples: int, device) -> torch.Tensor:
    temperature = batch["temperature"]
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.tensor([float(temperature)] * num_samples)
    temperature = temperature.to(device=device, dtype=torch.float32).reshape(-1).clone()
    if temperature.numel() == 1:
        temperature = temperature.expand(num_samples).clone()
    temperature[temperature <= 0] = 1e-8  # as the stock engine: padding may carry 0
    return temperature


def temperatures_agree_within_groups(layout: PackedPrefixLayout, temperature: torch.Tensor) -> bool:
    group = layout.sample_group.to(temperature.device)
    first = torch.full((layout.num_groups,), float("nan"), device=temperature.device)
    first.scatter_(0, group.flip(0), temperature.flip(0))  # any member's value per group
    return bool((first[group] == temperature).all())


class PrefixSharingEngineMixin:
    """Mixed in before verl's `MegatronEngineWithLMHead` (or its NPU subclass)."""

    prefix_sharing_config: Optional[PrefixSharingConfig] = None

    # ---- configuration checks -----------------------------------------------------------------
    def _prefix_sharing(self) -> PrefixSharingConfig:
        if self.prefix_sharing_config is None:
            self.prefix_sharing_config = PrefixSharingConfig.from_env(enabled=True)
        return self.prefix_sharing_config

    def _check_prefix_sharing_support(self) -> None:
        cfg = self.engine_config
        if cfg.use_fused_kernels:
            raise NotImplementedError(
                "prefix sharing (ps_bridge.verl) computes log-probs from the packed logits and does not "
                "support verl's fused kernels: set actor_rollout_ref.model.use_fused_kernels=False"
            )
        ParallelSettings.from_config(cfg).check_supported()
        if self.engine_config.router_replay.mode != "disabled":
            _refuse("MoE router replay")
        if self.model_config.mtp.enable:
            _refuse("multi-token prediction")
        if self.model_config.model_type != "language_model":
            _refuse(f"model_type={self.model_config.model_type!r}")
        if cfg.vanilla_mbridge:
            raise ValueError(
                "prefix sharing builds its model through Megatron-Bridge providers: set "
                "actor_rollout_ref.actor.megatron.vanilla_mbridge=False (and for the ref model too)"
            )
        from ps_bridge.providers.registry import resolve_provider

        archs = list(self.model_config.architectures or getattr(self.model_config.hf_config, "architectures", []) or [])
        resolve_provider(self._prefix_sharing().provider, archs)  # unsupported architecture -> clear error

    def initialize(self):
        from ps_bridge.compat import verl as verl_compat

        self._check_prefix_sharing_support()
        super().initialize()
        verl_compat.check_per_token_loss(self.tf_config)
        model = self._unwrapped_model()
        if not any(type(m).__module__.startswith("ps_bridge.") for m in model.modules()):
            raise RuntimeError(
                f"the engine built a {type(model).__name__} without prefix-aware modules: Megatron-Bridge did "
                "not dispatch to a ps-bridge provider (was ps_bridge.verl imported before the model was built?)"
            )
        cfg = self._prefix_sharing()
        logger.info(
            "[PS][prepare][%s] config.enable_prefix_sharing=%s sharing=%s backend=%s provider=%s engine=%s model=%s "
            "prompt_values=%s", rank_tag(), cfg.enabled, cfg.sharing, cfg.backend, cfg.provider, type(self).__name__,
            type(self._unwrapped_model()).__name__, cfg.layout_prompt_values,
        )

    def _model_cost(self) -> Optional[ModelCost]:
        """What the sharing rule needs of the model (its HF config), read once; None (the rule then
        always shares) for a config it cannot read."""
        if not hasattr(self, "_ps_model_cost"):
            self._ps_model_cost = ModelCost.try_from_hf_config(self.model_config.hf_config)
        return self._ps_model_cost

    def _unwrapped_model(self):
        from verl.utils.megatron_utils import unwrap_model

        return unwrap_model(self.module[0])

    # ---- micro-batches: groups whole, token budgets in packed tokens -----------------------------
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        from megatron.core import parallel_state as mpu
        from verl.utils import tensordict_utils as tu

        keep_groups_whole(data)
        cfg = self._prefix_sharing()
        if cfg.enabled:
            install_prefix_aware_micro_batching()
            pad = cfg.pad_multiple or mpu.get_tensor_model_parallel_world_size()
            tu.assign_non_tensor(data, **{PACKED_BUDGET_KEY: True, PAD_MULTIPLE_KEY: pad})
        return super().forward_backward_batch(data, loss_function, forward_only=forward_only)

    # ---- the forward step -----------------------------------------------------------------------
    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        from megatron.core import parallel_state as mpu
        from verl.utils import tensordict_utils as tu
        from verl.utils.device import get_device_id
        from verl.utils.megatron_utils import unwrap_model

        batch = next(batch_iter)
        batch = batch.to(get_device_id())
        for key, what in UNSUPPORTED_BATCH_KEYS.items():
            if tu.get_non_tensor_data(batch, key=key, default=False):
                _refuse(what)
        if tu.get_non_tensor_data(batch, key="use_fused_kernels", default=False):
            _refuse("per-batch use_fused_kernels=True")
        if batch.get("multi_modal_inputs", None) is not None:
            _refuse("multi-modal inputs")
        calculate_entropy = tu.get_non_tensor_data(batch, key="calculate_entropy", default=False)
        calculate_sum_pi_squared = tu.get_non_tensor_data(batch, key="calculate_sum_pi_squared", default=False)

        cfg = self._prefix_sharing()
        samples = samples_from_micro_batch(batch)
        device = batch["input_ids"].device
        temperature = per_sample_temperature(batch, len(samples), device)
        pad = cfg.pad_multiple or mpu.get_tensor_model_parallel_world_size()
        # the true vocabulary: a padded one's extra ids stay out of the log-probs (ps_bridge.rows)
        vocab = self.model_config.hf_config.get_text_config().vocab_size
        # under context parallelism the whole pack is padded to equal CP shards (`cp_total_multiple`)
        # shared layouts list the read positions (the output layer skips the other prompt positions)
        # unless cfg.prompt_values; unshared ones (the stock computation) compute every position
        pack = partial(build_layout, samples, pad_multiple=pad, vocab_size=vocab, total_multiple=cp_total_multiple(),
                       prompt_values=cfg.layout_prompt_values)
        # the sharing rule (`ps_bridge.launch_rule`): shared only where the unshared GPU work outweighs
        # the shared path's host time; host integers only, so every TP/CP/PP rank decides alike
        decision = sharing_for(samples, cfg, self._model_cost(), device.type,
                               str(unwrap_model(model).config.params_dtype).replace("torch.", ""))
        layout = pack(share=decision.share)
        if layout.shared and layout.has_sharing and not temperatures_agree_within_groups(layout, temperature):
            # a shared prompt position is scaled by one temperature; samples of one prompt with
            # different temperatures cannot share it
            decision = SharingDecision(False, "samples of one prompt carry different temperatures: not shared")
            layout = pack(share=False)
        elif layout.shared and not layout.has_sharing:
            # nothing to share: one THD sequence per sample, the stock engine's computation
            layout = pack(share=False)
        logger.info("[PS][prepare][%s] sharing: %s", rank_tag(), decision.describe())
        log_layout(layout, f"[{rank_tag()}]{shard_tag(layout)}")
        layout = layout.to(device)

        # each CP rank runs its contiguous shard of the pack
        output = run_packed(model, layout, cfg)
        if unwrap_model(model).post_process:
            data_format = "thd" if self.engine_config.use_remove_padding else "bshd"
            labels = stock_row_labels(self, model, batch, data_format).to(device)
            rows = PackedRows(layout, labels=labels, cp_shard=local_shard(layout))
            output = self._packed_outputs(output, rows, temperature, calculate_entropy, calculate_sum_pi_squared)
        # static CP: verl's postprocess takes no local_cp_size (that is dynamic CP's); the rows are whole
        return output, partial(postprocess_micro_batch_func, data=batch, local_cp_size=None)

    # ---- megatron's per-token-loss regime under static CP ---------------------------------------
    def postprocess_micro_batch_func(self, output, data, forward_only, loss_function, local_cp_size=None):
        """verl's, with the per-token-loss token count corrected under static context parallelism.
        With `calculate_per_token_loss=True` verl returns (loss x n, this rank's tokens, output) and
        megatron divides every gradient by the tokens summed over data-parallel-with-CP; verl counts a
        static CP rank's tokens as `n // cp` (n: the micro-batch's real tokens), which sums to less
        than n over the CP ranks when CP does not divide n, and scales every gradient up by the
        missing fraction (measured 339 / 338 on the CPU test batch). CP rank r counts `(n + r) // cp`
        instead: the counts sum to exactly n (Hermite's identity). Everything else is verl's."""
        result = super().postprocess_micro_batch_func(output, data, forward_only, loss_function,
                                                      local_cp_size=local_cp_size)
        cp = self.engine_config.context_parallel_size
        if len(result) == 3 and cp > 1 and not self.engine_config.dynamic_context_parallel:
            from megatron.core import parallel_state as mpu

            local_sum, _, out = result
            tokens = (self._routed_num_tokens(data) + mpu.get_context_parallel_rank()) // cp
            return local_sum, tokens.to(torch.int), out
        return result

    def _packed_outputs(self, logits, rows: PackedRows, temperature: torch.Tensor, calculate_entropy: bool,
                        calculate_sum_pi_squared: bool):
        """Rows of log-probs (and entropy, sum of squared probabilities) from the packed TP-sharded
        logits, each position scaled by its samples' temperature. Log-probs and entropy are taken
        chunk by chunk (`ps_bridge.rows`): no float32 copy of the logits; with every temperature 1
        the logits are not rescaled (copied) either."""
        from verl.utils.megatron.tensor_parallel import vocab_parallel_sum_pi_squared

        from ps_bridge.compat import verl as verl_compat
        from ps_bridge.rows import chunked_vocab_parallel_entropy

        logits = logits.reshape(-1, logits.shape[-1])
        layout = rows.layout
        if not bool((temperature == 1).all()):
            # every row reading a packed position belongs to one group, whose samples share a
            # temperature; the positions the model computed (this rank's shard under CP, the read
            # positions by default: rows.source indexes them)
            row_temperature = temperature.repeat_interleave(layout.row_offsets.diff().to(logits.device))
            packed_temperature = torch.ones(rows.num_positions, dtype=torch.float32, device=logits.device)
            packed_temperature[rows.source[rows.computed]] = row_temperature[rows.computed]
            logits = logits / packed_temperature.unsqueeze(-1).to(logits.dtype)
        chunk = verl_compat.entropy_chunk_rows(self.engine_config)
        out = {}
        if calculate_sum_pi_squared:
            out["sum_pi_squared"] = rows.nested(rows.values(vocab_parallel_sum_pi_squared(logits)))
        if calculate_entropy:
            out["entropy"] = rows.nested(rows.values(chunked_vocab_parallel_entropy(logits, chunk_rows=chunk)))
        out["log_probs"] = rows.nested(rows.logprobs(logits, vocab_parallel=True, chunk_rows=chunk))
        return out


def group_run_length(uids) -> int:
    """n when `uids` come in equal runs of n adjacent samples with n > 1 (verl's
    `repeat(n, interleave=True)`), else 1."""
    if uids is None or len(uids) == 0:
        return 1
    runs = []
    count = 1
    for a, b in zip(uids[:-1], uids[1:]):
        if a == b:
            count += 1
        else:
            runs.append(count)
            count = 1
    runs.append(count)
    if len(set(runs)) == 1 and runs[0] > 1 and len(set(uids)) == len(runs):
        return runs[0]
    return 1


_warned: set = set()


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def keep_groups_whole(data) -> None:
    """Static micro-batch sizes: a size that is a multiple of n keeps groups whole, any other splits
    them (exact, shares less; said once). Dynamic sizes are formed by `prefix_aware_micro_batches`."""
    from verl.utils import tensordict_utils as tu

    n = group_run_length(uid_list(data))
    if n == 1 or tu.get_non_tensor_data(data, key="use_dynamic_bsz", default=True):
        return
    mbs = tu.get_non_tensor_data(data, key="micro_batch_size_per_gpu", default=None)
    if mbs is not None and mbs % n:
        _warn_once(
            "static",
            "[PS][prepare] micro_batch_size_per_gpu=%s is not a multiple of the group size %d: groups are "
            "split across micro-batches (results stay exact, less is shared)", mbs, n,
        )


# ---- prefix-aware micro-batches ------------------------------------------------------------------
#
# verl forms dynamic micro-batches (`prepare_micro_batches` -> `rearrange_micro_batches`) from a token
# budget that counts every sample's prompt again. With sharing on, our engine marks the batch
# (`PACKED_BUDGET_KEY`) and the budget counts what a packed micro-batch really holds: each group's
# prompt once plus its responses, every segment padded to the pack's multiple. Groups stay whole
# (a group that alone exceeds the budget is cut into parts that fit, each holding the prompt once),
# micro-batches are balanced by packed tokens with verl's own partitioner, and the micro-batch count
# is agreed across data-parallel ranks as verl agrees it. Batches without the mark (the stock engine,
# sharing off) go to verl's function unchanged.

PACKED_BUDGET_KEY = "ps_bridge_packed_budget"
PAD_MULTIPLE_KEY = "ps_bridge_pad_multiple"


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def prompt_and_total_lengths(data):
    """Per sample (prompt length, prompt + response length) from verl's no-padding batch."""
    total = data["input_ids"].offsets().diff().tolist()
    prompts = data["prompts"]
    if prompts.is_nested:
        prompt = prompts.offsets().diff().tolist()
    else:
        prompt = data["attention_mask"][:, : prompts.shape[1]].sum(dim=1).tolist()
    return prompt, total


def sample_groups(data) -> List[List[int]]:
    """Sample indices of each group: verl's `uid` when present, else identical prompt tokens; in
    order of first appearance (members need not be adjacent)."""
    uids = uid_list(data)
    if uids is None:
        prompts = data["prompts"]
        rows = prompts.unbind() if prompts.is_nested else [
            p[m.bool()] for p, m in zip(prompts, data["attention_mask"][:, : prompts.shape[1]])]
        uids = [tuple(r.tolist()) for r in rows]
    order: dict = {}
    for i, u in enumerate(uids):
        order.setdefault(u, []).append(i)
    return list(order.values())


def packed_units(groups: List[List[int]], prompt_len: List[int], total_len: List[int], budget: int,
                 pad_multiple: int = 1):
    """(sample indices, packed tokens) per unit a micro-batch takes whole: a group, or the parts of a
    group that alone holds more than `budget` packed tokens (each part holding the prompt once)."""
    units = []
    for members in groups:
        P = _round_up(prompt_len[members[0]], pad_multiple)
        part, tokens, first = [], P, len(units)
        for i in members:
            r = _round_up(total_len[i] - prompt_len[i], pad_multiple)
            if P + r > budget:
                raise ValueError(
                    f"a sample of {total_len[i]} tokens (prompt {prompt_len[i]}) does not fit the micro-batch token "
                    f"budget of {budget}: raise actor_rollout_ref.actor.ppo_max_token_len_per_gpu / "
                    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu / "
                    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"
                )
            if part and tokens + r > budget:
                units.append((part, tokens))
                part, tokens = [], P
            part.append(i)
            tokens += r
        units.append((part, tokens))
        if len(units) - first > 1:
            _warn_once(
                "budget",
                "[PS][prepare] a group of %d responses holds %d packed tokens, more than the micro-batch budget "
                "%d: it is split across micro-batches (results stay exact, less is shared); raise the "
                "*_max_token_len_per_gpu settings to keep groups whole",
                len(members), sum(t for _, t in units[first:]) - P * (len(units) - first - 1), budget,
            )
    return units


def partition_units(unit_tokens: List[int], budget: int, dp_group=None, num_batches_divided_by=None,
                    same_micro_num_in_dp: bool = True, min_num_micro_batch=None) -> List[List[int]]:
    """Units -> micro-batches (lists of unit indices), each within `budget` packed tokens, balanced by
    packed tokens with verl's partitioner; as few as fit (the count agreed across `dp_group`)."""
    import torch.distributed as dist
    from verl.utils.device import get_device_name
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions, roundup_divisible

    sync = dist.is_initialized() and same_micro_num_in_dp and dp_group is not None

    def agree(value: int, largest: bool) -> int:
        """The largest (else smallest) value over the data-parallel ranks."""
        if not sync:
            return value
        t = torch.tensor([value if largest else -value], device=get_device_name())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
        return int(t.item()) if largest else -int(t.item())

    k = min(len(unit_tokens), -(-sum(unit_tokens) // budget))
    if min_num_micro_batch is not None:
        k = max(k, min_num_micro_batch)
    k = agree(k, largest=True)
    if num_batches_divided_by is not None:
        k = roundup_divisible(k, num_batches_divided_by)
    fewest_units = agree(len(unit_tokens), largest=False)
    step = num_batches_divided_by or 1
    while True:
        if k > fewest_units:
            raise ValueError(f"cannot form {k} non-empty micro-batches from {fewest_units} groups within the token "
                             f"budget {budget}: raise the *_max_token_len_per_gpu settings")
        parts = get_seqlen_balanced_partitions(unit_tokens, k, equal_size=False)
        fits = int(all(sum(unit_tokens[u] for u in part) <= budget for part in parts))
        if agree(fits, largest=False):
            break
        k += step
    parts.sort(key=lambda part: (sum(unit_tokens[u] for u in part), part[0] if part else 0), reverse=True)
    return parts[::2][::-1] + parts[1::2]  # verl's order: the smaller micro-batches at both ends


def prefix_aware_micro_batches(data, dp_group=None, num_batches_divided_by=None, same_micro_num_in_dp=True,
                               min_num_micro_batch=None, **_ignored):
    """verl's `prepare_micro_batches` contract (micro-batches, sample index lists) for a batch our
    engine marked: dynamic budgets counted in packed tokens."""
    from verl.utils import tensordict_utils as tu

    budget = int(data["max_token_len_per_gpu"]) * int(tu.get_non_tensor_data(data, key="sp_size", default=1))
    pad = int(tu.get_non_tensor_data(data, key=PAD_MULTIPLE_KEY, default=1))
    prompt_len, total_len = prompt_and_total_lengths(data)
    units = packed_units(sample_groups(data), prompt_len, total_len, budget, pad)
    parts = partition_units([t for _, t in units], budget, dp_group, num_batches_divided_by, same_micro_num_in_dp,
                            min_num_micro_batch)
    indices = [[i for u in part for i in units[u][0]] for part in parts]
    return [tu.index_select_tensor_dict(data, idx) for idx in indices], indices


def install_prefix_aware_micro_batching() -> None:
    """verl's Megatron engine calls its module's `prepare_micro_batches`; route the batches our engine
    marked to `prefix_aware_micro_batches`, every other batch (the stock engine's) to verl's own
    function, unchanged. Idempotent."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.megatron import transformer_impl

    stock = transformer_impl.prepare_micro_batches
    if getattr(stock, "__ps_bridge__", False):
        return

    def prepare_micro_batches(data, *args, **kwargs):
        if tu.get_non_tensor_data(data, key=PACKED_BUDGET_KEY, default=False) and \
                tu.get_non_tensor_data(data, key="use_dynamic_bsz", default=True):
            return prefix_aware_micro_batches(data, *args, **kwargs)
        return stock(data, *args, **kwargs)

    prepare_micro_batches.__ps_bridge__ = True
    prepare_micro_batches.__wrapped__ = stock
    transformer_impl.prepare_micro_batches = prepare_micro_batches


def group_dp_partitions(uids: Sequence, prompt_len: Sequence[int], total_len: Sequence[int],
                        dp_size: int) -> List[List[int]]:
    """The trainer-side split of a batch over data-parallel ranks that prefix sharing needs: whole
    groups (same uid) per rank, balanced by packed tokens (each prompt once), `dp_size` lists of
    sample indices. verl's own `get_group_balanced_partitions` (what `actor.use_prefix_grouper=True`
    turns on in `RayPPOTrainer._balance_batch`) keeps groups whole too but balances unshared tokens."""
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    order: dict = {}
    for i, u in enumerate(uids):
        order.setdefault(u, []).append(i)
    groups = list(order.values())
    if len(groups) < dp_size:
        raise ValueError(f"{len(groups)} groups cannot fill {dp_size} data-parallel ranks with whole groups")
    tokens = [prompt_len[g[0]] + sum(total_len[i] - prompt_len[i] for i in g) for g in groups]
    parts = get_seqlen_balanced_partitions(tokens, dp_size, equal_size=len(groups) % dp_size == 0)
    return [sorted(i for gi in part for i in groups[gi]) for part in parts]


from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead  # noqa: E402


# ---- checkpoints: save / load overrides live in ps_bridge/checkpoint_engine.py (owner: checkpoints) ----
from ps_bridge.checkpoint_engine import CheckpointEngineMixin  # noqa: E402


class PrefixSharedMegatronEngine(CheckpointEngineMixin, PrefixSharingEngineMixin, MegatronEngineWithLMHead):
    """verl's Megatron LM-head engine (GPU) with the prefix-shared forward step (and the checkpoint
    load checks of `CheckpointEngineMixin`)."""


def npu_engine_class() -> Optional[type]:
    """verl's MindSpeed (NPU) engine with the prefix-shared forward step, or None where verl's
    MindSpeed engine module cannot be imported. Unverified on an NPU."""
    global _NPU_ENGINE
    if _NPU_ENGINE is None:
        try:
            from verl.workers.engine.mindspeed.transformer_impl import MindspeedEngineWithLMHead
        except ImportError as e:
            logger.warning("[PS][prepare] verl's NPU (MindSpeed) engine is not importable (%s); NPU not registered", e)
            return None

        class PrefixSharedMindspeedEngine(PrefixSharingEngineMixin, MindspeedEngineWithLMHead):
            """verl's MindSpeed (NPU) engine with the prefix-shared forward step."""

        _NPU_ENGINE = PrefixSharedMindspeedEngine
    return _NPU_ENGINE


_NPU_ENGINE: Optional[type] = None
