"""GPU check of the fused vocab-softmax kernels (ps_bridge.kernels.vocab_softmax) against the chunked torch path of
ps_bridge.rows at a Qwen2.5 vocabulary (T = 9000 positions, V = 152064, bf16): log-probs, the logits' gradient, time.

    python3 tools/check_vocab_softmax_gpu.py OUT.json
"""
import json, sys, time, torch
from ps_bridge import rows as R
from ps_bridge.kernels import vocab_softmax as K
torch.manual_seed(0)
T, V = 9000, 152064
x = (torch.randn(T, V, device="cuda") * 3).to(torch.bfloat16)
src = torch.randint(T, (T + 64,), device="cuda"); label = torch.randint(V, (T + 64,), device="cuda")
g = torch.randn(T + 64, device="cuda")
res = {}
def run(fused):
    K_usable = K.usable
    R.vocab_softmax.usable = K_usable if fused else (lambda t: False)
    try:
        out = R._VocabParallelRowLogprobs.apply(x.detach().requires_grad_(False), src, label, 1024, V - 100, 0, None)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(3):
            out = R._VocabParallelRowLogprobs.apply(x, src, label, 1024, V - 100, 0, None)
        torch.cuda.synchronize(); tf = (time.perf_counter() - t0) / 3
        for _ in range(2):  # the first warms up (compiles)
            xx = x.clone().requires_grad_(True)
            o = R._VocabParallelRowLogprobs.apply(xx, src, label, 1024, V - 100, 0, None)
            torch.cuda.synchronize(); t0 = time.perf_counter()
            o.backward(g); torch.cuda.synchronize(); tb = time.perf_counter() - t0
        return out, xx.grad, tf, tb
    finally:
        R.vocab_softmax.usable = K_usable
ref = run(False); new = run(True)
rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max())
res.update(logprob_rel=rel(new[0], ref[0]), grad_rel=rel(new[1], ref[1]),
           fwd_ms={"torch": ref[2] * 1e3, "fused": new[2] * 1e3}, bwd_ms={"torch": ref[3] * 1e3, "fused": new[3] * 1e3})
print(json.dumps(res)); json.dump(res, open(sys.argv[1], "w"))
