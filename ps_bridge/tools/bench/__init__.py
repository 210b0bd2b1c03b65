"""`ps-bridge bench`: how much faster is a prefix-shared step than the unshared one, on a GPU.

One process builds each requested model shape through our Megatron-Bridge provider (random weights,
the real hidden size, heads and head dim of the named checkpoint, possibly fewer layers: the count
is printed), and for each grid row (prompt length P, response length R, n responses per prompt)
times, on the *same* micro-batch packed shared and unshared:

- the actor step: forward, per-sample log-probs, a masked log-prob loss, backward;
- the log-prob pass: forward and log-probs, no gradient (the old/ref log-prob pass of GRPO).

Timing is with CUDA events after warm-up, median of repeats; the micro-batch's layout is built
before timing (verl prepares it on the host while the GPU works). Peak memory is torch's peak
allocated bytes during one actor step. The ideal speed-up is the token ratio S = n(P+R)/(P+nR)
(unshared over shared tokens); F, beside it, is the model-FLOP ratio (`flops.py`: with the output
layer on read positions only, the speed-up can exceed S, and F bounds it); tokens/s counts the
micro-batch's unshared tokens n(P+R), so it is comparable between the modes.

`--trees system,chain,search` adds rows shaped like prefix trees (`catalog.TREE_SHAPES`: a system
prompt shared across prompts, step-wise multi-turn trajectories, a search tree), shared as a token
trie; each reports its trie tokens, S, F, x / S and x / F.

`--min-shared-sweep K,K,...` measures the tree's threshold (`layout.DEFAULT_MIN_SHARED`): prompts that
share only a leading run of K tokens (`catalog.template_samples`), packed as a token trie at
`min_shared=0` and at `min_shared=K+1` and timed against each other, interleaved (`timing.run_pair`);
its own table (`report.format_min_shared_table`, docs/how-it-works.md "Choosing the threshold").

Model shapes are table entries (`catalog.MODEL_SHAPES`), built by their family's HF-config builder
(`catalog.FAMILIES`): a new family adds one builder and its shapes.

`--smoke` runs tiny shapes (on a CPU too, with wall-clock timing) so CI exercises the whole path.

Modules: `catalog` (model shapes, grids, ideal speed-up, the micro-batch), `timing` (timer, peak
memory, actor step, one packing's run, the unshared batch split on OOM), `fp32_reference` (the
float32 twin), `report` (row result, table, plot, environment, JSON), `run` (arguments, the run).
This module only re-exports their public names.
"""

from ps_bridge.tools.bench.catalog import (
    DEFAULT_GRID, DEFAULT_MODELS, FAMILIES, MIN_SHARED_SWEEP, MODEL_SHAPES, SMOKE_GRID, TREE_SHAPES, ModelShape,
    TreeShape, ideal_speedup, make_samples, qwen2_hf_config, qwen35_hf_config, response_row_mask, template_samples,
)
from ps_bridge.tools.bench.fp32_reference import Fp32Reference
from ps_bridge.tools.bench.report import (
    MinSharedRow, RowResult, environment, format_min_shared_table, format_table, write_plot,
)
from ps_bridge.tools.bench.run import add_bench_arguments, run_bench, run_row
from ps_bridge.tools.bench.timing import (
    UNSHARED_SPLITS, ModeResult, run_actor_step, run_mode, run_pair, run_unshared, split_in_order,
)

__all__ = [
    "DEFAULT_GRID", "DEFAULT_MODELS", "FAMILIES", "MIN_SHARED_SWEEP", "MODEL_SHAPES", "SMOKE_GRID", "TREE_SHAPES",
    "ModelShape", "TreeShape", "ideal_speedup",
    "make_samples", "qwen2_hf_config", "qwen35_hf_config", "response_row_mask", "template_samples", "Fp32Reference",
    "MinSharedRow", "RowResult", "environment", "format_min_shared_table", "format_table", "write_plot",
    "add_bench_arguments", "run_bench", "run_row",
    "UNSHARED_SPLITS", "ModeResult", "run_actor_step", "run_mode", "run_pair", "run_unshared", "split_in_order",
]
