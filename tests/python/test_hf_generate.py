# SPDX-License-Identifier: Apache-2.0
"""kvsieve.transformers.KvsieveCache with transformers' generate().

A tiny randomly initialised Llama (no download). The independent reference is the same model with
transformers' own eager attention and its own DynamicCache: with method ``full`` and float32 KV the
kvsieve run must give the same tokens and the same per-step logits to float rounding, for one
sequence, for a batch of equal prompts and for a left-padded batch of different prompt lengths,
greedy and beam search. A sparse method must change the decode steps' logits (and not the first
step's, which comes from the exact prompt pass) by a bounded amount. Run as a script (ctest) it
exits 77, skipped, when torch or transformers is missing; under pytest those tests skip.
"""
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

import kvsieve  # noqa: E402
import kvsieve.transformers as kt  # noqa: E402

PAD = 0
NEW = 8
TOL = 2e-5   # f32 KV on the cpu backend: float rounding only (relative to the logits' scale)


def tiny_llama(num_heads=4, num_kv_heads=2, head_dim=16, layers=3, seed=0, qk_std=None, std=0.15):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=101, hidden_size=num_heads * head_dim, intermediate_size=96,
                      num_hidden_layers=layers, num_attention_heads=num_heads,
                      num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=256,
                      rope_theta=10000.0, attn_implementation="eager", pad_token_id=PAD)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    # Larger-than-default weights: sharper attention, so that a wrong key set, order or position shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                sharp = qk_std is not None and ("q_proj" in name or "k_proj" in name)
                p.normal_(0.0, qk_std if sharp else std)
    model.generation_config.eos_token_id = None   # always NEW tokens, whatever comes out
    model.generation_config.pad_token_id = PAD
    return model


