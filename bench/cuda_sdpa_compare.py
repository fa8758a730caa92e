#!/usr/bin/env python3
"""Side-by-side timing of kvsieve's CUDA decode kernels and torch's scaled_dot_product_attention.

One process, the same tensors: q [B, Hq, 1, d] bf16, K/V [B, Hkv, N, d] bf16 (K[b] is exactly our
per-sequence [Hkv, capacity, d] layout with capacity = N). Times are medians of CUDA-event timings
of single calls, each preceded by a 256 MiB L2 flush (so the CPU enqueue hides behind the flush and
no run reads a warm L2). Also measures a device-to-device copy (bytes read + written) as the
bandwidth ceiling.

Usage: python3 bench/cuda_sdpa_compare.py --lib build/libkvs_cuda_bench.so [--json out.json]
       [--quick]
"""
import argparse
import ctypes
import json
import math
import statistics
import sys

import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", category=UserWarning)

BF16, F16, F32 = 3, 2, 1  # kvs_scalar numbers


def load_lib(path):
    lib = ctypes.CDLL(path)
    P, I, I64, SZ, FL = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_size_t, ctypes.c_float
    lib.kvsb_last_message.restype = ctypes.c_char_p
    lib.kvsb_dense_ws.restype = SZ
    lib.kvsb_dense_ws.argtypes = [I, I, I, I, I]
    lib.kvsb_gathered_ws.restype = SZ
    lib.kvsb_gathered_ws.argtypes = [I, I, I, I, I]
    lib.kvsb_topk_ws.restype = SZ
    lib.kvsb_topk_ws.argtypes = [I, I, I, I, I, I]
    lib.kvsb_num_splits.argtypes = [I, I, I, I, I, I]
    lib.kvsb_set_variant.argtypes = [I]
    lib.kvsb_dense.argtypes = [I, I, I, I, FL, I, I, I, P, P, P, I64, P, I, P, P, P, SZ, P]
    lib.kvsb_gathered.argtypes = [I, I, I, I, FL, I, I, I, P, P, P, I64, P, P, I, P, P, P, SZ, P]
    lib.kvsb_topk.argtypes = [I, I, I, I, FL, I, I, P, P, I64, P, I, I, P, P, P, SZ, P]
    return lib


FLUSH = None


def bench(fn, reps=50, warmup=5):
    """Median microseconds of fn() over reps, each after an L2 flush."""
    global FLUSH
    if FLUSH is None:
        FLUSH = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        FLUSH.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    ts = [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends)]
    return statistics.median(ts), min(ts), max(ts)


def check(lib, rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: status {rc}: {lib.kvsb_last_message().decode()}")


def sdpa_backends():
    from torch.nn.attention import SDPBackend
    return [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION)]


