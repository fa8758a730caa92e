# SPDX-License-Identifier: Apache-2.0
"""RetroInfer under preset=paper against an independent float64 reference of the authors' decode logic,
given the clusters kvsieve built (read back from its saved tables).

The reference is written from microsoft/RetrievalAttention (commit 6b1228c: config/config.py,
cache_hub/retroinfer_cache.py), not from kvsieve:
* counts from the whole prompt length N: segments = max(round(N / 8192), 1); clusters =
  max(round(N / 16), lcm(8, segments)) moved to the nearer multiple of lcm(8, segments), the lower
  one on a tie; retrieval zone r = min(max(round(C * 0.018), 1), C); estimation zone
  e = min(round(C * 0.232), C - r); Python's round (halves to even) everywhere;
* the prompt is indexed when N >= 4 + 64 + 1024; tokens [4, N - 64) are clustered, the rest (4
  sinks, 64 local, every generated token) form the steady zone;
* once the steady zone holds 4 + 64 + 1024 tokens before a decode token is appended, its oldest
  1024 non-sink tokens are clustered on their own into max(round(1024/16)//8*8, 8) = 64 clusters,
  and the zones grow by max(round(64 * 0.018), 1) = 1 and max(round(64 * 0.232), 1) = 15 clusters;
* ranking: per query head the softmax of scale * q.C over every centroid (empty clusters included),
  summed over the group; empty clusters are then masked; the top r are attended exactly (every
  token of each) with the steady zone, the next e are estimated: lse_e = log sum_c size_c e^{l_c},
  o_e = sum_c e^{l_c} VS_c / sum_c size_c e^{l_c}; the two parts are merged by their lse.
Ties in the ranking go to the lower cluster id (torch.topk leaves them unspecified).

With a 16-bit KV (bf16 or fp16: the authors' model dtype) the traces' queries, keys and values are
16-bit numbers, and the ranking is rounded where the authors' code rounds it (batch_gemm_softmax.cu
and its CUTLASS epilogue: the scaled logits are stored in the model dtype and the softmax is computed
in fp32 from the stored values, its outputs stored in the model dtype; torch.sum adds the group's
outputs in fp32 and stores the sum in the model dtype; topk compares the stored sums). The centroids
the logits read are the model dtype too (the authors' meta index; kvsieve's meta_dtype=kv rounds its
fp32 centroids to it). bf16 rounding is emulated on float32 bits (round to nearest even), fp16 with
numpy's float16. The estimation's weights are unrounded (the authors' estimation kernel recomputes
the logits in fp32); its value rows are kvsieve's: the value means rounded to the KV dtype times the
exact sizes (the authors round the value sums and the sizes instead: not reproduced, see
docs/methods/retroinfer.md).

Run: PYTHONPATH=<build>/bindings/python python -m pytest tests/conformance
"""

import math

import numpy as np
import pytest

import kvsieve
from conformance_util import Tables, attend, merge

SINKS, LOCAL, UPDATE = 4, 64, 1024


def pyround(x):
    return round(x)  # Python's round: halves to even, as the authors' config


def authors_counts(N):
    """(segments, clusters, r, e) of the authors' config for a prompt of N tokens."""
    s = max(pyround(N / 8192), 1)
    f = math.lcm(8, s)
    c = max(pyround(N / 16), f)
    lower = c // f * f
    upper = lower + f
    C = lower if abs(c - lower) <= abs(c - upper) else upper
    r = min(max(pyround(C * 0.018), 1), C)
    e = min(pyround(C * 0.232), C - r)
    return s, C, r, e


