#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Host time of one Session.decode through the Python binding, torch tensors in, and of its parts.

  python bench/python_host_time.py [--backend cuda|cpu] [--calls 300]

One layer, 32 query / 8 KV heads, d 128, bf16, `full`, 8192 tokens prefilled; medians of --calls
calls (time.perf_counter), after 20 untimed ones. On the cuda backend the calls are asynchronous:
what is timed is the host's part (argument checks, enqueue), the stream drained only at the end.
"""
import argparse
import statistics
import time

import kvsieve
import torch


def median_us(fn, calls):
    for _ in range(20):
        fn()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    dev = torch.device("cuda", 0) if a.backend == "cuda" else torch.device("cpu")
    hq, hkv, d, n = 32, 8, 128, 8192
    s = kvsieve.Session(1, hq, hkv, d, method="full", backend=a.backend)
    kk = torch.randn(n, hkv, d, device=dev, dtype=torch.bfloat16)
    s.prefill(0, torch.randn(n, hq, d, device=dev, dtype=torch.bfloat16), kk, torch.randn_like(kk))
    s.build_index()
    q = torch.randn(hq, d, device=dev, dtype=torch.bfloat16)
    k, v = torch.randn(hkv, d, device=dev, dtype=torch.bfloat16), torch.randn(hkv, d, device=dev, dtype=torch.bfloat16)
    out, lse = torch.empty(hq, d, device=dev, dtype=torch.bfloat16), torch.empty(hq, device=dev)
    sync = torch.cuda.synchronize if a.backend == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name(dev) if a.backend == "cuda" else "cpu"
    print(f"kvsieve {kvsieve.version()}, torch {torch.__version__}, {a.backend} ({name}); medians of {a.calls} calls")
    rows = [("Session.decode, outputs allocated", lambda: s.decode(0, q, k, v)),
            ("Session.decode, outputs given", lambda: s.decode(0, q, k, v, out=out, lse=lse)),
            ("torch.empty (one output)", lambda: torch.empty(hq, d, device=dev, dtype=torch.bfloat16)),
            ("q.__dlpack__() (what the binding no longer calls)",
             (lambda: q.__dlpack__(stream=1)) if a.backend == "cuda" else (lambda: q.__dlpack__()))]
    for label, fn in rows:
        us = median_us(fn, a.calls)
        sync()
        print(f"  {label:52s} {us:7.1f} us")


if __name__ == "__main__":
    main()
