#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The kernels torch's cuDNN SDPA runs for one decode query (the peer of bench/gpu_bench.py), by
torch.profiler: each kernel's mean time over 10 calls, each call after a 512 MiB L2-flushing read.

  python tools/device/sdpa_profile.py [--contexts 8192 131072] [--q-heads 32] [--kv-heads 8] [--head-dim 128]
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 131072])
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args()
    print(torch.cuda.get_device_name())
    flush = torch.zeros(512 << 20, dtype=torch.uint8, device="cuda").view(torch.int64)
    for n in a.contexts:
        k = torch.randn(1, n, a.kv_heads, a.head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn_like(k)
        q = torch.randn(1, a.q_heads, 1, a.head_dim, device="cuda", dtype=torch.bfloat16)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for _ in range(3):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(a.calls):
                    flush.sum()
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                torch.cuda.synchronize()
        print(f"== cuDNN SDPA, context {n}")
        for e in p.key_averages():
            if e.count >= a.calls and e.device_time_total > 0 and "reduce" not in e.key.lower():
                print(f"  {e.device_time_total / e.count:8.1f} us x{e.count}  {e.key[:100]}")
        del k, v


if __name__ == "__main__":
    main()
