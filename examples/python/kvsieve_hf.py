# SPDX-License-Identifier: Apache-2.0
"""Route a Hugging Face transformers model's attention through kvsieve.

kvsieve becomes the model's KV cache: the model runs with ``use_cache=False`` and explicit
``position_ids``, so each forward hands every attention layer only the new tokens' post-RoPE
q/k/v, and a :class:`KvsieveCache` (one kvsieve ``Session`` per sequence) stores the K/V and does
the attention:

- the first call for a layer (the prompt, ``n`` tokens) is ``Session.prefill`` of that layer, which
  also returns exact causal attention of the prompt (cpu backend), then ``build_index``;
- every later call with one token is ``Session.decode`` (the method's sparse attention);
- a later call with several tokens (a new chat turn) is ``Session.append`` (exact attention).

Usage::

    import kvsieve_hf
    kvsieve_hf.register()                       # adds "kvsieve" to transformers' AttentionInterface
    model.set_attn_implementation("kvsieve")     # or from_pretrained(..., attn_implementation="kvsieve")
    cache = kvsieve_hf.KvsieveCache(model.config, method="quest", budget=0.05)
    logits = kvsieve_hf.forward(model, input_ids, cache)       # prompt
    logits = kvsieve_hf.forward(model, next_ids, cache)        # one decode step
    ids = kvsieve_hf.greedy_generate(model, input_ids, cache, max_new_tokens=64)

Tensors cross by DLPack. The model's q/k/v arrive as [B, H, n, d] views of [B, n, H, d]
projections (transformers transposes them); kvsieve wants [n, H, d] (prefill) and [H, d] (decode).
On the cpu backend these are strided views, accepted as they are: no copy at all, and kvsieve
writes its output straight into the [B, n, Hq, d] tensor transformers expects. On the cuda backend
kvsieve requires C-contiguous tensors and K/V in the session's KV dtype (bf16 or fp16 there; an
f32 model gets bf16 KV by default), so the new tokens' q/k/v are copied once per layer (a
[Hq + 2 Hkv, d] gather per decode step, converting K/V to the KV dtype in the same copy; the cache
itself is never copied), and the prompt's attention output is computed by torch's
scaled_dot_product_attention (the cuda backend's prefill has no output). The cuda backend runs
full and exact_topk only, head dims 64 and 128, and cannot fork.

Limits: batch 1 (one session per sequence), no attention dropout, no sliding-window or
logit-softcapping layers (Gemma 2/3 sliding layers are refused with a clear error), float32 /
float16 / bfloat16 models.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

import kvsieve

NAME = "kvsieve"
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class KvsieveCache:
    """The kvsieve state of one sequence: a Session over all layers, created lazily at the first
    attention call (which fixes the softmax scale the model uses)."""

    def __init__(self, config, *, method: str = "full", budget: Optional[float] = None,
                 budget_tokens: Optional[int] = None, method_params: Optional[Mapping[str, Any]] = None,
                 backend: str = "cpu", device_id: int = 0, num_threads: int = 0,
                 kv_dtype: Optional[str] = None, _session: Optional[kvsieve.Session] = None,
                 _prefilled: Optional[set] = None):
        text = getattr(config, "get_text_config", lambda: config)()
        self.num_layers = int(text.num_hidden_layers)
        self.num_q_heads = int(text.num_attention_heads)
        self.num_kv_heads = int(getattr(text, "num_key_value_heads", None) or self.num_q_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // self.num_q_heads)
        if backend not in ("cpu", "cuda"):
            raise ValueError(f"backend: expected 'cpu' or 'cuda', got {backend!r}")
        self.method, self.budget, self.budget_tokens = method, budget, budget_tokens
        self.method_params = dict(method_params or {})
        self.backend, self.device_id, self.num_threads = backend, int(device_id), int(num_threads)
        self.kv_dtype = kv_dtype
        self.session = _session
        self._prefilled = set(_prefilled or ())
        self._scale = None
        self.tokens = 0                      # tokens of the sequence so far (positions of the next)
        self._lse = None                     # reused decode LSE buffer

    # -- lifetime
    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def fork(self) -> "KvsieveCache":
        """A new cache at this cache's current state (kvsieve ``Session.fork``: KV shared
        copy-on-write, the method's index copied). Both evolve independently."""
        if self.session is None:
            raise ValueError("fork: the cache holds no session yet (run the prompt first)")
        c = KvsieveCache.__new__(KvsieveCache)
        c.__dict__.update(self.__dict__)
        c.session = self.session.fork()
        c._prefilled = set(self._prefilled)
        c._lse = None
        return c

    def _ensure_session(self, dtype: torch.dtype, scale: float) -> None:
        if self.session is not None:
            if self._scale is not None and not math.isclose(scale, self._scale, rel_tol=1e-6):
                raise ValueError(f"scaling: every layer must use the softmax scale the session was "
                                 f"created with ({self._scale}), got {scale}")
            return
        self._scale = float(scale)
        if self.kv_dtype is None:
            # The cuda backend stores KV in bf16/fp16 only: an f32 model gets bf16 KV there.
            self.kv_dtype = "bfloat16" if self.backend == "cuda" and dtype == torch.float32 else _DTYPES[dtype]
        self._kv_torch = {v: k for k, v in _DTYPES.items()}[self.kv_dtype]
        self.session = kvsieve.Session(
            self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim,
            method=self.method, budget=self.budget, budget_tokens=self.budget_tokens,
            method_params=self.method_params or None, kv_dtype=self.kv_dtype,
            backend=self.backend, device_id=self.device_id, num_threads=self.num_threads,
            softmax_scale=self._scale)

    def prefill_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float, out: Optional[torch.Tensor] = None) -> None:
        """Prefills one layer from precomputed prompt q [n, Hq, d], k/v [n, Hkv, d] (e.g. from a
        trace or a shared prompt pass) and builds its index; ``out`` optionally receives the
        prompt's causal attention (cpu backend). The sequence position advances to the prompt's
        end, so the next ``forward`` gets the right RoPE positions."""
        self._ensure_session(q.dtype, scale)
        if self.backend == "cuda":   # contiguous, K/V in the KV dtype (a copy where they are not)
            stream = torch.cuda.current_stream(q.device)
            self.session.prefill(layer, q.contiguous(), _kv(k, self), _kv(v, self), out=out, stream=stream)
            self.session.build_index(stream=stream)
        else:
            self.session.prefill(layer, q, k, v, out=out)
            self.session.build_index()
        self._prefilled.add(layer)
        self.tokens = max(self.tokens, int(q.shape[0]))

    @property
    def stats(self) -> kvsieve.Stats:
        return self.session.stats


