#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Side-by-side timing of kvsieve's CUDA decode kernels and torch's scaled_dot_product_attention.

One process, the same data: q [B, Hq, 1, d] bf16, K/V [B, Hkv, N, d] bf16 for torch; for kvsieve the
same K/V copied into the paged layout of src/backends/cuda/kv_layout.cuh (a page = K[Hkv][P][d] then
V[Hkv][P][d]; the pages sit in a pool in SHUFFLED order, so consecutive pages of a sequence are not
neighbours in memory), timed with pages of 256 tokens (the library's default) and of 16 (the
vLLM/FlashInfer page). With --old-lib, the previous kernels (contiguous per-sequence
[Hkv, capacity, d] caches: the shim of commit 32a5362, built like this one) run on torch's own K/V tensors in the
same process, for a before/after on one machine.

Times are medians of CUDA-event timings of single calls, each preceded by a 256 MiB L2 flush (so
the CPU enqueue hides behind the flush and no run reads a warm L2). Also measures a
device-to-device copy (bytes read + written) as the bandwidth ceiling.

Usage: python3 bench/cuda_sdpa_compare.py --lib build/libkvs_cuda_bench.so [--old-lib old.so]
       [--json out.json] [--quick] [--variants 0,2]
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
P_, I_, I64_, SZ_, FL_ = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_size_t, ctypes.c_float


def load_lib(path):
    lib = ctypes.CDLL(path)
    P, I, SZ, FL = P_, I_, SZ_, FL_
    lib.kvsb_last_message.restype = ctypes.c_char_p
    lib.kvsb_dense_ws.restype = SZ
    lib.kvsb_dense_ws.argtypes = [I, I, I, I, I]
    lib.kvsb_gathered_ws.restype = SZ
    lib.kvsb_gathered_ws.argtypes = [I, I, I, I, I, I]
    lib.kvsb_num_splits.argtypes = [I, I, I, I, I, I]
    lib.kvsb_set_variant.argtypes = [I]
    lib.kvsb_set_merge_pdl.argtypes = [I]
    lib.kvsb_set_min_chunk.argtypes = [I]
    lib.kvsb_set_gather_variant.argtypes = [I]
    lib.kvsb_dense.argtypes = [I, I, I, I, FL, I, I, I, P, P, I, I, P, I, P, P, P, SZ, P]
    lib.kvsb_gathered.argtypes = [I, I, I, I, FL, I, I, I, P, P, I, I, P, P, I, I, P, P, P, SZ, P]
    return lib


def load_old_lib(path):
    """The shim of the contiguous-cache kernels (git HEAD before the paged layout)."""
    lib = ctypes.CDLL(path)
    P, I, I64, SZ, FL = P_, I_, I64_, SZ_, FL_
    lib.kvsb_last_message.restype = ctypes.c_char_p
    lib.kvsb_dense_ws.restype = SZ
    lib.kvsb_dense_ws.argtypes = [I, I, I, I, I]
    lib.kvsb_gathered_ws.restype = SZ
    lib.kvsb_gathered_ws.argtypes = [I, I, I, I, I]
    lib.kvsb_dense.argtypes = [I, I, I, I, FL, I, I, I, P, P, P, I64, P, I, P, P, P, SZ, P]
    lib.kvsb_gathered.argtypes = [I, I, I, I, FL, I, I, I, P, P, P, I64, P, P, I, P, P, P, SZ, P]
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
    return [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]


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


class Paged:
    """K/V [B, Hkv, N, d] copied into pages of P tokens, placed in a pool in shuffled order."""

    def __init__(self, k, v, P, seed=1):
        B, Hkv, N, D = k.shape
        assert N % P == 0
        npg = N // P
        # [B, Hkv, npg, P, D] -> [B, npg, Hkv, P, D]; a page = (K, V) halves
        kp = k.view(B, Hkv, npg, P, D).permute(0, 2, 1, 3, 4)
        vp = v.view(B, Hkv, npg, P, D).permute(0, 2, 1, 3, 4)
        g = torch.Generator(device="cpu").manual_seed(seed)
        perm = torch.randperm(B * npg, generator=g)  # logical page i -> pool slot perm[i]
        self.pool = torch.empty(B * npg, 2, Hkv, P, D, dtype=k.dtype, device=k.device)
        slots = perm.to(k.device)
        self.pool[slots, 0] = kp.reshape(B * npg, Hkv, P, D)
        self.pool[slots, 1] = vp.reshape(B * npg, Hkv, P, D)
        page_bytes = 2 * Hkv * P * D * k.element_size()
        base = self.pool.data_ptr()
        self.table = (base + perm.to(torch.int64) * page_bytes).to(k.device).contiguous()
        self.max_pages, self.P = npg, P


