#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""End-to-end accuracy of sparse attention on a real model: how much does method X at budget B
change stories260K?

The model (Karpathy's stories260K, a trained Llama-2 of 5 layers, 8 query / 4 KV heads, head dim 8,
context 512) runs in NumPy (tools/traces/stories260k.py: embeddings, RMSNorm, projections, RoPE,
SwiGLU, logits, in float64); every attention goes through a kvsieve.Session: the prompt's through
Session.prefill(out=...), every later token's through Session.decode, for every layer.

Per (method, budget) it reports, on one text (docs/accuracy.md defines each figure):
  nll                 mean NLL (nats/token) of the N continuation tokens under teacher forcing; each
                      is predicted by the logits of one decode step
  delta_nll_vs_full   nll - nll of `full` through kvsieve (same session code, dense)
  delta_nll_vs_ref    nll - nll of the pure-NumPy float64 model (no kvsieve)
  delta_nll_stderr    standard error of delta_nll_vs_full (per-token paired differences)
  kl_vs_full          mean KL(full || method) of the next-token distributions, teacher-forced
  greedy_agreement    fraction of the N decode steps whose top-1 token equals full's greedy
                      continuation, the method teacher-forced on that continuation
  first_divergence    first step at which the method's own free-running greedy decoding leaves
                      full's (N when it never does); equals the first disagreement above
  kept_fraction       mean over decode steps and layers of the exact keys attended / context
                      (Session.stats.last_selected_fraction after every decode call)

  kvsieve_e2e.py [--text FILE | --story] [--prompt 256] [--continuation 255] [--windows 1]
                 [--methods all] [--budgets 0.01,0.02,0.05,0.10,0.20] [--params m:k=v,...]
                 [--json FILE]

Needs the kvsieve Python package on PYTHONPATH (<build>/bindings/python) and NumPy.
"""
import argparse
import json
import math
import os
import re
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
sys.path.insert(0, os.path.join(_REPO, "tools", "traces"))
import stories260k  # noqa: E402  (the model, tokenizer and reference forward)

DEFAULT_BUDGETS = (0.01, 0.02, 0.05, 0.10, 0.20)
STORY_SEED, STORY_TEMPERATURE = 42, 1.0  # the stories260k-gen trace's sample (docs/real-traces.md)

# Parameters for a 512-token, head-dim-8 model, applied unless --no-presets (docs/accuracy.md says
# why each; --params adds to or overrides them):
PRESETS = {
    # ctkvr's default static set (4 sinks + 64 local) is the whole budget at 512 tokens: it would
    # be streaming. 1 + 1 is the best setting of docs/methods/ctkvr.md on these traces.
    "ctkvr": "sinks=1,local=1",
    # lfps forces 4 sink keys; at 1% (about 4 keys) they are the whole selection, not even the
    # current token is attended: 1 sink, as for ctkvr. alpha_scale 60 is lfps's calibration for
    # these 512-token traces (the library default, 600, is calibrated at 4K; docs/methods/lfps.md).
    "lfps": "sinks=1,alpha_scale=60",
    # retroinfer's default steady zone (4 + 64, and no index below 1024 tokens) would make the trace
    # streaming; index_min=0: indexed from update_segment tokens, as the authors do;
    # the session budget, a small window and small clusters, as docs/methods/retroinfer.md.
    "retroinfer": "budget=session,local=4,update_segment=16,index_min=0,cluster_size=4",
    # hgca has no budget: the session budget sizes its window (at least 2 blocks); blocks of 4
    # tokens let the window follow the budget down to 8 tokens. beta stays at the paper's 1.
    "hgca": "block_size=4",
}


class Error(Exception):
    """A bad argument or input: printed as one line, exit status 2."""


# ------------------------------------------------------------------------------------------------
# kvsieve as the model's attention

class SessionAttention:
    """The attend(layer, q, k, v) callback of stories260k.Model.forward over a kvsieve.Session.

    In prefill mode a chunk goes to Session.prefill(out=...) (exact causal attention over the
    prompt); after build_index() every call is one token through Session.decode."""

    def __init__(self, model, method, budget=None, params=None, kv_dtype="float32", threads=1):
        import kvsieve
        self.model = model
        self.session = kvsieve.Session(
            model.n_layers, model.n_heads, model.n_kv_heads, model.head_dim, method=method,
            method_params=params or None, budget=budget, kv_dtype=kv_dtype, num_threads=threads,
            softmax_scale=1.0 / math.sqrt(model.head_dim))
        self.decoding = False
        self.kept = []  # Session.stats.last_selected_fraction after each decode call

    def __call__(self, layer, q, k, v):
        q = np.ascontiguousarray(q, dtype=np.float32)
        k = np.ascontiguousarray(k, dtype=np.float32)
        v = np.ascontiguousarray(v, dtype=np.float32)
        if not self.decoding:
            out = np.empty(q.shape, dtype=np.float32)
            self.session.prefill(layer, q, k, v, out=out)
            return out
        if q.shape[0] != 1:
            raise ValueError("decode: one token at a time, got %d" % q.shape[0])
        out, _ = self.session.decode(layer, q[0], k[0], v[0])
        self.kept.append(self.session.stats.last_selected_fraction)
        return out[None]

    def start(self, prompt):
        """Prefills the prompt (every layer) and builds the index. Returns (prompt logits, cache)."""
        cache = self.model.new_cache()
        logits = self.model.forward(prompt, cache=cache, attend=self)
        self.session.build_index()
        self.decoding = True
        return logits, cache

    def step(self, cache, token):
        """One token through every layer (one decode call per layer). Returns its logits [V]."""
        return self.model.forward([token], cache=cache, attend=self)[-1]

    def close(self):
        self.session.close()


def log_softmax(z):
    z = np.asarray(z, dtype=np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))


def teacher_forced(att, prompt, feed):
    """Prefills prompt, then feeds each token of feed through one decode step. Returns the prompt's
    last logits [V] and the decode steps' logits [len(feed), V]."""
    plog, cache = att.start(prompt)
    out = np.empty((len(feed), att.model.vocab_size))
    for i, t in enumerate(feed):
        out[i] = att.step(cache, int(t))
    return plog[-1], out