def time_sdpa(q4, k, v, scale, reps):
    """Each backend that accepts the call: (name, median_us, output)."""
    from torch.nn.attention import sdpa_kernel
    res = []
    for name, be in sdpa_backends():
        try:
            with sdpa_kernel([be]):
                out = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
                torch.cuda.synchronize()
                med, lo, hi = bench(lambda: F.scaled_dot_product_attention(
                    q4, k, v, scale=scale, enable_gqa=True), reps=reps)
            res.append((name, med, out))
        except Exception as e:  # noqa: BLE001  # backend refuses this shape
            print(f"  sdpa[{name}] unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return res


def copy_bandwidth():
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    a.random_(0, 255)
    b = torch.empty_like(a)
    med, _, _ = bench(lambda: b.copy_(a), reps=20)
    return 2 * n / (med * 1e-6) / 1e9, med


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def dense_case(lib, B, N, Hq, Hkv, D, reps, variants, copy_gbps, results, check_lse=False):
    torch.manual_seed(B * 1000003 + N + D)
    scale = 1.0 / math.sqrt(D)
    dev = "cuda"
    q = (torch.rand(B, Hq, D, device=dev) * 4 - 2).to(torch.bfloat16)
    k = (torch.rand(B, Hkv, N, D, device=dev) * 2 - 1).to(torch.bfloat16)
    v = (torch.rand(B, Hkv, N, D, device=dev) * 2 - 1 + 0.25).to(torch.bfloat16)
    q4 = q.view(B, Hq, 1, D)
    seq_bytes = Hkv * N * D * 2
    kptr = torch.tensor([k.data_ptr() + b * seq_bytes for b in range(B)], dtype=torch.int64, device=dev)
    vptr = torch.tensor([v.data_ptr() + b * seq_bytes for b in range(B)], dtype=torch.int64, device=dev)
    lens = torch.full((B,), N, dtype=torch.int32, device=dev)
    o = torch.empty(B, Hq, D, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=dev)
    wsb = lib.kvsb_dense_ws(B, Hq, Hkv, D, N)
    ws = torch.empty(max(wsb, 1), dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream().cuda_stream

    def ours():
        check(lib, lib.kvsb_dense(B, Hq, Hkv, D, scale, BF16, BF16, BF16, q.data_ptr(), kptr.data_ptr(),
                                  vptr.data_ptr(), N, lens.data_ptr(), N, o.data_ptr(), lse.data_ptr(),
                                  ws.data_ptr(), wsb, stream), "dense")

    kv_bytes = 2 * B * seq_bytes
    sd = time_sdpa(q4, k, v, scale, reps)
    best = min(sd, key=lambda r: r[1]) if sd else None
    tag = f"dense B={B} N={N} Hq={Hq} Hkv={Hkv} d={D}"
    for var in variants:
        check(lib, lib.kvsb_set_variant(var), "variant")
        o.fill_(float("nan"))
        ours()
        torch.cuda.synchronize()
        err = rel_err(o, best[2].view(B, Hq, D)) if best else float("nan")
        med, lo, hi = bench(ours, reps=reps)
        splits = lib.kvsb_num_splits(B, Hq, Hkv, D, N, BF16)
        row = dict(case=tag, kernel=f"kvsieve v{var}", splits=splits, us=med, us_min=lo, us_max=hi,
                   GBps=kv_bytes / (med * 1e-6) / 1e9, frac_copy_bw=kv_bytes / (med * 1e-6) / 1e9 / copy_gbps,
                   rel_err_vs_sdpa=err, ratio_vs_best_sdpa=(med / best[1]) if best else None)
        if check_lse and var == variants[0]:
            # natural-log LSE from fp32 scores
            G = Hq // Hkv
            kk = k.float().repeat_interleave(G, dim=1)  # [B,Hq,N,D]
            s = torch.einsum("bhd,bhnd->bhn", q.float(), kk) * scale
            ref_lse = torch.logsumexp(s, dim=-1)
            row["lse_abs_err"] = (lse - ref_lse).abs().max().item()
            del kk, s
        results.append(row)
    lib.kvsb_set_variant(0)
    for name, med, out in sd:
        results.append(dict(case=tag, kernel=f"sdpa {name}", us=med,
                            GBps=kv_bytes / (med * 1e-6) / 1e9,
                            frac_copy_bw=kv_bytes / (med * 1e-6) / 1e9 / copy_gbps))
    del k, v
    torch.cuda.empty_cache()


def gathered_case(lib, N, Hq, Hkv, D, frac, reps, copy_gbps, results):
    torch.manual_seed(7)
    scale = 1.0 / math.sqrt(D)
    dev = "cuda"
    q = (torch.rand(1, Hq, D, device=dev) * 4 - 2).to(torch.bfloat16)
    k = (torch.rand(1, Hkv, N, D, device=dev) * 2 - 1).to(torch.bfloat16)
    v = (torch.rand(1, Hkv, N, D, device=dev) * 2 - 1).to(torch.bfloat16)
    sel = max(1, int(N * frac))
    idx = torch.stack([torch.randperm(N, device=dev)[:sel] for _ in range(Hkv)]).to(torch.int32).contiguous()
    cnt = torch.full((Hkv,), sel, dtype=torch.int32, device=dev)
    kptr = torch.tensor([k.data_ptr()], dtype=torch.int64, device=dev)
    vptr = torch.tensor([v.data_ptr()], dtype=torch.int64, device=dev)
    o = torch.empty(1, Hq, D, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(1, Hq, dtype=torch.float32, device=dev)
    wsb = lib.kvsb_gathered_ws(1, Hq, Hkv, D, sel)
    ws = torch.empty(max(wsb, 1), dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream().cuda_stream

    def ours():
        check(lib, lib.kvsb_gathered(1, Hq, Hkv, D, scale, BF16, BF16, BF16, q.data_ptr(), kptr.data_ptr(),
                                     vptr.data_ptr(), N, idx.data_ptr(), cnt.data_ptr(), sel, o.data_ptr(),
                                     lse.data_ptr(), ws.data_ptr(), wsb, stream), "gathered")
    ours()
    torch.cuda.synchronize()
    # reference: gather then dense SDPA (math on the small gathered set)
    G = Hq // Hkv
    ks = torch.stack([k[0, h, idx[h].long()] for h in range(Hkv)])[None]
    vs = torch.stack([v[0, h, idx[h].long()] for h in range(Hkv)])[None]
    ref = F.scaled_dot_product_attention(q.view(1, Hq, 1, D).float(), ks.float().repeat_interleave(G, 1),
                                         vs.float().repeat_interleave(G, 1), scale=scale).view(1, Hq, D)
    err = rel_err(o, ref)
    med, lo, hi = bench(ours, reps=reps)
    byts = 2 * Hkv * sel * D * 2
    results.append(dict(case=f"gathered N={N} sel={sel} ({frac:.0%}) Hq={Hq} Hkv={Hkv} d={D}",
                        kernel="kvsieve", us=med, us_min=lo, GBps=byts / (med * 1e-6) / 1e9,
                        frac_copy_bw=byts / (med * 1e-6) / 1e9 / copy_gbps, rel_err_vs_ref=err))


def topk_case(lib, N, Hq, Hkv, D, k_top, reps, results):
    torch.manual_seed(11)
    scale = 1.0 / math.sqrt(D)
    dev = "cuda"
    q = (torch.rand(1, Hq, D, device=dev) * 4 - 2).to(torch.bfloat16)
    k = (torch.rand(1, Hkv, N, D, device=dev) * 2 - 1).to(torch.bfloat16)
    kptr = torch.tensor([k.data_ptr()], dtype=torch.int64, device=dev)
    lens = torch.full((1,), N, dtype=torch.int32, device=dev)
    out = torch.empty(Hkv, k_top, dtype=torch.int32, device=dev)
    cnt = torch.empty(Hkv, dtype=torch.int32, device=dev)
    wsb = lib.kvsb_topk_ws(1, Hq, Hkv, D, N, k_top)
    ws = torch.empty(max(wsb, 1), dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream().cuda_stream

    def ours():
        check(lib, lib.kvsb_topk(1, Hq, Hkv, D, scale, BF16, BF16, q.data_ptr(), kptr.data_ptr(), N,
                                 lens.data_ptr(), N, k_top, out.data_ptr(), cnt.data_ptr(), ws.data_ptr(),
                                 wsb, stream), "topk")
    ours()
    torch.cuda.synchronize()
    # torch reference: group-summed softmax then topk
    G = Hq // Hkv
    s = torch.einsum("hd,hnd->hn", q[0].float(), k[0].float().repeat_interleave(G, 0)) * scale
    p = torch.softmax(s, dim=-1).view(Hkv, G, N).sum(1)
    ref_vals, _ = torch.topk(p, k_top, dim=-1)
    got = torch.gather(p, 1, out.long())
    worst = (ref_vals[:, -1:] - got).max().item()  # > 0 only if a pick is below the k-th score
    med, lo, hi = bench(ours, reps=reps)

    def torch_topk():
        sc = torch.einsum("hd,hnd->hn", q[0].float(), k[0].float().repeat_interleave(G, 0)) * scale
        torch.topk(torch.softmax(sc, -1).view(Hkv, G, N).sum(1), k_top, dim=-1)
    tmed, _, _ = bench(torch_topk, reps=max(5, reps // 4))
    results.append(dict(case=f"topk N={N} k={k_top} Hq={Hq} Hkv={Hkv} d={D}", kernel="kvsieve", us=med,
                        us_min=lo, torch_fp32_us=tmed, worst_below_kth=worst))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    lib = load_lib(args.lib)
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}, "
          f"cudnn {torch.backends.cudnn.version()}")
    copy_gbps, copy_us = copy_bandwidth()
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (1 GiB, read+write, median {copy_us:.0f} us)")
    results = []
    reps = 20 if args.quick else 50
    V = [0, 1, 2, 3]
    dense_case(lib, 1, 131072, 32, 8, 128, reps, V, copy_gbps, results, check_lse=True)
    if not args.quick:
        dense_case(lib, 1, 524288, 32, 8, 128, reps, V, copy_gbps, results)
        dense_case(lib, 8, 131072, 32, 8, 128, 20, V, copy_gbps, results)
        dense_case(lib, 1, 32768, 32, 8, 128, reps, V, copy_gbps, results)
        dense_case(lib, 1, 8192, 32, 8, 128, reps, V, copy_gbps, results)
        dense_case(lib, 1, 131072, 32, 8, 64, reps, V, copy_gbps, results)
        dense_case(lib, 1, 131072, 32, 4, 128, reps, V, copy_gbps, results)
        dense_case(lib, 1, 131072, 64, 8, 128, reps, V, copy_gbps, results)
        dense_case(lib, 1, 131072, 32, 32, 128, reps, V, copy_gbps, results)  # MHA, G = 1
        for frac in (0.01, 0.2):
            gathered_case(lib, 131072, 32, 8, 128, frac, reps, copy_gbps, results)
    gathered_case(lib, 131072, 32, 8, 128, 0.05, reps, copy_gbps, results)
    topk_case(lib, 131072, 32, 8, 128, 6554, 10 if args.quick else 20, results)
    # the headline case again: run-to-run spread
    dense_case(lib, 1, 131072, 32, 8, 128, reps, V, copy_gbps, results)

    print()
    print(f"{'case':52s} {'kernel':16s} {'splits':>6s} {'median us':>10s} {'GB/s':>7s} {'%copy':>6s} "
          f"{'x sdpa':>7s} {'err':>9s}")
    for r in results:
        err = r.get("rel_err_vs_sdpa", r.get("rel_err_vs_ref", r.get("worst_below_kth")))
        ratio = r.get("ratio_vs_best_sdpa")
        print(f"{r['case']:52s} {r['kernel']:16s} {str(r.get('splits', '')):>6s} {r['us']:10.1f} "
              f"{r.get('GBps', 0):7.0f} {100 * r.get('frac_copy_bw', 0):5.0f}% "
              f"{(f'{ratio:.2f}' if ratio else ''):>7s} {(f'{err:.2e}' if err is not None else ''):>9s}"
              + (f"  lse_err={r['lse_abs_err']:.1e}" if 'lse_abs_err' in r else "")
              + (f"  torch_fp32={r['torch_fp32_us']:.0f}us" if 'torch_fp32_us' in r else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           copy_GBps=copy_gbps, results=results), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
