#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""End-to-end quality of kvsieve's methods inside a real model (transformers + kvsieve_hf.py).

For a prompt of --prompt-tokens tokens of a text and the next --continuation tokens:

- the prompt's model pass runs once (transformers' SDPA attention, every layer's post-RoPE q/k/v
  recorded); each method's session is prefilled from those q/k/v (kvsieve's prefill is exact
  attention, so the prompt pass is the same for every method) and its index built once; two forks
  of it then decode (kvsieve_hf.KvsieveCache.fork: KV shared copy-on-write, index copied);
- NLL: teacher-forced on the real text. Decode step j feeds continuation token c_j and predicts
  c_{j+1} (j = 0..N-1), so all N scored predictions come from sparse decode steps; c_0 itself is
  predicted by the prompt pass, exact for every method, and not scored;
- greedy: full's greedy continuation g_0..g_N (g_0 from the prompt pass). Each method is teacher-
  forced on g_0..g_{N-1}; greedy_agreement = the fraction of the N steps where its argmax equals
  g_{j+1}; first_divergence = the first such j that differs (N if none). Until its first
  disagreement a method's own free-running greedy decoding has seen exactly these inputs, so this
  is also the index of the first differing token of free-running greedy decoding (counting the N
  decode-predicted tokens g_1..g_N);
- kept_fraction: the session's mean exact keys per decode step (kvs stats mean_selected_keys,
  mean over KV heads, layers and steps of the NLL fork) over the mean context length.

Writes --json with {"model", "text", "prompt_tokens", "continuation_tokens", "results": [{"method",
"budget", "params", "kept_fraction", "nll", "delta_nll_vs_full", "greedy_agreement",
"first_divergence"}]}, rewritten after every configuration (a partial run leaves valid JSON).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvsieve  # noqa: E402
import kvsieve_hf  # noqa: E402
from dump_trace import Capture, load_model, text_tokens  # noqa: E402

ALL = ["exact_topk", "streaming", "quest", "csattention", "ctkvr", "lfps", "hgca", "retroinfer"]


def used_params(cache: kvsieve_hf.KvsieveCache, path: str) -> dict:
    """The method parameters the session actually uses, read back from its saved tables' header
    (kvsieve resolves defaults and the budget there)."""
    cache.session.save(path)
    try:
        return dict(kvsieve.tables_describe(path)["header"]["method"]["params"])
    finally:
        os.remove(path)


