# SPDX-License-Identifier: Apache-2.0
"""kvsieve as the KV cache and attention of a Hugging Face transformers model (``generate()`` included).

Usage::

    import kvsieve.transformers as kt
    model.set_attn_implementation(kt.NAME)          # "kvsieve" (registered when this module is imported)
    cache = kt.KvsieveCache(model.config, method="quest", budget=0.05)
    out = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache,
                         max_new_tokens=64, do_sample=False)
    cache.close()                                    # frees the kvsieve sessions (or use ``with``)

:class:`KvsieveCache` is a ``transformers.Cache``: one kvsieve ``Session`` per batch row, created
at the first forward. Its ``update`` keeps no tensors: it hands the new tokens' post-RoPE K/V to the
``"kvsieve"`` attention function (registered in transformers' AttentionInterface, with a mask
function under the same name), which stores them in the row's session and computes attention there:

- the first tokens a layer sees (the prompt) go through ``Session.prefill`` (exact causal attention
  of the prompt on the cpu backend) and ``build_index``;
- one new token per row is a decode step, the method's sparse attention (``kvsieve.decode_batch``
  for B > 1 on the cpu backend, ``Session.decode`` otherwise);
- several new tokens after the prompt (a new turn, chunked prefill) are ``Session.append`` (exact).

Batches: row b of the batch is ``cache.sessions[b]``. Left padding (``tokenizer.padding_side =
"left"``, the attention mask ``generate`` gets) is supported: a row's padding positions are never
stored in its session, and generate's position ids (counted over the mask) give its real tokens the
positions an unpadded run would. Padding after a real token (right padding, holes) is refused.

Beam search, ``num_return_sequences`` and other row reorderings fork the sessions (copy-on-write KV
pages, on either backend). Removing tokens (``crop``: assisted / speculative decoding) truncates every
row's session (``Session.truncate``): full, exact_topk, streaming and quest roll back to any length;
on the cpu backend the methods whose index keeps history (csattention, ctkvr, lfps, hgca, retroinfer)
as far back as ``max_rollback`` tokens (a ``KvsieveCache`` argument, 0 by default: give the most
tokens one crop removes), never below the prompt their index was built on (so not with
``assistant_model``, whose first drafts come with the prompt); on the cuda backend csattention not
below its indexed tokens, retroinfer not below its clustered tokens and local window.

Not supported (a clear error each): sliding-window, chunked, linear-attention or shared-KV layers,
attention logit softcapping, dropout (call ``model.eval()``), packed sequences or custom mask
overlays, dtypes other than float32/float16/bfloat16, several new tokens after the prompt on the cuda
backend (its append computes no attention output; so no ``assistant_model`` there either). The cuda
backend runs the methods that have CUDA kernels (``kvsieve.methods()``: full, exact_topk, streaming,
quest, csattention, retroinfer), head dims 64, 128 and 256.
"""

from __future__ import annotations

import math
import threading
from typing import Any, List, Mapping, Optional

try:
    import torch
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("kvsieve.transformers needs PyTorch (the 'torch' package): pip install torch") from e
try:
    import transformers
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("kvsieve.transformers needs Hugging Face transformers >= 5 (the 'transformers' "
                      f"package): pip install transformers ({e})") from e

import kvsieve

__all__ = ["NAME", "KvsieveCache", "kvsieve_attention", "kvsieve_mask", "register"]

NAME = "kvsieve"
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}
# The pending handshake between KvsieveCache.update and kvsieve_attention (same thread, same layer).
_local = threading.local()


class _KvsieveLayer(CacheLayerMixin):
    """The per-layer view transformers' generate/masking code asks about; the data lives in the
    sessions of the owning :class:`KvsieveCache`."""

    is_sliding = False
    is_compileable = False
    is_croppable = True   # cpu backend (set per instance)
    supports_early_init = False

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.seen = 0          # positions this layer has seen (padding included), same for every row
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("internal: KvsieveCache.update handles the layers")

    def get_mask_sizes(self, query_length: int):
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen = 0

    def offload(self):
        pass

    def prefetch(self):
        pass


