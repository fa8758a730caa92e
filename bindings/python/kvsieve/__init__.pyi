# SPDX-License-Identifier: Apache-2.0
# Type hints of the kvsieve package (see __init__.py for the docstrings).
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

from . import capi as capi  # the raw SWIG layer

ArrayLike = Any  # anything with __dlpack__ (NumPy, PyTorch, CuPy, JAX) or the buffer protocol
StreamLike = Union[None, int, Any]  # cudaStream_t as int, torch.cuda.Stream, cupy.cuda.Stream

STATUS_OK: int
STATUS_INVALID_ARGUMENT: int
STATUS_OUT_OF_MEMORY: int
STATUS_UNSUPPORTED: int
STATUS_INVALID_STATE: int
STATUS_IO: int
STATUS_FORMAT_MAGIC: int
STATUS_FORMAT_VERSION: int
STATUS_FORMAT_TRUNCATED: int
STATUS_FORMAT_CHECKSUM: int
STATUS_FORMAT_INVALID: int
STATUS_BACKEND: int
STATUS_ABI_MISMATCH: int
STATUS_INTERNAL: int
STATUS_NAMES: dict[int, str]

class Error(RuntimeError):
    code: int
    status: str
    message: str
    backend_code: int
    details: Optional[Any]
    def __init__(self, code: int, message: str, backend_code: int = ...) -> None: ...

def version() -> str: ...
def version_number() -> int: ...
def abi_version() -> int: ...

class ParamInfo:
    name: str
    type: str
    default: str
    doc: str

class MethodInfo:
    name: str
    doc: str
    backends: Tuple[str, ...]
    params: Tuple[ParamInfo, ...]

def method_names() -> list[str]: ...
def methods() -> list[MethodInfo]: ...
def method_unsupported_reason(method: str, backend: Union[str, int]) -> Optional[str]: ...

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

class Session:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    method: Optional[str]
    backend: str
    device_id: int
    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
                 method: str = ..., method_params: Union[None, str, Mapping[str, Any]] = ...,
                 budget: Optional[float] = ..., budget_tokens: Optional[int] = ...,
                 kv_dtype: Union[str, int] = ..., backend: Union[str, int] = ..., device_id: int = ...,
                 num_threads: int = ..., gemm: Union[str, int] = ..., softmax_scale: float = ...) -> None: ...
    @classmethod
    def load(cls, path: str, *, backend: Union[None, str, int] = ..., device_id: int = ...,
             num_threads: int = ..., gemm: Union[str, int] = ..., mmap: bool = ...) -> Session: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> Session: ...
    def __exit__(self, *exc: Any) -> None: ...
    def prefill(self, layer: int, q: ArrayLike, k: ArrayLike, v: ArrayLike, *, out: Optional[ArrayLike] = ...,
                stream: StreamLike = ...) -> None: ...
    def build_index(self, *, stream: StreamLike = ...) -> None: ...
    def decode(self, layer: int, q: ArrayLike, k_new: ArrayLike, v_new: ArrayLike, *,
               out: Optional[ArrayLike] = ..., lse: Optional[ArrayLike] = ...,
               stream: StreamLike = ...) -> Tuple[Any, Any]: ...
    def append(self, layer: int, q: ArrayLike, k: ArrayLike, v: ArrayLike, *, out: Optional[ArrayLike] = ...,
               stream: StreamLike = ...) -> None: ...
    def save(self, path: str, *, include_kv: bool = ...) -> None: ...
    def fork(self) -> Session: ...
    @property
    def stats(self) -> Stats: ...
    def layer_tokens(self, layer: int) -> int: ...
    def last_selection(self, layer: int, kv_head: int) -> npt.NDArray[np.int32]: ...
    def method_stat(self, name: str) -> float: ...

def decode_batch(sessions: Sequence[Session], layer: int, q: ArrayLike, k_new: ArrayLike, v_new: ArrayLike, *,
                 out: Optional[ArrayLike] = ..., lse: Optional[ArrayLike] = ...,
                 stream: StreamLike = ...) -> Tuple[Any, Any]: ...
def tables_describe(path: str) -> dict[str, Any]: ...

class Batch:
    def __init__(self, sessions: Sequence[Session]) -> None: ...
    @property
    def sessions(self) -> Tuple[Session, ...]: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> Batch: ...
    def __exit__(self, *exc: Any) -> None: ...
    def __len__(self) -> int: ...
    def plan(self, stream: StreamLike = ...) -> None: ...
    def decode(self, layer: int, q: ArrayLike, k_new: ArrayLike, v_new: ArrayLike, *,
               out: Optional[ArrayLike] = ..., lse: Optional[ArrayLike] = ...,
               stream: StreamLike = ...) -> Tuple[Any, Any]: ...

class Trace:
    info: dict[str, Any]
    layers: list[int]
    def __init__(self, path: str) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Trace: ...
    def __exit__(self, *exc: Any) -> None: ...
    def tensor(self, layer: int, name: str) -> npt.NDArray[Any]: ...

def set_log_callback(fn: Optional[Callable[[int, str], None]], min_level: Union[int, str] = ...) -> None: ...