def greedy(att, prompt, n):
    """Free-running greedy decoding: n + 1 tokens after prompt (the first from the prompt's last
    logits, the others from n decode steps)."""
    plog, cache = att.start(prompt)
    toks = [int(np.argmax(plog[-1]))]
    for _ in range(n):
        toks.append(int(np.argmax(att.step(cache, toks[-1]))))
    return toks


# ------------------------------------------------------------------------------------------------
# The measurement

def token_nll(logits, targets):
    """-log p(target) of each row of logits (natural log)."""
    lp = log_softmax(logits)
    return -lp[np.arange(len(targets)), np.asarray(targets)]


def continuation_nll(logits, targets):
    """Mean -log p(target) over rows of logits (natural log)."""
    return float(np.mean(token_nll(logits, targets)))


class Reference:
    """What every method is compared with, computed once per text: the NumPy float64 model and
    `full` through kvsieve."""

    def __init__(self, model, ids, prompt_len, n, kv_dtype="float32", threads=1):
        self.model, self.ids, self.P, self.N = model, list(ids), prompt_len, n
        self.kv_dtype, self.threads = kv_dtype, threads
        prompt, feed, targets = self.split(self.ids)
        # NumPy float64, no kvsieve: one causal pass over the whole sequence.
        ref_logits = model.forward(self.ids[:self.P + self.N])[self.P:]
        self.ref_nll = continuation_nll(ref_logits, targets)
        self.ref_greedy = stories260k.generate(model, prompt, self.N + 1, temperature=0)[self.P:]
        # full through kvsieve: teacher-forced logits and its greedy continuation.
        t0 = time.perf_counter()
        att = SessionAttention(model, "full", None, None, kv_dtype, threads)
        _, self.full_logits = teacher_forced(att, prompt, feed)
        att.close()
        self.full_token_nll = token_nll(self.full_logits, targets)
        self.full_nll = float(np.mean(self.full_token_nll))
        att = SessionAttention(model, "full", None, None, kv_dtype, threads)
        self.full_greedy = greedy(att, prompt, self.N)  # y_P .. y_{P+N}
        att.close()
        self.full_seconds = time.perf_counter() - t0
        self.full_vs_ref_max_logit_diff = float(np.max(np.abs(self.full_logits - ref_logits)))

    def split(self, ids):
        """prompt x_0..x_{P-1}; decode feed x_P..x_{P+N-1}; targets x_{P+1}..x_{P+N}."""
        return ids[:self.P], ids[self.P:self.P + self.N], ids[self.P + 1:self.P + self.N + 1]

    def measure(self, method, budget, params, progress=None):
        """One (method, budget): teacher-forced NLL on the text, then teacher-forced top-1
        agreement on full's greedy continuation (whose first miss is where free-running greedy
        decoding diverges: until then both runs see the same tokens)."""
        t0 = time.perf_counter()
        prompt, feed, targets = self.split(self.ids)
        att = SessionAttention(self.model, method, budget, params, self.kv_dtype, self.threads)
        try:
            _, logits = teacher_forced(att, prompt, feed)
            if progress:
                progress(0.5)
            kept_tf = att.kept
        finally:
            att.close()
        tok_nll = token_nll(logits, targets)
        nll = float(np.mean(tok_nll))
        # Standard error of the paired per-token difference: how much of the delta one text of
        # N tokens can resolve.
        diff = tok_nll - self.full_token_nll
        stderr = float(np.std(diff, ddof=1) / math.sqrt(diff.size)) if diff.size > 1 else None
        lp, lq = log_softmax(self.full_logits), log_softmax(logits)
        kl = float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))

        att = SessionAttention(self.model, method, budget, params, self.kv_dtype, self.threads)
        try:
            _, glogits = teacher_forced(att, prompt, self.full_greedy[:self.N])
        finally:
            att.close()
        top1 = np.argmax(glogits, axis=-1)
        match = top1 == np.asarray(self.full_greedy[1:self.N + 1])
        miss = np.flatnonzero(~match)
        return {
            "method": method, "budget": budget, "params": params or "",
            "kept_fraction": float(np.mean(kept_tf)) if kept_tf else None,
            "nll": nll,
            "delta_nll_vs_full": nll - self.full_nll,
            "delta_nll_vs_ref": nll - self.ref_nll,
            "delta_nll_stderr": stderr,
            "kl_vs_full": kl,
            "greedy_agreement": float(np.mean(match)),
            "first_divergence": int(miss[0]) if miss.size else self.N,
            "seconds": time.perf_counter() - t0,
            "_tok_nll": tok_nll,
        }


