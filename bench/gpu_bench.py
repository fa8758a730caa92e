#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvsieve's whole public decode step against PyTorch's SDPA: one process, the same tensors.

What is timed
  kvsieve: one call of the binding's public decode entry point, Session.decode (kvs_session_decode)
  for B = 1 and kvsieve.decode_batch (kvs_decode_batch) for B > 1: argument checks, planning and
  every launch, enqueued on the current torch stream (passed as stream=).
  peer: torch.nn.functional.scaled_dot_product_attention, one query token, GQA (enable_gqa=True;
  K/V repeated to Hq heads where this torch lacks it), with the first of the cuDNN, flash and
  memory-efficient backends that runs the shape (torch.nn.attention.sdpa_kernel; named in "peer").
  Each timed call is preceded by an L2 flush over max(2 x L2, 256 MiB) (--flush read, the default:
  a read of that buffer, which leaves L2 full of clean lines; --flush write: a write of it, which
  leaves L2 full of dirty lines that the timed call then pays to write back) and a GPU spin of
  about --hide-us microseconds (torch.cuda._sleep; raised for a case whose warm-up calls take longer
  on the host, to 1.5x the slowest of them after the first), so the host's enqueue work is hidden
  behind GPU work and the events time the GPU alone; each call is bracketed by CUDA events on the
  current stream; the calls rotate which goes first; medians over --reps steps after --warmup untimed ones.
  The host time of one kvsieve decode call (time.perf_counter around the call, stream idle before
  it) is reported apart as host_us, and the peer's as peer_host_us.