def prompts(lengths, seed=1, vocab=101):
    """Left-padded batch: ids [B, max], mask [B, max] (0 on the padding)."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.full((len(lengths), L), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), L), dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, L - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[b, L - n:] = 1
    return ids, mask


def generate(model, ids, mask, attn, cache=None, **kw):
    model.set_attn_implementation(attn)
    args = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                output_logits=True)
    args.update(kw)
    if cache is not None:
        args["past_key_values"] = cache
    with torch.no_grad():
        out = model.generate(ids, **args)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)   # [B, NEW], [B, NEW, vocab]


def assert_logits_close(got, want):
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= TOL * scale, f"max |logit diff| {err} (logit scale {scale})"


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)], ids=["gqa4to2", "mha", "mqa6to1"])
@pytest.mark.parametrize("lengths", [[23], [19, 19, 19], [23, 9, 16]], ids=["b1", "b3", "b3_leftpad"])
def test_generate_full_matches_eager(heads, lengths):
    model = tiny_llama(*heads)
    ids, mask = prompts(lengths)
    want_tok, want_logits = generate(model, ids, mask, "eager")
    with kt.KvsieveCache(model.config, method="full", kv_dtype="float32") as cache:
        got_tok, got_logits = generate(model, ids, mask, kt.NAME, cache)
        assert torch.equal(got_tok, want_tok), (got_tok, want_tok)
        assert_logits_close(got_logits, want_logits)
        # One session per row, holding only that row's real tokens (no padding), every layer.
        assert len(cache.sessions) == len(lengths)
        assert cache.get_seq_length() == ids.shape[1] + NEW - 1   # the last token is never fed back
        for b, n in enumerate(lengths):
            s = cache.sessions[b]
            for layer in range(model.config.num_hidden_layers):
                assert s.layer_tokens(layer) == n + NEW - 1
            assert s.stats.decode_steps == (NEW - 1) * model.config.num_hidden_layers


def test_left_padding_is_invisible():
    """Each row of a left-padded kvsieve batch generates what eager attention generates for that
    prompt alone, unpadded."""
    model = tiny_llama()
    lengths = [23, 9, 16]
    ids, mask = prompts(lengths)
    with kt.KvsieveCache(model.config, method="full", kv_dtype="float32") as cache:
        got_tok, got_logits = generate(model, ids, mask, kt.NAME, cache)
    for b, n in enumerate(lengths):
        row = ids[b:b + 1, ids.shape[1] - n:]
        want_tok, want_logits = generate(model, row, torch.ones_like(row), "eager")
        assert torch.equal(got_tok[b:b + 1], want_tok)
        assert_logits_close(got_logits[b:b + 1], want_logits)


@pytest.mark.parametrize("lengths", [[23], [23, 9]], ids=["b1", "b2_leftpad"])
def test_beam_search_matches_eager(lengths):
    """Beam search reorders the rows every step (Session.fork per row): same beams as eager."""
    model = tiny_llama()
    ids, mask = prompts(lengths)
    kw = dict(num_beams=3, num_return_sequences=2, output_logits=False)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, num_beams=3,
                              num_return_sequences=2)
    with kt.KvsieveCache(model.config, method="full", kv_dtype="float32") as cache:
        model.set_attn_implementation(kt.NAME)
        with torch.no_grad():
            got = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW,
                                 do_sample=False, **{k: v for k, v in kw.items() if k != "output_logits"})
        assert len(cache.sessions) == 3 * len(lengths)
    assert torch.equal(got, want), (got, want)


def teacher_forced_eager_logits(model, ids, mask, new_tok):
    """Eager (full attention) logits of the steps of a generation whose tokens are new_tok: row t =
    the logits that predict new token t, computed over the prompt and new_tok[:, :t]."""
    model.set_attn_implementation("eager")
    seq = torch.cat([ids, new_tok], dim=1)
    m = torch.cat([mask, torch.ones_like(new_tok)], dim=1)
    pos = (m.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=m, position_ids=pos, use_cache=False).logits
    return logits[:, ids.shape[1] - 1:-1]


def sparse_run(model, ids, mask, **cfg):
    """generate() through kvsieve with cfg; returns (first step's and decode steps' max |logit diff|
    against eager full attention over the same tokens, relative to the logits' scale; the sessions'
    last selected fractions)."""
    with kt.KvsieveCache(model.config, kv_dtype="float32", **cfg) as cache:
        tok, logits = generate(model, ids, mask, kt.NAME, cache)
        frac = [s.stats.last_selected_fraction for s in cache.sessions]
    ref = teacher_forced_eager_logits(model, ids, mask, tok)
    scale = ref.abs().max().item()
    first = (logits[:, 0] - ref[:, 0]).abs().max().item() / scale
    rest = (logits[:, 1:] - ref[:, 1:]).abs().max().item() / scale
    print(f"{cfg}: first step {first:.2e}, decode steps {rest:.4f} of the logit scale; selected {frac}")
    return first, rest, frac


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparse_exact_topk_error_is_bounded(seed):
    """exact_topk at a 25% budget through generate(), a left-padded batch of 3. Its logits are
    compared with eager full attention over the same tokens (teacher forcing, so that a different
    token choice cannot make the comparison meaningless). The first step comes from the exact prompt
    pass: float rounding. The decode steps differ (the method really selects a quarter of the keys)
    but by little: with the q/k projections sharpened (std 0.5) each head's softmax puts almost all
    its mass on few keys, the top quarter keeps nearly all of it, and a head's output error is at
    most 2 x (dropped mass) x max |v|. Measured (seeds 0-2): 0.01% to 0.5% of the logits' scale; the
    bound is 2%. streaming with 4 tokens, which drops most of the mass, errs by ~120%."""
    model = tiny_llama(seed=seed, qk_std=0.5)
    ids, mask = prompts([64, 50, 57], seed=seed + 1)
    first, rest, frac = sparse_run(model, ids, mask, method="exact_topk", budget=0.25)
    assert first <= TOL
    assert 1e-6 < rest <= 0.02
    assert all(0.2 < f < 0.3 for f in frac), frac
    _, rest_streaming, _ = sparse_run(model, ids, mask, method="streaming", budget_tokens=4)
    assert rest_streaming > 10 * rest


def test_sparse_quest_runs_through_generate():
    """quest at a 25% budget through generate() (left-padded batch of 3): the first step is exact,
    the decode steps select a subset of pages and change the logits. No tight bound: the random
    model's keys have no locality, so quest's per-page min/max bounds rank 16-key pages almost at
    random and the error is that of dropping most pages (measured ~100% of the logits' scale, as
    streaming with 4 tokens); the bound checked is that of the exact_topk test above."""
    model = tiny_llama(qk_std=0.5)
    ids, mask = prompts([64, 50, 57])
    first, rest, frac = sparse_run(model, ids, mask, method="quest", budget=0.25)
    assert first <= TOL
    assert rest > 1e-3
    assert all(f < 0.5 for f in frac), frac


def test_full_cache_reports_seq_length_and_can_continue():
    """A second generate() call on the same cache continues the sequence (prompt turn = append)."""
    model = tiny_llama()
    ids, mask = prompts([17])
    with kt.KvsieveCache(model.config, method="full", kv_dtype="float32") as cache:
        tok1, _ = generate(model, ids, mask, kt.NAME, cache)
        seq = torch.cat([ids, tok1], dim=1)
        more = torch.randint(1, 101, (1, 5), generator=torch.Generator().manual_seed(3))
        seq2 = torch.cat([seq, more], dim=1)
        tok2, got_logits = generate(model, seq2, torch.ones_like(seq2), kt.NAME, cache)
    want_tok, want_logits = generate(model, seq2, torch.ones_like(seq2), "eager")
    assert torch.equal(tok2, want_tok)
    assert_logits_close(got_logits, want_logits)


def crop_then_compare(model, a, b, prompt, device="cpu"):
    """Cache a: the prompt, 6 drafts, crop(-4). Cache b: the prompt and the 2 kept drafts. Then 4
    more tokens into each: bit-identical logits. Returns (ids, drafts, after) for more checks."""
    model.set_attn_implementation(kt.NAME)
    ids, _ = prompts([prompt], seed=5)
    g = torch.Generator().manual_seed(6)
    drafts, after = torch.randint(1, 101, (1, 6), generator=g), torch.randint(1, 101, (1, 4), generator=g)
    ids, drafts, after = ids.to(device), drafts.to(device), after.to(device)
    model(ids, past_key_values=a)
    for t in range(6):
        model(drafts[:, t:t + 1], past_key_values=a)
    a.crop(-4)
    assert a.get_seq_length() == prompt + 2 and a.session.layer_tokens(2) == prompt + 2
    model(ids, past_key_values=b)
    for t in range(2):
        model(drafts[:, t:t + 1], past_key_values=b)
    for t in range(4):
        la = model(after[:, t:t + 1], past_key_values=a).logits
        lb = model(after[:, t:t + 1], past_key_values=b).logits
        assert torch.equal(la, lb)
    return ids, drafts, after


@pytest.mark.parametrize("method,kw", [("full", {}), ("quest", {"budget": 0.5}),
                                       ("csattention", {"budget": 0.5, "max_rollback": 8}),
                                       ("hgca", {"budget": 0.5, "max_rollback": 8})])
def test_crop_continues_as_a_cache_that_never_saw_the_tokens(method, kw):
    """cache.crop(-k) after k decode steps: the next forwards give bit-identical logits to a cache
    fed only the kept tokens (the independent reference: a fresh cache, same calls up to the kept
    point)."""
    model = tiny_llama()
    a = kt.KvsieveCache(model.config, method=method, kv_dtype="float32", **kw)
    b = kt.KvsieveCache(model.config, method=method, kv_dtype="float32", **kw)
    with a, b, torch.no_grad():
        ids, drafts, after = crop_then_compare(model, a, b, prompt=20)
        # A verification pass of several tokens (append), then its rejected tail dropped. The kept
        # token's K/V come from a 3-token forward here and a 1-token forward in the reference, which
        # torch's matrix products round differently: float tolerance, and only where attention
        # is dense (a sparse method may then pick other keys).
        model(drafts[:, :3], past_key_values=a)
        a.crop(-2)
        assert a.get_seq_length() == 27 and a.session.layer_tokens(0) == 27
        model(drafts[:, :1], past_key_values=b)
        la, lb = model(after[:, :1], past_key_values=a).logits, model(after[:, :1], past_key_values=b).logits
        if method == "full":
            assert_logits_close(la, lb)


@pytest.mark.parametrize("method", ["full", "quest"])
def test_assisted_generation_crops_the_rejected_drafts(method):
    """generate() with an assistant model (speculative decoding): the target verifies the drafts
    with one pass (the first one with the prompt: a prefill; then appends) and crops the rejected
    ones. With full attention and float32 KV the tokens equal plain greedy decoding with
    transformers' eager attention and DynamicCache."""
    model = tiny_llama(seed=0)
    assistant = tiny_llama(seed=1, layers=2)   # a different model: some drafts are rejected
    ids, mask = prompts([15], seed=7)
    want, want_logits = generate(model, ids, mask, "eager")
    assistant.set_attn_implementation("eager")
    with kt.KvsieveCache(model.config, method=method, budget=0.5, kv_dtype="float32") as cache:
        got, got_logits = generate(model, ids, mask, kt.NAME, cache, assistant_model=assistant)
        assert cache.get_seq_length() == cache.session.layer_tokens(0) == ids.shape[1] + NEW - 1
    assert got.shape == want.shape
    if method == "full":
        assert torch.equal(got, want)
        assert_logits_close(got_logits, want_logits)


