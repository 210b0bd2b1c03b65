"""verl's rollout dump (`trainer.rollout_data_dir`) with each response's token log-probs: the actor's (old,
before the update), the reference's and vLLM's, so that two runs can be compared response by response, not
only through the step's means.

verl 0.9.1's trainer writes the prompt, the response, the score and the uid of each response
(verl/trainer/ppo/v1/trainer_base.py:1297-1348, `PPOTrainer._log_rollout_data`), and any per-sample list it
is handed in `reward_extra_infos_dict` (`_write_generations`); the log-probs are in its TransferQueue under
`old_log_probs`, `ref_log_prob` and `rollout_log_probs` (one row of response length per sample) until the
step's end. Here `_log_rollout_data` hands them over too, in the dump's order.

Loaded through `VERL_USE_EXTERNAL_MODULES` by `ps_bridge.tools.grpo.launch` for both engines: it only adds
fields to the dump, nothing of the training changes.
"""

from __future__ import annotations

import functools
import os
from typing import Dict, List

from ps_bridge.compat.main_ppo_on_cpu import _after_import

TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"
# the dump's field names: verl's TransferQueue fields
FIELDS = ("old_log_probs", "ref_log_prob", "rollout_log_probs")


def _rows(tensor) -> List[List[float]]:
    """One list of float32 values per sample, from verl's jagged (nested) response rows."""
    if getattr(tensor, "is_nested", False):
        return [row.float().tolist() for row in tensor.unbind()]
    return [row.float().tolist() for row in tensor]


def _log_prob_rows(tq, batch) -> Dict[str, Dict[str, List[float]]]:
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(FIELDS))
    return {name: dict(zip(batch.keys, _rows(data[name]))) for name in FIELDS}


def _with_log_probs(module) -> None:
    cls = module.PPOTrainer
    stock = cls._log_rollout_data
    if getattr(stock, "__ps_bridge_log_probs__", False):
        return

    @functools.wraps(stock)
    def _log_rollout_data(self, batch, timing_raw, rollout_data_dir):
        rows = _log_prob_rows(module.tq, batch)
        dump = self._dump_generations

        def dump_with_log_probs(inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path):
            keys = reward_extra_infos_dict["uid"]  # the dump's order: the batch's keys sorted
            extra = {name: [by_key[k] for k in keys] for name, by_key in rows.items()}
            return dump(inputs, outputs, gts, scores, dict(reward_extra_infos_dict, **extra), dump_path)

        self._dump_generations = dump_with_log_probs
        try:
            return stock(self, batch, timing_raw, rollout_data_dir)
        finally:
            del self._dump_generations  # the class's method again

    _log_rollout_data.__ps_bridge_log_probs__ = True
    cls._log_rollout_data = _log_rollout_data


if __name__ in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(","):
    # imported by verl (`VERL_USE_EXTERNAL_MODULES`); any other import only reads this module
    _after_import(TRAINER_MODULE, _with_log_probs)