def _check(cache, module, query: torch.Tensor, dropout: float, kwargs) -> None:
    if not isinstance(cache, KvsieveCache):
        raise ValueError("kvsieve attention: pass kvsieve_cache=KvsieveCache(...) to the model's forward "
                         f"(got {type(cache).__name__}); see kvsieve_hf.forward")
    if query.dtype not in _DTYPES:
        raise TypeError(f"kvsieve attention: query/key/value dtype must be float32, float16 or bfloat16, "
                        f"got {query.dtype} (convert the model, e.g. model.to(torch.float32))")
    want = "cuda" if cache.backend == "cuda" else "cpu"
    if query.device.type != want or (want == "cuda" and query.device.index != cache.device_id):
        where = f"cuda:{cache.device_id}" if want == "cuda" else "cpu"
        raise ValueError(f"kvsieve attention: the KvsieveCache's backend {cache.backend!r} needs the model "
                         f"on {where}, got tensors on {query.device}")
    if query.shape[0] != 1:
        raise ValueError(f"kvsieve attention: batch size must be 1 (one KvsieveCache per sequence), "
                         f"got {query.shape[0]}")
    if dropout:
        raise ValueError(f"kvsieve attention: dropout must be 0 (call model.eval()), got {dropout}")
    if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
        raise NotImplementedError("kvsieve attention: sliding-window layers are not supported "
                                  f"(layer {module.layer_idx})")
    if kwargs.get("softcap") or getattr(module, "attn_logit_softcapping", None):
        raise NotImplementedError("kvsieve attention: attention logit softcapping is not supported")


def _kv(x: torch.Tensor, cache: KvsieveCache) -> torch.Tensor:
    """K/V for the cuda backend: C-contiguous, in the KV dtype (one copy, none if already so)."""
    return x.to(dtype=cache._kv_torch, memory_format=torch.contiguous_format)


