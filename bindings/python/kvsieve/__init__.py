# SPDX-License-Identifier: Apache-2.0
"""kvsieve: sparse-attention decoding over a KV cache (Python binding of the C ABI).

Tensors go in without a copy through DLPack (NumPy, PyTorch, CuPy, JAX; CPU, CUDA-host or CUDA
memory) or the buffer protocol. A wrong dtype raises TypeError, a wrong shape, rank, device or
layout raises ValueError, both naming what was expected; the binding converts or copies nothing (the
library stores K/V in the session's kv_dtype, bfloat16 by default, rounding float32 K/V as it stores
them). Library errors raise :class:`kvsieve.Error` with the code and message. The GIL is
released during every call that can take time. See docs/bindings.md.

Example::

    import numpy as np, kvsieve
    with kvsieve.Session(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=64,
                         method="quest", budget=0.05) as s:
        s.prefill(0, q, k, v)          # q [n, 8, 64], k, v [n, 2, 64], float32/float16/bfloat16
        s.build_index()
        o, lse = s.decode(0, q1, k1, v1)   # o [8, 64] float32, lse [8] float32 (natural log)
"""

from __future__ import annotations

import json as _json
import numbers as _numbers
import os as _os
import threading as _threading
import warnings as _warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import numpy as _np

from . import capi as _native
from ._errors import (STATUS_NAMES, AbiMismatchError, BackendError, Error, FormatError, InternalError,
                      InvalidArgumentError, InvalidStateError, LibraryFileNotFoundError, LibraryIOError,
                      LibraryPermissionError, OutOfMemoryError, UnsupportedError)

__all__ = [
    "Error", "InvalidArgumentError", "OutOfMemoryError", "UnsupportedError", "InvalidStateError",
    "LibraryIOError", "LibraryFileNotFoundError", "LibraryPermissionError", "FormatError", "BackendError",
    "AbiMismatchError", "InternalError", "Session", "Batch", "Stats", "MethodInfo", "ParamInfo", "Trace", "methods", "method_names",
    "method_unsupported_reason", "decode_batch", "tables_describe", "version", "version_number", "abi_version",
    "set_log_callback",
]

# ---- constants (mirrors of the C enums) ---------------------------------------------------------
STATUS_OK = 0
STATUS_INVALID_ARGUMENT = 1
STATUS_OUT_OF_MEMORY = 2
STATUS_UNSUPPORTED = 3
STATUS_INVALID_STATE = 4
STATUS_IO = 5
STATUS_FORMAT_MAGIC = 6
STATUS_FORMAT_VERSION = 7
STATUS_FORMAT_TRUNCATED = 8
STATUS_FORMAT_CHECKSUM = 9
STATUS_FORMAT_INVALID = 10
STATUS_BACKEND = 11
STATUS_ABI_MISMATCH = 12
STATUS_INTERNAL = 13

_BACKENDS = {"cpu": _native.KVS_BACKEND_CPU, "cuda": _native.KVS_BACKEND_CUDA,
             "hybrid": _native.KVS_BACKEND_HYBRID}
_BACKEND_NAMES = {v: k for k, v in _BACKENDS.items()}
_KV_DTYPES = {"float32": _native.KVS_SCALAR_F32, "f32": _native.KVS_SCALAR_F32,
              "float16": _native.KVS_SCALAR_F16, "f16": _native.KVS_SCALAR_F16,
              "bfloat16": _native.KVS_SCALAR_BF16, "bf16": _native.KVS_SCALAR_BF16}
_KV_MEMORY = {"default": 0, "cpu": _native.KVS_DEVICE_CPU, "cuda": _native.KVS_DEVICE_CUDA,
              "cuda_host": _native.KVS_DEVICE_CUDA_HOST}
_KV_SOURCES = {"owned": _native.KVS_KV_OWNED, "caller": _native.KVS_KV_CALLER}
_GEMMS = {"auto": _native.KVS_GEMM_AUTO, "onednn": _native.KVS_GEMM_ONEDNN,
          "openblas": _native.KVS_GEMM_OPENBLAS}
_LOG_LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3, "off": 4}

# The ABI this package was built against must be the one of the library it loads.
_native.abi_check(_native.KVS_ABI_VERSION)


def version() -> str:
    """"MAJOR.MINOR.PATCH" of the loaded library."""
    return _native.kvs_version()


def version_number() -> int:
    return int(_native.kvs_version_number())


def abi_version() -> int:
    return int(_native.kvs_abi_version())


# ---- method registry ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamInfo:
    name: str
    type: str  # "int", "float", "bool", "string" or "enum:a|b|c"
    default: str
    doc: str


@dataclass(frozen=True)
class MethodInfo:
    name: str
    doc: str
    backends: Tuple[str, ...]
    params: Tuple[ParamInfo, ...]


def method_names() -> list:
    """Names of every registered method, in registry order (kvs_method_count / kvs_method_name)."""
    return [_native.kvs_method_name(i) for i in range(_native.kvs_method_count())]


def methods() -> list:
    """Every registered method with its description, backends and parameters."""
    out = []
    for name in method_names():
        mask = _native.kvs_method_backends(name)
        backends = tuple(b for b, v in _BACKENDS.items() if mask & (1 << v))
        params = tuple(ParamInfo(*p) for p in _native.method_params(name))
        out.append(MethodInfo(name, _native.kvs_method_doc(name) or "", backends, params))
    return out