def _refuse_layer_types(text) -> None:
    types = getattr(text, "layer_types", None)
    if types is not None:
        bad = sorted({t for t in types if t != "full_attention"})
        if bad:
            raise NotImplementedError(f"KvsieveCache: only full-attention layers are supported, the model has "
                                      f"layer types {bad} (sliding-window, chunked, linear or shared-KV layers)")
    if getattr(text, "sliding_window", None) is not None and types is None:
        raise NotImplementedError(f"KvsieveCache: sliding-window attention (sliding_window="
                                  f"{text.sliding_window}) is not supported")
    if getattr(text, "attention_chunk_size", None) is not None:
        raise NotImplementedError("KvsieveCache: chunked attention is not supported")
    if getattr(text, "kv_sharing_modes", None) is not None or getattr(text, "num_kv_shared_layers", 0):
        raise NotImplementedError("KvsieveCache: layers sharing another layer's KV are not supported")


class KvsieveCache(Cache):
    """A ``transformers.Cache`` whose K/V live in kvsieve sessions, one per batch row.

    Pass it as ``past_key_values=`` to ``model.generate`` or ``model(...)`` with the model's
    attention implementation set to ``"kvsieve"`` (:data:`NAME`). ``method``, ``budget``,
    ``budget_tokens``, ``method_params``, ``kv_dtype``, ``backend``, ``device_id`` and
    ``num_threads`` are those of :class:`kvsieve.Session` (``kv_dtype`` defaults to the model's
    dtype, bfloat16 for a float32 model on the cuda backend). The softmax scale is the model's.
    ``max_rollback`` too: the tokens one :meth:`crop` may remove on a method whose index keeps
    history (csattention, ctkvr, lfps, hgca, retroinfer; 0 = none, the default).
    """

    def __init__(self, config, *, method: str = "full", budget: Optional[float] = None,
                 budget_tokens: Optional[int] = None, method_params: Optional[Mapping[str, Any]] = None,
                 backend: str = "cpu", device_id: int = 0, num_threads: int = 0,
                 kv_dtype: Optional[str] = None, max_rollback: int = 0):
        register()
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if getattr(text, "is_encoder_decoder", False):
            raise NotImplementedError("KvsieveCache: encoder-decoder models are not supported")
        _refuse_layer_types(text)
        if backend not in ("cpu", "cuda"):
            raise ValueError(f"backend: expected 'cpu' or 'cuda', got {backend!r}")
        self.num_layers = int(text.num_hidden_layers)
        self.num_q_heads = int(text.num_attention_heads)
        self.num_kv_heads = int(getattr(text, "num_key_value_heads", None) or self.num_q_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // self.num_q_heads)
        super().__init__(layers=[_KvsieveLayer(i) for i in range(self.num_layers)])
        for layer in self.layers:
            layer.is_croppable = True   # Session.truncate says which methods and lengths it takes
        self.max_rollback = int(max_rollback)
        self._config = config
        self.method, self.budget, self.budget_tokens = method, budget, budget_tokens
        self.method_params = dict(method_params or {})
        self.backend, self.device_id, self.num_threads = backend, int(device_id), int(num_threads)
        self.kv_dtype = kv_dtype
        self.sessions: List[kvsieve.Session] = []
        self._held: List[List[int]] = []     # [row][layer]: tokens stored in the row's session
        self._scale: Optional[float] = None
        self._lse = None

    # ---- lifetime
    def close(self) -> None:
        """Frees the kvsieve sessions; the cache is empty afterwards (it can be filled again)."""
        for s in self.sessions:
            s.close()
        self.sessions, self._held = [], []
        for layer in self.layers:
            layer.reset()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"KvsieveCache(method={self.method!r}, backend={self.backend!r}, rows={len(self.sessions)}, "
                f"tokens={self.get_seq_length()})")

    # ---- what transformers calls
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Hands the new tokens' K/V to the kvsieve attention function of the same layer (which
        stores them) and returns them unchanged; the cache keeps no tensors of its own."""
        pending = getattr(_local, "pending", None)
        if pending is not None and pending[0] is self:
            _local.pending = None
            raise ValueError(f"KvsieveCache: layer {pending[1]}'s attention did not run through kvsieve: call "
                             f"model.set_attn_implementation({NAME!r}) before using the cache")
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"KvsieveCache: layer {layer_idx} out of range (the config has {self.num_layers})")
        _local.pending = (self, int(layer_idx), key_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].seen

    def get_mask_sizes(self, query_length: int, layer_idx: int):
        if layer_idx >= len(self.layers):
            return query_length, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def reset(self) -> None:
        self.close()

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last ``-tokens_to_remove`` positions of every layer (transformers' convention:
        a negative count; 0 is a no-op) from every row's session, KV and index alike
        (``Session.truncate``), so that decoding continues as if they had never been
        fed: assisted and speculative decoding drop their rejected draft tokens this way."""
        n = int(tokens_to_remove)
        if n == 0:
            return
        if n > 0:
            raise ValueError(f"KvsieveCache.crop: expected a negative number of tokens to remove (transformers' "
                             f"convention), got {n}")
        n = -n
        seen = {layer.seen for layer in self.layers}
        if len(seen) != 1:
            raise ValueError(f"KvsieveCache.crop: the layers have seen different numbers of positions {sorted(seen)}")
        past = seen.pop()
        if n > past:
            raise ValueError(f"KvsieveCache.crop: cannot remove {n} positions, the cache holds {past}")
        targets = []
        for b, held in enumerate(self._held):
            if len(set(held)) != 1:
                raise ValueError(f"KvsieveCache.crop: row {b}'s layers hold different numbers of tokens {held}")
            # The positions removed are the newest: real tokens of every row (padding is only at the
            # left), except where a row holds fewer than n (then it is emptied of them all).
            targets.append(max(0, held[0] - n))
        # Every row is checked first (truncate validates before it changes anything), so a refused
        # crop leaves the cache as it was.
        for b, s in enumerate(self.sessions):
            try:
                s.truncate(targets[b])
            except kvsieve.Error as e:
                hint = ("" if self.max_rollback else " (pass KvsieveCache(..., max_rollback=N) with N at least the "
                        "tokens one crop removes)")
                if b == 0:
                    raise type(e)(e.code, f"KvsieveCache.crop: {e.c_message}{hint}", e.backend_code) from e
                raise RuntimeError(f"KvsieveCache.crop: row {b} could not be cropped after rows 0..{b - 1} were "
                                   f"({e}); the cache is inconsistent: close it") from e
        for b, t in enumerate(targets):
            self._held[b] = [t] * self.num_layers
        for layer in self.layers:
            layer.seen = past - n

    def _select_rows(self, rows: List[int], what: str) -> None:
        if not self.sessions:
            return
        if rows == list(range(len(self.sessions))):
            return
        new = [self.sessions[i].fork() for i in rows]
        held = [list(self._held[i]) for i in rows]
        for s in self.sessions:
            s.close()
        self.sessions, self._held = new, held

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes a fork of row ``beam_idx[i]``."""
        self._select_rows([int(i) for i in beam_idx.tolist()], "beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([i for i in range(len(self.sessions)) for _ in range(int(repeats))],
                          "batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows([int(i) for i in torch.as_tensor(indices).tolist()], "batch_select_indices")

    @property
    def batch_size(self) -> int:
        return len(self.sessions) if self.sessions else -1

    # ---- kvsieve side
    @property
    def stats(self) -> kvsieve.Stats:
        """The statistics of the single session (batch 1); ``cache.sessions[b].stats`` for a batch."""
        if len(self.sessions) != 1:
            raise ValueError(f"stats: the cache holds {len(self.sessions)} sessions; use cache.sessions[b].stats")
        return self.sessions[0].stats

    @property
    def session(self) -> Optional[kvsieve.Session]:
        """The single session (batch 1), None before the first forward."""
        if len(self.sessions) > 1:
            raise ValueError(f"session: the cache holds {len(self.sessions)} sessions; use cache.sessions[b]")
        return self.sessions[0] if self.sessions else None

    @property
    def tokens(self) -> int:
        """Positions seen so far (padding included): the position of the next token."""
        return self.get_seq_length()

    def fork(self) -> "KvsieveCache":
        """A new cache at this cache's current state (every session forked: KV shared copy-on-write,
        the method's index copied). Both evolve independently."""
        if not self.sessions:
            raise ValueError("fork: the cache holds no session yet (run the prompt first)")
        c = KvsieveCache.__new__(KvsieveCache)
        c.__dict__.update(self.__dict__)
        c.layers = [_KvsieveLayer(i) for i in range(self.num_layers)]
        for a, b in zip(c.layers, self.layers):
            a.seen = b.seen
        c.sessions = [s.fork() for s in self.sessions]
        c._held = [list(h) for h in self._held]
        c._lse = None
        return c

    def prefill_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      out: Optional[torch.Tensor] = None) -> None:
        """Batch 1: prefills one layer from precomputed prompt q [n, Hq, d], k/v [n, Hkv, d] (e.g. from
        a trace or a shared prompt pass) and builds its index; ``out`` optionally receives the
        prompt's causal attention (cpu backend). The layer's length becomes n, so the next forward
        (with ``past_key_values=cache``) continues at position n."""
        self._ensure_sessions(1, q.dtype, scale)
        s, n = self.sessions[0], int(q.shape[0])
        if self._held[0][layer]:
            raise ValueError(f"prefill_layer: layer {layer} already holds {self._held[0][layer]} tokens")
        if self.backend == "cuda":
            stream = torch.cuda.current_stream(q.device)
            s.prefill(layer, q.contiguous(), self._kv(k), self._kv(v), out=out, stream=stream)
            s.build_index(stream=stream)
        else:
            s.prefill(layer, q, k, v, out=out)
            s.build_index()
        self._held[0][layer] = n
        self.layers[layer].seen = n

    def _ensure_sessions(self, batch: int, dtype: torch.dtype, scale: float) -> None:
        if self.sessions:
            if len(self.sessions) != batch:
                raise ValueError(f"KvsieveCache: the cache holds {len(self.sessions)} sequences, the input has "
                                 f"batch size {batch}")
            if not math.isclose(scale, self._scale, rel_tol=1e-6):
                raise ValueError(f"scaling: every layer must use the softmax scale the sessions were created "
                                 f"with ({self._scale}), got {scale}")
            return
        self._scale = float(scale)
        if self.kv_dtype is None:
            self.kv_dtype = "bfloat16" if self.backend == "cuda" and dtype == torch.float32 else _DTYPES[dtype]
        self.sessions = [kvsieve.Session(
            self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim,
            method=self.method, budget=self.budget, budget_tokens=self.budget_tokens,
            method_params=self.method_params or None, kv_dtype=self.kv_dtype,
            backend=self.backend, device_id=self.device_id, num_threads=self.num_threads,
            softmax_scale=self._scale, max_rollback=self.max_rollback) for _ in range(batch)]
        self._held = [[0] * self.num_layers for _ in range(batch)]

    def _kv(self, x: torch.Tensor) -> torch.Tensor:
        """K/V for the cuda backend: C-contiguous, in the KV dtype (one copy, none if already so)."""
        return x.to(dtype=_TORCH_DTYPES[self.kv_dtype], memory_format=torch.contiguous_format)


