"""verl Megatron engine whose forward step packs each micro-batch prefix-shared.

`PrefixSharingEngineMixin.forward_step` replaces `MegatronEngineWithLMHead.forward_step`; model
building (through Megatron-Bridge and our provider), optimizer, weight export and the loss stay
verl's. Dynamic micro-batches are formed by `ps_bridge.verl.micro_batches` (budgets counted in packed
tokens, samples that share a prefix kept together). Per micro-batch the forward step

1. rebuilds every sample `prompt + response` from verl's nested `input_ids` and the prompt lengths
   (`ps_bridge.verl.batch`),
2. packs them with `prepare.micro_batch_layout` and the micro-batch's `plan.SharingPlan` (decided
   once per mini-batch in `forward_backward_batch` and carried by each micro-batch: the sharing rule,
   then `build_layout`: with `PrefixSharingConfig.tree` (the default) the token prefix tree, every
   common prefix once (a GRPO group: its prompt once), built once per micro-batch and read by the
   sharing rule too; `PS_BRIDGE_TREE=0`: one prompt per group; samples of
   different temperatures share nothing; `pad_multiple` = TP size),
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
import time
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch
from megatron.core import parallel_state as mpu
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.utils.megatron.tensor_parallel import vocab_parallel_sum_pi_squared
from verl.utils.megatron_utils import unwrap_model

from ps_bridge import launch_rule
from ps_bridge.compat import verl as verl_compat
from ps_bridge.config import PrefixSharingConfig
from ps_bridge.cuda_graphs import buckets_for
from ps_bridge.forward import local_shard, run_packed
from ps_bridge.launch_rule import ModelCost
from ps_bridge.parallel.settings import ParallelSettings
from ps_bridge.parallel_info import rank_tag
from ps_bridge.plan import SharingPlan
from ps_bridge.prepare import micro_batch_layout
from ps_bridge.providers.registry import resolve_provider
from ps_bridge.rows import PackedRows, chunked_vocab_parallel_entropy
from ps_bridge.transfer import to_device
from ps_bridge.verl.batch import (
    mark_vision,
    per_sample_temperature,
    samples_of,
    temperature_classes,
)
from ps_bridge.verl.micro_batches import install_prefix_aware_micro_batching, keep_groups_whole, mark_plan, plan_of

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


@contextmanager
def _context_parallel_off():
    """megatron's parallel state reporting one CP rank of one, while verl's preprocess functions form
    the labels: they slice by CP rank, and the labels are wanted whole (`stock_row_labels`)."""
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


def thd_row_labels(labels, align: int) -> torch.Tensor:
    """What verl's `preprocess_thd_engine(labels, need_roll=True)` and the slices of its rows give at CP=1
    without FP8 padding or a length bucket (`_stock_row_labels`), in one pass over the values: each row
    at its start in a zero buffer of rows padded to a multiple of `align` (the TP size), the buffer rolled
    left by one, each row's positions read back (a row's last position reads the next row's first token,
    or padding). verl's function places the rows one at a time, each a nested-tensor index: about 15 ms of
    host time for 64 rows on a 2-core CPU. tests/test_verl_labels.py holds the two equal."""
    values, offsets = labels.values(), labels.offsets()
    if align == 1:  # no padding: the buffer is the values
        return torch.roll(values, -1)
    pad = ((-offsets.diff()) % align).long()  # verl's nested tensors hold their offsets as int64 or int32
    # a token's place in the buffer: its index plus the padding of the rows ahead of it (index_add_ and
    # index_select: on a 2-core CPU 0.05 ms each for 24k tokens, where advanced indexing took 7 ms)
    step = torch.zeros_like(values, dtype=torch.long).index_add_(0, offsets[1:-1], pad[:-1])
    positions = torch.arange(values.shape[0], device=values.device) + torch.cumsum(step, 0)
    buffer = values.new_zeros(int(offsets[-1] + pad.sum())).index_copy_(0, positions, values)
    return torch.roll(buffer, -1).index_select(0, positions)


def _stock_row_labels(engine, model, batch, data_format: str) -> torch.Tensor:
    labels = batch["input_ids"]
    use_fp8_padding = unwrap_model(model).config.fp8 in ["e4m3", "hybrid"]
    bucket = verl_compat.length_bucket(engine.engine_config) if data_format == "thd" else None
    # on an NPU verl's function also hands mindspeed the pack's sequence lengths (`preprocess_for_mindspeed`),
    # which the NPU path has only run with
    plain = data_format == "thd" and not use_fp8_padding and bucket is None and labels.dim() == 2
    if plain and _engine_device().type != "npu":
        return thd_row_labels(labels, mpu.get_tensor_model_parallel_world_size())
    lengths = labels.offsets().diff().tolist()
    if data_format == "thd":
        rolled, params = verl_compat.roll_thd_labels(labels, use_fp8_padding, bucket)
        starts = params.cu_seqlens_q_padded.tolist()
        return torch.cat([rolled[0, s : s + n] for s, n in zip(starts, lengths)])
    forced = tu.get_non_tensor_data(data=batch, key="forced_max_seqlen", default=None)
    rolled = verl_compat.roll_bshd_labels(labels, use_fp8_padding, forced)
    return torch.cat([rolled[i, :n] for i, n in enumerate(lengths)])


def _engine_device() -> torch.device:
    """The device verl moves each micro-batch to (`batch.to(get_device_id())`), as a torch device."""
    index = get_device_id()
    return torch.device(get_device_name(), index) if isinstance(index, int) else torch.device(index)


class PrefixSharingEngineMixin:
    """Mixed in before verl's `MegatronEngineWithLMHead` (or its NPU subclass)."""

    prefix_sharing_config: Optional[PrefixSharingConfig] = None
    # called with (samples, layout) for every micro-batch the forward step packs (`ps-bridge
    # verl-check` counts the model FLOPs of what ran: `ps_bridge.tools.verl_check.flops`)
    layout_observer: Optional[Callable[[Sequence, Any], None]] = None

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
        self._check_parallel_layout()
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
        archs = list(self.model_config.architectures or getattr(self.model_config.hf_config, "architectures", []) or [])
        resolve_provider(self._prefix_sharing().provider, archs)  # unsupported architecture -> clear error

    def _check_parallel_layout(self) -> None:
        """`ParallelSettings.check_supported` (the one owner of what parallel settings are refused) for
        verl's engine config. Prefix trees of any depth (the default, `PS_BRIDGE_TREE`) run under every layout it
        accepts (tests/test_verl_plugin.py: the engine on trees at TP=2, CP=2, PP=2, EP=2)."""
        ParallelSettings.from_config(self.engine_config).check_supported()

    def initialize(self):
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
            "[PS][prepare][%s] config.enable_prefix_sharing=%s sharing=%s tree=%s backend=%s provider=%s engine=%s "
            "model=%s prompt_values=%s", rank_tag(), cfg.enabled, cfg.sharing, cfg.tree, cfg.backend, cfg.provider,
            type(self).__name__, type(self._unwrapped_model()).__name__, cfg.layout_prompt_values,
        )

    def _model_cost(self) -> Optional[ModelCost]:
        """What the sharing rule needs of the model (its HF config), read once; None (the rule then
        always shares) for a config it cannot read."""
        if not hasattr(self, "_ps_model_cost"):
            self._ps_model_cost = ModelCost.try_from_hf_config(self.model_config.hf_config)
        return self._ps_model_cost

    def _sharing_plan(self) -> SharingPlan:
        """The plan of this engine's config (no tree yet): segments padded to the TP size unless the
        config sets `pad_multiple`, to their level's bucket where the model runs as CUDA graphs."""
        cfg = self._prefix_sharing()
        return SharingPlan.from_config(cfg, cfg.pad_multiple or mpu.get_tensor_model_parallel_world_size(),
                                       bucket=buckets_for(self.module[0], cfg))

    def _unwrapped_model(self):
        return unwrap_model(self.module[0])

    # ---- micro-batches: shared prefixes together, token budgets in packed tokens ------------------
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        keep_groups_whole(data)
        cfg = self._prefix_sharing()
        if cfg.enabled:
            install_prefix_aware_micro_batching()
            # the mini-batch's plan, decided once: the micro-batcher and every forward step read it
            mark_plan(data, self._sharing_plan())
            mark_vision(data, self.model_config.hf_config)
        self._ps_timed = None
        output = super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        self._end_timed_micro_batch(time.perf_counter_ns())
        return output

    # ---- mode `measured`: this process's host time of its shared micro-batches -------------------
    def _measures_host(self) -> bool:
        """Whether this engine feeds `launch_rule.HOST_CALIBRATION` (mode `measured`): only where no
        other rank runs its micro-batches (no TP, PP or CP), whose decision must equal this rank's;
        elsewhere the calibration stays unfed and the rule is `auto`'s. A micro-batch is timed from
        its forward step to the next one (or the end of the batch): with one pipeline stage megatron
        runs its forward, loss and backward in between."""
        if self._prefix_sharing().sharing != "measured":
            return False
        settings = ParallelSettings.from_config(self.engine_config)  # as `_check_parallel_layout` reads it
        alone = settings.tp == settings.pp == settings.cp == 1
        if not alone and not getattr(self, "_ps_said_unmeasured", False):
            logger.warning("[PS][prepare] PS_BRIDGE_SHARING=measured decides as auto under tensor, pipeline or "
                           "context parallelism: every rank of a micro-batch must take the same path")
            self._ps_said_unmeasured = True
        return alone

    def _end_timed_micro_batch(self, now_ns: int) -> None:
        timed, self._ps_timed = getattr(self, "_ps_timed", None), None
        if timed is not None:
            decision, start_ns = timed
            launch_rule.HOST_CALIBRATION.observe(decision, now_ns - start_ns)

    # ---- the forward step -----------------------------------------------------------------------
    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        start_ns = time.perf_counter_ns()
        self._end_timed_micro_batch(start_ns)  # the previous micro-batch's backward has been queued
        batch = next(batch_iter)
        for key, what in UNSUPPORTED_BATCH_KEYS.items():
            if tu.get_non_tensor_data(batch, key=key, default=False):
                _refuse(what)
        if tu.get_non_tensor_data(batch, key="use_fused_kernels", default=False):
            _refuse("per-batch use_fused_kernels=True")
        calculate_entropy = tu.get_non_tensor_data(batch, key="calculate_entropy", default=False)
        calculate_sum_pi_squared = tu.get_non_tensor_data(batch, key="calculate_sum_pi_squared", default=False)

        # Everything the host reads of the micro-batch (the samples' tokens, their temperatures, verl's
        # labels) and the whole layout are prepared from verl's batch as it arrives (on the CPU), and the
        # forward is queued before verl's batch is moved to the device: that copy waits for the GPU's
        # queued work (the previous micro-batch's backward), so host work done before it runs while the
        # GPU computes, and host work done after it (or reads of device tensors) leaves the GPU idle.
        cfg = self._prefix_sharing()
        samples = samples_of(batch, self.model_config.hf_config)  # images: each sample carries its own
        temperature = per_sample_temperature(batch, len(samples), "cpu")
        # the micro-batch's plan (the micro-batcher's; with its tree where the micro-batch is the whole
        # mini-batch); a micro-batch verl formed without our micro-batcher gets the config's
        plan = plan_of(batch) or self._sharing_plan()
        # the true vocabulary: a padded one's extra ids stay out of the log-probs (ps_bridge.rows)
        vocab = self.model_config.hf_config.get_text_config().vocab_size
        device = _engine_device()
        # decide what is shared and pack it (`prepare.micro_batch_layout`, as `runtime.make_layout`): with
        # cfg.tree the token prefix tree is decided once (or taken from the plan), the sharing rule
        # (`ps_bridge.launch_rule`: shared only where the unshared GPU work outweighs the shared path's host time; host integers
        # only, so every TP/CP/PP rank decides alike) reads its token count, the layout packs it.
        # A shared position's logits are scaled by one temperature: samples of different temperatures
        # share no position (the share classes; with nothing left to share, the unshared layout).
        # Under context parallelism the whole pack is padded to equal CP shards; shared layouts list
        # the read positions unless cfg.prompt_values, unshared ones compute every position.
        layout, decision = micro_batch_layout(samples, cfg, self._model_cost(), device.type,
                                              unwrap_model(model).config.params_dtype, plan=plan, vocab_size=vocab,
                                              share_classes=temperature_classes(temperature))
        if decision is not None and layout.shared and self._measures_host():
            self._ps_timed = (decision, start_ns)
        if self.layout_observer is not None:
            self.layout_observer(samples, layout)
        post_process = unwrap_model(model).post_process
        if post_process:
            data_format = "thd" if self.engine_config.use_remove_padding else "bshd"
            labels = stock_row_labels(self, model, batch, data_format)
        all_ones = bool((temperature == 1).all())

        layout = layout.to(device)
        temperature = to_device(temperature, device)
        if post_process:
            labels = to_device(labels, device)
        # each CP rank runs its contiguous shard of the pack
        output = run_packed(model, layout, cfg)
        if post_process:
            rows = PackedRows(layout, labels=labels, cp_shard=local_shard(layout))
            output = self._packed_outputs(output, rows, temperature, calculate_entropy, calculate_sum_pi_squared,
                                          all_ones)
        # verl's micro-batch goes to the device after the forward is queued: only verl's loss reads it, and
        # torch copies a nested tensor's offsets synchronously (the host waits for every queued kernel),
        # which before the forward would leave the GPU idle until the forward's kernels are launched
        batch = batch.to(get_device_id(), non_blocking=True)
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
            local_sum, _, out = result
            tokens = (self._routed_num_tokens(data) + mpu.get_context_parallel_rank()) // cp
            return local_sum, tokens.to(torch.int), out
        return result

    def _packed_outputs(self, logits, rows: PackedRows, temperature: torch.Tensor, calculate_entropy: bool,
                        calculate_sum_pi_squared: bool, temperature_all_one: bool):
        """Rows of log-probs (and entropy, sum of squared probabilities) from the packed TP-sharded
        logits, each position scaled by its samples' temperature. Log-probs and entropy are taken
        chunk by chunk (`ps_bridge.rows`): no float32 copy of the logits; with every temperature 1
        the logits are not rescaled (copied) either."""
        logits = logits.reshape(-1, logits.shape[-1])
        layout = rows.layout
        if not temperature_all_one:
            # the rows reading a packed position share a temperature (the layout's share classes);
            # the positions the model computed (this rank's shard under CP, the read
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
            # imported here: verl's MindSpeed engine imports only on stacks with mindspeed (NPU)
            from verl.workers.engine.mindspeed.transformer_impl import MindspeedEngineWithLMHead
        except ImportError as e:
            logger.warning("[PS][prepare] verl's NPU (MindSpeed) engine is not importable (%s); NPU not registered", e)
            return None

        class PrefixSharedMindspeedEngine(PrefixSharingEngineMixin, MindspeedEngineWithLMHead):
            """verl's MindSpeed (NPU) engine with the prefix-shared forward step."""

        _NPU_ENGINE = PrefixSharedMindspeedEngine
    return _NPU_ENGINE


_NPU_ENGINE: Optional[type] = None