def measure_windows(refs, method, budget, params, progress=None):
    """One (method, budget) over every window: per-token figures pooled over all scored tokens
    (nll, its deltas, KL, greedy agreement: the windows have equal length), kept fraction and
    first divergence per window (first_divergence: the median, rounded down)."""
    rows = []
    for w, ref in enumerate(refs):
        sub = (lambda f, w=w: progress((w + f) / len(refs))) if progress else None
        rows.append(ref.measure(method, budget, params, progress=sub))
        if progress:
            progress((w + 1) / len(refs))
    if len(rows) == 1:
        r = dict(rows[0])
        del r["_tok_nll"]
        return r
    tok = np.concatenate([r["_tok_nll"] for r in rows])
    full = np.concatenate([ref.full_token_nll for ref in refs])
    diff = tok - full
    nll = float(np.mean(tok))
    firsts = [r["first_divergence"] for r in rows]
    kept = [r["kept_fraction"] for r in rows]
    return {
        "method": method, "budget": budget, "params": params or "",
        "kept_fraction": float(np.mean(kept)) if None not in kept else None,
        "nll": nll,
        "delta_nll_vs_full": nll - float(np.mean(full)),
        "delta_nll_vs_ref": nll - float(np.mean([ref.ref_nll for ref in refs])),
        "delta_nll_stderr": float(np.std(diff, ddof=1) / math.sqrt(diff.size)),
        "kl_vs_full": float(np.mean([r["kl_vs_full"] for r in rows])),
        "greedy_agreement": float(np.mean([r["greedy_agreement"] for r in rows])),
        "first_divergence": int(np.floor(np.median(firsts))),
        "first_divergence_per_window": firsts,
        "delta_nll_per_window": [r["delta_nll_vs_full"] for r in rows],
        "seconds": float(sum(r["seconds"] for r in rows)),
    }