def test_assisted_generation_with_a_history_method_is_refused_clearly():
    """The first verification pass of assisted decoding comes with the prompt (one prefill): a
    method whose index keeps history cannot roll back below the prompt its index was built on, so
    the crop raises (naming the range) instead of decoding from a wrong index."""
    model = tiny_llama(seed=0)
    assistant = tiny_llama(seed=1, layers=2)
    ids, mask = prompts([15], seed=7)
    assistant.set_attn_implementation("eager")
    with kt.KvsieveCache(model.config, method="csattention", kv_dtype="float32", max_rollback=16) as cache:
        with pytest.raises(kvsieve.InvalidArgumentError, match=r"num_tokens: expected (\d+)\.\.\1 "):
            generate(model, ids, mask, kt.NAME, cache, assistant_model=assistant)


def test_refusals():
    model = tiny_llama()
    ids, mask = prompts([12, 7])
    # The model must run kvsieve attention with the cache.
    cache = kt.KvsieveCache(model.config)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="set_attn_implementation"):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    cache.close()
    # kvsieve attention without the cache.
    model.set_attn_implementation(kt.NAME)
    with pytest.raises(ValueError, match="past_key_values=kvsieve.transformers.KvsieveCache"):
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    # Right padding.
    right = torch.flip(mask, dims=[1])
    with kt.KvsieveCache(model.config) as cache:
        with pytest.raises(NotImplementedError, match="only left padding"):
            with torch.no_grad():
                model(input_ids=ids, attention_mask=right, past_key_values=cache)
    # Removing tokens: a positive count (transformers' legacy absolute length) and more than held are
    # refused; a method whose index keeps history needs max_rollback.
    with kt.KvsieveCache(model.config) as cache:
        generate(model, ids, mask, kt.NAME, cache)
        cache.crop(0)   # a no-op is fine
        with pytest.raises(ValueError, match="expected a negative number"):
            cache.crop(3)
        with pytest.raises(ValueError, match="cannot remove 100 positions"):
            cache.crop(-100)
    with kt.KvsieveCache(model.config, method="csattention") as cache:
        generate(model, ids[:1], mask[:1], kt.NAME, cache)
        seen = cache.get_seq_length()
        with pytest.raises(kvsieve.InvalidArgumentError, match="max_rollback"):
            cache.crop(-2)
        assert cache.get_seq_length() == seen and cache.session.layer_tokens(0) == seen
    with pytest.raises(ValueError, match="backend: expected 'cpu' or 'cuda'"):
        kt.KvsieveCache(model.config, backend="tpu")
    # Dropout and wrong dtypes.
    m64 = tiny_llama().to(torch.float64)
    m64.set_attn_implementation(kt.NAME)
    with kt.KvsieveCache(m64.config) as cache:
        with pytest.raises(TypeError, match=r"float32, float16 or bfloat16, got torch.float64"):
            with torch.no_grad():
                m64(input_ids=ids[:1], past_key_values=cache)


