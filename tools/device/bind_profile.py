#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The host time of Session.bind_kv and of the native call under it (cuda backend) in a tight loop:
an unchanged binding, and one whose last page-table entry changes every call, for tables of 8192
and 32768 pages (128K and 512K tokens in pages of 16) and of 512 (128K in pages of 256). Prints the
mean of 300 calls of each. Needs torch with CUDA and the kvsieve package.

    python tools/device/bind_profile.py
"""
import time

import numpy as np
import torch

import kvsieve


def mean_us(f, reps=300):
    f()
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t0) / reps * 1e6


def main():
    hq, hkv, d = 32, 8, 128
    for P, n in ((16, 131072), (16, 524288), (256, 131072)):
        npages = n // P + 2
        pool = torch.zeros(npages, 2, hkv, P, d, device="cuda", dtype=torch.bfloat16)
        table = np.arange(npages, dtype=np.int32)
        s = kvsieve.Session(1, hq, hkv, d, method="full", backend="cuda", kv_source="caller")
        s.bind_kv(0, pool, table, n)
        h, ptr, nbytes = s._handle(), pool.data_ptr(), pool.numel() * pool.element_size()
        changed = table.copy()

        def native(ids):
            h.bind_kv(0, ptr, npages, P, int(ids.ctypes.data), len(ids), n, 0, nbytes, 0, 0, 0)

        def native_changed():  # the last entry differs every call
            changed[n // P - 1] ^= 1
            native(changed)

        a = mean_us(lambda: s.bind_kv(0, pool, table, n))
        b = mean_us(lambda: native(table))
        c = mean_us(native_changed)
        print(f"P={P} n={n} entries={n // P}: Session.bind_kv {a:.1f} us, native call {b:.1f} us, "
              f"native with the last entry changed {c:.1f} us")
        s.close()
        # vLLM's FlashAttention cache: NHD pages, K and V in two tensors.
        kv_cache = torch.zeros(2, npages, P, hkv, d, device="cuda", dtype=torch.bfloat16)
        s = kvsieve.Session(1, hq, hkv, d, method="full", backend="cuda", kv_source="caller")
        pools = (kv_cache[0], kv_cache[1])
        s.bind_kv(0, pools, table, n, layout="NHD")
        e = mean_us(lambda: s.bind_kv(0, pools, table, n, layout="NHD"))
        print(f"P={P} n={n} NHD, two pools: Session.bind_kv {e:.1f} us")
        s.close()


if __name__ == "__main__":
    main()
