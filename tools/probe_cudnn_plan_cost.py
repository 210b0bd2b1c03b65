"""How long cuDNN's dense SDPA takes on a shape it has not seen (its execution plan is built per shape)
against a repeated shape, forward and backward, for a run of new sequence lengths.

    python3 tools/probe_cudnn_plan_cost.py --heads 32,8 --head-dim 128
"""
import argparse
import json
import time

import torch

aten = torch.ops.aten


def once(L, hq, hkv, d, causal):
    q = torch.randn(1, L, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, L, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=d ** -0.5)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    aten._scaled_dot_product_cudnn_attention_backward(do, q, k, v, r[0], r[1], r[6], r[7], None, r[2], r[3], r[4],
                                                      r[5], 0.0, causal, scale=d ** -0.5)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="32,8")
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    hq, hkv = (int(x) for x in a.heads.split(","))
    once(512, hq, hkv, a.head_dim, True)
    rows = []
    for L in (1000, 1001, 2047, 3001, 4096, 4097, 4352, 4353):
        first = once(L, hq, hkv, a.head_dim, True)
        again = once(L, hq, hkv, a.head_dim, True)
        rows.append({"L": L, "first_fwd_ms": first[0], "first_bwd_ms": first[1], "again_fwd_ms": again[0],
                     "again_bwd_ms": again[1]})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
