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
Ties in the ranking go to the lower cluster id (torch.topk leaves them unspecified). The KV is fp32
here, so the model-dtype rounding of the authors' ranking (fp16/bf16) does not arise.

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


def ref_step(q, K, V, n, idx_end, clusters, r, e, scale):
    """One decode step of one KV head: q [G, d]; K, V [n, d] float64; clusters = (centroids [C, d],
    value_sum [C, d], size [C], members: list of position arrays). Returns (o [G, d], lse [G], exact keys)."""
    cent, vsum, size, members = clusters
    logits = scale * (q @ cent.T)                                   # [G, C]
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    dist = (p / p.sum(axis=1, keepdims=True)).sum(axis=0)           # softmax over every centroid, summed
    dist[size == 0] = -np.inf                                       # empty clusters masked after the sum
    order = sorted(range(len(size)), key=lambda c: (-dist[c], c))
    nonempty = int((size > 0).sum())
    retr = order[:min(r, nonempty)]
    est = order[min(r, nonempty):min(r + e, nonempty)]
    steady = list(range(min(SINKS, n))) + list(range(idx_end, n))
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


def load_clusters(tables, layer, hkv, d):
    """Per KV head: centroids, value sums, sizes and member positions of every saved cluster."""
    out = []
    for h in range(hkv):
        cent = tables.array("retroinfer.centroids", layer, h, np.float32).reshape(-1, d).astype(np.float64)
        vsum = tables.array("retroinfer.value_sum", layer, h, np.float32).reshape(-1, d).astype(np.float64)
        size = tables.array("retroinfer.size", layer, h, np.int32).astype(np.int64)
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
def test_retroinfer_paper_preset_matches_authors_decode(trace, seed, tmp_path):
    L, hq, hkv, d, N, steps, run = trace
    g = hq // hkv
    rng = np.random.default_rng(seed * 7919 + N)
    T = N + steps
    # Keys drawn around a few hundred topic directions (clusterable, like real keys) plus noise.
    topics = rng.standard_normal((L, 300, hkv, d)) * 1.5
    ids = np.repeat(rng.integers(0, 300, T // run + 1), run)[:T]
    K = (topics[:, ids] + rng.standard_normal((L, T, hkv, d)) * (0.7 if run == 1 else 0.05)
         + rng.normal(0, 0.5, (L, 1, hkv, d))).astype(np.float32)
    V = rng.standard_normal((L, T, hkv, d)).astype(np.float32)
    Q = (topics[:, rng.integers(0, 300, (T, g))].transpose(0, 1, 3, 2, 4).reshape(L, T, hq, d) * 1.2
         + rng.standard_normal((L, T, hq, d))).astype(np.float32)
    scale = 1.0 / math.sqrt(d)
    path = str(tmp_path / "r.kvs")
    s = kvsieve.Session(L, hq, hkv, d, method="retroinfer", method_params="preset=paper", kv_dtype="float32")
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
    for layer in range(L):
        if not tab.meta["layers"].get(str(layer)):
            chunk_list = []
        else:
            chunk_list = tab.meta["layers"][str(layer)]["chunks"]
        heads = load_clusters(tab, layer, hkv, d) if chunk_list else None
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
                    ro, rl, keys = ref_step(qg, Kl[:n, h], Vl[:n, h], n, idx_end, first(heads[h], C), r, e, scale)
                assert sels[i, layer][h].tolist() == keys.tolist(), (layer, t, h)
                assert np.abs(outs[i, layer, h * g:(h + 1) * g] - ro).max() < 1e-5, (layer, t, h)
                assert np.abs(lses[i, layer, h * g:(h + 1) * g] - rl).max() < 1e-5, (layer, t, h)


def test_authors_counts_at_4k():
    """The issue's example: at 4096 tokens the authors' config gives 256 clusters and 5 retrieved
    (counted from the indexed tokens instead: 248 and 4)."""
    assert authors_counts(4096)[1:3] == (256, 5)


@pytest.mark.parametrize("bad, name", [("kmeans_init=uniform", "kmeans_init"), ("mask_empty=never", "mask_empty"),
                                       ("cluster_basis=context", "cluster_basis"), ("preset=authors", "preset")])
def test_retroinfer_bad_parameters_name_the_parameter(bad, name):
    with pytest.raises(kvsieve.Error) as e:
        kvsieve.Session(1, 4, 2, 32, method="retroinfer", method_params=bad)
    assert name in str(e.value)