def test_unsupported_layer_types_are_refused():
    from transformers import LlamaConfig, MistralConfig
    cfg = MistralConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    with pytest.raises(NotImplementedError, match="sliding"):
        kt.KvsieveCache(cfg)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    cfg.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(NotImplementedError, match="only full-attention layers"):
        kt.KvsieveCache(cfg)


# ---- the cuda backend (skipped without a GPU and a CUDA build of kvsieve) ----
def _cuda_ready():
    if not torch.cuda.is_available():
        return False
    return any(m.name == "full" and "cuda" in m.backends for m in kvsieve.methods())


cuda_only = pytest.mark.skipif(not _cuda_ready(), reason="needs a GPU and kvsieve built with CUDA")
CUDA_TOL = 3e-3   # fp16 KV (the cuda backend stores bf16/fp16): K/V rounding sets the tolerance


def tiny_llama_cuda(num_heads=4, num_kv_heads=2, seed=0, layers=3):
    """tiny_llama with head dim 64 (the cuda kernels take 64, 128 and 256) on the GPU, float32; the
    weights' std shrinks with the width so that the logits' spread does not grow with it."""
    return tiny_llama(num_heads, num_kv_heads, head_dim=64, layers=layers, seed=seed,
                      std=0.15 * (1.0 / num_heads) ** 0.5).to("cuda")


