"""Probe (GPU): the MoE combine's segmented sum as `embedding_bag` vs a gather and a sum over the
fixed top-k bag (every token of a dropless top-k router has exactly k routed rows). Prints median ms
and whether the two agree. Not part of the package; run by hand on a GPU."""
import time

import torch
import torch.nn.functional as F

T, k, H = 24576, 8, 2048
g = torch.Generator(device="cuda").manual_seed(0)
routed = torch.randn(T * k, H, device="cuda", dtype=torch.bfloat16)
idx = torch.randperm(T * k, device="cuda", generator=g) % T  # routed row -> token, k rows each
rows = torch.argsort(idx, stable=True)
offsets = torch.arange(T, device="cuda") * k


def bag():
    return F.embedding_bag(rows, routed, offsets, mode="sum")


def gather_sum():
    return routed.index_select(0, rows).view(T, k, H).sum(1, dtype=torch.float32).to(routed.dtype)


def gather_sum_bf16():
    return routed.index_select(0, rows).view(T, k, H).sum(1)


def ms(fn, n=20):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    return sorted(ts)[n // 2]


ref = routed.float().index_select(0, rows).view(T, k, H).sum(1)
for name, fn in (("embedding_bag", bag), ("index_select + fp32 sum", gather_sum), ("index_select + sum", gather_sum_bf16)):
    out = fn()
    err = float((out.float() - ref).norm() / ref.norm())
    print(f"{name}: {ms(fn):.3f} ms, rel err vs float32 {err:.2e}")
