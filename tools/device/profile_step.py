#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where the GPU time of one kvsieve decode step goes: torch.profiler (CUPTI) over a few steps.

For each case (method:context:batch:budget[:method_params]), sessions are prefilled with random bf16 data
(32 query / 8 KV heads, d 128, one layer), then --steps decode steps run back to back behind a GPU
spin (so the host's enqueue is hidden) and are profiled. Prints, per case: every kernel and copy
with its median GPU duration per step, their sum, and the median span of a step (first start to
last end on the GPU), so the gap between the sum and the span is launch latency and idle time.
--timeline adds the kernels of the median-span step with their start and end relative to its first
start (overlaps and gaps show there). --ncu runs the steps without torch.profiler inside an NVTX
range named kvs_steps, for Nsight Compute:

  ncu --nvtx --nvtx-include "kvs_steps/" --clock-control none --section SpeedOfLight \
      python tools/device/profile_step.py quest:131072:1:0.05 --steps 2 --ncu

  python tools/device/profile_step.py quest:131072:1:0.05:page_size=16 exact_topk:131072:1:0.05 full:8192:1:0
Needs torch with CUDA and the kvsieve binding on PYTHONPATH (tools/device/gpu_check.sh STEPS=profile).
"""
import argparse
import statistics
import sys


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-api", action="store_true", help="kvs_batch_plan + kvs_batch_decode per step")
    ap.add_argument("--timeline", action="store_true", help="print the median-span step's kernels with start/end")
    ap.add_argument("--ncu", action="store_true", help="no profiler: the steps inside an NVTX range kvs_steps")
    ap.add_argument("--locality", type=float, default=0.0,
                    help="decode queries as a random walk with this coefficient (0: independent)")
    ap.add_argument("--kv-memory", default="default", choices=("default", "cuda", "cuda_host"),
                    help="cuda_host: the KV cache in pinned host memory (retroinfer's wave buffer)")
    ap.add_argument("--placement", default="cuda", choices=("cuda", "hybrid"),
                    help="hybrid: the gaps of a step's span are its host part (the CPU's search)")
    a = ap.parse_args(argv)
    import torch
    import kvsieve as kvs
    from torch.profiler import profile, ProfilerActivity

    hq, hkv, d = 32, 8, 128
    dev = torch.device("cuda", 0)
    stream = torch.cuda.current_stream().cuda_stream
    for case in a.cases:
        m, n, b, f, *params = case.split(":")
        N, B, F = int(n), int(b), float(f)
        ss = [kvs.Session(1, hq, hkv, d, method=m, budget=F or None, kv_dtype="bf16", backend=a.placement,
                          method_params=params[0] if params else None, kv_memory=a.kv_memory)
              for _ in range(B)]
        g = torch.Generator(device=dev).manual_seed(1)
        rnd = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=torch.bfloat16)  # noqa: E731
        chunk = min(N, 16384)
        qc = rnd(chunk, hq, d)
        for s in ss:
            for c0 in range(0, N, chunk):
                k = rnd(min(chunk, N - c0), hkv, d)
                s.prefill(0, qc[:k.shape[0]], k, rnd(*k.shape), stream=stream)
            s.build_index(stream=stream)
        S = a.steps + 5
        qs, ks, vs = rnd(S, B, hq, d), rnd(S, B, hkv, d), rnd(S, B, hkv, d)
        if a.locality > 0:  # decode queries as a random walk q_t = a q_(t-1) + sqrt(1 - a^2) g_t
            for j in range(1, S):
                qs[j] = (a.locality * qs[j - 1].float() + (1 - a.locality ** 2) ** 0.5 * qs[j].float()).to(qs.dtype)
        o = torch.empty(B, hq, d, dtype=torch.bfloat16, device=dev)
        lse = torch.empty(B, hq, dtype=torch.float32, device=dev)
        batch = kvs.Batch(ss) if a.batch_api else None

        def step(j):
            if batch is not None:
                batch.plan(stream=stream)
                batch.decode(0, qs[j], ks[j], vs[j], out=o, lse=lse, stream=stream)
            elif B == 1:
                ss[0].decode(0, qs[j, 0], ks[j, 0], vs[j, 0], out=o[0], lse=lse[0], stream=stream)
            else:
                kvs.decode_batch(ss, 0, qs[j], ks[j], vs[j], out=o, lse=lse, stream=stream)

        for j in range(5):
            step(j)
        torch.cuda.synchronize()
        if a.ncu:
            torch.cuda.nvtx.range_push("kvs_steps")
            for j in range(5, S):
                step(j)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            print(f"== {case}: {a.steps} steps in the NVTX range kvs_steps")
            for s in ss:
                s.close()
            del batch
            continue
        marks = []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for j in range(5, S):
                torch.cuda._sleep(2_000_000)  # ~1 ms of GPU spin: the enqueue runs ahead
                marks.append(j)
                step(j)
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
        evs.sort(key=lambda e: e.time_range.start)
        # Steps: split at the spin kernels.
        steps, cur = [], None
        for e in evs:
            if "sleep" in e.name or "spin" in e.name:
                if cur:
                    steps.append(cur)
                cur = []
            elif cur is not None:
                cur.append(e)
        if cur:
            steps.append(cur)
        per = {}
        spans, sums = [], []
        for st in steps:
            if not st:
                continue
            spans.append(st[-1].time_range.end - st[0].time_range.start)
            sums.append(sum(e.time_range.end - e.time_range.start for e in st))
            seen = {}
            for e in st:
                seen[e.name] = seen.get(e.name, 0) + (e.time_range.end - e.time_range.start)
            for k_, v_ in seen.items():
                per.setdefault(k_, []).append(v_)
        print(f"== {case} ({'batch api' if batch else 'decode'}; {len(steps)} steps; {torch.cuda.get_device_name()})")
        for k_, v_ in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"   {statistics.median(v_):8.1f} us  x{len(v_):3d}  {k_[:110]}")
        print(f"   sum of kernels {statistics.median(sums):.1f} us, step span {statistics.median(spans):.1f} us")
        if a.timeline and spans:
            med = sorted(range(len(spans)), key=lambda i: spans[i])[len(spans) // 2]
            st = [x for x in steps if x][med]
            t0 = st[0].time_range.start
            print(f"   timeline of the median step (span {spans[med]:.1f} us): start..end us, kernel")
            for e in st:
                print(f"   {e.time_range.start - t0:7.1f}..{e.time_range.end - t0:7.1f}  {e.name[:100]}")
        for s in ss:
            s.close()
        del batch


if __name__ == "__main__":
    main(sys.argv[1:])
