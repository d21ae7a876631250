"""Measures the per-operation tables the configurator's step-time model
reads: dense GEMM throughput (bf16 and fp8) over token counts and the
weight shapes of the catalog's models, decode and prefill attention, device
memory bandwidth and the cost of one small kernel inside a CUDA graph.

Run on the GPU to calibrate (PyTorch and Triton must be there):
    python3 configurator/calibrate/gpu_ops.py configurator/data/calibration/<gpu>.json
(`scripts/gpu_checks.sh run OUT` runs it among the GPU checks).

Every time is the median of repeated runs timed with CUDA events
(triton.testing.do_bench) after warm-up, on random data (never zeros).
"""

import json
import sys
import time

import torch
import triton.testing

DEV = "cuda"
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
# (N, K) of the linear layers, per GPU: Llama-3.1-8B at TP 1, Llama-3.1-70B
# at TP 4 and 8, and two LM heads.
SHAPES = [
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
    (2560, 8192), (8192, 2048), (14336, 8192), (8192, 7168),
    (1280, 8192), (8192, 1024), (7168, 8192), (8192, 3584),
    (32000, 4096), (32064, 8192),
]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3  # us


def gemm_bf16(m, n, k):
    a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    return bench(lambda: torch.matmul(a, w.t()))


def gemm_fp8(m, n, k):
    mp = max(m, 16)
    a = torch.randn(mp, k, device=DEV).to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device=DEV).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device=DEV)
    return bench(lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))


def attn_decode(b, hq, hkv, l, d=128):
    q = torch.randn(b, hq, 1, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(b, hkv, l, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(b, hkv, l, d, device=DEV, dtype=torch.bfloat16)
    f = torch.nn.functional.scaled_dot_product_attention
    return bench(lambda: f(q, k, v, enable_gqa=True))


def attn_prefill(l, hq, hkv, d=128):
    q = torch.randn(1, hq, l, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, l, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(1, hkv, l, d, device=DEV, dtype=torch.bfloat16)
    f = torch.nn.functional.scaled_dot_product_attention
    return bench(lambda: f(q, k, v, is_causal=True, enable_gqa=True))


def copy_gbps():
    n = 1 << 30
    a = torch.randint(0, 255, (n,), device=DEV, dtype=torch.uint8)
    b = torch.empty_like(a)
    us = bench(lambda: b.copy_(a))
    return 2 * n / (us * 1e-6) / 1e9


def graph_kernel_us():
    x = torch.randn(1024, device=DEV)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(200):
            x.add_(1.0)
    return bench(lambda: g.replay()) / 200


def main():
    out_path = sys.argv[1]
    t0 = time.time()
    p = torch.cuda.get_device_properties(0)
    res = {
        "gpu": torch.cuda.get_device_name(0),
        "sms": p.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"),
        "gemm": [],
        "attn_decode": [],
        "attn_prefill": [],
    }
    res["copy_gbps"] = copy_gbps()
    res["graph_kernel_us"] = graph_kernel_us()
    print(f"copy {res['copy_gbps']:.0f} GB/s, kernel in graph {res['graph_kernel_us']:.2f} us", flush=True)
    for dtype, fn in (("bf16", gemm_bf16), ("fp8", gemm_fp8)):
        for n, k in SHAPES:
            for m in MS:
                try:
                    us = fn(m, n, k)
                except Exception as e:  # a shape the library refuses: recorded, not fatal
                    print(f"gemm {dtype} {m}x{n}x{k}: {e}", flush=True)
                    continue
                res["gemm"].append({"dtype": dtype, "m": m, "n": n, "k": k, "us": us})
        best = max(2 * g["m"] * g["n"] * g["k"] / g["us"] / 1e6 for g in res["gemm"] if g["dtype"] == dtype)
        print(f"gemm {dtype}: best {best:.0f} TFLOP/s ({time.time() - t0:.0f} s)", flush=True)
    for hq, hkv in ((32, 8), (8, 1), (64, 8)):
        for b in (1, 8, 32, 64, 128, 256):
            for l in (128, 512, 2048, 8192):
                if b * hkv * l * 128 * 2 * 2 > (8 << 30):
                    continue
                us = attn_decode(b, hq, hkv, l)
                res["attn_decode"].append({"batch": b, "q_heads": hq, "kv_heads": hkv, "ctx": l, "head_dim": 128, "us": us})
    print(f"decode attention done ({time.time() - t0:.0f} s)", flush=True)
    for hq, hkv in ((32, 8), (8, 1), (64, 8)):
        for l in (128, 512, 1024, 2048, 4096, 8192, 16384):
            us = attn_prefill(l, hq, hkv)
            res["attn_prefill"].append({"len": l, "q_heads": hq, "kv_heads": hkv, "head_dim": 128, "us": us})
    print(f"prefill attention done ({time.time() - t0:.0f} s)", flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    for g in res["gemm"]:
        if g["n"] == 28672 and g["m"] in (1, 64, 1024, 8192):
            print(f"  {g['dtype']} {g['m']}x{g['n']}x{g['k']}: {g['us']:.1f} us, {2*g['m']*g['n']*g['k']/g['us']/1e6:.0f} TFLOP/s")
    for a in res["attn_decode"]:
        if a["q_heads"] == 32 and a["ctx"] == 2048:
            gb = 2 * a["batch"] * a["kv_heads"] * a["ctx"] * 128 * 2 / (a["us"] * 1e-6) / 1e9
            print(f"  decode attn b{a['batch']} ctx2048: {a['us']:.1f} us, {gb:.0f} GB/s of KV")
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
