#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""tools/traces/stories260k.py: the README's reference figures, and a small trace written by the
`trace` subcommand, checked against (a) an independent scalar recomputation of layer 0's q/k/v and
(b) the model's own attention outputs for every layer. Plain Python: exits nonzero on failure,
77 (skipped) when the stories260K files are not found."""
import math
import os
import struct
import subprocess
import sys
import tempfile
import json

try:
    import numpy as np
except ImportError:  # a pyenv python3 first on PATH: NumPy comes from Debian's python3-numpy
    if os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3") and \
            os.path.exists("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TOOL = os.path.join(REPO, "tools", "traces", "stories260k.py")
sys.path.insert(0, os.path.dirname(TOOL))
import stories260k as S  # noqa: E402

failures = []


def expect(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL:", msg)


def scalar_qkv(model_path, token, pos, layer=0):
    """Layer-0 q, k, v of one token at one position, from the checkpoint bytes with plain Python
    loops (no NumPy, its own weight offsets, RoPE angles from theta 10000 rather than the file's
    tables), following llama2.c run.c."""
    with open(model_path, "rb") as f:
        raw = f.read()
    dim, hidden, nl, nh, nkv, vocab, seq = struct.unpack("<7i", raw[:28])
    hd = dim // nh
    kv_dim = nkv * hd

    def floats(start, count):
        return struct.unpack_from("<%df" % count, raw, 28 + 4 * start)

    o_emb = 0
    o_rms = o_emb + abs(vocab) * dim
    o_wq = o_rms + nl * dim
    o_wk = o_wq + nl * dim * dim
    o_wv = o_wk + nl * kv_dim * dim
    x = floats(o_emb + token * dim, dim)
    w = floats(o_rms + layer * dim, dim)
    ss = sum(a * a for a in x) / dim + 1e-5
    xb = [w[i] * x[i] / math.sqrt(ss) for i in range(dim)]

    def matvec(off, rows):
        m = floats(off, rows * dim)
        return [sum(m[r * dim + c] * xb[c] for c in range(dim)) for r in range(rows)]

    q = matvec(o_wq + layer * dim * dim, dim)
    k = matvec(o_wk + layer * kv_dim * dim, kv_dim)
    v = matvec(o_wv + layer * kv_dim * dim, kv_dim)
    for i in range(0, dim, 2):
        j = i % hd
        ang = pos * (1.0 / 10000.0 ** (j / hd))
        c, s = math.cos(ang), math.sin(ang)
        for vec in ((q, k) if i < kv_dim else (q,)):
            a, b = vec[i], vec[i + 1]
            vec[i], vec[i + 1] = a * c - b * s, a * s + b * c
    return (np.array(q).reshape(nh, hd), np.array(k).reshape(nkv, hd),
            np.array(v).reshape(nkv, hd))


def full_attention(q, k, v, scale):
    """Causal full attention in float64 from trace tensors q [T,Hq,d], k, v [T,Hkv,d]."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T, hq, _ = q.shape
    group = hq // k.shape[1]
    out = np.empty_like(q)
    for h in range(hq):
        kh, vh = k[:, h // group], v[:, h // group]
        for t in range(T):
            s = kh[:t + 1] @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ vh[:t + 1]
    return out


def check_layout(path, tensors, meta):
    with open(path, "rb") as f:
        raw = f.read()
    (h,) = struct.unpack_from("<Q", raw, 0)
    expect((8 + h) % 64 == 0, "data buffer starts at %d, not a multiple of 64" % (8 + h))
    header = json.loads(raw[8:8 + h])
    header.pop("__metadata__")
    order = sorted(header, key=lambda n: header[n]["data_offsets"][0])
    expect(order == sorted(header), "tensors not laid out by name (all 4-byte): %s" % order)
    end = 0
    for n in order:
        b, e = header[n]["data_offsets"]
        expect(b == end, "%s: hole or overlap at %d" % (n, b))
        end = e
    expect(8 + h + end == len(raw), "data buffer not covered exactly")
    for key in ("format", "version", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
                "prefill_len", "layers", "softmax_scale", "source"):
        expect(key in meta, "metadata %s missing" % key)
    expect(meta.get("format") == "kvsieve-trace" and meta.get("version") == "1",
           "format/version: %s" % meta)


def main():
    try:
        model_dir = S.default_model_dir()
    except FileNotFoundError as e:
        print("SKIPPED:", e)
        return 77
    model, tok = S.load(model_dir)

    # Reference figures (the `check` subcommand, in its own process as a user runs it).
    r = subprocess.run([sys.executable, TOOL, "check"], capture_output=True, text=True)
    print(r.stdout, end="")
    expect(r.returncode == 0, "`stories260k.py check` failed: %s" % r.stderr)

    # The tokenizer: a round trip, and a character outside the vocabulary via byte fallback.
    text = "Once upon a time, Tom saw a big caf\u00e9 \u4e2d!"  # e-acute is a token, not this
    ids = tok.encode(text)
    expect(ids[0] == S.BOS, "encode starts with BOS")
    expect(tok.decode(ids[1:]) == text, "decode(encode(x)) = %r" % tok.decode(ids[1:]))
    expect(tok.index["\u00e9".encode()] in ids, "e-acute token: %s" % ids)
    expect(ids[-4:-1] == [0xE4 + 3, 0xB8 + 3, 0xAD + 3], "byte fallback for U+4E2D: %s" % ids)

    # KV-cached incremental forward agrees with the whole-sequence forward.
    seq = ids[:12]
    full = model.forward(seq)
    cache = model.new_cache()
    inc = np.concatenate([model.forward(seq[:5], cache=cache)] +
                         [model.forward([t], cache=cache) for t in seq[5:]])
    expect(np.allclose(full, inc, rtol=0, atol=1e-9), "cached forward differs from full forward")

    with tempfile.TemporaryDirectory() as tmp:
        txt = os.path.join(tmp, "story.txt")
        with open(txt, "w") as f:
            f.write("One day, a little girl named Lily went to the park with her mom. She saw a "
                    "red ball under a tree and ran to get it. \"Look, Mom!\" she said.\n")
        for name, args in (("text", ["--text", txt, "--length", "40", "--prefill-len", "16"]),
                           ("gen", ["--generate", "30", "--seed", "3", "--temperature", "1.0",
                                    "--prefill-len", "20"])):
            out = os.path.join(tmp, name + ".safetensors")
            r = subprocess.run([sys.executable, TOOL, "trace", "--out", out] + args,
                               capture_output=True, text=True)
            expect(r.returncode == 0, "trace %s failed: %s" % (name, r.stderr))
            if r.returncode:
                continue
            tensors, meta = S.read_safetensors(out)
            check_layout(out, tensors, meta)
            toks = tensors["tokens"].astype(np.int64).tolist()
            T = len(toks)
            expect(T == (40 if name == "text" else 31), "%s: T = %d" % (name, T))
            expect(toks[0] == S.BOS, "%s: trace starts with BOS" % name)
            if name == "text":
                expect(toks == tok.encode(S.read_text(txt))[:40], "text tokens differ")
            expect(meta["prefill_len"] == ("16" if name == "text" else "20"), "prefill_len")
            for l in range(model.n_layers):
                for key, heads in (("q", 8), ("k", 4), ("v", 4)):
                    a = tensors.get("layers.%d.%s" % (l, key))
                    expect(a is not None and a.dtype == np.float32 and a.shape == (T, heads, 8),
                           "%s: layers.%d.%s shape/dtype" % (name, l, key))

            # (a) layer-0 q/k/v at a few positions, recomputed independently.
            for t in sorted({0, 1, T // 2, T - 1}):
                q, k, v = scalar_qkv(os.path.join(model_dir, "stories260K.bin"), toks[t], t)
                for key, ref in (("q", q), ("k", k), ("v", v)):
                    got = tensors["layers.0.%s" % key][t].astype(np.float64)
                    err = np.max(np.abs(got - ref)) / max(1.0, np.max(np.abs(ref)))
                    expect(err < 1e-5, "%s: layer 0 %s at t=%d off by %.2e" % (name, key, t, err))

            # (b) full attention from the trace reproduces the model's attention outputs.
            _, layers = model.forward(toks, record=True)
            scale = float(meta["softmax_scale"])
            worst = 0.0
            for l in range(model.n_layers):
                att = full_attention(tensors["layers.%d.q" % l], tensors["layers.%d.k" % l],
                                     tensors["layers.%d.v" % l], scale)
                ref = layers[l]["attn"]
                err = np.max(np.abs(att - ref)) / max(1.0, np.max(np.abs(ref)))
                worst = max(worst, err)
                expect(err < 1e-5, "%s: layer %d attention output off by %.2e" % (name, l, err))
            print("%s trace: T=%d, attention from trace vs model: max rel err %.2e"
                  % (name, T, worst))

    if failures:
        print("%d failure(s)" % len(failures))
        return 1
    print("test_stories260k: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