# ------------------------------------------------------------------------------------------------
# Command line

def parse_budgets(text):
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            b = float(item)
        except ValueError:
            raise Error("--budgets: %r is not a number (expected fractions in (0, 1], e.g. "
                        "0.01,0.05)" % item)
        if not 0.0 < b <= 1.0 or not math.isfinite(b):
            raise Error("--budgets: %g is outside (0, 1] (a budget is the fraction of the "
                        "context attended exactly)" % b)
        out.append(b)
    if not out:
        raise Error("--budgets: expected at least one budget")
    return out


def parse_methods(text, registered):
    names = []
    for item in text.split(","):
        item = item.strip()
        if item == "all":
            names.extend(registered)
        elif item in registered:
            names.append(item)
        else:
            raise Error("--methods: unknown method %r (available: %s, or all)"
                        % (item, ", ".join(registered)))
    seen = set()
    return [m for m in names if not (m in seen or seen.add(m))]


def parse_params(items, registered):
    """`method:key=value,key=value,other:key=value` (repeatable; items without `method:` continue
    the previous method), as `kvsieve eval --params`."""
    out = {}
    for arg in items:
        cur = None
        for item in arg.split(","):
            item = item.strip()
            if not item:
                continue
            if ":" in item.split("=", 1)[0]:
                cur, item = item.split(":", 1)
                if cur not in registered:
                    raise Error("--params: unknown method %r in %r (available: %s)"
                                % (cur, arg, ", ".join(registered)))
            if cur is None:
                raise Error("--params: %r names no method (expected method:key=value)" % arg)
            if "=" not in item or not item.split("=", 1)[0]:
                raise Error("--params: %r is not key=value (in %r)" % (item, arg))
            out.setdefault(cur, []).append(item)
    return {m: ",".join(v) for m, v in out.items()}


def merge_params(preset, extra):
    """preset and extra as key=value lists; extra wins."""
    kv = {}
    for s in (preset, extra):
        for item in (s or "").split(","):
            if item:
                k, v = item.split("=", 1)
                kv[k] = v
    return ",".join("%s=%s" % kv_ for kv_ in kv.items())


class Progress:
    """A one-line progress indication on stderr, only when it is a terminal."""

    def __init__(self, total, enabled):
        self.total, self.done = total, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def show(self, label, frac=0.0):
        if self.enabled:
            pos = self.done + frac
            width = 30
            fill = int(width * pos / max(self.total, 1))
            sys.stderr.write("\r\x1b[K[%s%s] %d/%d %s %.0fs" % (
                "#" * fill, "." * (width - fill), self.done, self.total, label,
                time.perf_counter() - self.t0))
            sys.stderr.flush()

    def advance(self):
        self.done += 1

    def close(self):
        if self.enabled:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def load_windows(args, model, tok, per):
    """The token windows to score, each BOS + per - 1 tokens. --text: consecutive windows of the
    encoded text (window k = BOS + tokens [1 + k (per - 1), 1 + (k + 1)(per - 1))); --story: one
    sampled story per seed, seed, seed + 1, ..."""
    K = args.windows
    if args.text:
        if not os.path.isfile(args.text):
            raise Error("--text: no such file: %s" % args.text)
        ids = tok.encode(stories260k.read_text(args.text))
        need = 1 + K * (per - 1)
        if len(ids) < need:
            raise Error("--text: %s has %d tokens (BOS included); --windows %d of --prompt %d + "
                        "--continuation %d + 1 need %d" % (args.text, len(ids), K, args.prompt,
                                                           args.continuation, need))
        wins = [[stories260k.BOS] + ids[1 + k * (per - 1):1 + (k + 1) * (per - 1)]
                for k in range(K)]
        name = args.text_name or os.path.basename(args.text)
        if K > 1:
            name += " (%d consecutive windows of %d tokens after BOS)" % (K, per - 1)
        return wins, name
    wins = [stories260k.generate(model, [stories260k.BOS], per - 1, temperature=args.temperature,
                                 seed=args.seed + k) for k in range(K)]
    seeds = ("seed %d" % args.seed) if K == 1 else ("seeds %d-%d" % (args.seed, args.seed + K - 1))
    name = args.text_name or ("stories260K's own stor%s (BOS + %d tokens sampled, NumPy PCG64 %s, "
                              "temperature %g)" % ("y" if K == 1 else "ies", per - 1, seeds,
                                                   args.temperature))
    return wins, name


