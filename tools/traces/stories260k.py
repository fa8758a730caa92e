#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Real-model attention traces from Karpathy's stories260K (llama2.c legacy v0 checkpoint).

A NumPy reimplementation of the llama2.c forward pass (computed in float64; traces are stored as
F32) and of its tokenizer, used to write kvsieve-trace safetensors files (docs/formats.md) from a
real trained model. See docs/real-traces.md.

  stories260k.py check
  stories260k.py trace --out FILE [--text FILE | --generate N --seed S --temperature T]
                       [--prefill-len P]
  stories260k.py nll --text FILE

Model files default to $KVS_STORIES260K_DIR, else shared/data/stories260K next to the repository
(or /work/shared/data/stories260K).
"""
import argparse
import json
import os
import struct
import sys

try:
    import numpy as np
except ImportError:  # e.g. a pyenv python3 first on PATH: NumPy comes from Debian's python3-numpy
    if os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3") and \
            os.path.exists("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

RMS_EPS = 1e-5
BOS, EOS = 1, 2

# Reference figures from shared/data/stories260K/README.md.
REF_TOP5 = [(" Once", 17.0235), (" One", 15.4062), (" ", 13.1083), (" Lily", 12.7692),
            (" upon", 12.4181)]
REF_P_ONCE = 0.784
REF_GREEDY = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401,
              396, 267, 337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432,
              358, 394, 261, 370, 432, 352]
REF_GREEDY_TEXT_PREFIX = ("Once upon a time, there was a little girl named Lily. She loved to play "
                          "outside in the park.")


def default_model_dir():
    env = os.environ.get("KVS_STORIES260K_DIR")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    for cand in (os.path.join(repo, "shared", "data", "stories260K"),
                 os.path.join(os.path.dirname(repo), "shared", "data", "stories260K")):
        if os.path.exists(os.path.join(cand, "stories260K.bin")):
            return cand
    raise FileNotFoundError("stories260K not found: set KVS_STORIES260K_DIR")


# ----------------------------------------------------------------------------------------------
# Model

class Model:
    """llama2.c legacy v0 checkpoint, weights as float64."""

    def __init__(self, path):
        with open(path, "rb") as f:
            raw = f.read()
        (self.dim, self.hidden_dim, self.n_layers, self.n_heads, self.n_kv_heads, vocab,
         self.seq_len) = struct.unpack("<7i", raw[:28])
        self.shared_classifier = vocab > 0
        self.vocab_size = abs(vocab)
        self.head_dim = self.dim // self.n_heads
        kv_dim = self.n_kv_heads * self.head_dim
        w = np.frombuffer(raw, dtype="<f4", offset=28).astype(np.float64)
        L, D, H, V = self.n_layers, self.dim, self.hidden_dim, self.vocab_size
        off = 0

        def take(*shape):
            nonlocal off
            n = int(np.prod(shape))
            a = w[off:off + n].reshape(shape)
            off += n
            return a

        self.tok_emb = take(V, D)
        self.rms_att = take(L, D)
        self.wq = take(L, D, D)
        self.wk = take(L, kv_dim, D)
        self.wv = take(L, kv_dim, D)
        self.wo = take(L, D, D)
        self.rms_ffn = take(L, D)
        self.w1 = take(L, H, D)
        self.w2 = take(L, D, H)
        self.w3 = take(L, H, D)
        self.rms_final = take(D)
        self.freq_cos = take(self.seq_len, self.head_dim // 2)
        self.freq_sin = take(self.seq_len, self.head_dim // 2)
        if self.shared_classifier:
            self.wcls = self.tok_emb
        else:
            self.wcls = take(V, D)
        if off != w.size:
            raise ValueError("checkpoint size mismatch: %d floats used of %d" % (off, w.size))

    @staticmethod
    def rmsnorm(x, weight):
        ss = np.mean(x * x, axis=-1, keepdims=True) + RMS_EPS
        return x / np.sqrt(ss) * weight

    def rope(self, x, pos):
        """x [T, heads, head_dim]; rotates interleaved pairs (x[2i], x[2i+1]) by the table angle."""
        c = self.freq_cos[pos][:, None, :]
        s = self.freq_sin[pos][:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    def new_cache(self):
        """A KV cache for incremental decoding: forward(tokens, cache=c) appends to it."""
        return {"len": 0, "k": [None] * self.n_layers, "v": [None] * self.n_layers}

    def forward(self, tokens, record=False, cache=None, attend=None):
        """Causal forward pass of tokens at positions cache["len"].. (0 without a cache).
        Returns logits [n, V] and, with record, per-layer dicts: q [n,Hq,hd], k,v [n,Hkv,hd]
        (q, k after RoPE) and attn [n,Hq,hd] (the attention output of each query head, before
        wo).

        attend: optional callback attend(layer, q, k, v) -> attn [n,Hq,hd] that replaces the
        model's own attention (e.g. a kvsieve session, examples/python/kvsieve_e2e.py). It gets
        the chunk's new q [n,Hq,hd], k, v [n,Hkv,hd] (float64, after RoPE) and keeps the KV
        itself: the cache then only counts positions (its k/v stay untouched)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = tokens.size
        start = cache["len"] if cache is not None else 0
        T = start + n
        if T > self.seq_len:
            raise ValueError("sequence of %d tokens exceeds the context %d" % (T, self.seq_len))
        hd, Hq, Hkv = self.head_dim, self.n_heads, self.n_kv_heads
        pos = np.arange(start, T)
        mask = np.arange(T)[None, :] > pos[:, None]  # [n, T]: key after query
        scale = 1.0 / np.sqrt(hd)
        x = self.tok_emb[tokens].copy()
        layers = []
        for l in range(self.n_layers):
            xb = self.rmsnorm(x, self.rms_att[l])
            q = self.rope((xb @ self.wq[l].T).reshape(n, Hq, hd), pos)
            k = self.rope((xb @ self.wk[l].T).reshape(n, Hkv, hd), pos)
            v = (xb @ self.wv[l].T).reshape(n, Hkv, hd)
            if attend is not None:
                attn = np.asarray(attend(l, q, k, v), dtype=np.float64).reshape(n, Hq, hd)
            else:
                attn = self._attention(l, q, k, v, cache, start, mask, scale)
            x = x + attn.reshape(n, Hq * hd) @ self.wo[l].T
            xb = self.rmsnorm(x, self.rms_ffn[l])
            h1 = xb @ self.w1[l].T
            h3 = xb @ self.w3[l].T
            x = x + ((h1 / (1.0 + np.exp(-h1))) * h3) @ self.w2[l].T
            if record:
                layers.append({"q": q, "k": k, "v": v, "attn": attn})
        if cache is not None:
            cache["len"] = T
        x = self.rmsnorm(x, self.rms_final)
        logits = x @ self.wcls.T
        return (logits, layers) if record else logits

    def _attention(self, l, q, k, v, cache, start, mask, scale):
        """Exact causal GQA attention of the chunk over the cached and new keys (float64)."""
        group = self.n_heads // self.n_kv_heads
        kall, vall = k, v
        if cache is not None:
            if start:
                kall = np.concatenate([cache["k"][l], k])
                vall = np.concatenate([cache["v"][l], v])
            cache["k"][l], cache["v"][l] = kall, vall
        kq = np.repeat(kall, group, axis=1)  # [T, Hq, hd], q head h -> kv head h // group
        vq = np.repeat(vall, group, axis=1)
        s = np.einsum("thd,shd->hts", q, kq) * scale
        s[:, mask] = -np.inf
        s -= s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        return np.einsum("hts,shd->thd", p, vq)