def method_unsupported_reason(method: str, backend) -> Optional[str]:
    """Why ``method`` cannot run on ``backend`` ("cpu", "cuda", "hybrid" or a kvs_backend value, as
    for :class:`Session`) in this build: a sentence, or None when it can (or the method is unknown:
    see :func:`method_names`). An unknown backend value gives a sentence saying so."""
    return _native.kvs_method_unsupported_reason(_text(method, "method"), _enum(backend, _BACKENDS, "backend"))


# ---- helpers ------------------------------------------------------------------------------------
def _enum(value, table: Mapping[str, int], what: str) -> int:
    if isinstance(value, str):
        try:
            return table[value.lower()]
        except KeyError:
            raise ValueError(f"{what}: expected one of {sorted(table)}, got {value!r}") from None
    if isinstance(value, int):
        return value
    raise TypeError(f"{what}: expected a string or an int, got {type(value).__name__}")


def _lse_base(value) -> int:
    """kvs_lse_base from "e" (natural log) or 2 (an int or "2")."""
    if isinstance(value, str) and value.lower() in ("e", "natural"):
        return _native.KVS_LSE_BASE_E
    if (isinstance(value, str) and value == "2") or (isinstance(value, int) and not isinstance(value, bool) and value == 2):
        return _native.KVS_LSE_BASE_2
    raise ValueError(f"lse_base: expected \"e\" (natural log) or 2, got {value!r}")


