"""Can one CUDA graph of fla's Gated DeltaNet kernels serve varlen batches of other lengths?

    python3 tools/probe_fla_varlen_replay.py [--tokens 2048] [--sequences 8] [--json out.json]
    python3 tools/probe_fla_varlen_replay.py --host-only     # the filler arithmetic alone (any machine)

A CUDA graph replays its kernels with the grids they were captured with. fla-core's varlen
`chunk_gated_delta_rule` and `causal_conv1d` size their grids by the sequence count (`len(cu_seqlens) - 1`)
and the chunk count (`len(chunk_indices)`, 64-token chunks), and take `chunk_indices` from the caller. So a
batch of other lengths replays a graph when it is given the same token count, sequence count and chunk
count. This probe pads each batch to that fixed shape with filler sequences after the real ones (their
tokens are padding, zero-length fillers allowed, each starting from a zero state) whose lengths make the
chunk count come out at the fixed number (`ps_bridge.tree.level_buckets`, what level buckets run a
tree level as under CUDA graphs), captures forward and backward once, refills the
inputs, `cu_seqlens` and `chunk_indices` for batches of other lengths, replays, and compares with eager runs
of the real sequences alone (outputs, final states and every gradient, real tokens only). fla derives
`chunk_offsets` from `cu_seqlens` through an identity cache (`fla.utils.tensor_cache`); the cache is off
while capturing, so that derivation is recorded in the graph and follows a refilled `cu_seqlens`.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import List, Sequence

from ps_bridge.packed_layout import cumulative_offsets
from ps_bridge.tree.level_buckets import CHUNK, chunk_index, chunks, filler_count, filler_lengths

# the probe's tensors with a row per token and with a row per sequence (the rest: the conv's weights)
PER_TOKEN = ("x", "g", "beta", "dy")
PER_SEQUENCE = ("h0", "conv0", "dht")


def fixed_shape(tokens: int, sequences: int) -> tuple:
    """(sequence count, chunk count) every batch of at most `sequences` real sequences and at most
    `tokens - filler_count(sequences)` real tokens is padded to (`ps_bridge.tree.level_buckets`)."""
    return sequences + filler_count(sequences), chunks(tokens) + sequences


def padded_batch(lengths: Sequence[int], tokens: int, sequences: int) -> List[int]:
    """The real `lengths` followed by filler lengths: `tokens` tokens, `fixed_shape` sequences and chunks."""
    count, chunk_count = fixed_shape(tokens, sequences)
    if len(lengths) > sequences:
        raise ValueError(f"{len(lengths)} sequences, the shape holds {sequences}")
    fillers = count - len(lengths)
    padding = tokens - sum(lengths)
    return list(lengths) + filler_lengths(padding, chunk_count - sum(chunks(n) for n in lengths), fillers)


def host_check(tokens: int, sequences: int, trials: int = 20000) -> dict:
    """Random batches of up to `sequences` real sequences within the token budget all pad to the fixed
    shape, the edge cases included (every sequence one token; every length a multiple of 64 or one more)."""
    import random

    rng = random.Random(0)
    count, chunk_count = fixed_shape(tokens, sequences)
    budget = tokens - (count - sequences)
    cases = [[1] * sequences, [budget // sequences // CHUNK * CHUNK] * sequences,
             [budget // sequences // CHUNK * CHUNK - CHUNK + 1] * sequences, [budget], [1]]
    for _ in range(trials):
        n = rng.randint(1, sequences)
        total = rng.randint(n, budget)
        cuts = sorted(rng.sample(range(1, total), n - 1)) if n > 1 else []
        cases.append([b - a for a, b in zip([0] + cuts, cuts + [total])])
    for lengths in cases:
        lengths = [n for n in lengths if n > 0] or [1]
        padded = padded_batch(lengths, tokens, sequences)
        assert len(padded) == count and sum(padded) == tokens and min(padded) >= 0, (lengths, padded)
        assert len(chunk_index(padded)) == chunk_count, (lengths, padded)
    return dict(tokens=tokens, sequences=sequences, padded_sequences=count, chunks=chunk_count,
                real_token_budget=budget, batches_checked=len(cases))


def run_gpu(tokens: int, sequences: int, heads: int, dim: int, width: int, device: str = "cuda", kernels=None) -> dict:
    """The probe on `device`; `kernels` = (causal_conv1d, chunk_gated_delta_rule) with fla's signatures
    (default fla's own). Off CUDA (a dry run of the bookkeeping) the "graph" reruns the step eagerly."""
    import torch

    if kernels is None:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    else:
        causal_conv1d, chunk_gated_delta_rule = kernels
    dev, dt = torch.device(device), torch.bfloat16
    count, chunk_count = fixed_shape(tokens, sequences)
    channels = 3 * heads * dim

    def inputs(seed: int, n_tokens: int, n_seq: int):
        g = torch.Generator(device=dev).manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
        return dict(
            x=(r(n_tokens, channels) * 0.5).to(dt), weight=(r(channels, width) * 0.3).to(dt), bias=(r(channels) * 0.1).to(dt),
            g=-torch.nn.functional.softplus(r(n_tokens, heads)).float(), beta=torch.sigmoid(r(n_tokens, heads)).to(dt),
            h0=r(n_seq, heads, dim, dim) * 0.1, conv0=(r(n_seq, channels, width) * 0.5).to(dt),
            dy=r(n_tokens, heads, dim).to(dt), dht=r(n_seq, heads, dim, dim) * 0.1,
        )

    def layer(t, cu, ci):
        """conv -> split q, k, v -> l2 norm -> gated delta rule; returns (o, final state)."""
        y, _ = causal_conv1d(x=t["x"].unsqueeze(0), weight=t["weight"], bias=t["bias"], initial_state=t["conv0"],
                             activation="silu", cu_seqlens=cu, chunk_indices=ci)
        q, k, v = y.squeeze(0).view(-1, 3, heads, dim).unbind(1)
        q, k = torch.nn.functional.normalize(q.float(), dim=-1).to(dt), torch.nn.functional.normalize(k.float(), dim=-1).to(dt)
        o, ht = chunk_gated_delta_rule(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), t["g"].unsqueeze(0),
                                       t["beta"].unsqueeze(0), scale=dim ** -0.5, initial_state=t["h0"],
                                       output_final_state=True, cu_seqlens=cu, chunk_indices=ci)
        return o.squeeze(0), ht

    leaves = ("x", "weight", "bias", "g", "beta", "h0", "conv0")
    # the outputs of `step`: the layer's output and final states, then the gradients of `leaves`
    names = ("o", "final_state", *(f"d_{k}" for k in leaves))
    rows = {"o": PER_TOKEN[0], "final_state": PER_SEQUENCE[0], **{f"d_{k}": k for k in leaves}}

    def step(t, cu, ci):
        args = {k: (t[k].detach().requires_grad_() if k in leaves else t[k]) for k in t}
        o, ht = layer(args, cu, ci)
        grads = torch.autograd.grad((o.float() * t["dy"].float()).sum() + (ht * t["dht"]).sum(), [args[k] for k in leaves])
        return [o, ht, *grads]

    def as_index(lengths):
        cu = torch.tensor(cumulative_offsets(lengths), dtype=torch.long, device=dev)
        return cu, torch.tensor(chunk_index(lengths), dtype=torch.long, device=dev).view(-1, 2)

    def real_part(outs, lengths):
        """The real sequences' share of each output of `step`."""
        return [real_rows(rows[n], o, lengths) for n, o in zip(names, outs)]

    def rel(a, b):
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    rng = torch.Generator().manual_seed(1)

    def random_lengths():
        budget = tokens - (count - sequences)
        w = torch.rand(sequences, generator=rng) + 0.2
        return [max(1, int(x)) for x in (w / w.sum() * budget * 0.9).tolist()]

    # the static buffers a graph reads
    first = random_lengths()
    padded = padded_batch(first, tokens, sequences)
    static = inputs(0, tokens, count)
    zero_fillers(static, first)
    cu, ci = as_index(padded)
    replay, outs = captured(lambda: step(static, cu, ci), dev)
    result = dict(tokens=tokens, sequences=sequences, padded_sequences=count, chunks=chunk_count, heads=heads,
                  dim=dim, conv_width=width, batches=[])
    for trial in range(4):
        lengths = first if trial == 0 else random_lengths()
        padded = padded_batch(lengths, tokens, sequences)
        t = inputs(100 + trial, tokens, count)
        zero_fillers(t, lengths)
        new_cu, new_ci = as_index(padded)
        for k in static:
            static[k].copy_(t[k])
        cu.copy_(new_cu)
        ci.copy_(new_ci)
        sync(dev)
        t0 = time.perf_counter()
        replay()
        sync(dev)
        replay_ms = (time.perf_counter() - t0) * 1e3
        replayed = real_part([o.clone() for o in outs], lengths)
        eager_padded = real_part(step(t, new_cu, new_ci), lengths)
        # the real sequences alone, as the model runs them without graphs
        alone = {k: real_rows(k, v, lengths) for k, v in t.items()}
        cu_a, ci_a = as_index(lengths)
        sync(dev)
        t0 = time.perf_counter()
        eager_alone = step(alone, cu_a, ci_a)
        sync(dev)
        eager_ms = (time.perf_counter() - t0) * 1e3
        result["batches"].append(dict(
            lengths=lengths, fillers=padded[len(lengths):], replay_ms=replay_ms, eager_ms=eager_ms,
            replay_equals_eager_padded=all(torch.equal(a, b) for a, b in zip(replayed, eager_padded)),
            rel_err_replay_vs_alone={n: rel(a, b) for n, a, b in zip(names, replayed, eager_alone)},
            rel_err_eager_padded_vs_alone={n: rel(a, b) for n, a, b in zip(names, eager_padded, eager_alone)},
        ))
    return result


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def captured(run, device):
    """(replay, outputs): `run` captured as a CUDA graph after one run on a side stream, with fla's
    identity cache off, so that what fla derives from `cu_seqlens` (`chunk_offsets`) is computed inside
    the graph. Off CUDA, `replay` reruns `run` into the same output list."""
    import torch

    if device.type != "cuda":
        outs = run()

        def rerun():
            outs[:] = run()

        return rerun, outs
    import fla.utils

    fla.utils.FLA_DISABLE_TENSOR_CACHE = True
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run()
    finally:
        fla.utils.FLA_DISABLE_TENSOR_CACHE = False
    return graph.replay, outs


def real_rows(name: str, value, lengths: Sequence[int]):
    """The rows of the probe's tensor `name` that belong to the real sequences `lengths` (the first ones)."""
    if name in PER_TOKEN:
        return value[: sum(lengths)]
    return value[: len(lengths)] if name in PER_SEQUENCE else value


def zero_fillers(t: dict, lengths: Sequence[int]) -> None:
    """The fillers start from zero states and their padding tokens carry no gradient into anything real."""
    for k in PER_SEQUENCE:
        t[k][len(lengths):] = 0
    t["dy"][sum(lengths):] = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--conv-width", type=int, default=4)
    parser.add_argument("--host-only", action="store_true", help="check the filler arithmetic only (no GPU)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = dict(host=host_check(args.tokens, args.sequences))
    if not args.host_only:
        out["gpu"] = run_gpu(args.tokens, args.sequences, args.heads, args.dim, args.conv_width)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