def format_table(doc):
    lines = []
    lines.append("%s; text: %s" % (doc["model"], doc["text"]))
    lines.append("%sprompt %d tokens, %d teacher-forced decode steps; NLL nats/token: NumPy "
                 "float64 reference %.5f, full through kvsieve %.5f (greedy %s the reference's)" % (
                     "%d windows, each: " % doc["windows"] if doc["windows"] > 1 else "",
                     doc["prompt_tokens"], doc["continuation_tokens"], doc["reference_nll"],
                     doc["full_nll"], "equals" if doc["full_greedy_equals_reference"]
                     else "differs from"))
    lines.append("")
    hdr = ("%-12s %7s %7s %8s %9s %7s %9s %8s %7s %6s  %s" % (
        "method", "budget", "kept", "nll", "dnll/full", "+-se", "dnll/ref", "KL/full", "greedy",
        "1stdiv", "params"))
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for r in doc["results"]:
        kept = "%6.1f%%" % (100 * r["kept_fraction"]) if r["kept_fraction"] is not None else "    n/a"
        se = "%7.4f" % r["delta_nll_stderr"] if r["delta_nll_stderr"] is not None else "    n/a"
        lines.append("%-12s %7.3g %7s %8.4f %+9.4f %7s %+9.4f %8.4f %6.1f%% %6d  %s" % (
            r["method"], r["budget"], kept, r["nll"], r["delta_nll_vs_full"], se,
            r["delta_nll_vs_ref"], r["kl_vs_full"], 100 * r["greedy_agreement"],
            r["first_divergence"], r["params"]))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="kvsieve_e2e.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="folder with stories260K.bin and tok512.bin (default: "
                    "$KVS_STORIES260K_DIR, else shared/data/stories260K)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--text", metavar="FILE", help="UTF-8 text, encoded after BOS and "
                     "teacher-forced (e.g. traces/kjv-genesis-1-2.txt, made by tools/traces/make_stories260k_traces.sh)")
    src.add_argument("--story", action="store_true", help="the model's own sampled story "
                     "(the default; --seed, --temperature)")
    ap.add_argument("--text-name", help="name of the text in the output (default: the file name)")
    ap.add_argument("--seed", type=int, default=STORY_SEED, help="--story sampling seed (%(default)s)")
    ap.add_argument("--temperature", type=float, default=STORY_TEMPERATURE,
                    help="--story sampling temperature (%(default)s)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens, BOS included, "
                    "prefilled (%(default)s)")
    ap.add_argument("--continuation", type=int, default=255, help="decode steps = scored tokens "
                    "(%(default)s; prompt + continuation + 1 <= the context, 512)")
    ap.add_argument("--windows", type=int, default=1, help="score this many windows and pool "
                    "them (--text: consecutive windows of the text; --story: seeds seed, seed+1, "
                    "...; default %(default)s)")
    ap.add_argument("--methods", default="all", help="comma-separated methods, or all (default)")
    ap.add_argument("--budgets", default=",".join("%g" % b for b in DEFAULT_BUDGETS),
                    help="comma-separated budgets in (0, 1] (%(default)s); `full` runs once")
    ap.add_argument("--params", action="append", default=[], metavar="M:K=V,...",
                    help="method parameters, as kvsieve eval --params (repeatable); added to the "
                    "presets")
    ap.add_argument("--no-presets", action="store_true", help="do not apply the small-model "
                    "parameter presets (PRESETS in this file)")
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="the sessions' KV storage dtype (%(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="library threads per session "
                    "(%(default)s; 0 = all)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress indication")
    args = ap.parse_args(argv)

    try:
        import kvsieve
    except ImportError as e:
        print("kvsieve_e2e.py: error: cannot import kvsieve (%s); set PYTHONPATH to "
              "<build>/bindings/python" % e, file=sys.stderr)
        return 1
    # The library's warnings (e.g. csattention's "tables exceed its KV cache" at 512 tokens) repeat
    # for every layer and session: print each once (numbers folded).
    seen_logs = set()

    def on_log(level, msg):
        key = re.sub(r"[0-9.]+", "#", msg)
        if key not in seen_logs:
            seen_logs.add(key)
            print("\r\x1b[K" if sys.stderr.isatty() else "", end="", file=sys.stderr)
            print("kvsieve: %s (reported once)" % msg.rstrip(), file=sys.stderr)

    kvsieve.set_log_callback(on_log, "warn")
    try:
        registered = kvsieve.method_names()
        methods = parse_methods(args.methods, registered)
        budgets = parse_budgets(args.budgets)
        extra = parse_params(args.params, registered)
        if args.prompt < 1:
            raise Error("--prompt: expected at least 1 token, got %d" % args.prompt)
        if args.continuation < 1:
            raise Error("--continuation: expected at least 1 decode step, got %d"
                        % args.continuation)
        if args.threads < 0:
            raise Error("--threads: expected >= 0, got %d" % args.threads)
        if args.temperature < 0:
            raise Error("--temperature: expected >= 0, got %g" % args.temperature)
        try:
            model, tok = stories260k.load(args.model_dir)
        except (FileNotFoundError, OSError) as e:
            raise Error("--model-dir: %s" % e)
        need = args.prompt + args.continuation + 1
        if need > model.seq_len:
            raise Error("--prompt %d + --continuation %d + 1 = %d exceeds the model's context %d"
                        % (args.prompt, args.continuation, need, model.seq_len))
        if args.windows < 1:
            raise Error("--windows: expected at least 1, got %d" % args.windows)
        windows, text_name = load_windows(args, model, tok, need)
    except Error as e:
        print("kvsieve_e2e.py: error: %s" % e, file=sys.stderr)
        return 2

    configs = []
    for m in methods:
        params = extra.get(m, "") if args.no_presets else merge_params(PRESETS.get(m), extra.get(m))
        for b in ([1.0] if m == "full" else budgets):
            configs.append((m, b, params))
    prog = Progress(len(configs) + 1, not args.quiet)
    refs = []
    for w, ids in enumerate(windows):
        prog.show("reference + full", w / len(windows))
        refs.append(Reference(model, ids, args.prompt, args.continuation, args.kv_dtype,
                              args.threads))
    prog.advance()
    results = []
    for m, b, params in configs:
        label = "%s %g" % (m, b)
        prog.show(label)
        if m == "full":
            r = measure_windows(refs, m, None, params)
            r["budget"] = 1.0
        else:
            try:
                r = measure_windows(refs, m, b, params, progress=lambda f: prog.show(label, f))
            except kvsieve.Error as e:
                prog.close()
                print("kvsieve_e2e.py: error: %s at budget %g%s: %s" % (
                    m, b, " with params %s" % params if params else "", e), file=sys.stderr)
                return 1
        results.append(r)
        prog.advance()
    prog.close()

    doc = {
        "model": "stories260K (llama2.c; 5 layers, 8 q / 4 kv heads, head dim 8, context 512)",
        "text": text_name,
        "prompt_tokens": args.prompt,
        "continuation_tokens": args.continuation,
        "windows": len(refs),
        "scored_tokens": len(refs) * args.continuation,
        "results": results,
        "reference_nll": float(np.mean([ref.ref_nll for ref in refs])),
        "full_nll": float(np.mean([ref.full_nll for ref in refs])),
        "full_greedy_equals_reference": all(ref.full_greedy == ref.ref_greedy for ref in refs),
        "full_vs_reference_max_logit_diff": max(ref.full_vs_ref_max_logit_diff for ref in refs),
        "kv_dtype": args.kv_dtype,
        "library_version": kvsieve.version(),
        "command": " ".join(["kvsieve_e2e.py"] + list(sys.argv[1:] if argv is None else argv)),
    }
    print(format_table(doc))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, args.json)
        print("\nwrote %s" % args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
