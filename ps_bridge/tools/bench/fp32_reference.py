"""`--fp32-reference`: both bf16 runs of a grid row judged against a float32 twin of the same weights."""

from __future__ import annotations

from typing import Tuple

import torch

from ps_bridge.tools.bench.catalog import response_row_mask
from ps_bridge.tools.runtime import float32_reference_model, row_logprobs, tf32_disabled


class Fp32Reference:
    """The bench model's own weights in a float32 twin (`runtime.float32_reference_model`: torch_ref
    kernels), run with TF32 off on the *unshared* packing: the computation bf16 approximates, so a
    shared and an unshared bf16 run are each judged by their distance to it, not only by their
    distance to each other. Slow for Qwen3.5 (torch_ref's GDN recurrence runs token by token)."""

    def __init__(self, hf_config, loaded, chunk: int):
        self.loaded = float32_reference_model(loaded, hf_config)
        self.chunk = chunk

    def response_logprobs(self, unshared_layouts) -> torch.Tensor:
        """Response-token log-probs over the unshared micro-batches, in sample order."""
        out = []
        with tf32_disabled(), torch.no_grad():
            for layout in unshared_layouts:
                layout = layout.to(self.loaded.device)
                mask = response_row_mask(layout).to(self.loaded.device)
                out.append(row_logprobs(self.loaded, layout, chunk_rows=self.chunk)[mask])
        return torch.cat(out).double().cpu()


def errors_against(reference: torch.Tensor, rows: torch.Tensor) -> Tuple[float, float]:
    diff = rows.double() - reference
    return float(diff.norm() / reference.norm()), float(diff.abs().max())


def row_errors(reference_rows, shared_rows: torch.Tensor, unshared_rows) -> dict:
    """The `*_fp32` fields of a row's result (none without a reference, no `unshared_*` ones without
    an unshared run)."""
    errors = {}
    if reference_rows is not None:
        errors["shared_rel_err_fp32"], errors["shared_max_err_fp32"] = errors_against(reference_rows, shared_rows)
        if unshared_rows is not None:
            errors["unshared_rel_err_fp32"], errors["unshared_max_err_fp32"] = errors_against(reference_rows, unshared_rows)
    return errors
