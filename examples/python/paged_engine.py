# SPDX-License-Identifier: Apache-2.0
"""kvsieve as the attention backend of an engine that owns its paged KV cache.

A toy serving loop in the shape of vLLM's or SGLang's: the engine keeps one page pool per layer,
``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (FlashInfer's paged layout "HND", keys then
values in each page; ``--layout NHD``: ``[num_pages, 2, page_size, num_kv_heads, head_dim]``;
``--two-pools``: K and V in two tensors, as vLLM's FlashAttention backend keeps its cache ``[2,
num_blocks, block_size, num_kv_heads, head_dim]``; those two on the cuda backend only), hands pages
out to sequences from a free list, writes each token's K/V into
its sequence's current page, and asks kvsieve for the sparse attention of each decode step. kvsieve
keeps only its method's index: no copy of the cache is made (``kv_source="caller"``), and the
engine re-binds a layer's pages (``Session.bind_kv``) after writing a token.

Two sequences of different lengths decode together: their pages interleave in the pool. Each has
two kvsieve sessions over the same pages: the sparse method, and ``full`` as a check. Every step
compares both against exact attention computed by torch over the engine's own cache: ``full``
must agree to bf16 rounding, the sparse method shows its approximation error at its budget; and
it shows what kvsieve holds (its index; no KV).

With ``--draft N`` each step also verifies N speculative tokens in one ``Session.decode_tokens``
call per layer (row j attends the context and the rows before it) and rejects the last one:
``Session.truncate`` rolls kvsieve back past it and the engine writes its next token over the
rejected one's slot (every method
on the cpu backend; on the cuda backend full, exact_topk, streaming and quest: csattention does not
roll back there, and retroinfer reads pages of 256 tokens, not this example's 16).

    python examples/python/paged_engine.py                       # cpu, pages of 256 tokens
    python examples/python/paged_engine.py --device cuda         # GPU, pages of 16 tokens
    python examples/python/paged_engine.py --device cuda --layout NHD --two-pools   # vLLM's cache

Needs torch (CPU or CUDA build) and the kvsieve package (``pip install .`` from a checkout).
"""
import argparse
import math

import torch

import kvsieve


class PagedCache:
    """One layer's page pool, shared by every sequence of the engine."""

    def __init__(self, num_pages, num_kv_heads, page_size, head_dim, dtype, device, layout="HND", two_pools=False):
        dims = (page_size, num_kv_heads) if layout == "NHD" else (num_kv_heads, page_size)
        if two_pools:  # vLLM's FlashAttention cache: [2, num_blocks, ...], bound as (kv_cache[0], kv_cache[1])
            self.store = torch.zeros(2, num_pages, *dims, head_dim, dtype=dtype, device=device)
            self.k, self.v = self.store[0], self.store[1]
            self.pages = (self.k, self.v)
        else:  # FlashInfer's: [num_pages, 2, ...]
            self.store = self.pages = torch.zeros(num_pages, 2, *dims, head_dim, dtype=dtype, device=device)
            self.k, self.v = self.pages[:, 0], self.pages[:, 1]
        self.layout, self.page_size = layout, page_size
        self.free = list(range(num_pages - 1, -1, -1))
        # Pages go out in a scattered order, as they would in a busy engine.
        g = torch.Generator().manual_seed(0)
        self.free = [self.free[i] for i in torch.randperm(len(self.free), generator=g).tolist()]

    def write(self, table, pos, k, v):
        """Stores k, v [num_kv_heads, head_dim] of token `pos` of the sequence with page table `table`."""
        if pos // self.page_size == len(table):
            table.append(self.free.pop())
        page, slot = table[pos // self.page_size], pos % self.page_size
        if self.layout == "NHD":
            self.k[page, slot] = k
            self.v[page, slot] = v
        else:
            self.k[page, :, slot] = k
            self.v[page, :, slot] = v

    def gather(self, table, n):
        """The first n tokens' K and V of a sequence, [num_kv_heads, n, head_dim] each (for the check)."""
        ids = torch.tensor(table, device=self.k.device)
        out = []
        for pool in (self.k, self.v):
            x = pool[ids]  # [pages, Hkv, P, d] or [pages, P, Hkv, d]
            if self.layout == "NHD":
                x = x.transpose(1, 2)
            out.append(x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])[:, :n])
        return out[0], out[1]