@torch.no_grad()
def run_config(model, cap, P, cont, greedy, method, budget, threads, scored_greedy=False, params=None):
    """Returns (nll, argmax list over the greedy pass, kept_fraction, params, seconds)."""
    t0 = time.time()
    base = kvsieve_hf.KvsieveCache(model.config, method=method, budget=budget, kv_dtype="float32",
                                   num_threads=threads, method_params=params)
    for layer in sorted(cap.q):
        base.prefill_layer(layer, cap.q[layer], cap.k[layer], cap.v[layer], cap.scale[layer])
    assert base.tokens == P
    used = used_params(base, f"/tmp/kvsieve_e2e_{os.getpid()}.kvs")
    N = len(cont) - 1
    # NLL fork: feed c_0..c_{N-1}, score c_1..c_N.
    a = base.fork()
    nll = 0.0
    for j in range(N):
        lg = kvsieve_hf.forward(model, torch.tensor([[cont[j]]]), a)[0, -1].double()
        nll -= torch.log_softmax(lg, -1)[cont[j + 1]].item()
    st = a.stats
    mean_ctx = P + (N + 1) / 2.0        # contexts P+1 .. P+N
    kept = st.mean_selected_keys / mean_ctx
    a.close()
    # Greedy fork: feed g_0..g_{N-1}; for full, g is built as it goes (free-running).
    b = base.fork()
    base.close()
    am = []
    for j in range(N):
        lg = kvsieve_hf.forward(model, torch.tensor([[greedy[j]]]), b)[0, -1]
        t = int(lg.argmax())
        am.append(t)
        if scored_greedy and len(greedy) == j + 1:
            greedy.append(t)
    b.close()
    return nll / N, am, kept, used, time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf-file")
    ap.add_argument("--text", required=True)
    ap.add_argument("--text-name", help="the 'text' field of the JSON (default: the path)")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--continuation", type=int, default=64, help="N: scored decode steps")
    ap.add_argument("--methods", default=",".join(ALL))
    ap.add_argument("--budgets", default="0.01,0.02,0.05,0.1,0.2")
    ap.add_argument("--params", action="append", default=[],
                    help="method parameters, as the CLI's: method:key=value,key=value (repeatable), "
                         "e.g. retroinfer:budget=session")
    ap.add_argument("--no-full", action="store_true",
                    help="still run full (its greedy continuation is the reference) but leave its row out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)

    overrides = {}
    for spec in a.params:
        m, _, kvs = spec.partition(":")
        if m not in kvsieve.method_names():
            raise SystemExit(f"--params: unknown method {m!r} in {spec!r}; expected one of "
                             f"{', '.join(kvsieve.method_names())}")
        if not kvs:
            raise SystemExit(f"--params: expected method:key=value[,key=value], got {spec!r}")
        for kv in kvs.split(","):
            k, eq, v = kv.partition("=")
            if not eq:
                raise SystemExit(f"--params: expected key=value, got {kv!r} in {spec!r}")
            overrides.setdefault(m, {})[k] = v
    tok, model = load_model(a.model, a.gguf_file, a.threads)
    P, N = a.prompt_tokens, a.continuation
    ids = text_tokens(tok, a.text, P + N + 1, False)[0].tolist()
    prompt, cont = ids[:P], ids[P:]

    # Every layer's post-RoPE prompt q/k/v ([P, H, d], float32), recorded during one SDPA pass.
    cap = Capture(range(model.config.num_hidden_layers), torch.float32, (), [])
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    AttentionInterface.register("kvsieve_e2e_capture", cap)
    AttentionMaskInterface.register("kvsieve_e2e_capture", sdpa_mask)
    model.set_attn_implementation("kvsieve_e2e_capture")
    t0 = time.time()
    with torch.no_grad():
        last = model(input_ids=torch.tensor([prompt]), use_cache=False, logits_to_keep=1).logits[0, -1]
    print(f"prompt pass: {P} tokens in {time.time() - t0:.1f}s", flush=True)
    kvsieve_hf.register()
    model.set_attn_implementation(kvsieve_hf.NAME)

    name = a.model.rstrip("/").split("/")[-1] + (f"/{a.gguf_file}" if a.gguf_file else "")
    out = {"model": name, "text": a.text_name or a.text, "prompt_tokens": P, "continuation_tokens": N,
           "results": []}

    def save():
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, a.json)

    greedy = [int(last.argmax())]
    nll_full, am, kept, params, sec = run_config(model, cap, P, cont, greedy, "full", None, a.threads, scored_greedy=True)
    assert am == greedy[1:N + 1]
    print(f"full: nll {nll_full:.4f} kept {kept:.3f} ({sec:.0f}s); greedy: {tok.decode(greedy)!r}", flush=True)
    if not a.no_full:
        out["results"].append({"method": "full", "budget": 1.0, "params": params,
                               "kept_fraction": kept, "nll": nll_full, "delta_nll_vs_full": 0.0,
                               "greedy_agreement": 1.0, "first_divergence": N})
    out["full_greedy_tokens"] = greedy
    save()
    budgets = [float(b) for b in a.budgets.split(",")]
    for budget in budgets:
        for method in a.methods.split(","):
            try:
                nll, am, kept, params, sec = run_config(model, cap, P, cont, greedy, method, budget, a.threads,
                                                       params=overrides.get(method))
            except Exception as e:  # a method that cannot run at this budget: say so, go on
                print(f"{method} @ {budget}: ERROR {e}", flush=True)
                out.setdefault("errors", []).append({"method": method, "budget": budget, "error": str(e)})
                save()
                continue
            same = [x == y for x, y in zip(am, greedy[1:N + 1])]
            first = next((j for j, s in enumerate(same) if not s), N)
            r = {"method": method, "budget": budget, "params": params, "kept_fraction": kept,
                 "nll": nll, "delta_nll_vs_full": nll - nll_full, "greedy_agreement": sum(same) / N,
                 "first_divergence": first}
            out["results"].append(r)
            save()
            print(f"{method:12s} {budget:5.2f}: kept {kept:.3f} nll {nll:.4f} (d {nll - nll_full:+.4f}) "
                  f"agree {r['greedy_agreement']:.3f} first div {first} ({sec:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
