# SPDX-License-Identifier: Apache-2.0
# Reproduces the GPU machine's crash of a GEMM-using method's index build inside Python (see
# docs/bindings.md, "Known problem there"): PYTHONPATH=build-gpu/bindings/python python3 csa_repro.py
import numpy as np, kvsieve
L, HQ, HKV, D, N = 2, 4, 2, 32, 384
rng = np.random.default_rng(1234)
def rand(*s): return rng.standard_normal(s).astype(np.float32)
for budget in (1.0, 0.1):
    with kvsieve.Session(L, HQ, HKV, D, method="csattention", budget=budget, kv_dtype="float32", num_threads=2) as s:
        q, k, v = rand(N, HQ, D), rand(N, HKV, D), rand(N, HKV, D)
        for layer in range(L): s.prefill(layer, q, k, v)
        s.build_index()
        for step in range(3):
            for layer in range(L): s.decode(layer, rand(HQ, D), rand(HKV, D), rand(HKV, D))
    print("ok", budget)