def exact_attention(q, k, v, scale):
    """q [Hq, d] over k, v [Hkv, n, d] (grouped-query), fp32."""
    hq, hkv = q.shape[0], k.shape[0]
    kk = k.float().repeat_interleave(hq // hkv, dim=0)
    vv = v.float().repeat_interleave(hq // hkv, dim=0)
    w = torch.softmax((kk @ q.float().unsqueeze(-1)).squeeze(-1) * scale, dim=-1)
    return (w.unsqueeze(1) @ vv).squeeze(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--method", default="quest")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--prompt", type=int, nargs=2, default=[3000, 1700], help="prompt lengths of the two sequences")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--draft", type=int, default=0, help="speculative tokens per step (the last one is rejected)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--layout", default="HND", choices=["HND", "NHD"], help="page layout (NHD: cuda only)")
    ap.add_argument("--two-pools", action="store_true", help="K and V in two tensors (cuda only)")
    a = ap.parse_args()
    if a.device == "cpu" and (a.layout != "HND" or a.two_pools):
        ap.error("the cpu backend reads HND pages with K and V in one tensor: use --device cuda")

    hq, hkv, d = 8, 2, 128
    page_size = 16 if a.device == "cuda" else 256  # the cpu backend reads pages of 256 tokens
    dtype, dev = torch.bfloat16, torch.device(a.device)
    scale = 1.0 / math.sqrt(d)
    torch.manual_seed(1)
    total = sum(a.prompt) + 2 * a.steps * (a.draft + 1) + 64
    caches = [PagedCache(total // page_size + 8, hkv, page_size, d, dtype, dev, a.layout, a.two_pools)
              for _ in range(a.layers)]

    # A stand-in for the model: the text moves between 8 topics (a topic per 64-token stretch); keys
    # lean towards their stretch's topic and the queries of a group towards one topic, so attention
    # falls on the stretches of that topic (an eighth of the context), as it falls on a few spans in
    # trained models. On pure noise every key scores alike and no sparse method can do well.
    topics = torch.nn.functional.normalize(torch.randn(8, d, device=dev), dim=-1) * math.sqrt(d)

    def qkv(n, start=0):
        t = torch.arange(start, start + n, device=dev)
        k = 0.7 * topics[(t // 64) % 8][:, None, :] + torch.randn(n, hkv, d, device=dev)
        pick = torch.randint(0, 8, (n, hkv), device=dev).repeat_interleave(hq // hkv, dim=1)  # per query group
        q = 1.5 * topics[pick] + torch.randn(n, hq, d, device=dev)
        return q, k.to(dtype), torch.randn(n, hkv, d, device=dev).to(dtype)

    def session(method):
        return kvsieve.Session(a.layers, hq, hkv, d, method=method, budget=a.budget, backend=a.device,
                               kv_source="caller", max_rollback=64)

    seqs = []
    for n in a.prompt:
        sq = {"sessions": [session(a.method), session("full")], "tables": [[] for _ in range(a.layers)], "len": n}
        for layer, cache in enumerate(caches):
            q, k, v = qkv(n)
            for t in range(n):  # the engine's prefill writes the prompt's K/V into its pages
                cache.write(sq["tables"][layer], t, k[t], v[t])
            for s in sq["sessions"]:
                s.bind_kv(layer, cache.pages, sq["tables"][layer], n, layout=a.layout)
                s.prefill(layer, q, None, None)  # kvsieve sees the prompt's queries; keys are read in place
        for s in sq["sessions"]:
            s.build_index()
        seqs.append(sq)

    worst = [0.0, 0.0]  # relative error against exact attention: the method, full
    for step in range(a.steps):
        for sq in seqs:
            tables = sq["tables"]
            r = a.draft + 1  # the token itself, then the drafts to verify: one decode_tokens call per layer
            for layer, cache in enumerate(caches):
                q, k, v = qkv(r, sq["len"])
                for j in range(r):
                    cache.write(tables[layer], sq["len"] + j, k[j], v[j])
                for i, s in enumerate(sq["sessions"]):
                    s.bind_kv(layer, cache.pages, tables[layer], sq["len"] + r, layout=a.layout)
                    out, _ = s.decode_tokens(layer, q, None, None)  # row j sees the context and rows < j
                    for j in range(r):
                        kk, vv = cache.gather(tables[layer], sq["len"] + j + 1)
                        ref = exact_attention(q[j], kk, vv, scale)
                        worst[i] = max(worst[i], ((out[j].float() - ref).norm() / ref.norm()).item())
            sq["len"] += 1 + max(a.draft - 1, 0)  # the verifier keeps every draft but the last
            if a.draft:
                for s in sq["sessions"]:
                    s.truncate(sq["len"])  # kvsieve forgets the rejected draft; the engine overwrites its slot
        if step % 4 == 0 or step == a.steps - 1:
            st = seqs[0]["sessions"][0].stats
            print(f"step {step:3d}: lengths {[sq['len'] for sq in seqs]}; worst relative error against exact "
                  f"attention over the engine's cache: {a.method} at {a.budget:.0%} {worst[0]:.3f}, full "
                  f"{worst[1]:.4f}; kvsieve holds {st.kv_bytes} bytes of KV and {st.index_bytes} of index")
    if worst[1] > 1e-2:
        raise SystemExit(f"full attention over the engine's cache disagrees with torch: {worst[1]:.4f}")
    for sq in seqs:
        for s in sq["sessions"]:
            s.close()


if __name__ == "__main__":
    main()