def _check(module, query: torch.Tensor, dropout: float, kwargs, cache: Optional[KvsieveCache]) -> None:
    if query.dtype not in _DTYPES:
        raise TypeError(f"kvsieve attention: query/key/value dtype must be float32, float16 or bfloat16, "
                        f"got {query.dtype} (convert the model, e.g. model.to(torch.float32))")
    if cache is not None:
        want = "cuda" if cache.backend == "cuda" else "cpu"
        if query.device.type != want or (want == "cuda" and query.device.index != cache.device_id):
            where = f"cuda:{cache.device_id}" if want == "cuda" else "cpu"
            raise ValueError(f"kvsieve attention: the KvsieveCache's backend {cache.backend!r} needs the model "
                             f"on {where}, got tensors on {query.device}")
    if dropout:
        raise ValueError(f"kvsieve attention: dropout must be 0 (call model.eval()), got {dropout}")
    if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
        raise NotImplementedError("kvsieve attention: sliding-window layers are not supported "
                                  f"(layer {getattr(module, 'layer_idx', '?')})")
    if kwargs.get("softcap") or getattr(module, "attn_logit_softcapping", None):
        raise NotImplementedError("kvsieve attention: attention logit softcapping is not supported")
    if getattr(module, "is_causal", True) is False:
        raise NotImplementedError("kvsieve attention: only causal self-attention is supported")


