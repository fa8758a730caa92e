# SPDX-License-Identifier: Apache-2.0
"""kvsieve as a transformers attention function, step by step (examples/python/kvsieve_hf.py over
kvsieve.transformers; generate() is tested in test_hf_generate.py).

A tiny randomly initialised Llama (no download) decodes through kvsieve; its logits must equal the
same model's with transformers' own eager attention (the independent reference) over the prompt
and several decode steps, GQA included. Run as a script (ctest) it exits 77, skipped, when torch
or transformers is missing; under pytest those tests skip.

KVSIEVE_HF_BACKEND=cuda runs the model on the GPU with kvsieve's cuda backend (tools/device/hf_cuda.sh).
"""
import os
import sys

if __name__ == "__main__":
    try:
        import pytest  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"skipped: {e}")
        sys.exit(77)

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python"))
import kvsieve_hf  # noqa: E402

BACKEND = os.environ.get("KVSIEVE_HF_BACKEND", "cpu")
DEVICE = "cuda" if BACKEND == "cuda" else "cpu"
PROMPT, STEPS = 23, 9
# cpu: f32 KV, so kvsieve must match eager f32 attention to float rounding. cuda: the backend stores
# KV in fp16 (bf16/fp16 only) and takes head dims 64/128, so K/V rounding to fp16 sets the tolerance.
KV_DTYPE = "float16" if BACKEND == "cuda" else "float32"
HEAD_DIM = 64 if BACKEND == "cuda" else 16
TOL = 3e-3 if BACKEND == "cuda" else 2e-5
cpu_only = pytest.mark.skipif(BACKEND == "cuda", reason="the cuda backend runs full/exact_topk only and cannot fork")

kvsieve_hf.register()


def tiny_llama(num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, layers=3, seed=0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=101, hidden_size=num_heads * head_dim, intermediate_size=96,
                      num_hidden_layers=layers, num_attention_heads=num_heads,
                      num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=256,
                      rope_theta=10000.0, attn_implementation="eager")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    # Larger-than-default weights: sharper attention, so a wrong key set or order would show (the
    # std shrinks with the width so that the logits' spread does not grow with it).
    std = 0.15 * (64.0 / cfg.hidden_size) ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.normal_(0.0, std)
    return model.to(device=DEVICE, dtype=dtype)


def reference_logits(model, ids):
    """transformers' eager attention over the whole sequence, causal: row t = logits after token t."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits[0]


def kvsieve_logits(model, ids, **cache_args):
    """Prompt through prefill, then one kvsieve decode per token per layer."""
    model.set_attn_implementation(kvsieve_hf.NAME)
    cache = kvsieve_hf.KvsieveCache(model.config, backend=BACKEND, **cache_args)
    rows = []
    with torch.no_grad():
        rows.append(kvsieve_hf.forward(model, ids[:, :PROMPT], cache)[0])
        for t in range(PROMPT, ids.shape[1]):
            rows.append(kvsieve_hf.forward(model, ids[:, t:t + 1], cache)[0])
    return torch.cat(rows), cache


def random_ids(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, PROMPT + STEPS), generator=g).to(DEVICE)


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)], ids=["gqa4to2", "mha", "mqa6to1"])
@pytest.mark.parametrize("method,budget", [("full", None), ("exact_topk", 1.0)])
def test_matches_eager_attention(heads, method, budget):
    model = tiny_llama(*heads)
    ids = random_ids(model)
    ref = reference_logits(model, ids)
    got, cache = kvsieve_logits(model, ids, method=method, budget=budget, kv_dtype=KV_DTYPE)
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= TOL * scale, f"max |logit diff| {err} (logit scale {scale})"
    # Every decode step of every layer went through the session.
    st = cache.stats
    assert st.tokens == ids.shape[1]
    assert st.decode_steps == STEPS * model.config.num_hidden_layers
    assert abs(st.last_selected_fraction - 1.0) < 1e-9
    # Greedy tokens agree with the eager model's (f32 KV; fp16 KV may flip near-ties).
    if BACKEND == "cpu":
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    cache.close()


@cpu_only
def test_sparse_method_really_decodes_through_kvsieve():
    """streaming with a 4-token budget over a 32-token context must change the decode logits (and
    not the prompt's, which is exact), proving decode does not fall back to dense attention."""
    model = tiny_llama(4, 2)
    ids = random_ids(model)
    ref = reference_logits(model, ids)
    got, cache = kvsieve_logits(model, ids, method="streaming", budget_tokens=4, kv_dtype=KV_DTYPE)
    prompt_err = (got[:PROMPT] - ref[:PROMPT]).abs().max().item()
    decode_err = (got[PROMPT:] - ref[PROMPT:]).abs().max().item()
    assert prompt_err <= TOL * ref.abs().max().item()
    assert decode_err > 1e-2, decode_err
    assert cache.stats.last_selected_keys <= 8.0  # of 32: the 4-token budget plus rounding
    cache.close()


@cpu_only
def test_fork_replays_the_same_continuation():
    """A fork taken after the prompt gives the same decode logits as the original session."""
    model = tiny_llama(4, 2)
    ids = random_ids(model)
    model.set_attn_implementation(kvsieve_hf.NAME)
    with torch.no_grad():
        a = kvsieve_hf.KvsieveCache(model.config, method="exact_topk", budget=0.3, kv_dtype=KV_DTYPE,
                                    backend=BACKEND)
        kvsieve_hf.forward(model, ids[:, :PROMPT], a)
        b = a.fork()
        la = [kvsieve_hf.forward(model, ids[:, t:t + 1], a) for t in range(PROMPT, ids.shape[1])]
        lb = [kvsieve_hf.forward(model, ids[:, t:t + 1], b) for t in range(PROMPT, ids.shape[1])]
    assert torch.equal(torch.cat(la), torch.cat(lb))
    a.close()
    b.close()


def test_greedy_generate_matches_eager_generate():
    model = tiny_llama(4, 2)
    ids = random_ids(model)[:, :PROMPT]
    if BACKEND == "cuda":   # fp16 KV may flip near-ties of the argmax
        pytest.skip("greedy equality is checked with f32 KV (cpu backend)")
    model.set_attn_implementation("eager")
    model.generation_config.eos_token_id = None   # greedy_generate has no end token either
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=8, do_sample=False)[:, PROMPT:]
    model.set_attn_implementation(kvsieve_hf.NAME)
    cache = kvsieve_hf.KvsieveCache(model.config, method="full", kv_dtype=KV_DTYPE, backend=BACKEND)
    got = kvsieve_hf.greedy_generate(model, ids, cache, max_new_tokens=8)
    assert torch.equal(got, want), (got, want)
    cache.close()