UPDATE_C = max(pyround(UPDATE / 16) // 8 * 8, 8)
UPDATE_R = max(pyround(UPDATE_C * 0.018), 1)
UPDATE_E = max(pyround(UPDATE_C * 0.232), 1)


def to_bf16(x):
    """x rounded to bfloat16 (through float32, round to nearest even), as float64."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def to_f16(x):
    """x rounded to float16 (through float32, round to nearest even), as float64."""
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def to_f32(x):
    return np.asarray(x, np.float32).astype(np.float64)


ROUND = {"float32": to_f32, "bfloat16": to_bf16, "float16": to_f16}   # the KV dtype's numbers


def no_rounding(x):
    return x   # an fp32 KV: kvsieve ranks in fp32 and the reference in float64 (rank_dtype is a no-op)


def test_bf16_rounding_is_round_to_nearest_even():
    one = 1.0
    ulp = 2.0 ** -7                      # bf16's spacing in [1, 2)
    assert to_bf16(one + ulp / 2) == one                      # a tie goes to the even neighbour
    assert to_bf16(one + 3 * ulp / 2) == one + 2 * ulp
    assert to_bf16(one + ulp / 2 + 2 ** -20) == one + ulp      # above the tie: up
    assert to_bf16(-np.inf) == -np.inf and to_bf16(3.0e38) == 1.765625 * 2.0 ** 127


def ref_step(q, K, V, n, idx_end, clusters, r, e, scale, rnd=no_rounding, moved=None, sinks=SINKS):
    """One decode step of one KV head: q [G, d]; K, V [n, d] float64; clusters = (centroids [C, d],
    value_sum [C, d], size [C], members: list of position arrays) as decode reads them; rnd rounds to
    the model dtype at the authors' points of the ranking. Returns (o [G, d], lse [G], exact keys).
    moved (a list): gets True appended when an unrounded ranking would give other zones."""
    cent, vsum, size, members = clusters
    logits = scale * (q @ cent.T)                                   # [G, C]
    lr = rnd(logits)                                                # batch_gemm_softmax's D (model dtype)
    p = np.exp(lr - lr.max(axis=1, keepdims=True))
    p = rnd(p / p.sum(axis=1, keepdims=True))                       # its softmax output (model dtype)
    dist = rnd(p.sum(axis=0))                                       # torch.sum over the group (model dtype)
    dist[size == 0] = -np.inf                                       # empty clusters masked after the sum
    order = sorted(range(len(size)), key=lambda c: (-dist[c], c))
    nonempty = int((size > 0).sum())
    retr = order[:min(r, nonempty)]
    est = order[min(r, nonempty):min(r + e, nonempty)]
    if moved is not None:
        p32 = np.exp(logits - logits.max(axis=1, keepdims=True))
        d32 = (p32 / p32.sum(axis=1, keepdims=True)).sum(axis=0)
        d32[size == 0] = -np.inf
        o32 = sorted(range(len(size)), key=lambda c: (-d32[c], c))
        moved.append(set(o32[:len(retr)]) != set(retr) or set(o32[len(retr):len(retr) + len(est)]) != set(est))
    steady = list(range(min(sinks, n))) + list(range(idx_end, n))
    keys = np.array(sorted(steady + [int(t) for c in retr for t in members[c]]))
    o = np.empty(q.shape)
    lse = np.empty(q.shape[0])
    for g in range(q.shape[0]):
        o[g], lse[g] = attend(q[g], K[keys], V[keys], scale)
        if est:
            l = logits[g, est]
            m = l.max()
            w = np.exp(l - m)
            den = (w * size[est]).sum()
            merged = merge(o[g], lse[g], (w @ vsum[est]) / den, m + np.log(den))
            o[g], lse[g] = merged
    return o, lse, keys


def load_clusters(tables, layer, hkv, d, rnd=None):
    """Per KV head: centroids, value sums, sizes and member positions of every saved cluster, as
    decode reads them: the fp32 tables as they are for an fp32 KV; for a 16-bit KV (meta_dtype=kv)
    the centroids rounded to it, and the value sums as the rounded value means times the sizes."""
    out = []
    for h in range(hkv):
        cent32 = tables.array("retroinfer.centroids", layer, h, np.float32).reshape(-1, d)
        vsum32 = tables.array("retroinfer.value_sum", layer, h, np.float32).reshape(-1, d)
        size = tables.array("retroinfer.size", layer, h, np.int32).astype(np.int64)
        if rnd is None:
            cent, vsum = cent32.astype(np.float64), vsum32.astype(np.float64)
        else:
            cent = rnd(cent32)
            with np.errstate(invalid="ignore", divide="ignore"):
                mean = np.where(size[:, None] > 0, vsum32 / size[:, None].astype(np.float32), np.float32(0))
            vsum = rnd(mean.astype(np.float32)) * size[:, None]
        pos = tables.array("retroinfer.pos", layer, h, np.int32)
        starts = np.concatenate([[0], np.cumsum(size)])
        members = [pos[starts[c]:starts[c + 1]] for c in range(len(size))]
        out.append((cent, vsum, size, members))
    return out


def first(clusters, C):
    """The clusters [0, C) (those of the first index chunk)."""
    cent, vsum, size, members = clusters
    return cent[:C], vsum[:C], size[:C], members[:C]


# (num_layers, Hq, Hkv, d, prompt, decode steps, run): GQA and MHA; one trace crosses an index
# update (1024 + 1 decode steps) on a prompt just long enough to be indexed; one prompt is shorter
# than that (dense until the first update). run > 1 repeats each key topic over runs of that many
# tokens (repetitive text): many clusters then stay empty, and where empty clusters are masked in
# the ranking matters.
TRACES = [
    (1, 8, 2, 64, 4100, 30, 1),
    (2, 4, 4, 32, 2500, 20, 1),
    (1, 6, 2, 32, 1093, 1040, 1),
    (1, 4, 2, 32, 1000, 100, 1),
    (1, 4, 2, 32, 2500, 100, 8),
]


@pytest.mark.parametrize("seed", [11, 12])
@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "float16"])
def test_retroinfer_paper_preset_matches_authors_decode(kv, trace, seed, tmp_path):
    L, hq, hkv, d, N, steps, run = trace
    g = hq // hkv
    rng = np.random.default_rng(seed * 7919 + N)
    T = N + steps
    rnd = ROUND[kv]
    # Keys drawn around a few hundred topic directions (clusterable, like real keys) plus noise;
    # queries, keys and values are numbers of the KV dtype (the authors' model dtype).
    topics = rng.standard_normal((L, 300, hkv, d)) * 1.5
    ids = np.repeat(rng.integers(0, 300, T // run + 1), run)[:T]
    K = rnd(topics[:, ids] + rng.standard_normal((L, T, hkv, d)) * (0.7 if run == 1 else 0.05)
            + rng.normal(0, 0.5, (L, 1, hkv, d))).astype(np.float32)
    V = rnd(rng.standard_normal((L, T, hkv, d))).astype(np.float32)
    Q = rnd(topics[:, rng.integers(0, 300, (T, g))].transpose(0, 1, 3, 2, 4).reshape(L, T, hq, d) * 1.2
            + rng.standard_normal((L, T, hq, d))).astype(np.float32)
    scale = 1.0 / math.sqrt(d)
    path = str(tmp_path / "r.kvs")
    s = kvsieve.Session(L, hq, hkv, d, method="retroinfer", method_params="preset=paper", kv_dtype=kv)
    with s:
        for layer in range(L):
            s.prefill(layer, Q[layer, :N], K[layer, :N], V[layer, :N])
        s.build_index()
        outs = np.empty((steps, L, hq, d), np.float32)
        lses = np.empty((steps, L, hq), np.float32)
        sels = {}
        for i, t in enumerate(range(N, T)):
            for layer in range(L):
                o, lse = s.decode(layer, Q[layer, t], K[layer, t], V[layer, t])
                outs[i, layer], lses[i, layer] = o, lse
                sels[i, layer] = [s.last_selection(layer, h) for h in range(hkv)]
        s.save(path)
    tab = Tables(path)
    assert tab.params["mask_empty"] == "after_softmax" and tab.params["cluster_basis"] == "prompt"
    assert tab.params["rank_dtype"] == "model" and tab.params["meta_dtype"] == "kv"
    if run > 1:
        assert tab.meta["layers"]["0"]["empty_clusters"] > 10

    # Zone sizes: the authors' counts at the build, their increments at each update.
    indexed = N >= SINKS + LOCAL + UPDATE
    # The authors' updates: one whenever the steady zone reaches 4 + 64 + 1024 tokens before an append.
    steady0 = SINKS + LOCAL if indexed else N
    n_updates = 0
    steady = steady0
    update_at = []
    for t in range(N, T):
        if steady == SINKS + LOCAL + UPDATE:
            n_updates += 1
            update_at.append(t)
            steady = SINKS + LOCAL
        steady += 1
    for layer in range(L):
        meta = tab.meta["layers"].get(str(layer))
        chunks = meta["chunks"] if meta else []
        assert len(chunks) == int(indexed) + n_updates
        if indexed:
            s_, C, r, e = authors_counts(N)
            assert chunks[0]["segments"] == s_ and chunks[0]["clusters"] == [0, C]
            assert chunks[0]["tokens"] == [SINKS, N - LOCAL]
            assert (chunks[0]["r_add"], chunks[0]["e_add"]) == (r, e)
        for c in chunks[int(indexed):]:
            assert c["clusters"][1] - c["clusters"][0] == UPDATE_C
            assert (c["r_add"], c["e_add"], c["segments"]) == (UPDATE_R, UPDATE_E, 1)
            assert c["tokens"][1] - c["tokens"][0] == UPDATE

    # Every step against the reference, with the clusters that existed at that step.
    moved = []   # per indexed head-step: would an unrounded ranking give other zones?
    for layer in range(L):
        if not tab.meta["layers"].get(str(layer)):
            chunk_list = []
        else:
            chunk_list = tab.meta["layers"][str(layer)]["chunks"]
        heads = load_clusters(tab, layer, hkv, d, None if kv == "float32" else rnd) if chunk_list else None
        Kl, Vl = K[layer].astype(np.float64), V[layer].astype(np.float64)
        for i, t in enumerate(range(N, T)):
            n = t + 1
            live = [c for j, c in enumerate(chunk_list) if (j == 0 and indexed) or update_at[j - int(indexed)] <= t]
            for h in range(hkv):
                qg = Q[layer, t, h * g:(h + 1) * g].astype(np.float64)
                if not live:   # nothing indexed yet: dense
                    keys = np.arange(n)
                    ro = np.empty((g, d))
                    rl = np.empty(g)
                    for j in range(g):
                        ro[j], rl[j] = attend(qg[j], Kl[:n, h], Vl[:n, h], scale)
                else:
                    C = live[-1]["clusters"][1]
                    r = sum(c["r_add"] for c in live)
                    e = sum(c["e_add"] for c in live)
                    idx_end = live[-1]["tokens"][1]
                    ro, rl, keys = ref_step(qg, Kl[:n, h], Vl[:n, h], n, idx_end, first(heads[h], C), r, e, scale,
                                            no_rounding if kv == "float32" else rnd, moved)
                assert sels[i, layer][h].tolist() == keys.tolist(), (layer, t, h)
                assert np.abs(outs[i, layer, h * g:(h + 1) * g] - ro).max() < 1e-5, (layer, t, h)
                assert np.abs(lses[i, layer, h * g:(h + 1) * g] - rl).max() < 1e-5, (layer, t, h)
    print(f"{kv} {trace} seed {seed}: {sum(moved)} of {len(moved)} head-steps rank into other zones unrounded")


def test_authors_counts_at_4k():
    """The issue's example: at 4096 tokens the authors' config gives 256 clusters and 5 retrieved
    (counted from the indexed tokens instead: 248 and 4)."""
    assert authors_counts(4096)[1:3] == (256, 5)


@pytest.mark.parametrize("bad, name", [("kmeans_init=uniform", "kmeans_init"), ("mask_empty=never", "mask_empty"),
                                       ("cluster_basis=context", "cluster_basis"), ("preset=authors", "preset"),
                                       ("rank_dtype=bf16", "rank_dtype"), ("meta_dtype=model", "meta_dtype")])
def test_retroinfer_bad_parameters_name_the_parameter(bad, name):
    with pytest.raises(kvsieve.Error) as e:
        kvsieve.Session(1, 4, 2, 32, method="retroinfer", method_params=bad)
    assert name in str(e.value)


@pytest.mark.parametrize("kv, delta", [("bfloat16", 2.0 ** -6), ("float16", 2.0 ** -9), ("float32", 2.0 ** -6)])
@pytest.mark.parametrize("rank", ["model", "f32"])
def test_rank_dtype_model_ties_what_the_model_dtype_cannot_tell_apart(kv, delta, rank):
    """Singleton clusters, one retrieved: keys a (id 3) and b (id 9) score 8 and 8 + delta, delta a
    quarter of the 16-bit dtype's spacing at 8. Rounded to the model dtype their logits, softmax
    outputs and sums are equal and the tie goes to the lower id (a); in fp32, b ranks first. An fp32
    KV has no model rounding: b either way."""
    d, N = 16, 16
    rng = np.random.default_rng(5)
    K = ROUND[kv](rng.standard_normal((N, 1, d)) - np.eye(d)[None, 0] * 6).astype(np.float32)   # logits ~ -6
    K[3, 0, :2] = [8.0, 0.0]
    K[9, 0, :2] = [8.0, delta]
    V = ROUND[kv](rng.standard_normal((N + 1, 1, d))).astype(np.float32)
    q = np.zeros((1, d), np.float32)
    q[0, :2] = 4.0                                  # scale 1/4: logit = k[0] + k[1]
    params = ("preset=paper,cluster_size=1,cluster_align=1,segment_size=0,sinks=0,local=0,update_segment=16,"
              f"retrieval=0.0625,estimation=0,rank_dtype={rank}")
    with kvsieve.Session(1, 1, 1, d, method="retroinfer", method_params=params, kv_dtype=kv) as s:
        s.prefill(0, np.zeros((N, 1, d), np.float32), K, V[:N])
        s.build_index()
        s.decode(0, q, np.zeros((1, d), np.float32), V[N])
        sel = s.last_selection(0, 0).tolist()
    want = 3 if (rank == "model" and kv != "float32") else 9
    assert sel == [want, N]
    # The reference agrees (singleton clusters: centroids = keys).
    rnd = no_rounding if kv == "float32" else ROUND[kv]
    size = np.ones(N, np.int64)
    members = [np.array([c]) for c in range(N)]
    Kd = K[:, 0].astype(np.float64)
    _, _, keys = ref_step(q.astype(np.float64), np.vstack([Kd, np.zeros((1, d))]), V[:, 0].astype(np.float64), N + 1,
                          N, (Kd, Kd, size, members), 1, 0, 0.25, rnd if rank == "model" else no_rounding, sinks=0)
    assert keys.tolist() == [want, N]