def dense_case(lib, old, B, N, Hq, Hkv, D, reps, pages, copy_gbps, results, check_lse=False,
               variants=(0,), pdl_ab=False):
    torch.manual_seed(B * 1000003 + N + D)
    scale = 1.0 / math.sqrt(D)
    dev = "cuda"
    q = (torch.rand(B, Hq, D, device=dev) * 4 - 2).to(torch.bfloat16)
    k = (torch.rand(B, Hkv, N, D, device=dev) * 2 - 1).to(torch.bfloat16)
    v = (torch.rand(B, Hkv, N, D, device=dev) * 2 - 1 + 0.25).to(torch.bfloat16)
    q4 = q.view(B, Hq, 1, D)
    lens = torch.full((B,), N, dtype=torch.int32, device=dev)
    o = torch.empty(B, Hq, D, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    kv_bytes = 2 * B * Hkv * N * D * 2
    sd = time_sdpa(q4, k, v, scale, reps)
    best = min(sd, key=lambda r: r[1]) if sd else None
    cudnn = next((r for r in sd if r[0] == "cudnn"), best)
    tag = f"dense B={B} N={N} Hq={Hq} Hkv={Hkv} d={D}"

    def row(kernel, fn, splits=None, extra=None):
        o.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        err = rel_err(o, best[2].view(B, Hq, D)) if best else float("nan")
        med, lo, hi = bench(fn, reps=reps)
        r = dict(case=tag, kernel=kernel, splits=splits, us=med, us_min=lo, us_max=hi,
                 GBps=kv_bytes / (med * 1e-6) / 1e9, frac_copy_bw=kv_bytes / (med * 1e-6) / 1e9 / copy_gbps,
                 rel_err_vs_sdpa=err, ratio_vs_cudnn=(med / cudnn[1]) if cudnn else None)
        if extra:
            r.update(extra)
        results.append(r)
        return r

    if old is not None:
        seq_bytes = Hkv * N * D * 2
        kptr = torch.tensor([k.data_ptr() + b * seq_bytes for b in range(B)], dtype=torch.int64, device=dev)
        vptr = torch.tensor([v.data_ptr() + b * seq_bytes for b in range(B)], dtype=torch.int64, device=dev)
        owsb = old.kvsb_dense_ws(B, Hq, Hkv, D, N)
        ows = torch.empty(max(owsb, 1), dtype=torch.uint8, device=dev)

        def old_fn():
            check(old, old.kvsb_dense(B, Hq, Hkv, D, scale, BF16, BF16, BF16, q.data_ptr(), kptr.data_ptr(),
                                      vptr.data_ptr(), N, lens.data_ptr(), N, o.data_ptr(), lse.data_ptr(),
                                      ows.data_ptr(), owsb, stream), "old dense")
        row("old contiguous", old_fn)

    wsb = lib.kvsb_dense_ws(B, Hq, Hkv, D, N)
    ws = torch.empty(max(wsb, 1), dtype=torch.uint8, device=dev)
    splits = lib.kvsb_num_splits(B, Hq, Hkv, D, N, BF16)
    for P in pages:
        pg = Paged(k, v, P)

        def ours():
            check(lib, lib.kvsb_dense(B, Hq, Hkv, D, scale, BF16, BF16, BF16, q.data_ptr(), pg.table.data_ptr(),
                                      pg.max_pages, P, lens.data_ptr(), N, o.data_ptr(), lse.data_ptr(),
                                      ws.data_ptr(), wsb, stream), "dense")
        for var in variants:
            check(lib, lib.kvsb_set_variant(var), "variant")
            r = row(f"paged P={P} v{var}", ours, splits)
            if check_lse and var == 0 and P == pages[0]:
                G = Hq // Hkv
                kk = k.float().repeat_interleave(G, dim=1)  # [B,Hq,N,D]
                s = torch.einsum("bhd,bhnd->bhn", q.float(), kk) * scale
                r["lse_abs_err"] = (lse - torch.logsumexp(s, dim=-1)).abs().max().item()
                del kk, s
        lib.kvsb_set_variant(0)
        if pdl_ab:
            lib.kvsb_set_merge_pdl(0)
            row(f"paged P={P} no-PDL", ours, splits)
            lib.kvsb_set_merge_pdl(1)
        del pg
    for name, med, out in sd:
        results.append(dict(case=tag, kernel=f"sdpa {name}", us=med,
                            GBps=kv_bytes / (med * 1e-6) / 1e9,
                            frac_copy_bw=kv_bytes / (med * 1e-6) / 1e9 / copy_gbps))
    del k, v, sd
    torch.cuda.empty_cache()


def gathered_case(lib, old, N, Hq, Hkv, D, frac, reps, pages, copy_gbps, results, runs=False, per_q=False,
                  shapes=((0, 0),)):
    """One sequence, random lists of frac * N tokens (or whole aligned 16-token runs in random
    order, sorted within a run) per KV head (or per query head with per_q)."""
    torch.manual_seed(7)
    scale = 1.0 / math.sqrt(D)
    dev = "cuda"
    G = Hq // Hkv
    q = (torch.rand(1, Hq, D, device=dev) * 4 - 2).to(torch.bfloat16)
    k = (torch.rand(1, Hkv, N, D, device=dev) * 2 - 1).to(torch.bfloat16)
    v = (torch.rand(1, Hkv, N, D, device=dev) * 2 - 1).to(torch.bfloat16)
    sel = max(1, int(N * frac))
    nl = Hq if per_q else Hkv

    def one_list():
        if runs:
            r = torch.randperm(N // 16, device=dev)[: (sel + 15) // 16]
            return (r[:, None] * 16 + torch.arange(16, device=dev)[None, :]).reshape(-1)[:sel]
        return torch.randperm(N, device=dev)[:sel]
    idx = torch.stack([one_list() for _ in range(nl)]).to(torch.int32).contiguous()
    cnt = torch.full((nl,), sel, dtype=torch.int32, device=dev)
    o = torch.empty(1, Hq, D, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(1, Hq, dtype=torch.float32, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    # reference: gather then dense SDPA (math on the small gathered set), per query head
    kvh = [h // G for h in range(Hq)]
    li = [h if per_q else h // G for h in range(Hq)]
    ks = torch.stack([k[0, kvh[h], idx[li[h]].long()] for h in range(Hq)])[None]
    vs = torch.stack([v[0, kvh[h], idx[li[h]].long()] for h in range(Hq)])[None]
    ref = F.scaled_dot_product_attention(q.view(1, Hq, 1, D).float(), ks.float(), vs.float(),
                                         scale=scale).view(1, Hq, D)
    byts = 2 * nl * sel * D * 2
    tag = (f"gathered N={N} sel={sel} ({frac:.0%}) Hq={Hq} Hkv={Hkv} d={D}"
           + (" runs16" if runs else "") + (" per-q-head" if per_q else ""))

    def row(kernel, fn):
        o.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        err = rel_err(o, ref)
        med, lo, hi = bench(fn, reps=reps)
        results.append(dict(case=tag, kernel=kernel, us=med, us_min=lo, GBps=byts / (med * 1e-6) / 1e9,
                            frac_copy_bw=byts / (med * 1e-6) / 1e9 / copy_gbps, rel_err_vs_ref=err))

    if old is not None and not per_q:
        kptr = torch.tensor([k.data_ptr()], dtype=torch.int64, device=dev)
        vptr = torch.tensor([v.data_ptr()], dtype=torch.int64, device=dev)
        owsb = old.kvsb_gathered_ws(1, Hq, Hkv, D, sel)
        ows = torch.empty(max(owsb, 1), dtype=torch.uint8, device=dev)

        def old_fn():
            check(old, old.kvsb_gathered(1, Hq, Hkv, D, scale, BF16, BF16, BF16, q.data_ptr(), kptr.data_ptr(),
                                         vptr.data_ptr(), N, idx.data_ptr(), cnt.data_ptr(), sel, o.data_ptr(),
                                         lse.data_ptr(), ows.data_ptr(), owsb, stream), "old gathered")
        row("old contiguous", old_fn)
    wsb = lib.kvsb_gathered_ws(1, Hq, Hkv, D, sel, int(per_q))
    ws = torch.empty(max(wsb, 1), dtype=torch.uint8, device=dev)
    for P in pages:
        pg = Paged(k, v, P)

        def ours():
            check(lib, lib.kvsb_gathered(1, Hq, Hkv, D, scale, BF16, BF16, BF16, q.data_ptr(), pg.table.data_ptr(),
                                         pg.max_pages, P, idx.data_ptr(), cnt.data_ptr(), sel, int(per_q),
                                         o.data_ptr(), lse.data_ptr(), ws.data_ptr(), wsb, stream), "gathered")
        # (pipeline shape, fewest keys per split): kernel shapes of the gathered path (bf16, d 128,
        # G 4 only; see detail::set_gather_variant) and split sizes; (0, 0) = the defaults.
        for gv, mc in shapes:
            check(lib, lib.kvsb_set_gather_variant(gv), "gather variant")
            lib.kvsb_set_min_chunk(mc)
            wsb = lib.kvsb_gathered_ws(1, Hq, Hkv, D, sel, int(per_q))  # the split count moves it
            ws = torch.empty(max(wsb, 1), dtype=torch.uint8, device=dev)
            row(f"paged P={P}" + (f" g{gv} mc{mc}" if (gv, mc) != (0, 0) else ""), ours)
        lib.kvsb_set_gather_variant(0)
        lib.kvsb_set_min_chunk(0)
        del pg
    del k, v
    torch.cuda.empty_cache()


def headline_cases(lib, old, args, V, reps, PG, copy_gbps, results):
    """The dense and gathered cases of the default run."""
    dense_case(lib, old, 1, 131072, 32, 8, 128, reps, PG, copy_gbps, results, check_lse=True, pdl_ab=True,
               variants=V)
    dense_case(lib, old, 1, 524288, 32, 8, 128, reps, PG, copy_gbps, results, variants=V)
    dense_case(lib, old, 8, 131072, 32, 8, 128, 20, PG, copy_gbps, results, variants=V)
    if not args.quick:
        dense_case(lib, old, 1, 32768, 32, 8, 128, reps, PG, copy_gbps, results, pdl_ab=True, variants=V)
        dense_case(lib, old, 1, 131072, 32, 32, 128, reps, (256,), copy_gbps, results)  # MHA, G = 1
        dense_case(lib, None, 1, 131072, 16, 8, 256, reps, PG, copy_gbps, results)  # d=256, G=2
        dense_case(lib, None, 1, 131072, 32, 8, 256, reps, (256,), copy_gbps, results)  # d=256, G=4
        for frac in (0.01, 0.2):
            gathered_case(lib, old, 131072, 32, 8, 128, frac, reps, PG, copy_gbps, results)
        gathered_case(lib, None, 131072, 16, 8, 256, 0.05, reps, PG, copy_gbps, results)
    gathered_case(lib, old, 131072, 32, 8, 128, 0.05, reps, PG, copy_gbps, results)
    gathered_case(lib, old, 131072, 32, 8, 128, 0.05, reps, PG, copy_gbps, results, runs=True)
    gathered_case(lib, None, 131072, 32, 8, 128, 0.05, reps, PG, copy_gbps, results, per_q=True)
    # the headline case again: run-to-run spread
    dense_case(lib, old, 1, 131072, 32, 8, 128, reps, PG, copy_gbps, results, variants=V)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--old-lib", help="shim of the previous (contiguous-cache) kernels, for before/after")
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", default="0",
                    help="dense kernel variants to time in the headline cases (comma-separated; "
                         "2 = the tensor-core kernel with 3 stages)")
    ap.add_argument("--gather-shapes", default="0:0",
                    help="gathered-decode shapes for the 5%% cases, comma-separated VARIANT:MIN_CHUNK "
                         "(detail::set_gather_variant, detail::set_min_chunk; 0:0 = the defaults)")
    ap.add_argument("--gathered-only", action="store_true", help="only the 5%% gathered cases")
    args = ap.parse_args()
    V = tuple(int(x) for x in args.variants.split(","))
    GS = tuple(tuple(int(y) for y in x.split(":")) for x in args.gather_shapes.split(","))
    lib = load_lib(args.lib)
    old = load_old_lib(args.old_lib) if args.old_lib else None
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}, "
          f"cudnn {torch.backends.cudnn.version()}")
    copy_gbps, copy_us = copy_bandwidth()
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (1 GiB, read+write, median {copy_us:.0f} us)")
    results = []
    reps = 20 if args.quick else 40
    PG = (256, 16)
    if args.gathered_only:
        gathered_case(lib, None, 131072, 32, 8, 128, 0.05, reps, PG, copy_gbps, results, shapes=GS)
        gathered_case(lib, None, 131072, 32, 8, 128, 0.05, reps, PG, copy_gbps, results, runs=True, shapes=GS)
        gathered_case(lib, None, 524288, 32, 8, 128, 0.05, reps, (256,), copy_gbps, results, runs=True, shapes=GS)
    if not args.gathered_only:
        headline_cases(lib, old, args, V, reps, PG, copy_gbps, results)

    print()
    print(f"{'case':58s} {'kernel':16s} {'splits':>6s} {'median us':>10s} {'GB/s':>7s} {'%copy':>6s} "
          f"{'x cuDNN':>7s} {'err':>9s}")
    for r in results:
        err = r.get("rel_err_vs_sdpa", r.get("rel_err_vs_ref"))
        ratio = r.get("ratio_vs_cudnn")
        print(f"{r['case']:58s} {r['kernel']:16s} {str(r.get('splits') or ''):>6s} {r['us']:10.1f} "
              f"{r.get('GBps', 0):7.0f} {100 * r.get('frac_copy_bw', 0):5.0f}% "
              f"{(f'{ratio:.3f}' if ratio else ''):>7s} {(f'{err:.2e}' if err is not None else ''):>9s}"
              + (f"  lse_err={r['lse_abs_err']:.1e}" if 'lse_abs_err' in r else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           copy_GBps=copy_gbps, results=results), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
