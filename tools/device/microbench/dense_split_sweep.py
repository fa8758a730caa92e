#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The dense decode kernels (with their chunk merge) against cuDNN SDPA for each kernel variant
(detail::set_variant) and fewest keys per split (detail::set_min_chunk), one sequence, 32 query / 8
KV heads, d 128, bf16, pages of 256, at 8K to 128K tokens; timings and data as in
bench/cuda_sdpa_compare.py (a 256 MiB L2-flushing write before each call).

  tools/device/cuda_check.sh builds the shim (STEPS=build): then
  python3 tools/device/microbench/dense_split_sweep.py .cudabuild/libkvs_cuda_bench.so
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench"))
import cuda_sdpa_compare as C  # noqa: E402


def main():
    lib = C.load_lib(sys.argv[1])
    B, Hq, Hkv, D = 1, 32, 8, 128
    scale = 1 / math.sqrt(D)
    print(torch.cuda.get_device_name())
    for N in (8192, 16384, 32768, 131072):
        torch.manual_seed(N)
        q = (torch.rand(B, Hq, D, device="cuda") * 4 - 2).to(torch.bfloat16)
        k = (torch.rand(B, Hkv, N, D, device="cuda") * 2 - 1).to(torch.bfloat16)
        v = (torch.rand(B, Hkv, N, D, device="cuda") * 2 - 1).to(torch.bfloat16)
        lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
        o = torch.empty(B, Hq, D, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(B, Hq, dtype=torch.float32, device="cuda")
        st = torch.cuda.current_stream().cuda_stream
        sd = C.time_sdpa(q.view(B, Hq, 1, D), k, v, scale, 60)
        print(f"N={N} sdpa " + " ".join(f"{n} {t:.1f}" for n, t, _ in sd))
        pg = C.Paged(k, v, 256)
        for var in (0, 1, 2, 3):
            for mc in (0, 256, 512, 1024, 2048):
                lib.kvsb_set_variant(var)
                lib.kvsb_set_min_chunk(mc)
                wsb = lib.kvsb_dense_ws(B, Hq, Hkv, D, N)
                ws = torch.empty(max(wsb, 1), dtype=torch.uint8, device="cuda")
                ns = lib.kvsb_num_splits(B, Hq, Hkv, D, N, C.BF16)

                def fn():
                    C.check(lib, lib.kvsb_dense(B, Hq, Hkv, D, scale, C.BF16, C.BF16, C.BF16, q.data_ptr(),
                                                pg.table.data_ptr(), pg.max_pages, 256, lens.data_ptr(), N,
                                                o.data_ptr(), lse.data_ptr(), ws.data_ptr(), wsb, st), "dense")
                med, lo, _ = C.bench(fn, reps=60)
                err = C.rel_err(o, sd[0][2].view(B, Hq, D))
                print(f"  variant {var} min_chunk {mc} splits {ns}: {med:.1f} us (min {lo:.1f}) rel err {err:.1e}")
        lib.kvsb_set_variant(0)
        lib.kvsb_set_min_chunk(0)
        del pg, k, v


if __name__ == "__main__":
    main()
