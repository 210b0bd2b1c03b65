"""What CUDA-graph buckets make of verl-check's micro-batches, counted on the host (no GPU, no verl):

    python3 tools/count_graph_buckets.py --model qwen3.5-0.8b --layers 24 --prompt-len 128 --response-len 256 \
        --steps 20 --buckets segment,level

For each step of verl-check's synthetic data (`verl_check.data.synthetic_tokens`: the same tokens as
`ps-bridge verl-check` with the same settings) the shared micro-batches of two pass kinds are packed
bucketed as the engine packs them under `PS_BRIDGE_CUDA_GRAPHS=1`: the log-prob passes' one
micro-batch of all prompts, the update's one per mini-batch of `--mini-batch` prompts (verl's
mini-batches in order; each must fit its token budget as one micro-batch, which the settings of
BENCHMARKS' small shapes do). Per bucket kind and pass kind it prints:
- F: the unshared samples' model FLOPs over those of the bucketed packs, padding included
  (`ps_bridge/tools/bench/flops.py`);
- padding: the bucketed packs' tokens over the samples' packed tokens, minus one;
- structures and captures: the distinct layout structures, and the steps at which a structure runs
  for the `cuda_graphs.CAPTURE_AT`-th time (its capture);
- eager: packs the sharing rule runs without graphs (the bucketed pack would hold more than
  `launch_rule.BUCKET_PAYS` of the samples' tokens: `launch_rule.bucketed_pack_runs`).
The level buckets' recent shapes (`tree.level_buckets.RecentShapes`) carry from step to step, as in
one process. Timing these passes needs a GPU: `tools/gpu_cuda_graphs.sh`.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List


@dataclass
class PassCount:
    """One pass kind's counts over the steps."""

    flops_unshared: float = 0.0
    flops_shared: float = 0.0
    tokens: int = 0
    tokens_bucketed: int = 0
    seen: Counter = field(default_factory=Counter)
    captures: List[int] = field(default_factory=list)
    eager: int = 0

    def line(self, label: str) -> str:
        if not self.flops_shared:
            return f"{label}: every pack eager ({self.eager})"
        return (f"{label}: F {self.flops_unshared / self.flops_shared:.3f}, padding "
                f"{self.tokens_bucketed / self.tokens - 1:.3f}, structures {len(self.seen)}, captures "
                f"{len(self.captures)} at steps {self.captures}, eager {self.eager}")


def count(model: str, layers: int, prompts: int, n: int, prompt_len: int, response_len: int, mini_batch: int,
          steps: int, buckets: str, seed: int = 0) -> Dict[str, PassCount]:
    """{"log-probs": ..., "update": ...} for bucket kind `buckets` ("segment" or "level")."""
    from ps_bridge.cuda_graphs import CAPTURE_AT
    from ps_bridge.launch_rule import bucketed_pack_runs
    from ps_bridge.layout import Sample, build_layout
    from ps_bridge.tools.bench.catalog import MODEL_SHAPES
    from ps_bridge.tools.bench.flops import flop_shape, model_flops
    from ps_bridge.tools.verl_check.config import CheckSettings
    from ps_bridge.tools.verl_check.data import synthetic_tokens
    from ps_bridge.tree.level_buckets import RecentShapes

    import ps_bridge.tree.materialize as materialize

    shape = flop_shape(MODEL_SHAPES[model], layers)
    settings = CheckSettings(model=model, layers=layers, prompts=prompts, n=n, prompt_len=prompt_len,
                             response_len=response_len, steps=steps, seed=seed)
    level = buckets == "level"
    saved, materialize.RECENT_SHAPES = materialize.RECENT_SHAPES, RecentShapes()  # one process's, from empty
    counts = {"log-probs": PassCount(), "update": PassCount()}
    try:
        for step in range(steps):
            prompt_tokens, responses, lengths, _, _ = synthetic_tokens(settings, shape.vocab, step)
            samples = [Sample(prompt_tokens[i].tolist(), responses[i, :int(lengths[i])].tolist())
                       for i in range(len(lengths))]
            per_mini = mini_batch * n
            for kind, parts in (("log-probs", [samples]),
                                ("update", [samples[a:a + per_mini] for a in range(0, len(samples), per_mini)])):
                c = counts[kind]
                for part in parts:
                    packed = build_layout(part, share="tree", prompt_values=False, bucket=True, level_buckets=level)
                    if not bucketed_pack_runs(packed.num_tokens, packed.tokens_unshared):
                        c.eager += 1
                        continue
                    c.flops_unshared += model_flops(shape, build_layout(part, share=False))
                    c.flops_shared += model_flops(shape, packed)
                    c.tokens += packed.tokens_shared  # the pack's valid tokens: the trie's, each once
                    c.tokens_bucketed += packed.num_tokens
                    key = packed.structure_key()
                    c.seen[key] += 1
                    if c.seen[key] == CAPTURE_AT:
                        c.captures.append(step + 1)
    finally:
        materialize.RECENT_SHAPES = saved
    return counts


def main() -> None:
    from ps_bridge.compat.quiet import quiet_third_party

    quiet_third_party(verbose=False)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3.5-0.8b", help="a shape of `ps-bridge bench --models`")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=256, help="mean; drawn from [R/2, 3R/2]")
    parser.add_argument("--mini-batch", type=int, default=4, help="prompts per update mini-batch")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--buckets", default="segment,level", help="comma-separated: segment, level")
    args = parser.parse_args()
    for buckets in args.buckets.split(","):
        result = count(args.model, args.layers, args.prompts, args.n, args.prompt_len, args.response_len,
                       args.mini_batch, args.steps, buckets, args.seed)
        for kind, c in result.items():
            print(c.line(f"{args.model} ({args.prompt_len}, {args.response_len}), {args.steps} steps, {buckets} "
                         f"buckets, {kind}"))


if __name__ == "__main__":
    main()
