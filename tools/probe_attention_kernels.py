"""Time and compare, for the calls of one `ps-bridge bench` row, torch's flash kernels (varlen) against
cuDNN's dense SDPA kernels (`aten._scaled_dot_product_cudnn_attention[_backward]`) on elements of equal
length: output, log-sum-exp and its layout, the backward given flash's output and log-sum-exp (what a
cascade passes: merged values), and the median time of each (CUDA events, after warm-up).

    python3 tools/probe_attention_kernels.py --heads 32,8 --head-dim 128 --row 4096,256,16
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

aten = torch.ops.aten


def _time(fn, repeats=10, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _offsets(lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device), max(lengths)


def flash_fwd(q, k, v, cq, ck, mq, mk, causal, scale):
    out, lse, rng, unused, _ = aten._flash_attention_forward(q, k, v, cq, ck, mq, mk, 0.0, causal, False, scale=scale)
    return out, lse, (rng, unused)


def flash_bwd(do, q, k, v, out, lse, cq, ck, mq, mk, causal, scale, aux):
    return aten._flash_attention_backward(do, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, aux[0], aux[1], scale=scale)



def dense(x, B):
    """packed [B*L, H, D] -> [B, H, L, D] view (BSHD strides)."""
    T, H, D = x.shape
    return x.view(B, T // B, H, D).transpose(1, 2)


def cudnn_dense_fwd(q, k, v, B, causal, scale):
    r = aten._scaled_dot_product_cudnn_attention(dense(q, B), dense(k, B), dense(v, B), None, True, 0.0, causal, False,
                                                 scale=scale)
    return r


def cudnn_dense_bwd(do, q, k, v, out, lse, r, B, causal, scale):
    return aten._scaled_dot_product_cudnn_attention_backward(
        dense(do, B), dense(q, B), dense(k, B), dense(v, B), out, lse, r[6], r[7], None, r[2], r[3], r[4], r[5], 0.0,
        causal, scale=scale)


def probe(name, B, Lq, Lk, causal, hq, hkv, d, device, expand):
    torch.manual_seed(0)
    tq, tk = B * Lq, B * Lk
    q = torch.randn(tq, hq, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(tk, hkv, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(tk, hkv, d, device=device, dtype=torch.bfloat16)
    do = torch.randn(tq, hq, d, device=device, dtype=torch.bfloat16)
    cq, mq = _offsets([Lq] * B, device)
    ck, mk = _offsets([Lk] * B, device)
    scale = d ** -0.5
    res = {"call": name, "B": B, "Lq": Lq, "Lk": Lk, "causal": causal, "gqa_expanded": expand}
    out, lse, aux = flash_fwd(q, k, v, cq, ck, mq, mk, causal, scale)
    dq, dk, dv = flash_bwd(do, q, k, v, out, lse, cq, ck, mq, mk, causal, scale, aux)
    res["flash_fwd_ms"] = _time(lambda: flash_fwd(q, k, v, cq, ck, mq, mk, causal, scale))
    res["flash_bwd_ms"] = _time(lambda: flash_bwd(do, q, k, v, out, lse, cq, ck, mq, mk, causal, scale, aux))
    kk, vv = (k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)) if expand else (k, v)
    try:
        r = cudnn_dense_fwd(q, kk, vv, B, causal, scale)
        o2, l2 = r[0], r[1]
        res["cudnn_out_shape_stride"] = [list(o2.shape), list(o2.stride())]
        res["cudnn_lse_shape_stride"] = [list(l2.shape), list(l2.stride())]
        o2p = o2.transpose(1, 2).reshape(tq, hq, d)
        res["out_max_diff"] = (o2p.float() - out.float()).abs().max().item()
        l2p = l2.reshape(B, hq, Lq).permute(1, 0, 2).reshape(hq, tq)
        res["lse_max_diff"] = (l2p.float() - lse).abs().max().item()
        res["cudnn_fwd_ms"] = _time(lambda: cudnn_dense_fwd(q, kk, vv, B, causal, scale))
    except Exception as e:  # noqa: BLE001 - the probe reports what the kernel refuses
        res["cudnn_fwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return res
    try:
        # the backward given flash's output and lse in cuDNN's layouts (what a cascade would pass: merged values)
        out_d = dense(out, B)
        lse_d = lse.view(hq, B, Lq).permute(1, 0, 2).reshape(l2.shape).contiguous()
        g = cudnn_dense_bwd(do, q, kk, vv, out_d, lse_d, r, B, causal, scale)
        g = [x.transpose(1, 2).reshape(-1, x.shape[1], d) for x in g]
        if expand:
            g[1] = g[1].view(tk, hkv, hq // hkv, d).sum(2)
            g[2] = g[2].view(tk, hkv, hq // hkv, d).sum(2)
        res["grad_max_diff"] = [(a.float() - b.float()).abs().max().item() for a, b in zip(g, (dq, dk, dv))]
        res["grad_scale"] = [b.float().abs().max().item() for b in (dq, dk, dv)]
        res["cudnn_bwd_ms"] = _time(lambda: cudnn_dense_bwd(do, q, kk, vv, out_d, lse_d, r, B, causal, scale))
    except Exception as e:  # noqa: BLE001
        res["cudnn_bwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="32,8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--row", default="4096,256,16")
    ap.add_argument("--json")
    a = ap.parse_args()
    hq, hkv = (int(x) for x in a.heads.split(","))
    P, R, n = (int(x) for x in a.row.split(","))
    dev = torch.device("cuda")
    calls = [
        ("unshared samples", n, P + R, P + R, True),
        ("unshared one sample", 1, P + R, P + R, True),
        ("shared prompt", 1, P, P, True),
        ("shared responses causal", n, R, R, True),
        ("shared ancestor", 1, R * n, P, False),
    ]
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for expand in (False, True):
        for name, B, lq, lk, c in calls:
            rows.append(probe(name, B, lq, lk, c, hq, hkv, a.head_dim, dev, expand))
            print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