def softmax(z):
    z = z - np.max(z)
    e = np.exp(z)
    return e / e.sum()


def generate(model, prompt, n, temperature=1.0, seed=0):
    """Extends prompt (token ids) by n tokens: greedy when temperature == 0, else sampled with a
    NumPy PCG64 generator seeded by seed (inverse CDF on one uniform per step). Does not stop at
    BOS/EOS: the model was trained on stories separated by BOS and simply starts a new one."""
    rng = np.random.default_rng(seed)
    toks = list(prompt)
    cache = model.new_cache()
    logits = model.forward(toks, cache=cache)[-1]
    for i in range(n):
        if i:
            logits = model.forward(toks[-1:], cache=cache)[-1]
        if temperature == 0:
            nxt = int(np.argmax(logits))
        else:
            p = softmax(logits / temperature)
            cdf = np.cumsum(p)
            nxt = int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), p.size - 1))
        toks.append(nxt)
    return toks


# ----------------------------------------------------------------------------------------------
# Tokenizer (llama2.c tokenizer.bin format)

class Tokenizer:
    def __init__(self, path, vocab_size):
        with open(path, "rb") as f:
            raw = f.read()
        self.max_token_length = struct.unpack_from("<i", raw, 0)[0]
        off = 4
        self.vocab, self.scores = [], []
        for _ in range(vocab_size):
            score, n = struct.unpack_from("<fi", raw, off)
            off += 8
            self.vocab.append(raw[off:off + n])
            off += n
            self.scores.append(score)
        self.index = {}
        for i, b in enumerate(self.vocab):
            self.index.setdefault(b, i)

    def encode(self, text, bos=True, eos=False):
        """llama2.c encode: optional BOS, a dummy-prefix space, each UTF-8 character (or its bytes
        as byte-fallback ids byte + 3), then repeatedly merge the adjacent pair whose merged
        token has the highest score (the leftmost on ties)."""
        ids = [BOS] if bos else []
        seq = [self.index[b" "]] if text else []  # the dummy prefix takes part in merges
        for ch in text:
            b = ch.encode("utf-8")
            if b in self.index:
                seq.append(self.index[b])
            else:
                seq.extend(c + 3 for c in b)
        while True:
            best, best_i, best_id = -1e10, -1, -1
            for i in range(len(seq) - 1):
                m = self.index.get(self.vocab[seq[i]] + self.vocab[seq[i + 1]])
                if m is not None and self.scores[m] > best:
                    best, best_i, best_id = self.scores[m], i, m
            if best_i < 0:
                break
            seq[best_i:best_i + 2] = [best_id]
        ids.extend(seq)
        if eos:
            ids.append(EOS)
        return ids

    def piece(self, prev, tok):
        """Bytes of token tok following token prev (llama2.c decode)."""
        b = self.vocab[tok]
        if prev == BOS and b.startswith(b" "):
            b = b[1:]
        if len(b) == 6 and b.startswith(b"<0x") and b.endswith(b">"):
            try:
                return bytes([int(b[3:5], 16)])
            except ValueError:
                pass
        return b

    def decode(self, ids, prev=BOS):
        out = []
        for t in ids:
            if t == BOS:
                out.append(b"\n")  # a new story starts
            elif t != EOS:
                out.append(self.piece(prev, t))
            prev = t
        return b"".join(out).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------------