def _row_span(mask_row: Optional[torch.Tensor], n: int, held: int, past: int, row: int) -> int:
    """First valid index among the n new positions of one row (n if none): left padding only."""
    if mask_row is None:
        if held != past:
            raise ValueError(f"kvsieve attention: row {row}'s session holds {held} of the {past} past positions (the "
                             "rest were padding): pass the attention mask that covers them")
        return 0
    new = mask_row[-n:]
    if bool(new.all()):
        start = 0
    else:
        valid = new.nonzero()
        start = int(valid[0]) if valid.numel() else n
        if held or not bool(new[start:].all()):
            raise NotImplementedError(
                f"kvsieve attention: row {row} has padding after a real token; only left padding is supported "
                "(tokenizer.padding_side = 'left'), and every token after the prompt must be unmasked")
    old = int(mask_row[:-n].sum()) if mask_row.shape[0] > n else 0
    if old != held:
        raise ValueError(f"kvsieve attention: row {row}'s attention mask marks {old} of its {past} past positions "
                         f"as real tokens, its kvsieve session holds {held}; the mask of past tokens cannot change")
    return start


def kvsieve_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                      dropout: float = 0.0, **kwargs):
    """A transformers attention function (registered as ``"kvsieve"``).

    query [B, Hq, n, d], key/value [B, Hkv, n, d]: the new tokens only, as handed over by
    :meth:`KvsieveCache.update`. attention_mask: None (no padding) or the [B, past + n] bool padding
    mask built by :func:`kvsieve_mask`. Returns (attn_output [B, n, Hq, d], None); the outputs at
    padding positions are zeros."""
    pending = getattr(_local, "pending", None)
    _local.pending = None
    if pending is None or pending[2] is not key:
        raise ValueError(f"kvsieve attention: pass past_key_values=kvsieve.transformers.KvsieveCache(model.config, "
                         "...) to the model or to generate() (with use_cache left on); the attention implementation "
                         f"{NAME!r} runs only with it")
    cache, layer = pending[0], pending[1]
    if getattr(module, "layer_idx", layer) != layer:
        raise ValueError(f"kvsieve attention: layer mismatch ({module.layer_idx} vs the cache's {layer})")
    _check(module, query, dropout, kwargs, cache)
    B, hq, n, d = query.shape
    if key.shape[1] != cache.num_kv_heads or hq != cache.num_q_heads or d != cache.head_dim:
        raise ValueError(f"kvsieve attention: q/k heads {hq}/{key.shape[1]}, head dim {d} differ from the "
                         f"config's {cache.num_q_heads}/{cache.num_kv_heads}/{cache.head_dim}")
    scale = float(scaling) if scaling is not None else d ** -0.5
    cache._ensure_sessions(B, query.dtype, scale)
    lay = cache.layers[layer]
    past = lay.seen
    mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape != (B, past + n):
            raise NotImplementedError(
                f"kvsieve attention: expected no mask or the [batch, past + new] padding mask of the "
                f"{NAME!r} mask function, got shape {tuple(attention_mask.shape)} (a 4D or custom mask)")
        mask = attention_mask.to(device="cpu", dtype=torch.bool)
    starts = [_row_span(None if mask is None else mask[b], n, cache._held[b][layer], past, b) for b in range(B)]

    cuda = cache.backend == "cuda"
    stream = torch.cuda.current_stream(query.device) if cuda else None
    out = (torch.zeros if any(starts) else torch.empty)((B, n, hq, d), dtype=query.dtype, device=query.device)
    sessions = cache.sessions
    if n == 1 and all(cache._held[b][layer] for b in range(B)) and not any(starts):
        # One decode step of every row: the method's sparse attention.
        q, k, v = query[:, :, 0], key[:, :, 0], value[:, :, 0]
        if cuda:
            q, k, v = q.contiguous(), cache._kv(k), cache._kv(v)
        if cache._lse is None or cache._lse.shape != (B, hq) or cache._lse.device != query.device:
            cache._lse = torch.empty((B, hq), dtype=torch.float32, device=query.device)
        if B == 1:
            sessions[0].decode(layer, q[0], k[0], v[0], out=out[0, 0], lse=cache._lse[0], stream=stream)
        else:
            kvsieve.decode_batch(sessions, layer, q, k, v, out=out[:, 0], lse=cache._lse, stream=stream)
        for b in range(B):
            cache._held[b][layer] += 1
    else:
        for b in range(B):
            s0 = starts[b]
            if s0 == n:
                continue
            q = query[b, :, s0:].transpose(0, 1)
            k = key[b, :, s0:].transpose(0, 1)
            v = value[b, :, s0:].transpose(0, 1)
            s = sessions[b]
            if cache._held[b][layer] == 0:
                if cuda:
                    # The cuda backend takes C-contiguous tensors, K/V in the KV dtype, and its prefill
                    # has no output: torch's SDPA gives the prompt's causal attention.
                    s.prefill(layer, q.contiguous(), cache._kv(k), cache._kv(v), stream=stream)
                    m = n - s0
                    o = torch.nn.functional.scaled_dot_product_attention(
                        query[b:b + 1, :, s0:], key[b:b + 1, :, s0:], value[b:b + 1, :, s0:],
                        is_causal=m > 1, scale=scale, enable_gqa=True)
                    out[b, s0:].copy_(o[0].transpose(0, 1))
                else:
                    s.prefill(layer, q, k, v, out=out[b, s0:])
                s.build_index(stream=stream)
            else:
                if cuda:
                    raise NotImplementedError("kvsieve attention: several new tokens after the prompt (append) need "
                                              "an output, which the cuda backend does not give; feed them one at a time")
                s.append(layer, q, k, v, out=out[b, s0:])
            cache._held[b][layer] += n - s0
    lay.seen = past + n
    return out, None


def kvsieve_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=causal_mask_function, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """The mask function registered as ``"kvsieve"``: kvsieve attention is causal over each row's
    session by construction, so it only needs the padding: None when there is none, else the
    [batch, kv_length] bool mask (left padding). Mask overlays (packed sequences, bidirectional
    blocks, image-token masks) are refused."""
    if mask_function is not causal_mask_function:
        raise NotImplementedError("kvsieve attention: only the plain causal mask is supported (no packed sequences, "
                                  "block or token-type overlays)")
    if kv_offset:
        raise NotImplementedError("kvsieve attention: a mask with a key offset (sliding or static cache) is not supported")
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].to(torch.bool)
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    if attention_mask.shape[1] != kv_length:
        raise ValueError(f"kvsieve attention: the attention mask covers {attention_mask.shape[1]} positions, the "
                         f"cache and the input {kv_length}")
    return attention_mask


def register(name: str = NAME) -> str:
    """Registers :func:`kvsieve_attention` in transformers' AttentionInterface and
    :func:`kvsieve_mask` in its AttentionMaskInterface under ``name`` (idempotent; done when this
    module is imported)."""
    AttentionInterface.register(name, kvsieve_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, kvsieve_mask)
    return name


register()