def test_wrong_dtype_is_refused():
    model = tiny_llama(4, 2, dtype=torch.float64)
    model.set_attn_implementation(kvsieve_hf.NAME)
    cache = kvsieve_hf.KvsieveCache(model.config, backend=BACKEND)
    with pytest.raises(TypeError, match=r"float32, float16 or bfloat16, got torch.float64"):
        with torch.no_grad():
            kvsieve_hf.forward(model, random_ids(model)[:, :PROMPT], cache)


def test_wrong_device_is_refused():
    model = tiny_llama(4, 2)
    model.set_attn_implementation(kvsieve_hf.NAME)
    other = "cpu" if BACKEND == "cuda" else "cuda"
    cache = kvsieve_hf.KvsieveCache(model.config, backend=other)
    with pytest.raises(ValueError, match=rf"backend '{other}' needs the model on {other}.*got tensors on {DEVICE}"):
        with torch.no_grad():
            kvsieve_hf.forward(model, random_ids(model)[:, :PROMPT], cache)


def test_missing_cache_is_refused_and_batches_decode():
    model = tiny_llama(4, 2)
    model.set_attn_implementation(kvsieve_hf.NAME)
    ids = random_ids(model)[:, :PROMPT]
    with pytest.raises(ValueError, match="pass past_key_values=kvsieve.transformers.KvsieveCache"):
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    # A batch of two rows (one session each) gives each row what the row alone gives.
    ids2 = torch.cat([ids, random_ids(model, seed=5)[:, :PROMPT]])
    with torch.no_grad():
        one = [kvsieve_logits(model, ids2[b:b + 1, :PROMPT], kv_dtype=KV_DTYPE) for b in range(2)]
        cache = kvsieve_hf.KvsieveCache(model.config, backend=BACKEND, kv_dtype=KV_DTYPE)
        both = kvsieve_hf.forward(model, ids2, cache)
    assert len(cache.sessions) == 2
    for b in range(2):
        assert torch.allclose(both[b], one[b][0], rtol=0, atol=TOL * one[b][0].abs().max().item())
        one[b][1].close()
    cache.close()
    with pytest.raises(ValueError, match="backend: expected 'cpu' or 'cuda'"):
        kvsieve_hf.KvsieveCache(model.config, backend="tpu")


if __name__ == "__main__":
    # ctest entry point: 77 = skipped when torch/transformers are missing.
    sys.exit(pytest.main([__file__, "-q", "-rs", "-p", "no:cacheprovider"]))