# safetensors writer (no dependency on the safetensors package)

_DTYPES = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<i4"): "I32",
           np.dtype("<i8"): "I64", np.dtype("<f8"): "F64", np.dtype("u1"): "U8"}


def write_safetensors(path, tensors, metadata=None):
    """Writes a safetensors file: tensors laid out by descending element size, then name; header
    padded with spaces so the data buffer starts at a multiple of 64."""
    arrs = {}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        if a.dtype not in _DTYPES:
            raise TypeError("unsupported dtype %s for %s" % (a.dtype, name))
        arrs[name] = a
    order = sorted(arrs, key=lambda n: (-arrs[n].dtype.itemsize, n))
    header, off = {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for n in order:
        a = arrs[n]
        header[n] = {"dtype": _DTYPES[a.dtype], "shape": list(a.shape),
                     "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((-(8 + len(hjson))) % 64)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for n in order:
            f.write(arrs[n].tobytes())
    os.replace(tmp, path)


def read_safetensors(path):
    """Minimal reader (for tests): returns (tensors dict, metadata dict)."""
    rev = {v: k for k, v in _DTYPES.items()}
    with open(path, "rb") as f:
        raw = f.read()
    (h,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8:8 + h].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    base = 8 + h
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        out[name] = np.frombuffer(raw[base + b:base + e], dtype=rev[info["dtype"]]).reshape(
            info["shape"])
    return out, meta


# ----------------------------------------------------------------------------------------------
# Traces

def make_trace(model, tokens, prefill_len, source):
    """Returns (tensors, metadata, layers) for a kvsieve-trace of the given token sequence."""
    T = len(tokens)
    if not 1 <= prefill_len <= T:
        raise ValueError("prefill_len %d not in [1, %d]" % (prefill_len, T))
    _, layers = model.forward(tokens, record=True)
    tensors = {"tokens": np.asarray(tokens, dtype=np.int32)}
    for l, rec in enumerate(layers):
        for key in ("q", "k", "v"):
            tensors["layers.%d.%s" % (l, key)] = rec[key].astype(np.float32)
    meta = {"format": "kvsieve-trace", "version": "1", "num_layers": str(model.n_layers),
            "num_q_heads": str(model.n_heads), "num_kv_heads": str(model.n_kv_heads),
            "head_dim": str(model.head_dim), "prefill_len": str(prefill_len),
            "layers": ",".join(str(l) for l in range(model.n_layers)),
            "softmax_scale": repr(float(1.0 / np.sqrt(model.head_dim))), "source": source}
    return tensors, meta, layers


def load(model_dir=None):
    d = model_dir or default_model_dir()
    model = Model(os.path.join(d, "stories260K.bin"))
    tok = Tokenizer(os.path.join(d, "tok512.bin"), model.vocab_size)
    return model, tok


def check(model, tok, verbose=True):
    """Asserts the README's reference figures. Returns a list of failure messages."""
    fails = []
    logits = model.forward([BOS])[-1]
    top = np.argsort(-logits)[:5]
    p = softmax(logits)
    for rank, (i, (ref_s, ref_v)) in enumerate(zip(top, REF_TOP5)):
        s = tok.vocab[i].decode("utf-8", errors="replace")
        if verbose:
            print("top%d: %5d %-8r %.4f (ref %r %.4f)" % (rank + 1, i, s, logits[i], ref_s, ref_v))
        if s != ref_s or abs(logits[i] - ref_v) > 6e-4:
            fails.append("top-%d logit after BOS: %r %.5f, expected %r %.4f"
                         % (rank + 1, s, logits[i], ref_s, ref_v))
    p_once = p[tok.index[b" Once"]]
    if verbose:
        print("p(' Once') = %.4f (ref %.3f)" % (p_once, REF_P_ONCE))
    if abs(p_once - REF_P_ONCE) > 6e-4:
        fails.append("p(' Once') = %.5f, expected %.3f" % (p_once, REF_P_ONCE))
    greedy = generate(model, [BOS], len(REF_GREEDY), temperature=0)[1:]
    text = tok.decode(greedy)
    if verbose:
        print("greedy:", " ".join(map(str, greedy)))
        print("text:  ", repr(text))
    if greedy != REF_GREEDY:
        fails.append("greedy ids differ: %s" % greedy)
    if not text.startswith(REF_GREEDY_TEXT_PREFIX):
        fails.append("greedy text differs: %r" % text)
    # The tokenizer round-trips the greedy text to the same ids.
    if tok.encode(text, bos=False) != greedy:
        fails.append("encode(decode(greedy)) != greedy: %s" % tok.encode(text, bos=False))
    return fails


def nll(model, tokens):
    """Mean negative log-likelihood (nats/token) of tokens[1:] given their prefixes."""
    logits = model.forward(tokens)[:-1]
    m = logits.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))[:, 0]
    return float(np.mean(lse - logits[np.arange(len(tokens) - 1), tokens[1:]]))


