# SPDX-License-Identifier: Apache-2.0
"""The cost of attending an engine's own paged KV cache (kv_source="caller") against a session that
stores the same tokens itself, in one process on the same tensors (cuda backend).

Per method and context: an owned session (decode with k_new, v_new: its step appends them) and one
caller session per --layouts entry over an engine pool of pages of --page tokens holding the same
tokens (the engine writes each token into its pool, outside the timed region, as it would for its
own attention; the timed call is bind_kv + decode). Layouts: HND and NHD (FlashInfer's paged cache,
K and V in one tensor [pages, 2, ...]), HND2 and NHD2 (K and V in two tensors, as vLLM's
FlashAttention backend keeps them). Each call is timed twice over (one layer; medians; the L2 is
not flushed): on the device, between two CUDA events around the call with a GPU spin of --hide-us
before it, so the host's enqueue time is hidden and the figure is the GPU's work (the step's
kernels, the page-table upload); and on the host, until the call returns. Reports both, the device
time's ratio caller / owned, and bind_kv's host time alone.

    python bench/caller_kv_bench.py --context 131072 --methods full quest exact_topk --page 16
    python bench/caller_kv_bench.py --context 131072 --methods full quest --layouts HND NHD NHD2
"""
import argparse
import json
import statistics
import time

import numpy as np
import torch

import kvsieve


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, nargs="+", default=[131072])
    ap.add_argument("--methods", nargs="+", default=["full", "quest", "exact_topk", "streaming"])
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--page", type=int, default=16, help="tokens per page of the engine's pool")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--hide-us", type=float, default=500.0, help="GPU spin before each timed call (us)")
    ap.add_argument("--layouts", nargs="+", default=["HND"], choices=["HND", "NHD", "HND2", "NHD2"],
                    help="the engine pool's layouts, one caller session each")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    hq, hkv, d, P = a.hq, a.hkv, a.d, a.page
    rows = []
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # (loads the kernel: not in the calibration below)
    torch.cuda.synchronize()
    e0.record()
    torch.cuda._sleep(1_000_000)
    e1.record()
    torch.cuda.synchronize()
    spin = int(a.hide_us * 1_000_000 / (e0.elapsed_time(e1) * 1e3))  # cycles of --hide-us
    print(f"{torch.cuda.get_device_name()}: GPU spin of {a.hide_us:.0f} us = {spin} cycles")
    for n in a.context:
        g = torch.Generator(device=dev).manual_seed(0)
        total = n + a.warmup + a.steps + 1
        q = torch.randn(total, hq, d, device=dev, generator=g, dtype=bf)
        k = torch.randn(total, hkv, d, device=dev, generator=g, dtype=bf)
        v = torch.randn(total, hkv, d, device=dev, generator=g, dtype=bf)
        npages = (total + P - 1) // P + 1
        perm = torch.randperm(npages, generator=torch.Generator().manual_seed(1))
        table = perm[: (total + P - 1) // P].numpy().astype(np.int32)  # the engine's page table (int32)
        # The engine's pools holding tokens 0..total-1 at (table[t // P], t % P), one per layout.
        tok = torch.arange(total, device=dev)
        pt = torch.from_numpy(table).to(dev).long()[tok // P]
        pools = {}
        for lay in a.layouts:
            nhd, two = lay.startswith("NHD"), lay.endswith("2")
            dims = (P, hkv) if nhd else (hkv, P)
            if two:
                kp = torch.zeros(npages, *dims, d, device=dev, dtype=bf)
                vp = torch.zeros_like(kp)
                pool = (kp, vp)
            else:
                pool = torch.zeros(npages, 2, *dims, d, device=dev, dtype=bf)
                kp, vp = pool[:, 0], pool[:, 1]
            if nhd:
                kp[pt, tok % P] = k
                vp[pt, tok % P] = v
            else:
                kp[pt, :, tok % P] = k
                vp[pt, :, tok % P] = v
            pools[lay] = (pool, lay[:3])
        for method in a.methods:
            kw = dict(method=method, budget=a.budget, kv_dtype="bfloat16", backend="cuda")
            own = kvsieve.Session(1, hq, hkv, d, **kw)
            cal = {lay: kvsieve.Session(1, hq, hkv, d, kv_source="caller", **kw) for lay in a.layouts}
            for c0 in range(0, n, 16384):
                c1 = min(n, c0 + 16384)
                own.prefill(0, q[c0:c1], k[c0:c1], v[c0:c1])
                for lay, (pool, layout) in pools.items():
                    cal[lay].bind_kv(0, pool, table, c1, layout=layout)
                    cal[lay].prefill(0, q[c0:c1], None, None)
            own.build_index()
            for c in cal.values():
                c.build_index()
            torch.cuda.synchronize()
            dev_own, host_own = [], []
            dev_cal, host_cal, t_bind = ({lay: [] for lay in a.layouts} for _ in range(3))
            for i in range(a.warmup + a.steps):
                t = n + i
                torch.cuda._sleep(spin)
                e0.record()
                s0 = time.perf_counter()
                own.decode(0, q[t], k[t], v[t])
                s1 = time.perf_counter()
                e1.record()
                torch.cuda.synchronize()
                if i >= a.warmup:
                    dev_own.append(e0.elapsed_time(e1) * 1e3)
                    host_own.append((s1 - s0) * 1e6)
                for lay, (pool, layout) in pools.items():
                    torch.cuda._sleep(spin)
                    e0.record()
                    s1 = time.perf_counter()
                    cal[lay].bind_kv(0, pool, table, t + 1, layout=layout)
                    s2 = time.perf_counter()
                    cal[lay].decode(0, q[t], None, None)
                    s3 = time.perf_counter()
                    e1.record()
                    torch.cuda.synchronize()
                    if i >= a.warmup:
                        dev_cal[lay].append(e0.elapsed_time(e1) * 1e3)
                        host_cal[lay].append((s3 - s1) * 1e6)
                        t_bind[lay].append((s2 - s1) * 1e6)
            med = statistics.median
            for lay in a.layouts:
                row = {"method": method, "context": n, "page_size": P, "layout": lay,
                       "budget": a.budget if method != "full" else 0,
                       "owned_us": med(dev_own), "caller_us": med(dev_cal[lay]),
                       "owned_host_us": med(host_own), "caller_host_us": med(host_cal[lay]),
                       "bind_host_us": med(t_bind[lay])}
                row["caller_over_owned"] = row["caller_us"] / row["owned_us"]
                rows.append(row)
                print(f"{method:11s} {n:8d} tokens, pages of {P}, {lay:4s}: device: owned {row['owned_us']:7.1f} us, "
                      f"caller (bind + decode) {row['caller_us']:7.1f} us ({row['caller_over_owned']:.3f}x); host: "
                      f"owned {row['owned_host_us']:6.1f} us, caller {row['caller_host_us']:6.1f} us, of which "
                      f"bind_kv {row['bind_host_us']:5.1f} us")
            own.close()
            for c in cal.values():
                c.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
