# SPDX-License-Identifier: Apache-2.0
"""The cost of attending an engine's own paged KV cache (kv_source="caller") against a session that
stores the same tokens itself, in one process on the same tensors (cuda backend).

Per method and context: an owned session (decode with k_new, v_new: its step appends them) and a
caller session over an engine pool of pages of --page tokens (the engine writes each token into its
pool, outside the timed region, as it would for its own attention; the timed call is bind_kv +
decode). Reports medians of the whole public call, timed from the host with the stream synchronised
after each call (one layer; the L2 is not flushed), the ratio caller / owned, and bind_kv's host time
alone.

    python bench/caller_kv_bench.py --context 131072 --methods full quest exact_topk --page 16
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
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    hq, hkv, d, P = a.hq, a.hkv, a.d, a.page
    rows = []
    for n in a.context:
        g = torch.Generator(device=dev).manual_seed(0)
        total = n + a.warmup + a.steps + 1
        q = torch.randn(total, hq, d, device=dev, generator=g, dtype=bf)
        k = torch.randn(total, hkv, d, device=dev, generator=g, dtype=bf)
        v = torch.randn(total, hkv, d, device=dev, generator=g, dtype=bf)
        npages = (total + P - 1) // P + 1
        perm = torch.randperm(npages, generator=torch.Generator().manual_seed(1))
        table = perm[: (total + P - 1) // P].numpy().astype(np.int32)  # the engine's page table (int32)
        # The engine's pool, [pages, 2, Hkv, P, d], holding tokens 0..total-1 at (table[t // P], t % P).
        pool = torch.zeros(npages, 2, hkv, P, d, device=dev, dtype=bf)
        tok = torch.arange(total, device=dev)
        pt = torch.from_numpy(table).to(dev).long()[tok // P]
        pool[pt, 0, :, tok % P] = k
        pool[pt, 1, :, tok % P] = v
        for method in a.methods:
            kw = dict(method=method, budget=a.budget, kv_dtype="bfloat16", backend="cuda")
            own = kvsieve.Session(1, hq, hkv, d, **kw)
            cal = kvsieve.Session(1, hq, hkv, d, kv_source="caller", **kw)
            for c0 in range(0, n, 16384):
                c1 = min(n, c0 + 16384)
                own.prefill(0, q[c0:c1], k[c0:c1], v[c0:c1])
                cal.bind_kv(0, pool, table, c1)
                cal.prefill(0, q[c0:c1], None, None)
            own.build_index()
            cal.build_index()
            torch.cuda.synchronize()
            t_own, t_cal, t_bind = [], [], []
            for i in range(a.warmup + a.steps):
                t = n + i
                s0 = time.perf_counter()
                own.decode(0, q[t], k[t], v[t])
                torch.cuda.synchronize()
                s1 = time.perf_counter()
                cal.bind_kv(0, pool, table, t + 1)
                s2 = time.perf_counter()
                cal.decode(0, q[t], None, None)
                torch.cuda.synchronize()
                s3 = time.perf_counter()
                if i >= a.warmup:
                    t_own.append((s1 - s0) * 1e6)
                    t_cal.append((s3 - s1) * 1e6)
                    t_bind.append((s2 - s1) * 1e6)
            row = {"method": method, "context": n, "page_size": P, "budget": a.budget if method != "full" else 0,
                   "owned_us": statistics.median(t_own), "caller_us": statistics.median(t_cal),
                   "bind_us": statistics.median(t_bind)}
            row["caller_over_owned"] = row["caller_us"] / row["owned_us"]
            rows.append(row)
            print(f"{method:11s} {n:8d} tokens, pages of {P}: owned {row['owned_us']:8.1f} us, caller (bind + decode) "
                  f"{row['caller_us']:8.1f} us ({row['caller_over_owned']:.2f}x), bind_kv alone {row['bind_us']:.1f} us")
            own.close()
            cal.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
