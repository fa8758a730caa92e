#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""RetroInfer's wave buffer against its peers, timed in one process on one GPU.

For each context N (one layer, B = 1, bf16, 32 query / 8 KV heads, d 128 by default) four sides
decode the same query sequence over the same keys and values:

  wave      retroinfer on the cuda backend with the KV cache in pinned host memory
            (kv_memory="cuda_host"): the steady zone's pages in GPU memory, a GPU block cache of
            --cache-ratio of the clustered rows, misses read from host memory in place
  all-GPU   retroinfer on the cuda backend with the KV cache in GPU memory (the same budget)
  full/pin  full attention on the cuda backend over the same KV in pinned host memory (every key
            over the bus each step: the floor of an offloaded dense step)
  sdpa      torch's scaled_dot_product_attention (its fastest backend) over the KV in GPU memory

Keys are drawn around --topics random directions (so the clusters mean something) and the decode
queries follow a random walk, q_t = a q_(t-1) + sqrt(1 - a^2) g_t per query head (--locality a),
which gives consecutive steps overlapping clusters as a real model's queries do; a = 0 is the worst
case (no locality). This is a synthetic generator, not a replayed trace: say so when quoting it.

Each side is timed as the whole public step (decode call, every launch, the host's share) over
--steps steps after --warmup, wall clock with one synchronisation at the end, per layer step; the
wave side's block-cache decisions run off the critical path but the layer's next step waits for
them, so they count (with --layers > 1 the other layers' steps run meanwhile, as in a model).
Reported: median over --rounds rounds of us/step, ratios, and the wave session's hit rate and bus
bytes per layer step (its statistics, over every step it ran, warm-up included).

  python bench/wave_bench.py --context 131072 524288 1048576 --json wave.json
"""
import argparse
import json
import math
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--cache-ratio", type=float, default=0.05)
    ap.add_argument("--params", default="", help="more retroinfer parameters, key=value,...")
    ap.add_argument("--locality", type=float, default=0.9, help="query random walk coefficient a in [0, 1)")
    ap.add_argument("--topics", type=int, default=256, help="key directions")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=1,
                    help="layers of the retroinfer sessions (the same K/V in each); times are per layer step. With "
                         "more than one, a layer's host-side cache decision overlaps the other layers' steps, as in "
                         "a model")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--full-steps", type=int, default=3, help="timed steps of full attention over pinned KV")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    import kvsieve as kvs

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    hq, hkv, d, G = args.hq, args.hkv, args.d, args.hq // args.hkv
    dt = torch.bfloat16
    total = args.warmup + args.rounds * args.steps + 2
    rows = []
    print(f"device {name}; torch {torch.__version__}; kvsieve {getattr(kvs, '__version__', '?')}", flush=True)
    for N in args.context:
        gen = torch.Generator(device=dev).manual_seed(args.seed)
        T = N + total
        topics = torch.randn(args.topics, hkv, d, generator=gen, device=dev)
        pick = torch.randint(0, args.topics, (T, hkv), generator=gen, device=dev)
        K = (topics[pick, torch.arange(hkv, device=dev)] * 1.5
             + torch.randn(T, hkv, d, generator=gen, device=dev)).to(dt)
        del pick
        V = torch.randn(T, hkv, d, generator=gen, device=dev, dtype=dt)
        qp = torch.randn(min(N, 16384), hq, d, generator=gen, device=dev, dtype=dt)  # prompt queries (unused by retroinfer)
        # Decode queries: a random walk per query head around the key topics' scale.
        a = args.locality
        qs = torch.empty(total, hq, d, device=dev, dtype=torch.float32)
        x = torch.randn(hq, d, generator=gen, device=dev)
        for t in range(total):
            x = a * x + math.sqrt(1 - a * a) * torch.randn(hq, d, generator=gen, device=dev)
            qs[t] = x * 1.5
        qs = qs.to(dt)

        def make(method, kv_memory, params, layers=1):
            s = kvs.Session(layers, hq, hkv, d, method=method, method_params=params or None,
                            budget=args.budget if method != "full" else None,
                            kv_dtype="bfloat16", backend="cuda", kv_memory=kv_memory)
            for layer in range(layers):
                for c0 in range(0, N, 16384):
                    c1 = min(N, c0 + 16384)
                    s.prefill(layer, qp[: c1 - c0], K[c0:c1], V[c0:c1])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            s.build_index()
            torch.cuda.synchronize()
            return s, time.perf_counter() - t0

        rp = ",".join(x for x in (f"cache_ratio={args.cache_ratio}", args.params) if x)
        print(f"== context {N}: building", flush=True)
        L = args.layers
        wave, wave_build = make("retroinfer", "cuda_host", rp, L)
        gpu, gpu_build = make("retroinfer", "cuda", rp, L)
        full = make("full", "cuda_host", "")[0]
        out = torch.empty(hq, d, device=dev, dtype=dt)
        lse = torch.empty(hq, device=dev, dtype=torch.float32)

        def run(s, j0, n, layers=L):
            for j in range(j0, j0 + n):
                for layer in range(layers):
                    s.decode(layer, qs[j], K[N + j], V[N + j], out=out, lse=lse)

        Kd, Vd = K[: N + 1].transpose(0, 1).unsqueeze(0), V[: N + 1].transpose(0, 1).unsqueeze(0)
        F = torch.nn.functional

        def sdpa(j0, n):
            for j in range(j0, j0 + n):
                F.scaled_dot_product_attention(qs[j].view(1, hq, 1, d), Kd, Vd, enable_gqa=True)

        def timed(fn):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) * 1e6

        # Warm-up (the wave buffer's cache fills), then rounds in rotating order.
        run(wave, 0, args.warmup)
        run(gpu, 0, args.warmup)
        sdpa(0, args.warmup)
        res = {"wave": [], "gpu": [], "sdpa": []}
        j = args.warmup
        for r in range(args.rounds):
            order = ["wave", "gpu", "sdpa"][r % 3:] + ["wave", "gpu", "sdpa"][: r % 3]
            for side in order:
                if side == "wave":
                    res[side].append(timed(lambda: run(wave, j, args.steps)) / (args.steps * L))
                elif side == "gpu":
                    res[side].append(timed(lambda: run(gpu, j, args.steps)) / (args.steps * L))
                else:
                    res[side].append(timed(lambda: sdpa(j, args.steps)) / args.steps)
            j += args.steps
        full_us = timed(lambda: run(full, 0, args.full_steps, 1)) / args.full_steps
        med = {k: statistics.median(v) for k, v in res.items()}
        hit = wave.method_stat("wave_hit_rate")
        bus = wave.method_stat("wave_pcie_bytes")
        cache = wave.method_stat("wave_cache_bytes")
        host_us = wave.method_stat("wave_host_seconds") * 1e6
        row = dict(device=name, context=N, batch=1, layers=L, budget=args.budget, cache_ratio=args.cache_ratio,
                   locality=args.locality, params=rp, wave_us=med["wave"], all_gpu_us=med["gpu"],
                   sdpa_us=med["sdpa"], full_pinned_us=full_us, wave_vs_full_pinned=full_us / med["wave"],
                   wave_vs_all_gpu=med["wave"] / med["gpu"], all_gpu_vs_sdpa=med["sdpa"] / med["gpu"],
                   hit_rate=hit, bus_bytes_per_layer_step=bus, cache_bytes=cache, host_lru_us=host_us,
                   build_s_wave=wave_build, build_s_all_gpu=gpu_build, rounds=res)
        rows.append(row)
        print(f"   wave {med['wave']:.1f} us/step; all-GPU {med['gpu']:.1f}; sdpa {med['sdpa']:.1f}; "
              f"full over pinned KV {full_us:.1f}  ->  wave {full_us / med['wave']:.1f}x faster than full/pinned, "
              f"{med['wave'] / med['gpu']:.2f}x the all-GPU step; hit rate {hit:.3f}, "
              f"{bus / 1e6:.2f} MB over the bus per layer step, cache {cache / 2**20:.0f} MiB, host LRU {host_us:.0f} us/step; "
              f"build {wave_build:.2f} s (pinned) / {gpu_build:.2f} s (GPU)", flush=True)
        for s in (wave, gpu, full):
            s.close()
        del K, V, Kd, Vd, qs, qp, topics
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