The tensors
  K and V are one allocation each, [B, N + 1, Hkv, d] (torch.randn, fixed seed). kvsieve's sessions
  (one per sequence, num_layers 1) are prefilled from the views K[b, :N] (C-contiguous: no copy) in
  chunks of --prefill-chunk tokens, with one random query chunk reused, then build_index. The peer
  reads K[:, :N].transpose(1, 2), a [B, Hkv, N, d] view of the same storage. Row N holds the first
  decode step's new token, so the correctness check compares kvsieve and the peer over the same
  N + 1 tokens. Unless --no-peer-bhnd, the peer is also timed on a contiguous [B, Hkv, N, d] copy
  (torch's usual KV-cache layout; peer_bhnd_us), so a layout preference of the peer shows.
  Each kvsieve decode appends its new token (pre-generated, as are the step queries, which both
  sides share), so kvsieve's context grows N+1, N+2, ... up to N + 1 + warmup + reps + host reps,
  while the peer's stays N: under 0.1% more keys at N = 131072, in the peer's favour.

Correctness (once, before timing): for `full`, kvsieve's output must match SDPA's over the same
N + 1 tokens within bf16 rounding (max |diff| <= 2 ulps of the largest output element) and its LSE
torch.logsumexp of the fp32 scores within 1e-3 (both printed); a mismatch is reported as FAIL and
the exit status is 1. For sparse methods the relative error ||o - o_sdpa|| / ||o_sdpa|| is printed
(informational: random data has flat attention).

Usage
  python bench/gpu_bench.py --method M --context N --batch B --budget F --placement cuda [--json PATH]
  python bench/gpu_bench.py [--json PATH]        # the default table (see DEFAULT_METHODS/SHAPES)
  python bench/gpu_bench.py --selftest           # no GPU, no torch: parsing, JSON, table
--method alone runs that method over the default shapes; --context (with --batch) alone runs the
default methods at that shape. A case is skipped, with its reason printed and kept in its row
("skipped"), when kvsieve refuses the session with UNSUPPORTED or the memory would exceed the card.
--placement cpu runs the same steps on the CPU backend with torch's CPU SDPA and wall-clock timing:
a way to test this driver without a GPU, not a benchmark. The kvsieve package is found by a
normal import (PYTHONPATH=build/bindings/python, or an installed wheel).
"""

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass

# The keys every row has (values None where they do not apply); rows may carry more.
ROW_KEYS = ("method", "placement", "context", "batch", "budget", "step_us", "peer", "peer_us",
            "speedup_vs_peer", "host_us", "max_abs_err")
REPORT_KEYS = ("device", "torch", "peer_backend", "rows")

DEFAULT_BUDGET = 0.05
# (method, method params) and (context, batch) of the default table.
DEFAULT_METHODS = (("full", ""), ("exact_topk", ""), ("quest", "page_size=16"), ("streaming", ""), ("csattention", ""))
# Methods whose index build is timed against a causal flash prefill of the same layer's prompt.
TIME_PREFILL = ("csattention", "retroinfer")
DEFAULT_SHAPES = ((131072, 1), (524288, 1), (131072, 8), (8192, 1))

# Peer backends in the order they are tried (name, torch.nn.attention.SDPBackend member); math is
# the last resort so a check still has a reference when none of the fast ones runs.
CUDA_PEERS = (("cudnn", "CUDNN_ATTENTION"), ("flash", "FLASH_ATTENTION"),
              ("efficient", "EFFICIENT_ATTENTION"), ("math", "MATH"))
CPU_PEERS = (("flash", "FLASH_ATTENTION"), ("math", "MATH"))

GIB = 1 << 30
LSE_TOL = 1e-3  # |kvsieve lse - torch.logsumexp of fp32 scores| allowed for `full`
KV_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # --dtype -> the binding's kv_dtype


@dataclass(frozen=True)
class Case:
    method: str
    context: int
    batch: int
    budget: float  # 0 for full
    params: str    # "key=value,..." or ""


class SkipCase(Exception):
    """The case cannot run here; the message says why."""


# ---- command line -------------------------------------------------------------------------------
def build_parser():
    ap = argparse.ArgumentParser(
        prog="gpu_bench.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time kvsieve's public decode step against torch SDPA on the same GPU tensors.",
        epilog=__doc__.split("Usage", 1)[1])
    ap.add_argument("--method", help="kvsieve method (default: the default table's methods)")
    ap.add_argument("--context", type=int, help="prompt tokens N per sequence (default: the default shapes)")
    ap.add_argument("--batch", type=int, help="sequences B (with --context; default 1)")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                    help="fraction of the context attended exactly by sparse methods, (0, 1] (full: 0)")
    ap.add_argument("--params", default="", help="method parameters key=value,... (with --method)")
    ap.add_argument("--placement", default="cuda", choices=("cuda", "hybrid", "cpu"),
                    help="kvsieve backend; cpu = a test of this driver without a GPU, not a benchmark")
    ap.add_argument("--hq", type=int, default=32, help="query heads")
    ap.add_argument("--hkv", type=int, default=8, help="KV heads")
    ap.add_argument("--d", type=int, default=128, help="head dimension")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"), help="q/K/V/output dtype")
    ap.add_argument("--reps", type=int, default=50, help="timed steps of each side")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--host-reps", type=int, default=None, help="calls timed on the host (default: --reps)")
    ap.add_argument("--prefill-chunk", type=int, default=16384, help="tokens per kvsieve prefill call")
    ap.add_argument("--hide-us", type=float, default=200.0,
                    help="GPU spin before each timed call, hiding host enqueue time (0 = flush only)")
    ap.add_argument("--flush", default="read", choices=("read", "write"),
                    help="L2 flush before each timed call: read a large buffer (clean lines left "
                         "behind) or write it (dirty lines left behind, written back during the call)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random tensors")
    ap.add_argument("--device", type=int, default=0, help="CUDA device")
    ap.add_argument("--no-peer-bhnd", action="store_true",
                    help="skip timing the peer on a contiguous [B, Hkv, N, d] copy")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--selftest", action="store_true", help="check parsing, JSON and table; no GPU needed")
    return ap


def parse_args(argv):
    """Parses and checks the command line; errors exit with status 2 (argparse)."""
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.selftest:
        return a
    if a.batch is not None and a.context is None:
        ap.error("--batch needs --context")
    if a.params and not a.method:
        ap.error("--params needs --method")
    if a.context is not None and a.context < 1:
        ap.error("--context must be >= 1")
    if a.batch is not None and a.batch < 1:
        ap.error("--batch must be >= 1")
    if not (0.0 < a.budget <= 1.0):
        ap.error("--budget must be in (0, 1]")
    if min(a.hq, a.hkv, a.d) < 1 or a.hq % a.hkv:
        ap.error("--hq must be a positive multiple of --hkv, and --d positive")
    if a.hide_us < 0:
        ap.error("--hide-us must be >= 0")
    if a.reps < 1 or a.warmup < 0 or a.prefill_chunk < 1 or a.device < 0:
        ap.error("--reps and --prefill-chunk must be >= 1, --warmup and --device >= 0")
    if a.host_reps is None:
        a.host_reps = a.reps
    if a.host_reps < 1:
        ap.error("--host-reps must be >= 1")
    return a


def cases_from_args(a):
    """The cases to run, in order: every (shape, method) pair of the selected shapes and methods."""
    methods = [(a.method, a.params)] if a.method else list(DEFAULT_METHODS)
    shapes = [(a.context, a.batch or 1)] if a.context is not None else list(DEFAULT_SHAPES)
    return [Case(m, n, b, 0.0 if m == "full" else a.budget, p) for n, b in shapes for m, p in methods]


# ---- rows, report, table ------------------------------------------------------------------------
def speedup(peer_us, step_us):
    if peer_us is None or step_us is None or step_us <= 0:
        return None
    return peer_us / step_us


def make_row(case, placement, **fields):
    row = {k: None for k in ROW_KEYS}
    row.update(method=case.method, placement=placement, context=case.context, batch=case.batch,
               budget=case.budget)
    if case.params:
        row["params"] = case.params
    row.update(fields)
    row["speedup_vs_peer"] = speedup(row["peer_us"], row["step_us"])
    if row.get("peer_pinned_us"):
        row["speedup_vs_pinned"] = speedup(row["peer_pinned_us"], row["step_us"])
    return row


def build_report(device, torch_version, rows, extra=None):
    """The JSON document: the fixed keys first, then `extra`."""
    backends = []
    for r in rows:
        name = (r.get("peer") or "").split(":", 1)[-1]
        if name and name not in backends:
            backends.append(name)
    doc = {"device": device, "torch": torch_version,
           "peer_backend": ", ".join(backends) if backends else None, "rows": rows}
    for k, v in (extra or {}).items():
        doc.setdefault(k, v)
    return doc


def write_json(path, doc):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _f(x, spec, suffix=""):
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_table(rows):
    """A markdown table of the rows (medians in microseconds)."""
    head = ["method", "placement", "context", "B", "budget", "kvsieve us", "peer", "peer us",
            "speedup", "host us", "peer host us", "peer us (BHND copy)", "max abs err", "note"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---:" if h not in ("method", "placement", "peer", "note") else "---"
                            for h in head) + "|"]
    for r in rows:
        notes = []
        if r.get("skipped"):
            notes.append("skipped: " + r["skipped"])
        if r.get("error"):
            notes.append("error: " + r["error"])
        if r.get("check") == "FAIL":
            notes.append("CHECK FAILED")
        if r.get("rel_err") is not None and r["method"] != "full":
            notes.append(f"rel err {r['rel_err']:.2e}")
        if r.get("selected_keys") is not None and r["method"] != "full":
            notes.append(f"{r['selected_keys']:.0f} keys/KV head")
        note = "; ".join(notes).replace("|", "/").replace("\n", " ")
        cells = [r["method"], r["placement"], str(r["context"]), str(r["batch"]), _f(r["budget"], "g"),
                 _f(r["step_us"], ".1f"), r["peer"] or "-", _f(r["peer_us"], ".1f"),
                 _f(r["speedup_vs_peer"], ".2f", "x"), _f(r["host_us"], ".1f"),
                 _f(r.get("peer_host_us"), ".1f"), _f(r.get("peer_bhnd_us"), ".1f"),
                 _f(r["max_abs_err"], ".2e"), note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the measurement ----------------------------------------------------------------------------
class _EventPair:
    """Two CUDA events recorded on the current stream: GPU time between start() and stop()."""

    __slots__ = ("a", "b")

    def __init__(self, torch):
        self.a = torch.cuda.Event(enable_timing=True)
        self.b = torch.cuda.Event(enable_timing=True)

    def start(self):
        self.a.record()

    def stop(self):
        self.b.record()

    def us(self):
        return self.a.elapsed_time(self.b) * 1e3


class _ClockPair:
    """Wall-clock time between start() and stop() (--placement cpu: every call is synchronous)."""

    __slots__ = ("a", "b")

    def start(self):
        self.a = time.perf_counter()

    def stop(self):
        self.b = time.perf_counter()

    def us(self):
        return (self.b - self.a) * 1e6


class Env:
    """torch, kvsieve and the device, loaded once; an L2-flush buffer."""

    def __init__(self, args):
        try:
            import torch
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError as e:
            raise SystemExit(f"gpu_bench: PyTorch (with torch.nn.attention) is not importable: {e}. "
                             "Run with the python that has torch >= 2.3.")
        self.torch, self.F, self.sdpa_kernel = torch, F, sdpa_kernel
        self.cuda = args.placement != "cpu"
        if self.cuda:
            if not torch.cuda.is_available():
                raise SystemExit("gpu_bench: torch sees no CUDA device (torch.cuda.is_available() is False; "
                                 f"torch {torch.__version__}, built for CUDA {torch.version.cuda}). "
                                 "--placement cpu tests this driver without one.")
            if args.device >= torch.cuda.device_count():
                raise SystemExit(f"gpu_bench: --device {args.device}: torch sees {torch.cuda.device_count()} "
                                 "CUDA device(s)")
            torch.cuda.set_device(args.device)
            self.device = torch.device("cuda", args.device)
            self.device_name = torch.cuda.get_device_name(self.device)
            props = torch.cuda.get_device_properties(self.device)
            l2 = int(getattr(props, "L2_cache_size", 0) or 0) or (50 << 20)
            self.flush_bytes = max(2 * l2, 256 << 20)
            peers = CUDA_PEERS
        else:
            self.device = torch.device("cpu")
            self.device_name = f"cpu ({platform.processor() or platform.machine()})"
            self.flush_bytes = 64 << 20
            peers = CPU_PEERS
        self.peers = [(n, getattr(SDPBackend, m)) for n, m in peers if hasattr(SDPBackend, m)]
        try:
            import kvsieve
        except ImportError as e:
            raise SystemExit(f"gpu_bench: cannot import kvsieve ({e}); set PYTHONPATH to the built "
                             "package (e.g. PYTHONPATH=build/bindings/python, configured with "
                             "-DKVS_BUILD_PYTHON=ON) or pip install it")
        self.kvsieve = kvsieve
        self.flush_buf = torch.zeros(self.flush_bytes, dtype=torch.uint8, device=self.device)
        self.flush_words = self.flush_buf.view(torch.int64)
        self.flush_mode = args.flush
        self.gqa = self._has_enable_gqa()
        self.spin_cycles, self.flush_us = 0, None
        if self.cuda:
            self.flush_us = self._gpu_us(self.flush)
            sleep = getattr(torch.cuda, "_sleep", None)
            if sleep is not None and args.hide_us > 0:
                us = self._gpu_us(lambda: sleep(1 << 20))
                self.spin_cycles = int((1 << 20) * args.hide_us / us) if us > 0 else 0
                self.cycles_per_us = (1 << 20) / us if us > 0 else 0.0
        self.case_spin_us = args.hide_us if self.spin_cycles else 0.0  # raised per case, see run_case

    def _gpu_us(self, fn, reps=5):
        """Median GPU time of fn() in microseconds (CUDA events)."""
        ts = []
        for _ in range(reps + 1):
            p = _EventPair(self.torch)
            p.start()
            fn()
            p.stop()
            self.torch.cuda.synchronize()
            ts.append(p.us())
        return statistics.median(ts[1:])

    def _has_enable_gqa(self):
        t = self.torch
        q = t.randn(1, 2, 1, 8, device=self.device)
        k = t.randn(1, 1, 4, 8, device=self.device)
        try:
            self.F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
            return True
        except TypeError:
            return False

    def flush(self):
        """Before a timed call: evict L2, then keep the GPU busy while the host enqueues the call."""
        if self.flush_mode == "read":
            self.flush_sink = self.flush_words.sum()  # reads every line; writes one word
        else:
            self.flush_buf.zero_()
        if self.spin_cycles:
            self.torch.cuda._sleep(int(self.case_spin_us * self.cycles_per_us))  # >= --hide-us

    def pair(self):
        return _EventPair(self.torch) if self.cuda else _ClockPair()

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def stream(self):
        return self.torch.cuda.current_stream() if self.cuda else None

    def free_memory(self):
        """(free, total) bytes of the card, or None on the CPU."""
        return self.torch.cuda.mem_get_info(self.device) if self.cuda else None


class Peer:
    """SDPA over one K/V layout with the first backend that runs it."""

    def __init__(self, env, k, v, groups, q_probe, label):
        self.env, self.label = env, label
        if not env.gqa and groups > 1:  # this torch has no enable_gqa: repeat K/V once, outside timing
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        self.k, self.v, self.groups = k, v, groups
        self.kw = {"enable_gqa": True} if env.gqa and groups > 1 else {}
        self.name, self.backend = None, None
        for name, be in env.peers:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with env.sdpa_kernel([be]):
                        env.F.scaled_dot_product_attention(q_probe, self.k, self.v, **self.kw)
                    env.sync()
                self.name = "sdpa:" + name + ("" if env.gqa or groups == 1 else "+repeat_kv")
                self.backend = be
                break
            except RuntimeError as e:
                print(f"    peer ({label}): {name} does not run this shape: {str(e).splitlines()[0][:160]}")
        if self.backend is None:
            raise RuntimeError(f"no SDPA backend runs this shape ({label})")

    def ctx(self):
        return self.env.sdpa_kernel([self.backend])

    def __call__(self, q4):
        return self.env.F.scaled_dot_product_attention(q4, self.k, self.v, **self.kw)


def bf16_like_ulp(x, dtype_name):
    """One ulp of a bf16 (8 significant bits) or fp16 (11) number of magnitude x."""
    bits = 8 if dtype_name == "bf16" else 11
    return 2.0 ** (math.floor(math.log2(x)) - (bits - 1)) if x > 0 else 0.0


def run_case(env, args, case):
    """One case: returns its row (raises SkipCase when it cannot run here)."""
    torch, kvs = env.torch, env.kvsieve
    B, N, hq, hkv, d = case.batch, case.context, args.hq, args.hkv, args.d
    G = hq // hkv
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    es = 2
    S = 1 + args.warmup + args.reps + args.host_reps  # new tokens: check, warm-up, timed, host-timed
    dev = env.device
    backend = "cpu" if args.placement == "cpu" else args.placement
    print(f"== {case.method} context {N} batch {B} budget {case.budget:g}"
          + (f" params {case.params}" if case.params else "") + f" ({args.placement})", flush=True)

    with contextlib.ExitStack() as stack:
        # Sessions first: a refusal (UNSUPPORTED) costs no allocation.
        sessions = []
        try:
            for _ in range(B):
                s = kvs.Session(1, hq, hkv, d, method=case.method, method_params=case.params or None,
                                budget=case.budget or None, kv_dtype=KV_DTYPES[args.dtype], backend=backend,
                                device_id=args.device)
                stack.callback(s.close)
                sessions.append(s)
        except kvs.Error as e:
            if e.code == kvs.STATUS_UNSUPPORTED:
                raise SkipCase(f"kvsieve refuses the session: {e.message}") from None
            raise

        # Memory: the shared K/V, kvsieve's copy (its capacity may round up to 2x), the peer's
        # contiguous copy, the prompt query chunk, and 1 GiB for workspaces and temporaries.
        kv_bytes = 2 * B * (N + 1) * hkv * d * es
        bhnd = not args.no_peer_bhnd
        rep_bytes = 0 if env.gqa or G == 1 else kv_bytes * G
        need = (4 if args.placement == "hybrid" else 3) * kv_bytes + rep_bytes + min(N, args.prefill_chunk) * hq * d * es + GIB
        mem = env.free_memory()
        if mem is not None:
            free, total = mem
            if bhnd and need + kv_bytes * (1 + (G - 1 if rep_bytes else 0)) > free:
                bhnd = False
                print("    (not timing the peer on a [B, Hkv, N, d] copy: not enough free memory)")
            if need > free:
                raise SkipCase(f"needs about {need / GIB:.1f} GiB of GPU memory, {free / GIB:.1f} GiB "
                               f"free of {total / GIB:.1f}")

        # The tensors (fixed seed): K/V with row N = the first step's new token, step inputs.
        gen = torch.Generator(device=dev).manual_seed(args.seed)
        randn = lambda *shape: torch.randn(*shape, generator=gen, device=dev, dtype=dt)  # noqa: E731
        K = randn(B, N + 1, hkv, d)
        V = randn(B, N + 1, hkv, d)
        qs = randn(S, B, hq, d)
        knew = randn(S, B, hkv, d)
        vnew = randn(S, B, hkv, d)
        K[:, N].copy_(knew[0])
        V[:, N].copy_(vnew[0])
        chunk = min(N, args.prefill_chunk)
        qchunk = randn(chunk, hq, d)
        o = torch.empty(B, hq, d, dtype=dt, device=dev)
        lse = torch.empty(B, hq, dtype=torch.float32, device=dev)
        q4 = qs.view(S, B, hq, 1, d)
        stream = env.stream()

        # Prefill from views of K/V (no copy), then the index.
        t0 = time.perf_counter()
        for b, s in enumerate(sessions):
            for c0 in range(0, N, chunk):
                n = min(chunk, N - c0)
                s.prefill(0, qchunk[:n], K[b, c0:c0 + n], V[b, c0:c0 + n], stream=stream)
        env.sync()
        prefill_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        for s in sessions:
            s.build_index(stream=stream)
        env.sync()
        index_ms = (time.perf_counter() - t0) * 1e3
        causal_ms = None
        if case.method in TIME_PREFILL:
            causal_ms = time_causal_prefill(env, K[0, :N], V[0, :N], hq, dt, args.seed)
            print(f"    index build {index_ms:.1f} ms (for {B} session(s)); causal SDPA prefill of one "
                  f"session's {N}-token prompt {causal_ms:.1f} ms", flush=True)

        def kvs_step(j):
            if B == 1:
                sessions[0].decode(0, qs[j, 0], knew[j, 0], vnew[j, 0], out=o[0], lse=lse[0], stream=stream)
            else:
                kvs.decode_batch(sessions, 0, qs[j], knew[j], vnew[j], out=o, lse=lse, stream=stream)

        # The peer over the same storage ([B, Hkv, N, d] views), and optionally a contiguous copy.
        peer = Peer(env, K[:, :N].transpose(1, 2), V[:, :N].transpose(1, 2), G, q4[0], "shared storage")
        # --placement hybrid: also the floor of any offloaded dense method, full attention over the
        # same KV held in pinned host memory: copy it to the GPU (pinned, async), then SDPA over it.
        peer_pin = None
        if args.placement == "hybrid":
            Kh, Vh = K[:, :N].cpu().pin_memory(), V[:, :N].cpu().pin_memory()
            Kd, Vd = torch.empty_like(K[:, :N]), torch.empty_like(V[:, :N])
            pin_sdpa = Peer(env, Kd.transpose(1, 2), Vd.transpose(1, 2), G, q4[0], "pinned host KV")

            def peer_pin(j):
                Kd.copy_(Kh, non_blocking=True)
                Vd.copy_(Vh, non_blocking=True)
                return pin_sdpa(q4[j])
            peer_pin.ctx = pin_sdpa.ctx
            peer_pin.name = "copy pinned KV + " + pin_sdpa.name
        peer_b = None
        if bhnd:
            peer_b = Peer(env, K[:, :N].transpose(1, 2).contiguous(), V[:, :N].transpose(1, 2).contiguous(),
                          G, q4[0], "[B, Hkv, N, d] copy")

        # Correctness, once: step 0 appends row N, so both see the same N + 1 tokens.
        o.fill_(float("nan"))
        kvs_step(0)
        env.sync()
        check_peer = Peer(env, K.transpose(1, 2), V.transpose(1, 2), G, q4[0], "check, N + 1 tokens")
        with check_peer.ctx():
            ref = check_peer(q4[0]).view(B, hq, d).float()
        env.sync()
        check_name = check_peer.name
        del check_peer
        # kvsieve's LSE (natural log) against torch.logsumexp of fp32 scores, one KV head at a time.
        qf = qs[0].float().view(B, hkv, G, d)
        lse_err = 0.0
        for h in range(hkv):
            sc = torch.einsum("bgd,bnd->bgn", qf[:, h], K[:, :, h].float()) / math.sqrt(d)
            lse_err = max(lse_err, (lse.view(B, hkv, G)[:, h] - torch.logsumexp(sc, dim=-1)).abs().max().item())
            del sc
        got = o.float()
        diff = got - ref
        finite = bool(torch.isfinite(got).all())
        max_abs = diff.abs().max().item() if finite else float("inf")
        rel = (diff.norm() / ref.norm()).item() if finite else float("inf")
        scale = ref.abs().max().item()
        if case.method == "full":
            tol = 2.0 * bf16_like_ulp(scale, args.dtype)
            check = "pass" if finite and max_abs <= tol and lse_err <= LSE_TOL else "FAIL"
            print(f"    check full vs {check_name} over {N + 1} tokens: max |diff| {max_abs:.3e} "
                  f"(tolerance {tol:.3e} = 2 ulps of max |o| {scale:.3e}), rel {rel:.3e}; "
                  f"max |lse - logsumexp| {lse_err:.2e} (tolerance {LSE_TOL:g}): {check}")
        else:
            check = "info" if finite else "FAIL"
            print(f"    {case.method} vs {check_name} over {N + 1} tokens (informational): rel error {rel:.3e}, "
                  f"max |diff| {max_abs:.3e}, max |lse - full logsumexp| {lse_err:.2e}"
                  + ("" if finite else " NON-FINITE OUTPUT"))
        del got, diff, ref

        # Timed steps: L2 flush, then one call between two marks; the order rotates every step.
        calls = [("kvsieve", None, kvs_step), ("peer", peer, lambda j: peer(q4[j]))]
        if peer_b is not None:
            calls.append(("peer_bhnd", peer_b, lambda j: peer_b(q4[j])))
        if peer_pin is not None:
            calls.append(("peer_pinned", peer_pin, peer_pin))
        pairs = {name: [env.pair() for _ in range(args.reps)] for name, _, _ in calls}
        phases = ("decode_update_seconds", "decode_select_seconds", "decode_attend_seconds")

        def host_part_s():  # the hybrid placement's CPU time so far (update, search, extra state)
            return sum(s.method_stat(n) for s in sessions for n in phases) if args.placement == "hybrid" else 0.0
        host_part0 = None
        env.case_spin_us = args.hide_us if env.spin_cycles else 0.0
        warm_host = []
        for i in range(args.warmup + args.reps):
            j = 1 + i
            r = i % len(calls)
            if i == args.warmup and warm_host and env.spin_cycles:
                # The spin must outlast the host's enqueue of one call, or the events time host work:
                # raised for this case to 1.5x the slowest warm-up call's host time (less the flush;
                # the first call, which sets things up once, left out).
                slowest = max(warm_host[1:] or warm_host)
                env.case_spin_us = max(args.hide_us, 1.5 * slowest - (env.flush_us or 0.0))
            if i == args.warmup:
                env.sync()
                host_part0 = host_part_s()
            for name, p, fn in calls[r:] + calls[:r]:
                env.flush()
                with (p.ctx() if p is not None else contextlib.nullcontext()):
                    if i >= args.warmup:
                        pr = pairs[name][i - args.warmup]
                        pr.start()
                        fn(j)
                        pr.stop()
                    else:
                        t0 = time.perf_counter()
                        fn(j)
                        if name == "kvsieve":
                            warm_host.append((time.perf_counter() - t0) * 1e6)
        env.sync()
        med = {name: statistics.median(pr.us() for pr in prs) for name, prs in pairs.items()}
        host_part_us = (host_part_s() - host_part0) / args.reps * 1e6 if args.placement == "hybrid" else None

        # Host time of one call, the stream idle before it.
        def host_times(fn, rows):
            ts = []
            for j in rows:
                env.sync()
                t = time.perf_counter()
                fn(j)
                ts.append((time.perf_counter() - t) * 1e6)
            env.sync()
            return statistics.median(ts)

        first = 1 + args.warmup + args.reps
        host_us = host_times(kvs_step, range(first, first + args.host_reps))
        with peer.ctx():
            peer_host_us = host_times(lambda j: peer(q4[j]), range(first, first + args.host_reps))

        hidden = None
        if env.cuda:  # did the GPU work queued before each timed call outlast the host's enqueue?
            ahead = (env.flush_us or 0.0) + env.case_spin_us
            hidden = host_us <= ahead
            if not hidden:
                print(f"    warning: a kvsieve call takes {host_us:.0f} us on the host, more than the "
                      f"{ahead:.0f} us of GPU work queued before it: its event time includes host time "
                      "(raise --hide-us)")
        st = sessions[0].stats
        ctx_end = sessions[0].layer_tokens(0)
        if host_part_us is not None:
            print(f"    host part (update, search, extra state; all sessions) {host_part_us:.1f} us per timed step "
                  "(mean)")
        print(f"    kvsieve {med['kvsieve']:.1f} us, {peer.name} {med['peer']:.1f} us"
              + (f" ({peer_b.name} on a [B, Hkv, N, d] copy {med['peer_bhnd']:.1f} us)" if peer_b else "")
              + (f"; {peer_pin.name} {med['peer_pinned']:.1f} us ({med['peer_pinned'] / med['kvsieve']:.2f}x)"
                 if peer_pin else "")
              + f", host {host_us:.1f} us per kvsieve call ({peer_host_us:.1f} us per SDPA call); "
              f"prefill {prefill_ms:.0f} ms, index {index_ms:.0f} ms; kvsieve context {N + 1}..{ctx_end}",
              flush=True)
        return make_row(case, args.placement, step_us=med["kvsieve"], peer=peer.name, peer_us=med["peer"],
                        host_us=host_us, gpu_spin_us=env.case_spin_us, max_abs_err=max_abs, rel_err=rel,
                        lse_abs_err=lse_err, check=check,
                        peer_host_us=peer_host_us, host_hidden=hidden,
                        peer_bhnd=peer_b.name if peer_b else None,
                        peer_bhnd_us=med.get("peer_bhnd"),
                        peer_pinned=peer_pin.name if peer_pin else None,
                        peer_pinned_us=med.get("peer_pinned"), host_part_us=host_part_us,
                        selected_keys=st.last_selected_keys, kvsieve_context_end=ctx_end,
                        prefill_ms=prefill_ms, index_build_ms=index_ms, causal_prefill_ms=causal_ms)


def time_causal_prefill(env, K, V, hq, dt, seed):
    """Median of 3 timed calls (after one warm-up) of torch's causal SDPA over the layer's prompt:
    queries [1, hq, N, d] (random), keys and values from K, V [N, hkv, d]; the cost an index build is
    judged against (a layer's prefill attention)."""
    torch, F = env.torch, env.F
    N, hkv, d = K.shape
    gen = torch.Generator(device=env.device).manual_seed(seed + 7)
    q = torch.randn(1, hq, N, d, generator=gen, device=env.device, dtype=dt)
    k = K.transpose(0, 1).unsqueeze(0).contiguous()
    v = V.transpose(0, 1).unsqueeze(0).contiguous()
    if not env.gqa and hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    kw = {"is_causal": True, **({"enable_gqa": True} if env.gqa and hq != hkv else {})}
    times = []
    for i in range(4):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        F.scaled_dot_product_attention(q, k, v, **kw)
        b.record()
        b.synchronize()
        if i:
            times.append(a.elapsed_time(b))
    del q, k, v
    return sorted(times)[1]


def run_all(args):
    env = Env(args)
    kvs, torch = env.kvsieve, env.torch
    hide = (f"{env.flush_us:.0f} us " if env.flush_us is not None else "") + \
        f"L2 flush ({env.flush_mode}, {env.flush_bytes >> 20} MiB)"
    hide += f" + {args.hide_us:g} us GPU spin" if env.spin_cycles else " (no GPU spin)" if env.cuda else ""
    print(f"gpu_bench: {env.device_name}, torch {torch.__version__}, kvsieve {kvs.version()}, "
          f"{args.hq} q / {args.hkv} kv heads, d {args.d}, {args.dtype}; medians of {args.reps} steps after "
          f"{args.warmup}; before each timed call: {hide}; enable_gqa "
          f"{'yes' if env.gqa else 'no (K/V repeated)'}", flush=True)
    rows, failed = [], False
    for case in cases_from_args(args):
        try:
            row = run_case(env, args, case)
            failed |= row.get("check") == "FAIL"
        except SkipCase as e:
            print(f"    skipped: {e}")
            row = make_row(case, args.placement, skipped=str(e))
        except Exception as e:  # noqa: BLE001  # one broken case must not lose the table
            oom = isinstance(e, getattr(torch.cuda, "OutOfMemoryError", MemoryError)) or (
                isinstance(e, kvs.Error) and e.code == kvs.STATUS_OUT_OF_MEMORY)
            if oom:
                reason = f"out of memory: {str(e).splitlines()[0][:200]}"
                print(f"    skipped: {reason}")
                row = make_row(case, args.placement, skipped=reason)
            else:
                traceback.print_exc()
                row = make_row(case, args.placement, error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
                failed = True
        rows.append(row)
        gc.collect()
        if env.cuda:
            torch.cuda.empty_cache()
    doc = build_report(env.device_name, torch.__version__, rows, extra={
        "kvsieve": kvs.version(), "placement": args.placement, "dtype": args.dtype,
        "q_heads": args.hq, "kv_heads": args.hkv, "head_dim": args.d, "reps": args.reps,
        "warmup": args.warmup, "host_reps": args.host_reps, "l2_flush_bytes": env.flush_bytes,
        "l2_flush": env.flush_mode,
        "l2_flush_us": env.flush_us, "gpu_spin_us": args.hide_us if env.spin_cycles else 0,
        "enable_gqa": env.gqa})
    print()
    print(format_table(rows))
    if args.json:
        write_json(args.json, doc)
        print(f"wrote {args.json}")
    return 1 if failed else 0


# ---- self-test (no GPU, no torch) ---------------------------------------------------------------
def selftest():
    results = []

    def check(name, ok, detail=""):
        results.append(bool(ok))
        print(f"{'PASS' if ok else 'FAIL'} {name}" + (f" {detail}" if detail else ""))

    def exits(argv):
        """The exit status argparse gives argv (None when it parses)."""
        import io
        err = sys.stderr
        sys.stderr = io.StringIO()
        try:
            parse_args(argv)
            return None
        except SystemExit as e:
            return e.code
        finally:
            sys.stderr = err

    a = parse_args("--method quest --context 4096 --batch 2 --budget 0.1 --placement cuda --params page_size=8".split())
    cs = cases_from_args(a)
    check("single case", cs == [Case("quest", 4096, 2, 0.1, "page_size=8")], repr(cs))
    check("host reps default to reps", a.host_reps == a.reps == 50)
    a = parse_args(["--method", "full", "--context", "8192"])
    check("full has budget 0", cases_from_args(a) == [Case("full", 8192, 1, 0.0, "")])
    cs = cases_from_args(parse_args([]))
    check("default table size", len(cs) == 20, str(len(cs)))
    check("default shapes", sorted({(c.context, c.batch) for c in cs}) ==
          [(8192, 1), (131072, 1), (131072, 8), (524288, 1)])
    check("default budgets", all(c.budget == (0.0 if c.method == "full" else 0.05) for c in cs))
    check("default quest params", {c.params for c in cs if c.method == "quest"} == {"page_size=16"}
          and all(c.params == "" for c in cs if c.method != "quest"))
    check("method over default shapes", len(cases_from_args(parse_args(["--method", "exact_topk"]))) == 4)
    check("shape over default methods",
          [c.method for c in cases_from_args(parse_args(["--context", "1024", "--batch", "3"]))] ==
          ["full", "exact_topk", "quest", "streaming", "csattention"])
    for argv in (["--budget", "0"], ["--budget", "1.5"], ["--context", "0"], ["--batch", "2"],
                 ["--context", "64", "--batch", "0"], ["--hq", "30", "--hkv", "8"], ["--dtype", "f32"],
                 ["--params", "x=1"], ["--placement", "tpu"], ["--reps", "0"], ["--warmup", "-1"],
                 ["--host-reps", "0"], ["--hide-us", "-1"]):
        code = exits(argv)
        check("rejects " + " ".join(argv), code == 2, f"exit {code}")
    check("accepts fp16 and hybrid", exits(["--dtype", "fp16", "--placement", "hybrid"]) is None)

    # Rows and the report on fake numbers.
    ok = make_row(Case("full", 131072, 1, 0.0, ""), "cuda", step_us=141.5, peer="sdpa:cudnn", peer_us=136.6,
                  host_us=22.0, max_abs_err=1.2e-4, rel_err=3e-4, check="pass", peer_bhnd_us=137.0,
                  peer_host_us=30.0)
    sparse = make_row(Case("quest", 131072, 8, 0.05, "page_size=16"), "cuda", step_us=50.0, peer="sdpa:flash",
                      peer_us=900.0, host_us=40.0, max_abs_err=0.2, rel_err=0.8, check="info",
                      selected_keys=6554.0)
    skipped = make_row(Case("streaming", 524288, 1, 0.05, ""), "cuda",
                       skipped="kvsieve refuses the session: the method | has no cuda backend")
    broken = make_row(Case("exact_topk", 8192, 1, 0.05, ""), "cuda", error="RuntimeError: boom")
    rows = [ok, sparse, skipped, broken]
    check("speedup = peer_us / step_us", abs(ok["speedup_vs_peer"] - 136.6 / 141.5) < 1e-12)
    check("no speedup without times", skipped["speedup_vs_peer"] is None and broken["speedup_vs_peer"] is None)
    check("every row has the keys", all(all(k in r for k in ROW_KEYS) for r in rows))
    doc = build_report("NVIDIA H100 80GB HBM3", "2.11.0+cu130", rows, extra={"reps": 50, "device": "ignored"})
    check("report keys first", list(doc)[:4] == list(REPORT_KEYS) and doc["reps"] == 50
          and doc["device"] == "NVIDIA H100 80GB HBM3")
    check("peer_backend lists the backends", doc["peer_backend"] == "cudnn, flash", repr(doc["peer_backend"]))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        write_json(path, doc)
        with open(path) as f:
            back = json.load(f)
    check("JSON round trip", back == doc)
    r0 = back["rows"][0]
    check("JSON row types", isinstance(r0["context"], int) and isinstance(r0["step_us"], float)
          and r0["budget"] == 0 and back["rows"][2]["step_us"] is None and "skipped" in back["rows"][2])
    check("JSON schema (required row keys)",
          all(set(ROW_KEYS) <= set(r) for r in back["rows"]) and set(REPORT_KEYS) <= set(back))
    tab = format_table(rows).splitlines()
    check("table: header, rule, one line per row", len(tab) == 2 + len(rows), str(len(tab)))
    ncol = tab[0].count("|")
    check("table: same column count everywhere", all(line.count("|") == ncol for line in tab),
          str([line.count("|") for line in tab]))
    check("table: numbers", "| 141.5 |" in tab[2] and "| 0.97x |" in tab[2] and "| 18.00x |" in tab[3], tab[2])
    check("table: skip reason kept", "skipped: kvsieve refuses the session" in tab[4] and "-" in tab[4])
    check("table: error and sparse notes", "error: RuntimeError: boom" in tab[5] and "rel err 8.00e-01" in tab[3])
    check("ulp", bf16_like_ulp(1.0, "bf16") == 2 ** -7 and bf16_like_ulp(0.3, "fp16") == 2 ** -12
          and bf16_like_ulp(0.0, "bf16") == 0.0)
    print()
    print(format_table(rows))
    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.selftest:
        return selftest()
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