def read_text(path):
    with open(path, "r", encoding="utf-8") as f:
        return " ".join(f.read().split())  # one line of words, single spaces


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-dir", help="folder with stories260K.bin and tok512.bin")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="assert the README's reference figures")
    tr = sub.add_parser("trace", help="write a kvsieve-trace safetensors file")
    tr.add_argument("--out", required=True)
    src = tr.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="UTF-8 text file, teacher-forced after BOS (truncated to T)")
    src.add_argument("--generate", type=int, metavar="N", help="sample N tokens after BOS")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--temperature", type=float, default=1.0)
    tr.add_argument("--length", type=int, default=512, help="T for --text (default 512)")
    tr.add_argument("--prefill-len", type=int, default=None, help="default T/2")
    tr.add_argument("--source", default=None, help="text for metadata 'source'")
    nl = sub.add_parser("nll", help="mean NLL of a text file (nats/token)")
    nl.add_argument("--text", required=True)
    nl.add_argument("--length", type=int, default=512)
    args = ap.parse_args(argv)

    model, tok = load(args.model_dir)
    if args.cmd == "check":
        fails = check(model, tok)
        for f in fails:
            print("FAIL:", f, file=sys.stderr)
        print("check: %s" % ("FAILED" if fails else "OK"))
        return 1 if fails else 0
    if args.cmd == "nll":
        ids = tok.encode(read_text(args.text))[:args.length]
        print("nll: %.4f nats/token over %d tokens" % (nll(model, ids), len(ids) - 1))
        return 0
    # trace
    if args.text:
        ids = tok.encode(read_text(args.text))
        if len(ids) < args.length:
            print("warning: text has only %d tokens" % len(ids), file=sys.stderr)
        ids = ids[:args.length]
        desc = "stories260K (llama2.c, float64 numpy forward); teacher-forced text: BOS + " \
               "first %d tokens of %s" % (len(ids) - 1, args.source or os.path.basename(args.text))
    else:
        ids = generate(model, [BOS], args.generate, temperature=args.temperature, seed=args.seed)
        desc = "stories260K (llama2.c, float64 numpy forward); BOS + %d sampled tokens, numpy " \
               "PCG64 seed %d, temperature %g" % (args.generate, args.seed, args.temperature)
        if args.source:
            desc += "; " + args.source
    prefill = args.prefill_len if args.prefill_len is not None else max(1, len(ids) // 2)
    tensors, meta, _ = make_trace(model, ids, prefill, desc)
    write_safetensors(args.out, tensors, meta)
    print("wrote %s: T=%d prefill_len=%d; nll %.4f nats/token" % (args.out, len(ids), prefill,
                                                                  nll(model, ids)))
    print("text: %r" % tok.decode(ids[1:])[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())
