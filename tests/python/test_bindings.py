# SPDX-License-Identifier: Apache-2.0
"""The Python binding against float64 NumPy references on random inputs.

Every registered method is covered: the method list is read from the library's registry
(kvs_method_count / kvs_method_name through kvsieve.method_names()) when the tests are collected,
so methods added later are tested without touching this file.

Run: PYTHONPATH=<build>/bindings/python python -m pytest tests/python/test_bindings.py
(ctest runs it as `python_bindings`; KVSIEVE_CLI names the kvsieve command for the trace tests.)
"""

import array
import errno
import gc
import os
import pickle
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvsieve

METHODS = kvsieve.method_names()
L, HQ, HKV, D, N = 2, 4, 2, 32, 384


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def ref_attend(q, K, V, scale):
    """float64 attention of q [Hq, d] over K, V [n, Hkv, d] -> o [Hq, d], lse [Hq] (natural log)."""
    q, K, V = (np.asarray(x, dtype=np.float64) for x in (q, K, V))
    hq, hkv = q.shape[0], K.shape[1]
    g = hq // hkv
    o = np.empty(q.shape)
    lse = np.empty(hq)
    for h in range(hq):
        s = scale * (K[:, h // g, :] @ q[h])
        m = s.max()
        p = np.exp(s - m)
        lse[h] = m + np.log(p.sum())
        o[h] = p @ V[:, h // g, :] / p.sum()
    return o, lse


def ref_causal(q, K, V, scale, past=0):
    """Causal attention of a chunk q [n, Hq, d] whose token i sees keys 0..past+i of K, V."""
    out = np.empty(q.shape)
    for i in range(q.shape[0]):
        out[i], _ = ref_attend(q[i], K[: past + i + 1], V[: past + i + 1], scale)
    return out


def ref_over(q, K, V, scale, sel_per_kv_head):
    """Attention of each query head over the keys its KV head selected."""
    hq, hkv = q.shape[0], K.shape[1]
    g = hq // hkv
    o = np.empty(q.shape)
    lse = np.empty(hq)
    for h in range(hq):
        idx = sel_per_kv_head[h // g]
        oh, lh = ref_attend(q[h : h + 1], K[idx][:, h // g : h // g + 1], V[idx][:, h // g : h // g + 1], scale)
        o[h], lse[h] = oh[0], lh[0]
    return o, lse


def make(method, **kw):
    kw.setdefault("kv_dtype", "float32")  # exact storage: the reference sees the same K/V
    kw.setdefault("num_threads", 2)
    return kvsieve.Session(L, HQ, HKV, D, method=method, **kw)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


SCALE = 1.0 / np.sqrt(D)

# Methods whose default selection is per query head, and the parameters of their per-KV-head mode.
PER_KV_HEAD_PARAMS = {"lfps": "gqa=per_kv_head", "quest": "gqa=sum"}


# ---- versions and registry -----------------------------------------------------------------------
def test_version_and_abi():
    assert kvsieve.version().count(".") == 2
    major, minor, patch = (int(x) for x in kvsieve.version().split("."))
    assert kvsieve.version_number() == major * 10000 + minor * 100 + patch
    assert kvsieve.abi_version() == kvsieve.capi.KVS_ABI_VERSION
    with pytest.raises(kvsieve.Error) as e:
        kvsieve.capi.abi_check(kvsieve.abi_version() + 1)
    assert e.value.code == kvsieve.STATUS_ABI_MISMATCH


def test_registry_lists_every_method():
    names = [kvsieve.capi.kvs_method_name(i) for i in range(kvsieve.capi.kvs_method_count())]
    assert names == METHODS and len(names) >= 4
    assert kvsieve.capi.kvs_method_name(len(names)) is None
    infos = {m.name: m for m in kvsieve.methods()}
    for name in names:
        assert infos[name].doc
        assert "cpu" in infos[name].backends
        for p in infos[name].params:
            assert p.name and p.type and p.doc
    assert {"full", "exact_topk", "streaming", "quest"} <= set(names)


# ---- every method against the NumPy reference ----------------------------------------------------
@pytest.mark.parametrize("budget", [1.0, 0.1])
@pytest.mark.parametrize("method", METHODS)
def test_method_against_reference(method, budget, rng):
    """Prefill's optional output is causal attention of the chunk, whatever the method. Each decode
    step's selection is valid (ascending, unique, in range) and its output is exact attention over
    that selection, merged with whatever extra state the method adds through the LSE (so the extra
    state can only add mass: lse >= lse over the selection, with equality when there is none).
    When the selection is the whole context, that is dense attention."""
    q, k, v = rand(rng, N, HQ, D), rand(rng, N, HKV, D), rand(rng, N, HKV, D)
    # last_selection reports one key set per KV head; a method selecting per query head by default
    # runs here in its per-KV-head mode so that the reported set is what each head attended.
    extra = {"method_params": PER_KV_HEAD_PARAMS[method]} if method in PER_KV_HEAD_PARAMS else {}
    with make(method, budget=budget, **extra) as s:
        for layer in range(L):
            o_pre = np.full((N, HQ, D), np.nan, dtype=np.float32)
            s.prefill(layer, q * (layer + 1), k, v, out=o_pre)
            np.testing.assert_allclose(o_pre[:: N // 16], ref_causal(q * (layer + 1), k, v, SCALE)[:: N // 16],
                                       rtol=2e-4, atol=2e-5)
        s.build_index()
        K, V = k, v
        for step in range(3):
            qn, kn, vn = rand(rng, HQ, D) * 3, rand(rng, HKV, D), rand(rng, HKV, D)
            K, V = np.concatenate([K, kn[None]]), np.concatenate([V, vn[None]])
            for layer in range(L):
                o, lse = s.decode(layer, qn, kn, vn)
                assert o.dtype == np.float32 and o.shape == (HQ, D) and lse.shape == (HQ,)
                assert np.isfinite(o).all() and np.isfinite(lse).all()
                sels = [s.last_selection(layer, h) for h in range(HKV)]
                for sel in sels:
                    assert sel.dtype == np.int32 and 1 <= sel.size <= K.shape[0]
                    assert (np.diff(sel) > 0).all() and sel[0] >= 0 and sel[-1] < K.shape[0]
                assert s.stats.last_selected_keys == pytest.approx(np.mean([x.size for x in sels]))
                ro, rl = ref_over(qn, K, V, SCALE, sels)
                assert (lse >= rl - 1e-4).all(), f"{method}: lse below attention over its own selection"
                exact = np.abs(lse - rl) < 1e-4
                np.testing.assert_allclose(o[exact], ro[exact], rtol=2e-4, atol=2e-5,
                                           err_msg=f"{method} step {step} layer {layer}")
                if method in ("full", "exact_topk", "streaming", "quest"):
                    assert exact.all(), f"{method} has no extra state: output must be attention over its selection"
                if all(sel.size == K.shape[0] for sel in sels):
                    do, dl = ref_attend(qn, K, V, SCALE)
                    np.testing.assert_allclose(o, do, rtol=2e-4, atol=2e-5)
                    np.testing.assert_allclose(lse, dl, rtol=1e-5, atol=1e-4)
                if method == "full" or (method == "exact_topk" and budget == 1.0):
                    assert all(sel.size == K.shape[0] for sel in sels)
        assert s.layer_tokens(0) == N + 3
        assert s.stats.decode_steps == 3 * L


def test_exact_topk_selects_the_numpy_topk(rng):
    q, k, v = rand(rng, N, HQ, D), rand(rng, N, HKV, D), rand(rng, N, HKV, D)
    budget = 24
    with make("exact_topk", budget_tokens=budget, num_threads=1) as s:
        s.prefill(0, q, k, v)
        s.prefill(1, q, k, v)
        s.build_index()
        qn, kn, vn = rand(rng, HQ, D) * 4, rand(rng, HKV, D), rand(rng, HKV, D)
        s.decode(0, qn, kn, vn)
        K = np.concatenate([k, kn[None]]).astype(np.float64)
        g = HQ // HKV
        for kh in range(HKV):
            # group-summed softmax over the whole context
            score = np.zeros(K.shape[0])
            for h in range(kh * g, (kh + 1) * g):
                z = SCALE * K[:, kh] @ qn[h].astype(np.float64)
                p = np.exp(z - z.max())
                score += p / p.sum()
            want = np.sort(np.argsort(-score)[:budget])
            np.testing.assert_array_equal(s.last_selection(0, kh), want)


def test_append_and_chunked_prefill(rng):
    q, k, v = rand(rng, N, HQ, D), rand(rng, N, HKV, D), rand(rng, N, HKV, D)
    with make("full") as s:
        s.prefill(0, q[:100], k[:100], v[:100])
        o2 = np.empty((N - 100, HQ, D), np.float32)
        s.prefill(0, q[100:], k[100:], v[100:], out=o2)
        np.testing.assert_allclose(o2[::37], ref_causal(q[100:], k, v, SCALE, past=100)[::37], rtol=2e-4, atol=2e-5)
        s.prefill(1, q, k, v)
        s.build_index()
        qa, ka, va = rand(rng, 5, HQ, D), rand(rng, 5, HKV, D), rand(rng, 5, HKV, D)
        oa = np.empty((5, HQ, D), np.float32)
        s.append(0, qa, ka, va, out=oa)
        K, V = np.concatenate([k, ka]), np.concatenate([v, va])
        np.testing.assert_allclose(oa, ref_causal(qa, K, V, SCALE, past=N), rtol=2e-4, atol=2e-5)
        assert s.layer_tokens(0) == N + 5 and s.layer_tokens(1) == N


@pytest.mark.parametrize("method,kw", [("full", {}), ("quest", {}), ("csattention", {"max_rollback": 8}),
                                       ("ctkvr", {"max_rollback": 8}), ("lfps", {"max_rollback": 8}),
                                       ("retroinfer", {"max_rollback": 8})])
def test_truncate_decodes_on_as_if_the_tokens_never_came(method, kw, rng):
    """Session.truncate after decode steps: the next steps equal, bit for bit, those of a fresh
    session fed only the kept tokens (the reference); out of range raises naming num_tokens."""
    q, k, v = rand(rng, N + 12, HQ, D), rand(rng, N + 12, HKV, D), rand(rng, N + 12, HKV, D)
    x, y = make(method, budget=0.2, **kw), make(method, budget=0.2, **kw)
    with x, y:
        for s in (x, y):
            for layer in range(L):
                s.prefill(layer, q[:N], k[:N], v[:N])
            s.build_index()
        for t in range(N, N + 6):
            for layer in range(L):
                x.decode(layer, q[t], k[t], v[t])
        x.truncate(N + 2)
        assert x.layer_tokens(0) == N + 2 and x.layer_tokens(1) == N + 2
        for t in range(N, N + 2):
            for layer in range(L):
                y.decode(layer, q[t], k[t], v[t])
        for t in range(N + 6, N + 12):
            for layer in range(L):
                ox, lx = x.decode(layer, q[t], k[t], v[t])
                oy, ly = y.decode(layer, q[t], k[t], v[t])
                np.testing.assert_array_equal(ox, oy)
                np.testing.assert_array_equal(lx, ly)
                np.testing.assert_array_equal(x.last_selection(layer, 0), y.last_selection(layer, 0))
        with pytest.raises(kvsieve.InvalidArgumentError, match="num_tokens: expected 0..") as e:
            x.truncate(N + 100)
        assert "Session.truncate" in str(e.value)
        with pytest.raises(TypeError, match="num_tokens"):
            x.truncate(3.0)


def test_lse_base_2_is_lse_over_ln2(rng):
    q, k, v = rand(rng, N + 1, HQ, D), rand(rng, N + 1, HKV, D), rand(rng, N + 1, HKV, D)
    with make("quest", budget=0.3) as a, make("quest", budget=0.3, lse_base=2) as b:
        for s in (a, b):
            s.prefill(0, q[:N], k[:N], v[:N])
            s.build_index()
        oa, la = a.decode(0, q[N], k[N], v[N])
        ob, lb = b.decode(0, q[N], k[N], v[N])
        np.testing.assert_array_equal(oa, ob)
        np.testing.assert_allclose(lb, la.astype(np.float64) / np.log(2.0), rtol=1e-6, atol=1e-6)
    for bad in ("ten", 10, True):
        with pytest.raises(ValueError, match="lse_base"):
            make("full", lse_base=bad)
    with pytest.raises(kvsieve.InvalidArgumentError, match="max_rollback"):
        make("full", max_rollback=-1)


def test_decode_batch_equals_single_decodes(rng):
    q, k, v = rand(rng, N, HQ, D), rand(rng, N, HKV, D), rand(rng, N, HKV, D)
    a, b = make("quest", budget=0.2), make("quest", budget=0.2)
    for s, scale in ((a, 1.0), (b, -1.0)):
        for layer in range(L):
            s.prefill(layer, q * scale, k, v)
        s.build_index()
    fa, fb = a.fork(), b.fork()
    qb, kb, vb = rand(rng, 2, HQ, D), rand(rng, 2, HKV, D), rand(rng, 2, HKV, D)
    o, lse = kvsieve.decode_batch([a, b], 1, qb, kb, vb)
    assert o.shape == (2, HQ, D) and lse.shape == (2, HQ)
    for i, s in enumerate((fa, fb)):
        oi, li = s.decode(1, qb[i], kb[i], vb[i])
        np.testing.assert_allclose(o[i], oi, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(lse[i], li, rtol=1e-6, atol=1e-7)
    with pytest.raises(kvsieve.Error) as e:
        kvsieve.decode_batch([a, a], 1, qb, kb, vb)
    assert e.value.code == kvsieve.STATUS_INVALID_ARGUMENT
    for s in (a, b, fa, fb):
        s.close()


def test_errors_are_builtin_exception_subclasses(tmp_path):
    with pytest.raises(ValueError) as e:  # an unknown method: INVALID_ARGUMENT
        kvsieve.Session(L, HQ, HKV, D, method="no_such_method")
    assert isinstance(e.value, kvsieve.InvalidArgumentError) and isinstance(e.value, kvsieve.Error)
    assert e.value.code == kvsieve.STATUS_INVALID_ARGUMENT
    assert e.value.c_message.startswith("params->method:") and e.value.message.startswith("method:")
    with pytest.raises(FileNotFoundError) as e:  # IO with ENOENT
        kvsieve.Session.load(str(tmp_path / "missing.kvt"))
    assert isinstance(e.value, kvsieve.LibraryIOError) and e.value.code == kvsieve.STATUS_IO
    assert e.value.errno == errno.ENOENT and "missing.kvt" in e.value.message
    bad = tmp_path / "bad.kvt"
    bad.write_bytes(b"not a tables file at all, just bytes" * 8)
    with pytest.raises(kvsieve.FormatError) as e:
        kvsieve.Session.load(str(bad))
    assert isinstance(e.value, ValueError) and e.value.status.startswith("FORMAT_")
    with make("full") as s:
        with pytest.raises(kvsieve.InvalidStateError):  # decode before prefill and build_index
            s.decode(0, np.zeros((HQ, D), np.float32) + 1, np.ones((HKV, D), np.float32),
                     np.ones((HKV, D), np.float32))
    assert kvsieve._errors.python_names("kvs_session_decode: params->budget x; call kvs_batch_plan first") == \
        "Session.decode: budget x; call Batch.plan first"
    # Pickling keeps the class and every field.
    err = kvsieve._errors.make(kvsieve.STATUS_IO, "kvs_session_load: cannot open 'x'", errno.ENOENT)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) is kvsieve.LibraryFileNotFoundError
    assert (back.code, back.message, back.c_message, back.backend_code) == (
        err.code, err.message, err.c_message, err.backend_code)


def test_torch_in_torch_out_on_the_cpu(rng):
    torch = pytest.importorskip("torch")
    q, k, v = rand(rng, N, HQ, D), rand(rng, N, HKV, D), rand(rng, N, HKV, D)
    qn, kn, vn = rand(rng, 1, HQ, D)[0], rand(rng, 1, HKV, D)[0], rand(rng, 1, HKV, D)[0]
    with make("full") as a, make("full") as b:
        for s, conv in ((a, lambda x: x), (b, torch.from_numpy)):
            for layer in range(L):
                s.prefill(layer, conv(q), conv(k), conv(v))
            s.build_index()
        o_np, l_np = a.decode(0, qn, kn, vn)
        o_t, l_t = b.decode(0, torch.from_numpy(qn), torch.from_numpy(kn), torch.from_numpy(vn))
        assert isinstance(o_t, torch.Tensor) and o_t.dtype == torch.float32 and o_t.device.type == "cpu"
        assert isinstance(l_t, torch.Tensor) and l_t.dtype == torch.float32 and tuple(l_t.shape) == (HQ,)
        np.testing.assert_array_equal(o_t.numpy(), o_np)
        np.testing.assert_array_equal(l_t.numpy(), l_np)
        # A bfloat16 query gives a bfloat16 output (the LSE stays float32).
        qb = torch.from_numpy(qn).bfloat16()
        o_b, l_b = a.fork().decode(0, qb, torch.from_numpy(kn), torch.from_numpy(vn))
        assert o_b.dtype == torch.bfloat16 and l_b.dtype == torch.float32


class _ViaDLPack:
    """Exposes a tensor only through DLPack (not a torch.Tensor, so the binding takes the DLPack path)."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__() if stream is None else self.t.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def _contiguous_strides(shape):
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return tuple(reversed(out))


def test_torch_tensors_read_directly_match_dlpack(rng):
    """The binding reads a torch.Tensor's metadata directly (a DLPack export costs ~20 us per CUDA
    tensor); what it reads must be what DLPack says, and what it does not take must still go through
    DLPack (requires_grad: refused there). A pending negation is refused: its memory holds the values
    before it, and torch's DLPack export passes that memory on as it is."""
    torch = pytest.importorskip("torch")
    base = torch.from_numpy(rng.standard_normal((6, 4, 8)).astype(np.float32))
    views = [base, base[:, 1], base.transpose(0, 1), base[2:], base.bfloat16(), base.half(), base[..., ::2]]
    for t in views:
        for output in (0, 1):
            got = kvsieve.capi.describe_tensor(t, output)
            ref = kvsieve.capi.describe_tensor(_ViaDLPack(t), output)
            ref_strides = ref[5] if ref[5] is not None else _contiguous_strides(ref[4])
            assert got[:5] == ref[:5] and got[5] == ref_strides
            assert got[7] + got[6] == ref[7] + ref[6] == t.data_ptr()
    with make("full") as s:
        s.prefill(0, torch.from_numpy(rand(rng, N, HQ, D)), torch.from_numpy(rand(rng, N, HKV, D)),
                  torch.from_numpy(rand(rng, N, HKV, D)))
        s.build_index()
        q, k, v = (torch.from_numpy(rand(rng, 1, h, D)[0]) for h in (HQ, HKV, HKV))
        with pytest.raises(BufferError, match="require gradient"):
            s.fork().decode(0, q.clone().requires_grad_(), k, v)
        with pytest.raises(ValueError, match="q: expected a tensor without a pending negation"):
            s.fork().decode(0, q._neg_view(), k, v)
        o_neg, _ = s.fork().decode(0, q._neg_view().resolve_neg(), k, v)
        o_ref, _ = s.fork().decode(0, -q, k, v)
        np.testing.assert_array_equal(o_neg.numpy(), o_ref.numpy())


def test_session_to_copies_the_state(rng):
    q, k, v = rand(rng, N, HQ, D), rand(rng, N, HKV, D), rand(rng, N, HKV, D)
    with make("quest", budget=0.2) as a:
        for layer in range(L):
            a.prefill(layer, q, k, v)
        a.build_index()
        b = a.to("cpu")
        assert (b.backend, b.device_id, b.method, b.num_layers) == ("cpu", 0, "quest", L)
        assert b.layer_tokens(0) == N and b.stats.tokens == a.stats.tokens
        for _ in range(3):
            qn, kn, vn = rand(rng, 1, HQ, D)[0], rand(rng, 1, HKV, D)[0], rand(rng, 1, HKV, D)[0]
            oa, la = a.decode(1, qn, kn, vn)
            ob, lb = b.decode(1, qn, kn, vn)
            np.testing.assert_array_equal(oa, ob)
            np.testing.assert_array_equal(la, lb)
        with pytest.raises(ValueError):
            a.to("tpu")
        b.close()


# ---- batches: plan once per token, decode per layer ----------------------------------------------
def _prefilled(method, prompts, **kw):
    """One session per prompt (q, k, v), every layer prefilled (layer l with q * (l + 1)) and indexed."""
    out = []
    for q, k, v in prompts:
        s = make(method, **kw)
        for layer in range(L):
            s.prefill(layer, q * (layer + 1), k, v)
        s.build_index()
        out.append(s)
    return out


@pytest.mark.parametrize("method", METHODS)
def test_batch_equals_decode_batch_and_single_decodes(method, rng):
    """kvsieve.Batch against two independent paths over separate sessions built from the same
    prompts: kvsieve.decode_batch and per-session decode. Three tokens, every layer, random inputs;
    the outputs must agree (and, for full, equal float64 dense attention)."""
    B = 3
    prompts = [(rand(rng, N, HQ, D), rand(rng, N, HKV, D), rand(rng, N, HKV, D)) for _ in range(B)]
    batched = _prefilled(method, prompts, budget=0.2)
    via_decode_batch = _prefilled(method, prompts, budget=0.2)
    via_decode = _prefilled(method, prompts, budget=0.2)
    K0 = [p[1] for p in prompts]  # layer 0's keys and values so far, per session (dense check)
    V0 = [p[2] for p in prompts]
    with kvsieve.Batch(batched) as b:
        assert len(b) == B and b.sessions == tuple(batched)
        for step in range(3):
            qn, kn, vn = rand(rng, L, B, HQ, D) * 2, rand(rng, L, B, HKV, D), rand(rng, L, B, HKV, D)
            K0 = [np.concatenate([K0[i], kn[0, i][None]]) for i in range(B)]
            V0 = [np.concatenate([V0[i], vn[0, i][None]]) for i in range(B)]
            b.plan()
            for layer in range(L):
                if step == 1:  # given outputs are filled in place (a float16 out is converted on write)
                    out, lse = np.empty((B, HQ, D), np.float16), np.empty((B, HQ), np.float32)
                    o, l = b.decode(layer, qn[layer], kn[layer], vn[layer], out=out, lse=lse)
                    assert o is out and l is lse
                    tol = dict(rtol=2e-3, atol=2e-3)
                else:
                    o, l = b.decode(layer, qn[layer], kn[layer], vn[layer])
                    assert o.dtype == np.float32 and o.shape == (B, HQ, D) and l.shape == (B, HQ)
                    tol = dict(rtol=1e-6, atol=1e-7)
                ro, rl = kvsieve.decode_batch(via_decode_batch, layer, qn[layer], kn[layer], vn[layer])
                np.testing.assert_allclose(o, ro, **tol, err_msg=f"{method} step {step} layer {layer}")
                np.testing.assert_allclose(l, rl, rtol=1e-6, atol=1e-7)
                for i, s in enumerate(via_decode):
                    so, sl = s.decode(layer, qn[layer, i], kn[layer, i], vn[layer, i])
                    np.testing.assert_allclose(o[i], so, **tol, err_msg=f"{method} session {i}")
                    np.testing.assert_allclose(l[i], sl, rtol=1e-6, atol=1e-7)
                if method == "full" and layer == 0:
                    for i in range(B):
                        do, dl = ref_attend(qn[0, i], K0[i], V0[i], SCALE)
                        np.testing.assert_allclose(o[i], do, rtol=max(tol["rtol"], 2e-4), atol=max(tol["atol"], 2e-5))
                        np.testing.assert_allclose(l[i], dl, rtol=1e-5, atol=1e-4)
        for s in batched:
            assert s.layer_tokens(0) == N + 3 and s.layer_tokens(L - 1) == N + 3
            assert s.stats.decode_steps == 3 * L
    assert b.closed
    for s in batched + via_decode_batch + via_decode:
        s.close()


def test_batch_errors(rng):
    prompts = [(rand(rng, 64, HQ, D), rand(rng, 64, HKV, D), rand(rng, 64, HKV, D)) for _ in range(2)]
    a, c = _prefilled("quest", prompts, budget=0.5)
    qn, kn, vn = rand(rng, 2, HQ, D), rand(rng, 2, HKV, D), rand(rng, 2, HKV, D)
    # creation: nothing, not a session, a closed session, a repeated one, mismatches
    with pytest.raises(ValueError, match="at least one session"):
        kvsieve.Batch([])
    with pytest.raises(TypeError, match=r"sessions\[1\]: expected a kvsieve.Session"):
        kvsieve.Batch([a, "c"])
    with pytest.raises(kvsieve.Error) as e:
        kvsieve.Batch([a, a])
    assert e.value.code == kvsieve.STATUS_INVALID_ARGUMENT and "twice" in e.value.message
    with kvsieve.Session(L, 2 * HQ, HKV, D, kv_dtype="float32") as wide, make("quest", budget=0.25) as other_budget, \
            make("streaming") as other_method, make("quest", softmax_scale=0.5) as other_scale:
        for bad in (wide, other_method, other_scale):
            with pytest.raises(kvsieve.Error) as e:
                kvsieve.Batch([a, bad])
            assert e.value.code == kvsieve.STATUS_INVALID_ARGUMENT and "sessions[1]" in e.value.message
        # same method, another budget: allowed at creation; the plan then wants it prefilled
        with kvsieve.Batch([a, other_budget]) as b:
            with pytest.raises(kvsieve.Error) as e:
                b.plan()
            assert e.value.code == kvsieve.STATUS_INVALID_STATE
    with pytest.raises(kvsieve.Error) as e:
        kvsieve.capi.batch_create([])  # the library's own count check
    assert e.value.code == kvsieve.STATUS_INVALID_ARGUMENT and "count" in e.value.message
    with pytest.raises(TypeError, match=r"sessions\[0\]"):
        kvsieve.capi.batch_create([None])

    b = kvsieve.Batch([a, c])
    assert len(b) == 2 and kvsieve.capi.batch_create([a._h]).size() == 1
    with pytest.raises(kvsieve.Error) as e:
        b.decode(0, qn, kn, vn)  # no plan yet
    assert e.value.code == kvsieve.STATUS_INVALID_STATE and "plan" in e.value.message
    b.plan()
    with pytest.raises(kvsieve.Error) as e:
        b.decode(L, qn, kn, vn)
    assert e.value.code == kvsieve.STATUS_INVALID_ARGUMENT and "layer" in e.value.message
    with pytest.raises(ValueError, match=r"q: expected shape \[2, 4, 32\], got \[1, 4, 32\]"):
        b.decode(0, qn[:1], kn, vn)
    with pytest.raises(TypeError, match="k_new: expected dtype"):
        b.decode(0, qn, kn.astype(np.float64), vn)
    assert a.layer_tokens(0) == 64  # rejected calls changed nothing
    b.decode(0, qn, kn, vn)
    with pytest.raises(kvsieve.Error) as e:
        b.decode(0, qn, kn, vn)  # the same layer twice under one plan
    assert e.value.code == kvsieve.STATUS_INVALID_STATE and "already decoded" in e.value.message
    assert a.layer_tokens(0) == 65 and c.layer_tokens(0) == 65
    b.plan()  # replaces the plan whose layer 1 was not decoded
    b.decode(0, qn, kn, vn)
    b.decode(1, qn, kn, vn)
    assert a.layer_tokens(0) == 66 and a.layer_tokens(1) == 65
    # the sessions stay usable on their own between tokens
    a.decode(1, qn[0], kn[0], vn[0])
    assert a.layer_tokens(1) == 66
    # a session closed under the batch: the batch refuses (cleanly), the rest stays usable
    c.close()
    with pytest.raises(ValueError, match=r"sessions\[1\]: expected an open session"):
        b.plan()
    with pytest.raises(ValueError, match=r"sessions\[1\]: expected an open session"):
        b.decode(0, qn, kn, vn)
    with pytest.raises(ValueError, match=r"sessions\[1\]: expected an open session"):
        kvsieve.Batch([a, c])
    b.close()
    b.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        b.plan()
    with pytest.raises(ValueError, match="closed"):
        len(b)
    a.close()


def test_batch_keeps_its_sessions_alive(rng):
    """The batch references the sessions' native handles: deleting every Session object (and
    collecting) leaves the batch working; batch and sessions may then go in any order."""
    prompts = [(rand(rng, 64, HQ, D), rand(rng, 64, HKV, D), rand(rng, 64, HKV, D)) for _ in range(2)]
    ref = _prefilled("exact_topk", prompts, budget=0.25)
    random.seed(9)
    for trial in range(4):
        sessions = _prefilled("exact_topk", prompts, budget=0.25)
        b = kvsieve.Batch(sessions)
        del sessions
        gc.collect()
        qn, kn, vn = rand(rng, 2, HQ, D), rand(rng, 2, HKV, D), rand(rng, 2, HKV, D)
        b.plan()
        o, lse = b.decode(0, qn, kn, vn)
        forks = [s.fork() for s in ref]
        for i, f in enumerate(forks):
            fo, fl = f.decode(0, qn[i], kn[i], vn[i])
            np.testing.assert_allclose(o[i], fo, rtol=1e-6, atol=1e-7)
        b.decode(1, qn, kn, vn)
        assert [s.layer_tokens(1) for s in b.sessions] == [65, 65]
        # drop the batch and the sessions in a random order; none of it may crash
        victims = [b] + list(b.sessions) + forks
        del b, f, forks
        random.shuffle(victims)
        while victims:
            v = victims.pop()
            if random.random() < 0.5:
                v.close()
            del v
            gc.collect()
    for s in ref:
        s.close()


def test_method_unsupported_reason():
    infos = {m.name: m for m in kvsieve.methods()}
    for name in METHODS:
        assert kvsieve.method_unsupported_reason(name, "cpu") is None
        assert kvsieve.method_unsupported_reason(name, kvsieve.capi.KVS_BACKEND_CPU) is None
        for backend in ("cuda", "hybrid"):
            why = kvsieve.method_unsupported_reason(name, backend)
            # a reason exactly when the registry does not list the backend
            assert (why is None) == (backend in infos[name].backends), (name, backend, why)
            assert why is None or (isinstance(why, str) and len(why) > 10)
        # hybrid runs every method exactly where the build has CUDA
        assert (kvsieve.method_unsupported_reason(name, "HYBRID") is None) == (
            kvsieve.method_unsupported_reason("full", "cuda") is None)
    assert kvsieve.method_unsupported_reason("no_such_method", "cpu") is None
    assert kvsieve.method_unsupported_reason("no_such_method", "hybrid") is None
    for bad in (0, 7, -1):
        assert "backend" in kvsieve.method_unsupported_reason("full", bad)
    with pytest.raises(ValueError, match="backend"):
        kvsieve.method_unsupported_reason("full", "tpu")
    with pytest.raises(TypeError, match="backend"):
        kvsieve.method_unsupported_reason("full", 1.5)


# ---- dtypes, layouts, devices: zero copy, strict checks -----------------------------------------
def test_zero_copy_through_dlpack_and_buffer(rng):
    x = rand(rng, 6, HQ, D)
    dev_t, dev_id, code, bits, shape, strides, off, addr = kvsieve.capi.describe_tensor(x, 0)
    assert (dev_t, code, bits, shape) == (1, 2, 32, x.shape)
    assert addr + off == x.__array_interface__["data"][0]
    view = x[:, ::2, 1:]  # strided, offset: still described in place
    _, _, _, _, shape, strides, off, addr = kvsieve.capi.describe_tensor(view, 0)
    assert shape == view.shape and strides == (HQ * D, 2 * D, 1)
    assert addr + off == view.__array_interface__["data"][0]
    ro = np.frombuffer(x.tobytes(), dtype=np.float32).reshape(x.shape)  # read-only: buffer protocol
    assert kvsieve.capi.describe_tensor(ro, 0)[7] == ro.__array_interface__["data"][0]
    h = np.arange(8, dtype=np.float16)
    assert kvsieve.capi.describe_tensor(memoryview(h), 0)[2:4] == (2, 16)
    a = array.array("f", [1.0, 2.0])
    assert kvsieve.capi.describe_tensor(a, 0)[4] == (2,)


def test_strided_and_half_inputs_match_contiguous(rng):
    big_q = rand(rng, N, 2 * HQ, D)
    q = big_q[:, ::2]  # non-contiguous
    k, v = rand(rng, N, HKV, D), rand(rng, N, HKV, D)
    qn, kn, vn = rand(rng, HQ, D), rand(rng, HKV, D), rand(rng, HKV, D)
    with make("exact_topk", budget=0.2) as s1, make("exact_topk", budget=0.2) as s2:
        s1.prefill(0, q, k, v)
        s2.prefill(0, np.ascontiguousarray(q), k, v)
        s1.build_index(), s2.build_index()
        out_t = np.zeros((D, HQ), np.float32).T  # transposed (strided) output
        o1, _ = s1.decode(0, qn, kn, vn, out=out_t)
        assert o1 is out_t
        o2, _ = s2.decode(0, qn, kn, vn)
        np.testing.assert_array_equal(o1, o2)
    with make("full") as s:
        s.prefill(0, q.astype(np.float16), k.astype(np.float16), v.astype(np.float16))
        s.build_index()
        o16 = np.empty((HQ, D), np.float16)
        o, lse = s.decode(0, qn.astype(np.float16), kn.astype(np.float16), vn.astype(np.float16), out=o16)
        assert o is o16
        K = np.concatenate([k, kn[None]]).astype(np.float16)
        V = np.concatenate([v, vn[None]]).astype(np.float16)
        ro, rl = ref_attend(qn.astype(np.float16), K, V, SCALE)
        np.testing.assert_allclose(o.astype(np.float64), ro, rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(lse, rl, rtol=1e-4, atol=1e-3)


def test_wrong_dtype_layout_device_raise_typed_errors(rng):
    q, k, v = rand(rng, 16, HQ, D), rand(rng, 16, HKV, D), rand(rng, 16, HKV, D)
    with make("full") as s:
        with pytest.raises(TypeError, match=r"q: expected dtype float32, float16 or bfloat16, got float64"):
            s.prefill(0, q.astype(np.float64), k, v)
        with pytest.raises(TypeError, match=r"k: expected dtype .* got int32"):
            s.prefill(0, q, k.astype(np.int32), v)
        with pytest.raises(TypeError, match=r"v: expected an array with __dlpack__ or the buffer protocol"):
            s.prefill(0, q, k, v.tolist())
        with pytest.raises(ValueError, match=r"q: expected 3 dimensions, got 2"):
            s.prefill(0, q[0], k, v)
        with pytest.raises(ValueError, match=r"k: expected shape \[16, 2, 32\], got \[16, 3, 32\]"):
            s.prefill(0, q, rand(rng, 16, 3, D), v)
        with pytest.raises(ValueError, match=r"non-negative strides"):
            s.prefill(0, q[::-1], k, v)
        with pytest.raises(ValueError, match=r"native \(little-endian\) byte order"):
            s.prefill(0, q, k, memoryview(v.astype(">f4")))
        with pytest.raises(ValueError, match=r"out: expected a writable"):
            ro = np.zeros((16, HQ, D), np.float32)
            ro.flags.writeable = False
            s.prefill(0, q, k, v, out=ro)
        assert s.layer_tokens(0) == 0  # nothing was appended by a rejected call
        s.prefill(0, q, k, v)
        s.build_index()
        with pytest.raises(TypeError, match=r"lse: expected dtype float32, got float16"):
            s.decode(0, q[0], k[0], v[0], lse=np.empty(HQ, np.float16))
        with pytest.raises(ValueError, match=r"out: expected shape \[4, 32\]"):
            s.decode(0, q[0], k[0], v[0], out=np.empty((HQ, D + 1), np.float32))

        class OpenCL:  # a DLPack producer on a device kvsieve does not know
            def __dlpack_device__(self):
                return (4, 0)

            def __dlpack__(self, stream=None):
                raise AssertionError("must not be exported")

        with pytest.raises(ValueError, match=r"expected a CPU, CUDA-host or CUDA tensor, got DLPack device type 4"):
            s.decode(0, OpenCL(), k[0], v[0])
        assert s.layer_tokens(0) == 16


def test_library_errors_carry_code_and_message(rng, tmp_path):
    with pytest.raises(kvsieve.Error) as e:
        make("no_such_method")
    assert e.value.code == kvsieve.STATUS_INVALID_ARGUMENT and "no_such_method" in e.value.message
    assert e.value.status == "INVALID_ARGUMENT" and str(e.value).startswith("[INVALID_ARGUMENT]")
    with pytest.raises(kvsieve.Error) as e:
        make("quest", method_params={"page_size": 0})
    assert "page_size" in e.value.message
    with pytest.raises(kvsieve.Error) as e:
        make("exact_topk", method_params="bogus=1")
    assert "bogus" in e.value.message
    with make("full") as s:
        q = rand(rng, HQ, D)
        with pytest.raises(kvsieve.Error) as e:
            s.decode(0, q, q[:HKV], q[:HKV])
        assert e.value.code == kvsieve.STATUS_INVALID_STATE
        with pytest.raises(kvsieve.Error) as e:
            s.decode(7, q, q[:HKV], q[:HKV])
        assert e.value.code == kvsieve.STATUS_INVALID_ARGUMENT and "layer" in e.value.message
        assert s.method_stat("decode_attend_seconds") == 0.0  # session-level, nothing decoded yet
        with pytest.raises(kvsieve.Error) as e:
            s.method_stat("no_such_stat")
        assert e.value.code == kvsieve.STATUS_INVALID_ARGUMENT
    with pytest.raises(kvsieve.Error) as e:
        kvsieve.Session.load(str(tmp_path / "missing.kvs"))
    assert e.value.code == kvsieve.STATUS_IO and e.value.backend_code == 2  # ENOENT
    err = pickle.loads(pickle.dumps(e.value))
    assert (err.code, err.message, err.backend_code) == (e.value.code, e.value.message, 2)
    with pytest.raises(ValueError, match="backend"):
        make("full", backend="tpu")


def test_save_load_roundtrip_and_corruption(rng, tmp_path):
    q, k, v = rand(rng, N, HQ, D), rand(rng, N, HKV, D), rand(rng, N, HKV, D)
    path = str(tmp_path / "s.kvs")
    with make("quest", budget=0.1) as s:
        for layer in range(L):
            s.prefill(layer, q, k, v)
        s.build_index()
        s.save(path, include_kv=True)
        qn, kn, vn = rand(rng, HQ, D), rand(rng, HKV, D), rand(rng, HKV, D)
        o1, l1 = s.decode(1, qn, kn, vn)
    desc = kvsieve.tables_describe(path)
    assert desc["ok"] is True
    for mmap in (False, True):  # pages copied (the default) or mapped from the file
        with kvsieve.Session.load(path, mmap=mmap) as t:
            assert (t.num_layers, t.num_q_heads, t.num_kv_heads, t.head_dim) == (L, HQ, HKV, D)
            st = t.stats
            assert (st.kv_shared_bytes > 0) == mmap, (mmap, st)
            o2, l2 = t.decode(1, qn, kn, vn)
            np.testing.assert_array_equal(o1, o2)
            np.testing.assert_array_equal(l1, l2)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "bad.kvs"
    bad.write_bytes(bytes(data))
    with pytest.raises(kvsieve.Error) as e:
        kvsieve.tables_describe(str(bad))
    assert e.value.code == kvsieve.STATUS_FORMAT_CHECKSUM
    assert isinstance(e.value.details, dict) and e.value.details["ok"] is False


# ---- lifetimes -----------------------------------------------------------------------------------
def test_lifetimes_any_collection_order(rng):
    q, k, v = rand(rng, 64, HQ, D), rand(rng, 64, HKV, D), rand(rng, 64, HKV, D)
    qn, kn, vn = rand(rng, HQ, D), rand(rng, HKV, D), rand(rng, HKV, D)
    random.seed(5)
    for trial in range(5):
        root = make("streaming", budget=0.5)
        for layer in range(L):
            root.prefill(layer, q, k, v)
        root.build_index()
        family = [root]
        for _ in range(6):
            family.append(random.choice(family).fork())
        want, _ = family[-1].decode(0, qn, kn, vn)
        random.shuffle(family)
        while len(family) > 1:
            victim = family.pop()
            if random.random() < 0.5:
                victim.close()
                victim.close()  # idempotent
            del victim
            gc.collect()
        survivor = family[0]
        o, _ = survivor.decode(1, qn, kn, vn)  # still usable whoever went first
        assert np.isfinite(o).all()
        with pytest.raises(ValueError, match="closed"):
            survivor.close()
            survivor.decode(0, qn, kn, vn)


def test_context_manager_closes():
    with make("full") as s:
        assert not s.closed
    assert s.closed
    with pytest.raises(ValueError, match="expected an open session"):
        s.build_index()


def _cli():
    cli = os.environ.get("KVSIEVE_CLI")
    if not cli or not os.path.exists(cli):
        pytest.skip("KVSIEVE_CLI (the kvsieve command, to write a trace) not set")
    return cli


def test_trace_views_outlive_the_trace(tmp_path):
    path = str(tmp_path / "t.safetensors")
    subprocess.run([_cli(), "synth", "--out", path, "--layers", "2", "--q-heads", "4", "--kv-heads", "2",
                    "--head-dim", "16", "--prefill", "64", "--decode", "8"], check=True, capture_output=True)
    t = kvsieve.Trace(path)
    info = t.info
    assert info["num_q_heads"] == 4 and info["head_dim"] == 16 and info["total_len"] == 72
    layer = t.layers[0]
    k = t.tensor(layer, "k")
    assert k.shape == (72, 2, 16) and not k.flags.writeable
    first = np.array(k, copy=True)
    t.close()
    del t
    gc.collect()
    np.testing.assert_array_equal(k, first)  # the view keeps the mapping alive


def test_trace_bf16_through_torch_goes_into_a_session(tmp_path):
    """A bf16 trace: NumPy sees its raw bits (uint16); kind="torch" gives torch.bfloat16 views of the
    same memory, which a session takes as they are, and decodes as it does from float32 copies."""
    torch = pytest.importorskip("torch")
    path = str(tmp_path / "t16.safetensors")
    subprocess.run([_cli(), "synth", "--out", path, "--layers", "1", "--q-heads", "4", "--kv-heads", "2",
                    "--head-dim", "16", "--prefill", "64", "--decode", "4", "--dtype", "bf16"], check=True,
                   capture_output=True)
    with kvsieve.Trace(path) as t:
        layer = t.layers[0]
        raw = t.tensor(layer, "k")
        assert raw.dtype == np.uint16
        q, k, v = (t.tensor(layer, n, kind="torch") for n in ("q", "k", "v"))
        assert k.dtype == torch.bfloat16 and tuple(k.shape) == raw.shape
        assert k.data_ptr() == raw.__array_interface__["data"][0]  # no copy
        np.testing.assert_array_equal(k.view(torch.int16).numpy().view(np.uint16), raw)
        with pytest.raises(ValueError, match="kind: expected 'numpy' or 'torch'"):
            t.tensor(layer, "k", kind="jax")
        sessions = []
        for conv in (lambda x: x, lambda x: x.float()):  # bf16 as given; float32 copies
            s = kvsieve.Session(1, 4, 2, 16, method="full", kv_dtype="bfloat16")
            s.prefill(0, conv(q[:64]), conv(k[:64]), conv(v[:64]))
            s.build_index()
            sessions.append(s)
        outs = [s.decode(0, q[64].float(), k[64], v[64])[0] for s in sessions]
        np.testing.assert_array_equal(outs[0].numpy(), outs[1].numpy())
        for s in sessions:
            s.close()


# ---- the GIL -------------------------------------------------------------------------------------
def test_gil_released_during_long_calls(rng):
    """A pure-Python thread must keep running at full speed while the main thread is inside the
    library. The ticker's rate during the second half of a long prefill is compared with its rate
    while the main thread sleeps (GIL free); with the GIL held it drops to a trickle (measured about
    a tenth, from the interpreter's periodic checks, in a GIL-holding C call such as a pathological
    regular expression)."""
    n = 1024
    q, k, v = rand(rng, n, 8, 128), rand(rng, n, 2, 128), rand(rng, n, 2, 128)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            for _ in range(200):
                pass

    def rate(a, b):
        return sum(1 for t in ticks if a < t < b) / (b - a)

    th = threading.Thread(target=ticker)
    th.start()
    try:
        s0 = time.perf_counter()
        time.sleep(0.2)
        baseline = rate(s0, time.perf_counter())
        for attempt in range(4):
            o = np.empty(q.shape, np.float32)
            s = kvsieve.Session(1, 8, 2, 128, kv_dtype="float32", num_threads=1)
            t0 = time.perf_counter()
            s.prefill(0, q, k, v, out=o)  # causal attention over n tokens: long
            t1 = time.perf_counter()
            s.close()
            if t1 - t0 > 0.2:
                break
            q, k, v = (np.concatenate([x, x]) for x in (q, k, v))
        assert t1 - t0 > 0.2, "the call was too short to tell"
    finally:
        stop.set()
        th.join()
    inside = rate((t0 + t1) / 2, t1)
    assert inside > 0.25 * baseline, (f"ticker ran at {inside:.0f}/s in the second half of a {t1 - t0:.2f}s call, "
                                      f"{baseline:.0f}/s with the GIL free")


def test_sessions_from_threads(rng):
    """Different sessions decode in parallel threads with the same results as serially; concurrent
    calls on one session are serialised by the facade (none lost, none interleaved)."""
    q, k, v = rand(rng, N, HQ, D), rand(rng, N, HKV, D), rand(rng, N, HKV, D)
    steps = [(rand(rng, HQ, D), rand(rng, HKV, D), rand(rng, HKV, D)) for _ in range(8)]

    def fresh():
        s = make("quest", budget=0.2, num_threads=1)
        for layer in range(L):
            s.prefill(layer, q, k, v)
        s.build_index()
        return s

    serial = fresh()
    want = [serial.decode(0, *st)[0] for st in steps]
    sessions = [fresh() for _ in range(3)]
    got = [[] for _ in sessions]
    ths = [threading.Thread(target=lambda i=i: got[i].extend(sessions[i].decode(0, *st)[0] for st in steps))
           for i in range(3)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    for g in got:
        for a, b in zip(g, want):
            np.testing.assert_array_equal(a, b)
    shared = fresh()
    ths = [threading.Thread(target=lambda: [shared.decode(1, *st) for st in steps]) for _ in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert shared.layer_tokens(1) == N + 4 * len(steps)
    assert shared.stats.decode_steps == 4 * len(steps)


def test_log_callback_runs_with_the_gil():
    lines = []
    kvsieve.set_log_callback(lambda level, line: lines.append((level, line)), "debug")
    try:
        with make("full"):
            pass
    finally:
        kvsieve.set_log_callback(None)
    assert all(isinstance(l, str) and "\n" not in l for _, l in lines)


# ---- CUDA through DLPack (skips without a GPU and torch/CuPy) --------------------------------------
def _torch_cuda():
    try:
        import torch
    except ImportError:
        pytest.skip("torch not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if "cuda" not in {m.name: m for m in kvsieve.methods()}["full"].backends:
        pytest.skip("method full has no cuda backend in this build")
    return torch


@pytest.mark.parametrize("method", ["full", "exact_topk"])
def test_cuda_tensors_zero_copy_on_a_stream(method):
    torch = _torch_cuda()
    hq, hkv, d, n = 8, 2, 64, 512
    try:
        s = kvsieve.Session(1, hq, hkv, d, method=method, budget=1.0, kv_dtype="bfloat16", backend="cuda")
    except kvsieve.Error as e:
        if e.code == kvsieve.STATUS_UNSUPPORTED:
            pytest.skip(f"cuda backend unavailable: {e.message}")
        raise
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(n, hq, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(n, hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(n, hkv, d, device="cuda", generator=g).bfloat16()
    qn = torch.randn(hq, d, device="cuda", generator=g)
    kn = torch.randn(hkv, d, device="cuda", generator=g).bfloat16()
    vn = torch.randn(hkv, d, device="cuda", generator=g).bfloat16()
    stream = torch.cuda.Stream()
    with s:
        assert kvsieve.capi.describe_tensor(q, 0)[7] == q.data_ptr()  # no copy
        with torch.cuda.stream(stream):
            s.prefill(0, q, k, v, stream=stream)
            s.build_index(stream=stream)
            o, lse = s.decode(0, qn, kn, vn, stream=stream)
        stream.synchronize()
        assert o.is_cuda and o.dtype == torch.float32 and lse.shape == (hq,)
        K = torch.cat([k, kn[None]]).float().cpu().numpy()
        V = torch.cat([v, vn[None]]).float().cpu().numpy()
        ro, rl = ref_attend(qn.cpu().numpy(), K, V, 1.0 / np.sqrt(d))
        np.testing.assert_allclose(o.cpu().numpy(), ro, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(lse.cpu().numpy(), rl, rtol=1e-3, atol=1e-2)
        with pytest.raises(ValueError, match="expected a CUDA tensor on device 0"):
            s.decode(0, qn.cpu(), kn, vn)
        with pytest.raises(ValueError, match="C-contiguous"):
            s.decode(0, torch.randn(d, hq, device="cuda").t(), kn, vn)
    with make("full") as c:  # a cpu session: CUDA tensors of the right shape and dtype are refused
        qc, kc = torch.randn(N, HQ, D, device="cuda"), torch.randn(N, HKV, D, device="cuda")
        with pytest.raises(ValueError, match="expected host memory"):
            c.prefill(0, qc, kc, kc.clone())


# ---- issue 22 (hardening), finding 7: typed errors instead of SystemError, AttributeError and
# silent truncation; method_params and overlapping outputs refused by the library -------------------


class _BadDevice:
    """A DLPack producer whose __dlpack_device__ breaks the protocol (DLPack: a tuple of 2 ints)."""

    def __init__(self, dev):
        self._dev = dev

    def __dlpack_device__(self):
        return self._dev

    def __dlpack__(self, stream=None):
        raise AssertionError("must not be exported")


@pytest.mark.parametrize("dev", [1, [1, 0], (1,), (1, 0, 0), ("cpu", 0), (1.0, 0), None],
                         ids=["int", "list", "1-tuple", "3-tuple", "str", "float", "None"])
def test_dlpack_device_not_a_tuple_of_two_ints_raises_type_error(dev, rng):
    q, k, v = rand(rng, 16, HQ, D), rand(rng, 16, HKV, D), rand(rng, 16, HKV, D)
    with make("full") as s:
        # The native intake (kvsieve.capi) and the facade's output allocation both check it.
        with pytest.raises(TypeError, match=r"k: __dlpack_device__\(\) of _BadDevice must return a tuple "
                                            r"\(device_type, device_id\) of two ints"):
            s.prefill(0, q, _BadDevice(dev), v)
        with pytest.raises(TypeError, match=r"tensor: __dlpack_device__\(\) of _BadDevice"):
            kvsieve.capi.describe_tensor(_BadDevice(dev), 0)
        s.prefill(0, q, k, v)
        s.build_index()
        with pytest.raises(TypeError, match=r"q: __dlpack_device__\(\) of _BadDevice"):
            s.decode(0, _BadDevice(dev), k[0], v[0])
        with pytest.raises(TypeError, match=r"q: __dlpack_device__\(\) of _BadDevice"):
            s.decode(0, _BadDevice(dev), k[0], v[0], out=np.empty((HQ, D), np.float32), lse=np.empty(HQ, np.float32))
        with pytest.raises(TypeError, match=r"q: __dlpack_device__\(\) of _BadDevice"):
            kvsieve.decode_batch([s], 0, _BadDevice(dev), k[:1], v[:1])
        assert s.layer_tokens(0) == 16  # nothing was appended by a rejected call
    with pytest.raises(ValueError, match=r"tensor: __dlpack_device__\(\) of _BadDevice returned an out-of-range"):
        kvsieve.capi.describe_tensor(_BadDevice((1, 2**40)), 0)


def test_decode_batch_rejects_what_is_not_an_open_session(rng):
    prompts = [(rand(rng, 32, HQ, D), rand(rng, 32, HKV, D), rand(rng, 32, HKV, D)) for _ in range(2)]
    a, c = _prefilled("full", prompts)
    qn, kn, vn = rand(rng, 2, HQ, D), rand(rng, 2, HKV, D), rand(rng, 2, HKV, D)
    with pytest.raises(TypeError, match=r"sessions\[1\]: expected a kvsieve.Session, got str"):
        kvsieve.decode_batch([a, "x"], 0, qn, kn, vn)
    with pytest.raises(TypeError, match=r"sessions\[0\]: expected a kvsieve.Session, got NoneType"):
        kvsieve.decode_batch([None, a], 0, qn, kn, vn)
    with pytest.raises(TypeError, match=r"sessions: expected a sequence of kvsieve.Session, got Session"):
        kvsieve.decode_batch(a, 0, qn, kn, vn)
    with pytest.raises(TypeError, match=r"sessions: expected a sequence of kvsieve.Session, got str"):
        kvsieve.decode_batch("ab", 0, qn, kn, vn)
    with pytest.raises(ValueError, match="at least one session"):
        kvsieve.decode_batch([], 0, qn, kn, vn)
    c.close()
    with pytest.raises(ValueError, match=r"sessions\[1\]: expected an open session"):
        kvsieve.decode_batch([a, c], 0, qn, kn, vn)
    assert a.layer_tokens(0) == 32
    o, lse = kvsieve.decode_batch(iter([a]), 0, qn[:1], kn[:1], vn[:1])  # any iterable of sessions
    assert o.shape == (1, HQ, D) and a.layer_tokens(0) == 33
    a.close()


def test_strings_with_nul_raise_value_error(tmp_path):
    """A NUL ends a C string: "full\\0junk" must not silently become "full"."""
    with pytest.raises(ValueError, match=r"method: expected a string without NUL characters"):
        make("full\0junk")
    with pytest.raises(TypeError, match=r"method: expected a str, got bytes"):
        make(b"full")
    with pytest.raises(ValueError, match=r"method_params: expected a string without NUL"):
        make("quest", method_params="page_size=16\0,bogus=1")
    with pytest.raises(ValueError, match=r"method_params\['page_size'\]: expected a string without NUL"):
        make("quest", method_params={"page_size": "16\0"})
    # In the mapping form, "," and "=" cannot smuggle in other parameters.
    with pytest.raises(ValueError, match=r"method_params: expected a parameter name without ',' or '='"):
        make("quest", method_params={"page_size=16,page_size": 32})
    with pytest.raises(ValueError, match=r"method_params\['page_size'\]: expected a value without ','"):
        make("quest", method_params={"page_size": "16,page_size=32"})
    with pytest.raises(ValueError, match="method"):
        kvsieve.method_unsupported_reason("full\0x", "cuda")
    with make("full") as s:
        with pytest.raises(ValueError, match="path"):
            s.save(str(tmp_path / "a\0b.kvs"))
        with pytest.raises(ValueError, match="name"):
            s.method_stat("decode_attend_seconds\0x")
        s.save(tmp_path / "pathlike.kvs")  # os.PathLike still accepted
    assert os.listdir(tmp_path) == ["pathlike.kvs"]
    for fn in (kvsieve.Session.load, kvsieve.tables_describe, kvsieve.Trace):
        with pytest.raises(ValueError, match="path: expected a string without NUL"):
            fn(str(tmp_path / "pathlike.kvs") + "\0x")
    # The native layer refuses on its own too, naming the argument.
    with pytest.raises(ValueError, match=r"method: expected a string without NUL"):
        kvsieve.capi.session_create(L, HQ, HKV, D, 0.0, kvsieve.capi.KVS_SCALAR_F32, kvsieve.capi.KVS_BACKEND_CPU,
                                    0, 1, 0, "full\0x", None, 0.0, 0, kvsieve.capi.KVS_LSE_BASE_E, 0, 0, 0)
    with pytest.raises(ValueError, match=r"method: expected a string without NUL"):
        kvsieve.capi.kvs_method_doc("quest\0x")
    assert kvsieve.capi.kvs_method_doc("quest")  # plain strings and None still pass
    assert kvsieve.capi.kvs_method_doc(None) is None


def test_kv_memory_is_checked():
    # Where the KV lives: the cpu backend keeps it in host memory; pinned host KV is the cuda backend's.
    kvsieve.Session(1, 4, 2, 16, kv_memory="cpu").close()
    kvsieve.Session(1, 4, 2, 16, kv_memory="default").close()
    with pytest.raises(kvsieve.UnsupportedError, match="kv_memory"):
        kvsieve.Session(1, 4, 2, 16, kv_memory="cuda_host")
    with pytest.raises(ValueError, match="kv_memory"):
        kvsieve.Session(1, 4, 2, 16, kv_memory="gpu")


def test_method_params_empty_items_and_repeated_keys_are_refused():
    for text, word in (("page_size=16,,", "item 2"), (",page_size=16", "item 1"), ("page_size=16,", "item 2"),
                       ("page_size=16,page_size=32", "'page_size' is given twice")):
        with pytest.raises(kvsieve.Error) as e:
            make("quest", method_params=text)
        assert e.value.code == kvsieve.STATUS_INVALID_ARGUMENT and word in e.value.message, e.value.message
    for text in ("", "  ", None, "page_size=16"):
        make("quest", method_params=text).close()


def test_outputs_whose_elements_overlap_are_refused(rng):
    q, k, v = rand(rng, 16, HQ, D), rand(rng, 16, HKV, D), rand(rng, 16, HKV, D)
    from numpy.lib.stride_tricks import as_strided
    with make("full") as s:
        base = np.zeros(D, np.float32)
        with pytest.raises(kvsieve.Error) as e:
            s.prefill(0, q, k, v, out=as_strided(base, (16, HQ, D), (0, 0, 4)))
        assert e.value.code == kvsieve.STATUS_INVALID_ARGUMENT and e.value.message.startswith("o: ")
        assert s.layer_tokens(0) == 0
        s.prefill(0, q, k, v)
        s.build_index()
        for out, lse, name in ((as_strided(base, (HQ, D), (0, 4)), None, "o: "),
                               (as_strided(np.zeros(1, np.float32), (HQ, D), (0, 0)), None, "o: "),
                               (None, as_strided(np.zeros(1, np.float32), (HQ,), (0,)), "lse: ")):
            with pytest.raises(kvsieve.Error) as e:
                s.decode(0, q[0], k[0], v[0], out=out, lse=lse)
            assert e.value.code == kvsieve.STATUS_INVALID_ARGUMENT and e.value.message.startswith(name), e.value.message
            assert "overlap" in e.value.message
        assert s.layer_tokens(0) == 16
        o_t = np.empty((D, HQ), np.float32).T  # transposed: strided but no overlap
        o, lse = s.decode(0, q[0], k[0], v[0], out=o_t)
        assert o is o_t and np.isfinite(o).all()


# ---- a KV cache the caller owns (kv_source="caller", Session.bind_kv) ------------------------------


def _caller_pool(n_pages, hkv, page, d, dtype):
    """An engine's page pool [num_pages, 2, Hkv, page, d] and a writer of token rows into it."""
    pool = np.full((n_pages, 2, hkv, page, d), np.nan, dtype=dtype)
    order = list(np.random.default_rng(5).permutation(n_pages))

    def write(table, t, k, v):
        if t // page == len(table):
            table.append(int(order.pop()))
        pool[table[t // page], 0, :, t % page] = k
        pool[table[t // page], 1, :, t % page] = v

    return pool, write


@pytest.mark.parametrize("method", ["full", "quest", "csattention"])
def test_caller_kv_decodes_as_an_owned_session(method, rng):
    n, steps, page = 300, 6, 256
    q, k, v = rand(rng, n + steps, HQ, D), rand(rng, n + steps, HKV, D), rand(rng, n + steps, HKV, D)
    pool, write = _caller_pool(4, HKV, page, D, np.float32)
    with make(method, budget=0.3) as own, make(method, budget=0.3, kv_source="caller") as cal:
        tables = [[] for _ in range(L)]
        for layer in range(L):
            own.prefill(layer, q[:n], k[:n], v[:n])
            for t in range(n):
                write(tables[layer], t, k[t], v[t])
            cal.bind_kv(layer, pool, tables[layer], n)
            cal.prefill(layer, q[:n], None, None)
        own.build_index()
        cal.build_index()
        for t in range(n, n + steps):
            for layer in range(L):
                o1, l1 = own.decode(layer, q[t], k[t], v[t])
                write(tables[layer], t, k[t], v[t])
                cal.bind_kv(layer, pool, np.array(tables[layer]), t + 1)
                o2, l2 = cal.decode(layer, q[t], None, None)
                np.testing.assert_array_equal(o1, o2)
                np.testing.assert_array_equal(l1, l2)
                for h in range(HKV):
                    np.testing.assert_array_equal(own.last_selection(layer, h), cal.last_selection(layer, h))
        assert cal.stats.kv_bytes == 0 and own.stats.kv_bytes > 0
        assert cal.layer_tokens(0) == n + steps
        with cal.fork() as f:  # a fork binds like its parent (the same kv_dtype, the same pools)
            for layer in range(L):
                f.bind_kv(layer, pool, tables[layer], n + steps)
            assert f.layer_tokens(0) == n + steps


def test_caller_kv_session_loads_saved_tables(rng, tmp_path):
    """Session.load(kv_source="caller"): the saved index over the engine's cache, layers prefilled again."""
    n, page = 300, 256
    q, k, v = rand(rng, n + 3, HQ, D), rand(rng, n + 3, HKV, D), rand(rng, n + 3, HKV, D)
    pool, write = _caller_pool(4, HKV, page, D, np.float32)
    tables = [[] for _ in range(L)]
    path = str(tmp_path / "quest.kvs")
    with make("quest", budget=0.3, kv_dtype="float32") as own:
        for layer in range(L):
            own.prefill(layer, q[:n], k[:n], v[:n])
            for t in range(n):
                write(tables[layer], t, k[t], v[t])
        own.build_index()
        own.save(path, include_kv=True)
    with kvsieve.Session.load(path) as ref, kvsieve.Session.load(path, kv_source="caller") as cal:
        assert cal.layer_tokens(0) == 0  # the file's KV is not read
        for layer in range(L):
            cal.bind_kv(layer, pool, tables[layer], n)
            cal.prefill(layer, q[:n], None, None)
        for t in range(n, n + 3):
            for layer in range(L):
                o1, l1 = ref.decode(layer, q[t], k[t], v[t])
                write(tables[layer], t, k[t], v[t])
                cal.bind_kv(layer, pool, tables[layer], t + 1)
                o2, l2 = cal.decode(layer, q[t], None, None)
                np.testing.assert_array_equal(o1, o2)
                np.testing.assert_array_equal(l1, l2)
        assert cal.stats.kv_bytes == 0
    with pytest.raises(ValueError, match="kv_source"):
        kvsieve.Session.load(path, kv_source="borrowed")


def test_caller_kv_errors(rng):
    pool = np.zeros((2, 2, HKV, 256, D), dtype=np.float32)
    with make("full") as own:
        with pytest.raises(kvsieve.InvalidStateError, match="stores its own KV"):
            own.bind_kv(0, pool, [0], 1)
    with make("full", kv_source="caller") as cal:
        with pytest.raises(ValueError, match=r"pages: expected a tensor \[num_pages, 2, 2, page_size, 32\]"):
            cal.bind_kv(0, pool[:, 0], [0], 1)
        with pytest.raises(ValueError, match="pages: expected the session's kv_dtype"):
            cal.bind_kv(0, pool.astype(np.float16), [0], 1)
        with pytest.raises(ValueError, match=r"page_indices\[0\]: expected 0..1, got 7"):
            cal.bind_kv(0, pool, [7], 1)
        with pytest.raises(NotImplementedError, match="pages of 256 tokens"):
            cal.bind_kv(0, np.zeros((4, 2, HKV, 16, D), dtype=np.float32), [0], 1)
        # The cpu backend reads HND pages with K and V in one tensor only.
        with pytest.raises(NotImplementedError, match="kv->layout: the cpu backend reads KVS_KV_LAYOUT_HND"):
            cal.bind_kv(0, np.zeros((2, 2, 256, HKV, D), dtype=np.float32), [0], 1, layout="NHD")
        with pytest.raises(NotImplementedError, match="kv->v_pages: the cpu backend reads K and V in one tensor"):
            cal.bind_kv(0, (pool[:, 0].copy(), pool[:, 1].copy()), [0], 1)
        with pytest.raises(ValueError, match=r"pages\[1\] \(v_pages\): expected a tensor \[num_pages, page_size, 2, 32\]"):
            cal.bind_kv(0, (np.zeros((2, 256, HKV, D), np.float32), np.zeros((2, HKV, 256, D), np.float32)), [0], 1,
                        layout="NHD")
        with pytest.raises(ValueError, match="k_pages and v_pages must have one shape"):
            cal.bind_kv(0, (np.zeros((2, HKV, 256, D), np.float32), np.zeros((3, HKV, 256, D), np.float32)), [0], 1)
        with pytest.raises(ValueError, match="layout: expected 'HND' or 'NHD'"):
            cal.bind_kv(0, pool, [0], 1, layout="NDH")
        q = rand(rng, 4, HQ, D)
        with pytest.raises(kvsieve.InvalidStateError, match="call Session.bind_kv first"):
            cal.prefill(0, q, None, None)
        cal.bind_kv(0, pool, [1], 4)
        with pytest.raises(ValueError, match="k: expected (NULL|None)"):
            cal.prefill(0, q, rand(rng, 4, HKV, D), rand(rng, 4, HKV, D))
        cal.prefill(0, q, None, None)
        assert cal.layer_tokens(0) == 4
        # A pool bound before passes unchecked only while its address and shape stay: resized in
        # place (pages of 128 tokens now), it is checked again.
        grown = np.zeros((2, 2, HKV, 256, D), dtype=np.float32)
        cal.bind_kv(0, grown, [1], 4)
        cal.bind_kv(0, grown, np.array([1], np.int32), 4)
        grown.resize((4, 2, HKV, 128, D), refcheck=False)
        with pytest.raises(NotImplementedError, match="pages of 256 tokens"):
            cal.bind_kv(0, grown, [1], 4)
    with pytest.raises(ValueError, match="kv_source"):
        make("full", kv_source="borrowed")


@pytest.mark.parametrize("layout,two_pools", [("HND", False), ("NHD", False), ("NHD", True), ("HND", True)])
def test_caller_kv_on_cuda_matches_an_owned_session(layout, two_pools):
    torch = _torch_cuda()
    hq, hkv, d, n, page = 8, 2, 128, 700, 16
    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(n + 4, hq, d, device="cuda", generator=g)
    k = torch.randn(n + 4, hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(n + 4, hkv, d, device="cuda", generator=g).bfloat16()
    page_dims = (page, hkv) if layout == "NHD" else (hkv, page)
    if two_pools:  # vLLM's FlashAttention cache: [2, num_blocks, block_size, Hkv, d], K and V apart
        cache = torch.zeros(2, 64, *page_dims, d, device="cuda", dtype=torch.bfloat16)
        pool, kp, vp = (cache[0], cache[1]), cache[0], cache[1]
    else:  # FlashInfer's: [num_pages, 2, ...]
        pool = torch.zeros(64, 2, *page_dims, d, device="cuda", dtype=torch.bfloat16)
        kp, vp = pool[:, 0], pool[:, 1]
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
    table = []

    def write(t):
        if t // page == len(table):
            table.append(perm.pop())
        if layout == "NHD":
            kp[table[t // page], t % page] = k[t]
            vp[table[t // page], t % page] = v[t]
        else:
            kp[table[t // page], :, t % page] = k[t]
            vp[table[t // page], :, t % page] = v[t]

    kw = dict(method="quest", budget=0.1, kv_dtype="bfloat16", backend="cuda")
    with kvsieve.Session(1, hq, hkv, d, **kw) as own, kvsieve.Session(1, hq, hkv, d, kv_source="caller", **kw) as cal:
        own.prefill(0, q[:n], k[:n], v[:n])
        for t in range(n):
            write(t)
        cal.bind_kv(0, pool, table, n, layout=layout)
        cal.prefill(0, q[:n], None, None)
        own.build_index()
        cal.build_index()
        for t in range(n, n + 4):
            o1, l1 = own.decode(0, q[t], k[t], v[t])
            write(t)
            cal.bind_kv(0, pool, table, t + 1, layout=layout)
            o2, l2 = cal.decode(0, q[t], None, None)
            torch.cuda.synchronize()
            assert torch.equal(o1, o2) and torch.equal(l1, l2)
        assert cal.stats.kv_bytes == 0
        cpu_pool = tuple(x.cpu() for x in pool) if two_pools else pool.cpu()
        with pytest.raises(ValueError, match=r"pages(\[0\] \(k_pages\))?: expected a tensor in cuda memory of device 0"):
            cal.bind_kv(0, cpu_pool, table, n + 4, layout=layout)
        other = "HND" if layout == "NHD" else "NHD"
        if two_pools:  # the same pools read in the other layout: its shape names the dims it expects
            with pytest.raises(ValueError, match=r"expected a tensor \[num_pages, "):
                cal.bind_kv(0, tuple(x.transpose(1, 2).contiguous() for x in pool), table, n + 4, layout=layout)
        with pytest.raises(ValueError, match=f"kv->layout: expected KVS_KV_LAYOUT_{layout}"):
            shp = (64,) + (() if two_pools else (2,)) + ((hkv, page) if other == "HND" else (page, hkv)) + (d,)
            alt = torch.zeros(shp, device="cuda", dtype=torch.bfloat16)
            cal.bind_kv(0, (alt, alt.clone()) if two_pools else alt, table, n + 4, layout=other)
    with make("full", kv_source="caller") as c:  # a cpu session refuses a CUDA pool
        with pytest.raises(ValueError, match="pages: expected a tensor in cpu memory"):
            c.bind_kv(0, torch.zeros(2, 2, HKV, 256, D, device="cuda"), [0], 1)


@pytest.mark.parametrize("device,extra", [("cpu", []), ("cuda", []), ("cuda", ["--layout", "NHD", "--two-pools"])])
def test_paged_engine_example_runs(device, extra):
    """examples/python/paged_engine.py (its own check: full over the engine's cache agrees with torch)."""
    if device == "cuda":
        _torch_cuda()
    else:
        pytest.importorskip("torch")
    example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python",
                           "paged_engine.py")
    r = subprocess.run([sys.executable, example, "--device", device, "--steps", "3", "--draft", "2", "--prompt", "700",
                        "300", "--method", "quest"] + extra, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kvsieve holds 0 bytes of KV" in r.stdout


def test_caller_kv_decode_batch_with_none(rng):
    n, page = 200, 256
    q, k, v = rand(rng, n + 1, HQ, D), rand(rng, n + 1, HKV, D), rand(rng, n + 1, HKV, D)
    pool, write = _caller_pool(4, HKV, page, D, np.float32)
    own = [make("quest", budget=0.3) for _ in range(2)]
    cal = [make("quest", budget=0.3, kv_source="caller") for _ in range(2)]
    tables = [[[] for _ in range(L)] for _ in range(2)]
    for b in range(2):
        for layer in range(L):
            own[b].prefill(layer, q[:n], k[:n], v[:n])
            for t in range(n):
                write(tables[b][layer], t, k[t], v[t])
            cal[b].bind_kv(layer, pool, tables[b][layer], n)
            cal[b].prefill(layer, q[:n], None, None)
        own[b].build_index()
        cal[b].build_index()
    qb, kb, vb = np.stack([q[n], q[n]]), np.stack([k[n], k[n]]), np.stack([v[n], v[n]])
    for layer in range(L):
        o1, l1 = kvsieve.decode_batch(own, layer, qb, kb, vb)
        for b in range(2):
            write(tables[b][layer], n, k[n], v[n])
            cal[b].bind_kv(layer, pool, tables[b][layer], n + 1)
        o2, l2 = kvsieve.decode_batch(cal, layer, qb, None, None)
        np.testing.assert_array_equal(o1, o2)
        np.testing.assert_array_equal(l1, l2)
    for s in own + cal:
        s.close()


def test_decode_tokens_equals_decode_calls(rng):
    n, r = 200, 3
    q, k, v = rand(rng, n + r, HQ, D), rand(rng, n + r, HKV, D), rand(rng, n + r, HKV, D)
    with make("quest", budget=0.3) as a, make("quest", budget=0.3) as b:
        for s in (a, b):
            for layer in range(L):
                s.prefill(layer, q[:n], k[:n], v[:n])
            s.build_index()
        for layer in range(L):
            out, lse = a.decode_tokens(layer, q[n:], k[n:], v[n:])
            assert out.shape == (r, HQ, D) and lse.shape == (r, HQ)
            for i in range(r):
                o1, l1 = b.decode(layer, q[n + i], k[n + i], v[n + i])
                np.testing.assert_array_equal(out[i], o1)
                np.testing.assert_array_equal(lse[i], l1)
        assert a.layer_tokens(0) == n + r
        with pytest.raises(ValueError, match="k_new"):
            a.decode_tokens(0, q[n:], k[n:n + 1], v[n:])