def kvsieve_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                      dropout: float = 0.0, kvsieve_cache: Optional[KvsieveCache] = None, **kwargs):
    """A transformers attention function (registered as ``"kvsieve"``).

    query [1, Hq, n, d], key/value [1, Hkv, n, d]: the new tokens only (use_cache=False).
    Returns (attn_output [1, n, Hq, d], None). The mask is ignored: kvsieve attention is causal
    over the sequence held by the cache (batch 1, no padding)."""
    cache = kvsieve_cache
    _check(cache, module, query, dropout, kwargs)
    d = query.shape[-1]
    scale = float(scaling) if scaling is not None else d ** -0.5
    layer = int(module.layer_idx)
    n = query.shape[2]
    cache._ensure_session(query.dtype, scale)
    s = cache.session
    out = torch.empty((1, n, query.shape[1], d), dtype=query.dtype, device=query.device)
    cuda = cache.backend == "cuda"
    stream = torch.cuda.current_stream(query.device) if cuda else None
    if layer not in cache._prefilled:
        q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
        if cuda:
            # The cuda backend takes C-contiguous tensors only, K/V in the session's KV dtype, and
            # its prefill has no output.
            s.prefill(layer, q.contiguous(), _kv(k, cache), _kv(v, cache), stream=stream)
            o = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, is_causal=n > 1, scale=scale, enable_gqa=True)
            out.copy_(o.transpose(1, 2))
        else:
            s.prefill(layer, q, k, v, out=out[0])
        s.build_index(stream=stream)
        cache._prefilled.add(layer)
    elif n == 1:
        q, k, v = query[0, :, 0], key[0, :, 0], value[0, :, 0]
        if cuda:
            q, k, v = q.contiguous(), _kv(k, cache), _kv(v, cache)
        if cache._lse is None or cache._lse.device != query.device:
            cache._lse = torch.empty(query.shape[1], dtype=torch.float32, device=query.device)
        s.decode(layer, q, k, v, out=out[0, 0], lse=cache._lse, stream=stream)
    else:
        q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
        if cuda:
            raise NotImplementedError("kvsieve attention: several new tokens after the prompt (append) "
                                      "need an output, which the cuda backend does not give; feed them "
                                      "one at a time")
        s.append(layer, q, k, v, out=out[0])
    return out, None


def register(name: str = NAME) -> str:
    """Registers :func:`kvsieve_attention` in transformers' AttentionInterface under ``name``.
    transformers builds no mask for a name it has no mask function for, which is what kvsieve
    wants (it is causal over its own cache)."""
    from transformers import AttentionInterface
    AttentionInterface.register(name, kvsieve_attention)
    return name


def forward(model, input_ids: torch.Tensor, cache: KvsieveCache, **kwargs):
    """Runs the model on the next tokens of the sequence held by ``cache`` (input_ids [1, n]) and
    returns the logits [1, n, vocab]. Positions continue from the cache's length."""
    n = input_ids.shape[-1]
    pos = torch.arange(cache.tokens, cache.tokens + n, device=input_ids.device).unsqueeze(0)
    out = model(input_ids=input_ids, position_ids=pos, use_cache=False, kvsieve_cache=cache, **kwargs)
    cache.tokens += n
    if cache.backend == "cuda":
        torch.cuda.current_stream(input_ids.device).synchronize()
    return out.logits


@torch.no_grad()
def greedy_generate(model, input_ids: torch.Tensor, cache: KvsieveCache, max_new_tokens: int,
                    eos_token_id: Optional[int] = None) -> torch.Tensor:
    """Greedy decoding: the prompt through prefill, then one kvsieve decode per token and layer.
    Returns the new token ids [1, m]."""
    logits = forward(model, input_ids, cache, logits_to_keep=1)   # not [n, vocab] for a long prompt
    new = []
    for _ in range(max_new_tokens):
        tok = logits[:, -1].argmax(-1, keepdim=True)
        new.append(tok)
        if eos_token_id is not None and int(tok) == eos_token_id:
            break
        logits = forward(model, tok, cache)
    return torch.cat(new, dim=1) if new else input_ids[:, :0]