def _close(got, want, tol=CUDA_TOL):
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= tol * scale, f"max |logit diff| {err} (logit scale {scale})"


@cuda_only
@pytest.mark.parametrize("lengths", [[23], [23, 9, 16]], ids=["b1", "b3_leftpad"])
def test_cuda_generate_full_matches_eager(lengths):
    """generate() with the cache on the cuda backend (tensors stay on the GPU): the same tokens as
    eager attention, logits within fp16 KV rounding; one session per row, every layer holding that
    row's real tokens."""
    model = tiny_llama_cuda()
    ids, mask = prompts(lengths)
    ids, mask = ids.cuda(), mask.cuda()
    want_tok, want_logits = generate(model, ids, mask, "eager")
    with kt.KvsieveCache(model.config, method="full", kv_dtype="float16", backend="cuda") as cache:
        got_tok, got_logits = generate(model, ids, mask, kt.NAME, cache)
        assert torch.equal(got_tok, want_tok), (got_tok, want_tok)
        _close(got_logits, want_logits)
        for b, n in enumerate(lengths):
            assert cache.sessions[b].layer_tokens(model.config.num_hidden_layers - 1) == n + NEW - 1


@cuda_only
def test_cuda_beam_search_matches_eager():
    """Beam search on the cuda backend: every step's reorder forks the sessions on the GPU (KV pages
    shared copy-on-write); the same beams as eager attention."""
    model = tiny_llama_cuda()
    ids, mask = prompts([23, 9])
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(max_new_tokens=NEW, do_sample=False, num_beams=3, num_return_sequences=2)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, **kw)
    with kt.KvsieveCache(model.config, method="full", kv_dtype="float16", backend="cuda") as cache:
        model.set_attn_implementation(kt.NAME)
        with torch.no_grad():
            got = model.generate(ids, attention_mask=mask, past_key_values=cache, **kw)
        assert len(cache.sessions) == 6
    assert torch.equal(got, want), (got, want)


@cuda_only
@pytest.mark.parametrize("method,kw", [("full", {}), ("quest", {"budget": 0.5})])
def test_cuda_crop_continues_as_a_cache_that_never_saw_the_tokens(method, kw):
    """cache.crop(-k) on the cuda backend (Session.truncate on the GPU): the next steps give
    bit-identical logits to a cache fed only the kept tokens."""
    model = tiny_llama_cuda()
    a = kt.KvsieveCache(model.config, method=method, kv_dtype="float16", backend="cuda", **kw)
    b = kt.KvsieveCache(model.config, method=method, kv_dtype="float16", backend="cuda", **kw)
    with a, b, torch.no_grad():
        crop_then_compare(model, a, b, prompt=40, device="cuda")


@cuda_only
def test_cuda_sparse_quest_runs_through_generate():
    """quest at 25% on the cuda backend through generate() (left-padded batch of 2): the first step
    comes from the exact prompt pass (fp16 KV rounding), the decode steps select a subset of pages."""
    model = tiny_llama_cuda()
    ids, mask = prompts([64, 50])
    ids, mask = ids.cuda(), mask.cuda()
    with kt.KvsieveCache(model.config, method="quest", budget=0.25, kv_dtype="float16", backend="cuda") as cache:
        tok, logits = generate(model, ids, mask, kt.NAME, cache)
        frac = [s.stats.last_selected_fraction for s in cache.sessions]
    ref = teacher_forced_eager_logits(model, ids, mask, tok)
    _close(logits[:, 0], ref[:, 0])
    assert all(0.0 < f < 0.5 for f in frac), frac


def test_missing_dependency_message(monkeypatch):
    """Importing kvsieve.transformers without transformers names the missing package."""
    import importlib
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "kvsieve.transformers", raising=False)
    with pytest.raises(ImportError, match="needs Hugging Face transformers"):
        importlib.import_module("kvsieve.transformers")
    monkeypatch.undo()
    importlib.import_module("kvsieve.transformers")
    assert kvsieve.transformers.NAME == "kvsieve"


if __name__ == "__main__":
    # ctest entry point: 77 = skipped when torch/transformers are missing.
    sys.exit(pytest.main([__file__, "-q", "-rs", "-p", "no:cacheprovider"]))