def _stream_ptr(stream) -> int:
    """A cudaStream_t as an int: None (stream 0), an int, torch.cuda.Stream (.cuda_stream) or a
    CuPy stream (.ptr)."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    raise TypeError(f"stream: expected None, an int (cudaStream_t) or a torch/CuPy stream, "
                    f"got {type(stream).__name__}")


def _text(value, what: str) -> str:
    """A str that crosses the C ABI as a NUL-terminated string: an embedded NUL would silently cut
    it short there, so it is refused here."""
    if not isinstance(value, str):
        raise TypeError(f"{what}: expected a str, got {type(value).__name__}")
    if "\0" in value:
        raise ValueError(f"{what}: expected a string without NUL characters, got {value!r}")
    return value


def _path(value, what: str = "path") -> str:
    """A file path (str or os.PathLike) as a str without NUL characters."""
    try:
        value = _os.fspath(value)
    except TypeError:
        raise TypeError(f"{what}: expected a str or os.PathLike, got {type(value).__name__}") from None
    if isinstance(value, bytes):
        value = _os.fsdecode(value)
    return _text(value, what)


def _method_params_str(params) -> Optional[str]:
    if params is None:
        return None
    if isinstance(params, str):
        return _text(params, "method_params")
    if isinstance(params, Mapping):
        items = []
        for k, v in params.items():
            if isinstance(v, bool):
                v = "true" if v else "false"
            k, v = _text(str(k), "method_params key"), _text(str(v), f"method_params[{k!r}]")
            # "," and "=" separate items and keys from values in the text the C ABI takes.
            if not k or "," in k or "=" in k:
                raise ValueError(f"method_params: expected a parameter name without ',' or '=', got {k!r}")
            if "," in v:
                raise ValueError(f"method_params[{k!r}]: expected a value without ',', got {v!r}")
            items.append(f"{k}={v}")
        return ",".join(items)
    raise TypeError(f"method_params: expected a str or a mapping, got {type(params).__name__}")


def _dlpack_device(obj, what: str) -> Tuple[int, int]:
    """obj.__dlpack_device__() checked as DLPack defines it: a tuple (device_type, device_id)."""
    dev = obj.__dlpack_device__()
    if not (isinstance(dev, tuple) and len(dev) == 2 and all(isinstance(x, int) for x in dev)):
        raise TypeError(f"{what}: __dlpack_device__() of {type(obj).__name__} must return a tuple "
                        f"(device_type, device_id) of two ints, got {dev!r}")
    return int(dev[0]), int(dev[1])


def _check_sessions(sessions, what: str = "sessions") -> tuple:
    """sessions as a tuple of open Session objects (TypeError/ValueError naming the bad entry)."""
    if isinstance(sessions, (str, bytes)) or not hasattr(sessions, "__iter__"):
        raise TypeError(f"{what}: expected a sequence of kvsieve.Session, got {type(sessions).__name__}")
    sessions = tuple(sessions)
    if not sessions:
        raise ValueError(f"{what}: expected at least one session")
    for i, s in enumerate(sessions):
        if not isinstance(s, Session):
            raise TypeError(f"{what}[{i}]: expected a kvsieve.Session, got {type(s).__name__}")
        if s.closed:
            raise ValueError(f"{what}[{i}]: expected an open session, got a closed one")
    return sessions


def _alloc_like(ref, shape, what: str, lse: bool = False):
    """Allocates an output where the query lives, with its library: torch in, torch out (same device;
    the query's dtype when it is float32, float16 or bfloat16, else float32), CuPy likewise (float32
    or float16), NumPy float32 for other host inputs. lse is always float32."""
    mod = type(ref).__module__.split(".")[0]
    if mod == "torch":
        import torch
        dt = torch.float32 if lse or ref.dtype not in (torch.float16, torch.bfloat16) else ref.dtype
        return torch.empty(shape, dtype=dt, device=ref.device)
    dev = _dlpack_device(ref, "q")[0] if hasattr(ref, "__dlpack_device__") else 1  # ref is always q
    if mod == "cupy":
        import cupy
        dt = cupy.float16 if not lse and ref.dtype == cupy.float16 else cupy.float32
        if dev != 2:
            return cupy.empty(shape, dtype=dt)
        with cupy.cuda.Device(ref.device.id):
            return cupy.empty(shape, dtype=dt)
    if dev != 2:
        return _np.empty(shape, dtype=_np.float32)
    raise ValueError(f"{what}: pass a CUDA output tensor (out=, lse=); kvsieve allocates CUDA outputs "
                     f"only for torch and CuPy inputs, got {type(ref).__name__}")


@dataclass(frozen=True)
class Stats:
    tokens: int
    decode_steps: int
    kv_bytes: int
    kv_shared_bytes: int
    index_bytes: int
    workspace_bytes: int
    last_selected_keys: float
    mean_selected_keys: float
    last_selected_fraction: float


# ---- sessions -----------------------------------------------------------------------------------
class Session:
    """The attention state of one sequence across the layers of one model shape.

    Use as a context manager, or call :meth:`close`; a session not closed is freed when collected.
    Sessions forked from this one stay valid after it is closed (the library keeps what they share
    alive). Mutating calls on one session are serialised by a lock of this object (the C ABI marks
    them exclusive); different sessions run in parallel from different threads, with the GIL released.
    """

    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
                 method: str = "full", method_params=None, budget: Optional[float] = None,
                 budget_tokens: Optional[int] = None, kv_dtype="bfloat16", backend="cpu",
                 device_id: int = 0, num_threads: int = 0, gemm="auto", softmax_scale: float = 0.0,
                 lse_base="e", max_rollback: int = 0, kv_memory="default", kv_source="owned",
                 _handle=None):
        """Creates a session (kvs_session_create).

        Args:
            num_layers, num_q_heads, num_kv_heads, head_dim: the model's attention shape
                (num_q_heads a multiple of num_kv_heads).
            method: a registered method name (``kvsieve.method_names()``): "full", "exact_topk",
                "streaming", "quest", "csattention", "ctkvr", "lfps", "hgca", "retroinfer".
            method_params: the method's parameters, "key=value,..." or a mapping
                (``kvsieve.methods()`` lists them with defaults and docs).
            budget: keys attended per step as a fraction of the context, in (0, 1]; or
            budget_tokens: the same as a number of keys (give at most one; neither: the method's
                default).
            kv_dtype: how the KV cache is stored, "bfloat16" (default), "float16" or "float32";
                float32 inputs are rounded to it when stored.
            backend: "cpu", "cuda" or "hybrid" (device_id: the CUDA device).
            num_threads: worker threads of the cpu backend (0: every hardware thread).
            gemm: the cpu backend's matrix library, "auto", "onednn" or "openblas".
            softmax_scale: the scale of q.k (0: 1/sqrt(head_dim)).
            lse_base: the base of the lse :meth:`decode` returns, "e" (natural log, the default) or
                2 (log2 = ln / ln 2, for kernels that merge attention states in base 2, such as
                FlashInfer's merge_state); the sessions of one cuda Batch must share it.
            max_rollback: tokens :meth:`truncate` must be able to drop on methods whose index keeps
                history (csattention, ctkvr, lfps, hgca, retroinfer); the cpu backend then keeps
                up to two copies of the index and the queries of the last 2 * max_rollback tokens.
                0 (the default): none. full, exact_topk, streaming and quest need none.
            kv_memory: where the KV cache lives: "default" (the backend's own memory), "cuda"
                (GPU memory), "cuda_host" (cuda backend: pinned host memory that the GPU kernels
                read over the bus, for contexts larger than GPU memory; the index stays on the GPU)
                or "cpu".
            kv_source: who stores the keys and values: "owned" (the default: the session stores
                what prefill, append and decode pass it) or "caller": an inference engine's paged
                KV cache, declared per layer with :meth:`bind_kv` (cpu and cuda backends); the
                session then keeps only its method's index, and prefill, append and decode take
                ``None`` for k and v.

        Raises:
            kvsieve.InvalidArgumentError (a ValueError) for a bad argument, kvsieve.UnsupportedError
            (a NotImplementedError) for a method or shape the backend does not run.
        """
        # Calls on one session are serialised here (the C ABI marks them exclusive); different
        # sessions run in parallel, the GIL being released inside each call.
        self._lock = _threading.RLock()
        # layer -> bind_kv's (pools, nhd, their signatures (_pool_sig), the checked arguments): the
        # pools stay referenced while bound, and the next binding of the same pools skips the checks.
        self._bound = {}
        self._kv_dtype = None
        if _handle is not None:
            self._h = _handle
            return
        method = _text(method, "method")
        self._h = _native.session_create(
            int(num_layers), int(num_q_heads), int(num_kv_heads), int(head_dim), float(softmax_scale),
            _enum(kv_dtype, _KV_DTYPES, "kv_dtype"), _enum(backend, _BACKENDS, "backend"), int(device_id),
            int(num_threads), _enum(gemm, _GEMMS, "gemm"), method, _method_params_str(method_params),
            float(budget or 0.0), int(budget_tokens or 0), _lse_base(lse_base),
            int(max_rollback), _enum(kv_memory, _KV_MEMORY, "kv_memory"),
            _enum(kv_source, _KV_SOURCES, "kv_source"))
        self._kv_dtype = _enum(kv_dtype, _KV_DTYPES, "kv_dtype")
        self._set_shape(num_layers, num_q_heads, num_kv_heads, head_dim, method,
                        _enum(backend, _BACKENDS, "backend"), device_id)

    def _set_shape(self, L, hq, hkv, d, method, backend, device_id):
        self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim = int(L), int(hq), int(hkv), int(d)
        self.method = method
        self.backend = _BACKEND_NAMES.get(backend, str(backend))
        self.device_id = int(device_id)
        cuda = backend == _native.KVS_BACKEND_CUDA
        # Where tensors must live: cuda: on the session's device; hybrid: either (prompt chunks may
        # come from the host, decode tensors from the device; the library says which it needs).
        where = 2 if cuda else -1 if backend == _native.KVS_BACKEND_HYBRID else 0
        self._spec = (self.num_q_heads, self.num_kv_heads, self.head_dim, where,
                      self.device_id, 1 if cuda else 0)

    @classmethod
    def load(cls, path: str, *, backend=None, device_id: int = 0, num_threads: int = 0,
             gemm="auto", mmap: bool = False, kv_memory="default", kv_source="owned") -> "Session":
        """Loads a session saved by :meth:`save`; the shape is read from the file.

        The KV pages are copied into memory of the session's own; ``mmap=True`` maps them from the
        file instead (no copy: the file must then not be truncated or modified while the session,
        or a fork of it, lives). ``backend`` (None = as saved) may differ from the one that saved;
        ``kv_memory`` as in :class:`Session`. ``kv_source="caller"``: the method's tables only, for
        a session over an engine's own KV cache: bind each layer (:meth:`bind_kv`) and prefill it
        again with ``k=None, v=None`` to the saved length; the loaded index is kept.
        """
        be = 0 if backend is None else _enum(backend, _BACKENDS, "backend")
        path = _path(path)
        flags = _native.KVS_LOAD_MMAP if mmap else 0
        h = _native.session_load(path, be, int(device_id), int(num_threads), _enum(gemm, _GEMMS, "gemm"), flags,
                                 _enum(kv_memory, _KV_MEMORY, "kv_memory"), _enum(kv_source, _KV_SOURCES, "kv_source"))
        s = cls(0, 0, 0, 0, _handle=h)
        # The C ABI has no shape getter: the shape comes from the file's header (already verified
        # by the load, so describing it cannot fail differently).
        hdr = _json.loads(_native.tables_describe(path))["header"]
        shape = hdr["shape"]
        s._set_shape(shape["num_layers"], shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"],
                     hdr["method"]["name"], be or int(hdr.get("backend", _native.KVS_BACKEND_CPU)), device_id)
        s._kv_dtype = _KV_DTYPES.get(shape.get("kv_dtype"))  # (what bind_kv checks pools against)
        return s

    # -- lifetime
    @property
    def closed(self) -> bool:
        return self._h is None

    def close(self) -> None:
        """Frees the session now; idempotent."""
        h, self._h = self._h, None
        del h

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _handle(self):
        if self._h is None:
            raise ValueError("session: expected an open session, got a closed one")
        return self._h

    def _spec_or_none(self):
        return self._spec if self.num_q_heads else None

    # -- work
    def prefill(self, layer: int, q, k, v, *, out=None, stream=None) -> None:
        """Appends a chunk of one layer's prompt: q [n, Hq, d], k, v [n, Hkv, d]. ``out`` (optional,
        [n, Hq, d]) receives causal attention of the chunk over the prompt so far."""
        with self._lock:
            self._handle().prefill(int(layer), q, k, v, out, _stream_ptr(stream), self._spec_or_none())

    def build_index(self, *, stream=None) -> None:
        """Builds the method's index over every prefilled layer."""
        with self._lock:
            self._handle().build_index(_stream_ptr(stream))

    def decode(self, layer: int, q, k_new, v_new, *, out=None, lse=None, stream=None):
        """One decode step of one layer: q [Hq, d], k_new, v_new [Hkv, d].

        Returns ``(out, lse)``: out [Hq, d] and lse [Hq] (natural log, or base 2 when the session
        was created with ``lse_base=2``). Both are allocated unless
        given, where q lives and with q's library: torch in, torch out (same device; out in q's dtype
        when that is float16 or bfloat16, else float32), CuPy likewise, NumPy float32 otherwise; lse
        is float32. Given outputs are filled in place (out float32, float16 or bfloat16; lse float32). On the cuda and hybrid backends
        the call may return before the work completes: read the outputs after ``stream`` has completed.
        """
        h = self._handle()
        hq, d = self.num_q_heads, self.head_dim
        if out is None:
            out = _alloc_like(q, (hq, d) if hq else tuple(_shape(q)), "out")
        if lse is None:
            lse = _alloc_like(q, (hq,) if hq else (tuple(_shape(q))[0],), "lse", lse=True)
        with self._lock:
            h.decode(int(layer), q, k_new, v_new, out, lse, _stream_ptr(stream), self._spec_or_none())
        return out, lse

    def decode_tokens(self, layer: int, q, k_new, v_new, *, out=None, lse=None, stream=None):
        """Several decode steps of one layer in one call (kvs_session_decode_tokens): q [n, Hq, d],
        k_new, v_new [n, Hkv, d] (``None`` for a session over the caller's KV cache, the n tokens
        bound already). Row i is exactly the i-th of n :meth:`decode` calls: sparse attention over
        the context and the rows before it, as for speculative decoding's drafts (reject some with
        :meth:`truncate`). Returns ``(out [n, Hq, d], lse [n, Hq])``, allocated as in
        :meth:`decode` unless given. A row that fails after the first leaves the rows before it
        decoded; the error names the row and the layer's length."""
        h = self._handle()
        n = tuple(_shape(q))[0]
        if out is None:
            out = _alloc_like(q, (n, self.num_q_heads, self.head_dim), "out")
        if lse is None:
            lse = _alloc_like(q, (n, self.num_q_heads), "lse", lse=True)
        with self._lock:
            h.decode_tokens(int(layer), q, k_new, v_new, out, lse, _stream_ptr(stream), self._spec_or_none())
        return out, lse

    def append(self, layer: int, q, k, v, *, out=None, stream=None) -> None:
        """Appends several tokens of one layer (a new chat turn); ``out`` (optional, [n, Hq, d])
        receives exact causal attention over the whole context."""
        with self._lock:
            self._handle().append(int(layer), q, k, v, out, _stream_ptr(stream), self._spec_or_none())

    def bind_kv(self, layer: int, pages, page_indices, num_tokens: int, *, layout: str = "HND",
                stream=None) -> None:
        """Sessions created with ``kv_source="caller"``: declares where layer ``layer``'s keys and
        values are now (kvs_session_bind_kv). kvsieve keeps no copy and reads them in place.

        Args:
            pages: the engine's page pool of this layer in the session's kv_dtype, contiguous:
                one tensor holding K and V, ``[num_pages, 2, num_kv_heads, page_size, head_dim]``
                (``layout="HND"``) or ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
                (``"NHD"``), as FlashInfer's paged KV cache with that ``kv_layout``; or a pair
                ``(k_pages, v_pages)`` of two tensors of one shape, ``[num_pages, num_kv_heads,
                page_size, head_dim]`` (HND) or ``[num_pages, page_size, num_kv_heads, head_dim]``
                (NHD), as vLLM's FlashAttention backend keeps them (``(kv_cache[0],
                kv_cache[1])``). A torch tensor on the session's CUDA device for the cuda backend;
                a CPU tensor or NumPy array (bfloat16 as uint16) for the cpu backend, which reads
                one HND tensor of pages of 256 tokens only. The session keeps a reference to the
                pool until the next binding of the layer.
            page_indices: this sequence's pages in token order (ints in [0, num_pages); a list,
                NumPy array or tensor, copied by the library; an int32 NumPy array or CPU tensor is
                read without conversion; a CUDA tensor is copied to the host first, which
                synchronises the device: pass the engine's host copy of its block table).
            num_tokens: tokens of the sequence the cache holds in this layer now, at least
                :meth:`layer_tokens`; the next prefill, append or decode (with ``k=None``,
                ``v=None``) counts the tokens beyond :meth:`layer_tokens` as its own.
            layout: ``"HND"`` (head-major pages) or ``"NHD"`` (token-major, vLLM's and
                FlashInfer's default); the same in every binding of a session.
            stream: (cuda) the stream that orders the page-table upload before the decode calls.

        Bind again whenever the engine's page table grows or changes, typically once per layer
        per step after writing the new token's K/V. Keep the K/V of tokens the session has
        counted unchanged until :meth:`truncate` drops them.
        """
        nhd = {"HND": False, "NHD": True}.get(layout.upper() if isinstance(layout, str) else layout)
        if nhd is None:
            raise InvalidArgumentError(STATUS_INVALID_ARGUMENT, f"layout: expected 'HND' or 'NHD', got {layout!r}")
        split = isinstance(pages, (tuple, list))
        if split and len(pages) != 2:
            raise InvalidArgumentError(STATUS_INVALID_ARGUMENT,
                                       f"pages: expected one tensor or a pair (k_pages, v_pages), got {len(pages)} items")
        pools = tuple(pages) if split else (pages,)
        layer = int(layer)
        # The pools of the layer's last binding were checked then: a pool with the same address,
        # shape, strides, dtype and device (an engine binds the same pools at every step, often
        # through new views such as kv_cache[0]) passes on that check.
        last = self._bound.get(layer)
        sigs = [_pool_sig(t) for t in pools]
        if last is not None and last[1] == nhd and last[2] == sigs and None not in sigs:
            args = last[3]
        else:
            args = self._pool_args(pools, nhd, split)
        if (type(page_indices) is _np.ndarray and page_indices.dtype == _np.int32 and page_indices.ndim == 1
                and page_indices.flags.c_contiguous):
            idx = page_indices
        else:
            if hasattr(page_indices, "cpu") and hasattr(page_indices, "numpy"):  # torch: no copy if on the CPU
                page_indices = page_indices.cpu().numpy()
            idx = _np.asarray(page_indices)
            if idx.dtype != _np.int32:  # (an int32 array is passed as it is: the library checks the values)
                idx = _np.asarray(idx, dtype=_np.int64)
                if idx.size and (idx.min() < -2**31 or idx.max() >= 2**31):
                    raise InvalidArgumentError(STATUS_INVALID_ARGUMENT, "page_indices: expected int32 values")
                idx = idx.astype(_np.int32)
            idx = _np.ascontiguousarray(idx)
            if idx.ndim != 1:
                raise InvalidArgumentError(STATUS_INVALID_ARGUMENT,
                                           f"page_indices: expected one dimension, got {idx.ndim}")
        k_ptr, k_bytes, v_ptr, v_bytes, num_pages, P = args
        with self._lock:
            self._handle().bind_kv(layer, k_ptr, num_pages, P, int(idx.ctypes.data), int(idx.size), int(num_tokens),
                                   _stream_ptr(stream), k_bytes,
                                   _native.KVS_KV_LAYOUT_NHD if nhd else _native.KVS_KV_LAYOUT_HND, v_ptr, v_bytes)
            self._bound[layer] = (pools, nhd, sigs, args)

    def _pool_args(self, pools, nhd, split):
        """bind_kv's pools checked against the session (shape, dtype, memory): (K address, K bytes,
        V address, V bytes (0, 0 for one pool), num_pages, page_size)."""
        H, d = self.num_kv_heads, self.head_dim
        names = ["pages[0] (k_pages)", "pages[1] (v_pages)"] if split else ["pages"]
        page_dims = ("page_size", str(H)) if nhd else (str(H), "page_size")
        want_shape = ("num_pages",) + (() if split else ("2",)) + page_dims + (str(d),)
        shapes = [tuple(int(x) for x in _shape(t)) for t in pools]
        P = 0
        for name, shape in zip(names, shapes):
            good = len(shape) == len(want_shape) and shape[-1] == d and (split or shape[1] == 2)
            if good:
                P, heads = (shape[-3], shape[-2]) if nhd else (shape[-2], shape[-3])
                good = heads == H
            if not good:
                raise InvalidArgumentError(STATUS_INVALID_ARGUMENT,
                                           f"{name}: expected a tensor [{', '.join(want_shape)}] (layout "
                                           f"{'NHD' if nhd else 'HND'}), got shape {list(shape)}")
        if split and shapes[0] != shapes[1]:
            raise InvalidArgumentError(STATUS_INVALID_ARGUMENT,
                                       f"pages: k_pages and v_pages must have one shape, got {list(shapes[0])} and "
                                       f"{list(shapes[1])}")
        addrs = []
        want = "cuda" if self.backend == "cuda" else "cpu"
        for name, t in zip(names, pools):
            ptr, nbytes, where, dtype_ok = _buffer_address(t, self._kv_dtype, name)
            if where[0] != want or (want == "cuda" and where[1] != self.device_id):
                raise InvalidArgumentError(STATUS_INVALID_ARGUMENT,
                                           f"{name}: expected a tensor in {want} memory"
                                           f"{f' of device {self.device_id}' if want == 'cuda' else ''} (the session's "
                                           f"backend), got {where[0]}" + (f":{where[1]}" if where[0] == "cuda" else ""))
            if not dtype_ok:
                raise InvalidArgumentError(STATUS_INVALID_ARGUMENT, f"{name}: expected the session's kv_dtype "
                                           f"({_KV_DTYPE_NAMES.get(self._kv_dtype, '?')}), got {t.dtype}")
            addrs.append((ptr, nbytes))
        v_ptr, v_bytes = addrs[1] if split else (0, 0)
        return addrs[0][0], addrs[0][1], v_ptr, v_bytes, shapes[0][0], P

    def truncate(self, num_tokens: int) -> None:
        """Rollback (kvs_session_truncate): keeps the first ``num_tokens`` tokens of every layer and
        drops the rest, KV and index alike, so that decoding continues exactly as if the dropped
        tokens had never been appended (a layer holding fewer is left as it is). ``num_tokens``: 0
        .. the longest layer's tokens; how far back a layer can go depends on the method (full,
        exact_topk, streaming, quest: anywhere; the others: as far as ``max_rollback`` keeps).

        Raises:
            kvsieve.InvalidArgumentError (a ValueError) naming the allowed range.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, _numbers.Integral):
            raise TypeError(f"num_tokens: expected an int, got {type(num_tokens).__name__}")
        with self._lock:
            self._handle().truncate(int(num_tokens))

    def save(self, path: str, *, include_kv: bool = False) -> None:
        """Writes the session (parameters, method tables, optionally the KV cache) atomically."""
        self._handle().save(_path(path), _native.KVS_SAVE_INCLUDE_KV if include_kv else _native.KVS_SAVE_TABLES)

    def fork(self) -> "Session":
        """A new session sharing this one's KV prefix copy-on-write; either may be closed first."""
        s = Session(0, 0, 0, 0, _handle=self._handle().fork())
        s._set_shape(self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim, self.method,
                     _BACKENDS.get(self.backend, 1), self.device_id)
        s._kv_dtype = self._kv_dtype
        s._bound = dict(self._bound)  # a fork reads the same pools until bound anew
        return s

    def to(self, backend: str, device_id: int = 0) -> "Session":
        """A new session with this one's state (KV, index, layer states, statistics) on another
        backend ("cpu", "cuda" or "hybrid") and device; this session is unchanged (kvs_session_to)."""
        code = _enum(backend, _BACKENDS, "backend")
        s = Session(0, 0, 0, 0, _handle=self._handle().to(code, int(device_id)))
        s._set_shape(self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim, self.method,
                     code, int(device_id))
        s._kv_dtype = self._kv_dtype
        return s

    # -- inspection
    @property
    def stats(self) -> Stats:
        return Stats(**self._handle().stats())

    def layer_tokens(self, layer: int) -> int:
        return int(self._handle().layer_tokens(int(layer)))

    def last_selection(self, layer: int, kv_head: int) -> _np.ndarray:
        """The exact keys the last decode step of ``layer`` attended for ``kv_head``, ascending (int32)."""
        return _np.frombuffer(self._handle().last_selection(int(layer), int(kv_head)), dtype=_np.int32)

    def method_stat(self, name: str) -> float:
        return float(self._handle().method_stat(_text(name, "name")))

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (f"<kvsieve.Session {self.method} {self.backend} L={self.num_layers} Hq={self.num_q_heads} "
                f"Hkv={self.num_kv_heads} d={self.head_dim} {state}>")


_KV_DTYPE_NAMES = {_native.KVS_SCALAR_F32: "float32", _native.KVS_SCALAR_F16: "float16",
                   _native.KVS_SCALAR_BF16: "bfloat16"}


def _pool_sig(t):
    """Everything bind_kv checks of a pool (address, shape, strides or contiguity, dtype, device):
    equal signatures, equal verdicts. None for what is checked at every binding."""
    if hasattr(t, "data_ptr") and hasattr(t, "stride") and hasattr(t, "device"):  # torch
        return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device
    if type(t) is _np.ndarray:
        return t.__array_interface__["data"][0], t.shape, t.dtype, t.flags.c_contiguous
    return None


def _buffer_address(t, kv_dtype, name="pages"):
    """The address and byte size of a contiguous torch tensor or NumPy array, where it lives
    (("cpu" or "cuda", device index)), and whether its dtype stores kv_dtype (bfloat16 may come as
    uint16 or int16 bits from NumPy)."""
    if kv_dtype is None:
        raise InvalidStateError(STATUS_INVALID_STATE, "Session.bind_kv: this session's kv_dtype is not known")
    if hasattr(t, "data_ptr") and hasattr(t, "is_contiguous"):  # torch
        if not t.is_contiguous():
            raise InvalidArgumentError(STATUS_INVALID_ARGUMENT, f"{name}: expected a contiguous tensor")
        where = (t.device.type, t.device.index or 0)
        ok = _KV_DTYPES.get(str(t.dtype).replace("torch.", "")) == kv_dtype
        return int(t.data_ptr()), int(t.numel() * t.element_size()), where, ok
    a = _np.asarray(t)
    if not a.flags["C_CONTIGUOUS"]:
        raise InvalidArgumentError(STATUS_INVALID_ARGUMENT, f"{name}: expected a contiguous array")
    dt = a.dtype.name
    ok = _KV_DTYPES.get(dt) == kv_dtype or (kv_dtype == _native.KVS_SCALAR_BF16 and dt in ("uint16", "int16",
                                                                                          "bfloat16"))
    return int(a.ctypes.data), int(a.nbytes), ("cpu", 0), ok


def _shape(x):
    s = getattr(x, "shape", None)
    if s is None:
        s = memoryview(x).shape
    return tuple(int(v) for v in s)


def decode_batch(sessions: Sequence[Session], layer: int, q, k_new, v_new, *, out=None, lse=None, stream=None):
    """One layer's decode step for several sessions of the same shape: q [B, Hq, d], k_new, v_new
    [B, Hkv, d] (None for sessions over the caller's cache, each reading its bound token); returns
    (out [B, Hq, d], lse [B, Hq]). All or nothing."""
    sessions = _check_sessions(sessions)
    s0 = sessions[0]
    B, hq, d = len(sessions), s0.num_q_heads, s0.head_dim
    if out is None:
        out = _alloc_like(q, (B, hq, d), "out")
    if lse is None:
        lse = _alloc_like(q, (B, hq), "lse", lse=True)
    with _locked(sessions):
        _native.decode_batch([s._handle() for s in sessions], int(layer), q, k_new, v_new, out, lse,
                             _stream_ptr(stream), s0._spec_or_none())
    return out, lse


def _locked(sessions):
    """Takes the locks of several sessions in one global order (no deadlock between batches)."""
    import contextlib
    stack = contextlib.ExitStack()
    for s in sorted(set(sessions), key=id):
        stack.enter_context(s._lock)
    return stack


class Batch:
    """Sessions of one shape, KV dtype, softmax scale, method, backend and device decoded together
    (kvs_batch_*): :meth:`plan` once per token, then :meth:`decode` once per layer with [B, ...]
    tensors, row b belonging to ``sessions[b]``.

    The batch keeps the sessions' native handles referenced, so deleting the Session objects does
    not free them while the batch lives; a session closed with :meth:`Session.close` makes
    :meth:`plan` and :meth:`decode` raise ValueError. The sessions may still be used on their own
    between tokens. Use as a context manager or call :meth:`close`; calls take the locks of every
    session of the batch.

    Example::

        with kvsieve.Batch([s0, s1]) as b:
            for token in range(steps):
                b.plan()
                for layer in range(num_layers):
                    o, lse = b.decode(layer, q[layer], k[layer], v[layer])   # [2, Hq, d], [2, Hq]
    """

    def __init__(self, sessions: Sequence[Session]):
        self._h = None
        sessions = _check_sessions(sessions)
        self._sessions = sessions
        # The native handles, referenced for the batch's lifetime: the C ABI requires that the
        # sessions outlive the batch.
        self._handles = tuple(s._h for s in sessions)
        with _locked(sessions):
            self._h = _native.batch_create(list(self._handles))

    @property
    def sessions(self) -> Tuple[Session, ...]:
        return self._sessions

    @property
    def closed(self) -> bool:
        return self._h is None

    def close(self) -> None:
        """Frees the batch now (not the sessions); idempotent."""
        h, self._h = self._h, None
        del h
        self._handles = ()

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return int(self._handle().size())

    def _handle(self):
        if self._h is None:
            raise ValueError("batch: expected an open batch, got a closed one")
        for i, s in enumerate(self._sessions):
            if s.closed:
                raise ValueError(f"batch: sessions[{i}]: expected an open session, got a closed one")
        return self._h

    def plan(self, stream=None) -> None:
        """Once per token, before that token's :meth:`decode` calls: checks every session and layer
        (prefilled and indexed) and reserves room for one more token. A plan whose layers were not
        all decoded is replaced by the next one."""
        h = self._handle()
        with _locked(self._sessions):
            h.plan(_stream_ptr(stream))

    def decode(self, layer: int, q, k_new, v_new, *, out=None, lse=None, stream=None):
        """One layer's decode step of the planned token for every session: q [B, Hq, d], k_new,
        v_new [B, Hkv, d] (None for sessions over the caller's cache); returns ``(out [B, Hq, d], lse [B, Hq])``, allocated as
        :meth:`Session.decode` does unless given. Each layer at most once per plan
        (Error STATUS_INVALID_STATE otherwise, and without a plan)."""
        h = self._handle()
        s0 = self._sessions[0]
        B, hq, d = len(self._sessions), s0.num_q_heads, s0.head_dim
        if out is None:
            out = _alloc_like(q, (B, hq, d) if hq else tuple(_shape(q)), "out")
        if lse is None:
            lse = _alloc_like(q, (B, hq) if hq else tuple(_shape(q))[:2], "lse", lse=True)
        with _locked(self._sessions):
            h.decode(int(layer), q, k_new, v_new, out, lse, _stream_ptr(stream), s0._spec_or_none())
        return out, lse

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<kvsieve.Batch of {len(self._sessions)} sessions {state}>"


# ---- tables files and traces --------------------------------------------------------------------
def tables_describe(path: str) -> dict:
    """Verifies a tables file and describes it; raises Error (with .details, the partial JSON as a
    dict) when it is corrupt."""
    try:
        return _json.loads(_native.tables_describe(_path(path)))
    except Error as e:
        if isinstance(e.details, str):
            e.details = _json.loads(e.details)
        raise


class _View:
    """Keeps the trace handle alive for as long as a NumPy view of its mapping exists."""

    __slots__ = ("_owner", "__array_interface__")

    def __init__(self, owner, iface):
        self._owner = owner
        self.__array_interface__ = iface


class Trace:
    """A memory-mapped kvsieve trace (safetensors). Tensor views stay valid after :meth:`close`
    for as long as they are referenced (they keep the mapping alive)."""

    def __init__(self, path: str):
        self._h = _native.trace_open(_path(path))
        self.info = self._h.info()
        self.layers = [int(self._h.layer_index(i)) for i in range(self.info["num_present_layers"])]

    def close(self) -> None:
        h, self._h = self._h, None
        del h

    def __enter__(self) -> "Trace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tensor(self, layer: int, name: str, kind: str = "numpy"):
        """A view (no copy) of "q", "k", "v" of a present layer or "tokens".

        kind="numpy" (default): a read-only NumPy array; bf16 tensors come back as a uint16 view of
        the raw bits (NumPy has no bfloat16). kind="torch": a CPU torch tensor over the same memory,
        bf16 as torch.bfloat16, which ``Session.prefill``/``decode`` take as they are (do not write
        to it: the trace is mapped read-only).
        """
        if kind not in ("numpy", "torch"):
            raise ValueError(f"kind: expected 'numpy' or 'torch', got {kind!r}")
        if self._h is None:
            raise ValueError("trace: expected an open trace, got a closed one")
        addr, shape, strides, code, bits = self._h.tensor(int(layer), _text(name, "name"))
        typestr = {(2, 32): "<f4", (2, 16): "<f2", (0, 32): "<i4", (4, 16): "<u2"}.get((code, bits))
        if typestr is None:
            raise TypeError(f"{name}: unsupported dtype code {code} bits {bits}")
        item = bits // 8
        iface = {"version": 3, "shape": tuple(shape), "typestr": typestr, "data": (addr, True),
                 "strides": tuple(s * item for s in strides)}
        arr = _np.asarray(_View(self._h, iface))
        if kind == "numpy":
            return arr
        import torch
        with _warnings.catch_warnings():  # torch warns that the array is read-only: it is, by design
            _warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)  # keeps arr, and through it the mapping, alive
        return t.view(torch.bfloat16) if (code, bits) == (4, 16) else t


# ---- logging ------------------------------------------------------------------------------------
_log_lock = _threading.Lock()


def set_log_callback(fn: Optional[Callable[[int, str], None]], min_level: Union[int, str] = "warn") -> None:
    """Routes the library's log lines to fn(level, line) (called with the GIL, possibly from a
    library worker thread); None restores the default sink (stderr)."""
    with _log_lock:
        _native.set_log_callback(fn, _enum(min_level, _LOG_LEVELS, "min_level"))
