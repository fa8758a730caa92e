# SPDX-License-Identifier: Apache-2.0
"""kvsieve.Error and its subclasses: a C-side kvs_error_t turned into a Python exception.

Every library error is a :class:`Error` (``except kvsieve.Error`` catches them all, ``.code`` tells
which) and also an instance of the built-in exception a Python caller expects for that kind of
failure: a bad argument is a ``ValueError``, a missing file a ``FileNotFoundError``, a damaged
tables or trace file a :class:`FormatError` (a ``ValueError``), running out of memory a
``MemoryError``, an unsupported request a ``NotImplementedError``.
"""
import errno as _errno
import re as _re

STATUS_NAMES = {
    0: "OK",
    1: "INVALID_ARGUMENT",
    2: "OUT_OF_MEMORY",
    3: "UNSUPPORTED",
    4: "INVALID_STATE",
    5: "IO",
    6: "FORMAT_MAGIC",
    7: "FORMAT_VERSION",
    8: "FORMAT_TRUNCATED",
    9: "FORMAT_CHECKSUM",
    10: "FORMAT_INVALID",
    11: "BACKEND",
    12: "ABI_MISMATCH",
    13: "INTERNAL",
}


class Error(RuntimeError):
    """An error reported by the library.

    Attributes:
        code: the kvs_status value (``kvsieve.STATUS_INVALID_ARGUMENT``, ...).
        status: its name without the prefix (``"INVALID_ARGUMENT"``).
        message: the library's message naming the argument and what was expected, with the C API's
            names replaced by the binding's (``Session.decode``, ``budget``).
        c_message: the message exactly as the C library wrote it (``kvs_session_decode: ...``).
        backend_code: the backend's own code (cudaError_t, dnnl_status_t, errno), 0 if none.
        details: for ``tables_describe``, the JSON the library could still produce (else None).
    """

    def __init__(self, code: int, message: str, backend_code: int = 0):
        self.code = int(code)
        self.status = STATUS_NAMES.get(self.code, str(self.code))
        self.c_message = message
        self.message = python_names(message)
        self.backend_code = int(backend_code)
        self.details = None
        RuntimeError.__init__(self, f"[{self.status}] {self.message}")

    def __str__(self):
        return f"[{self.status}] {self.message}"

    def __reduce__(self):
        return (make, (self.code, self.c_message, self.backend_code))


class InvalidArgumentError(Error, ValueError):
    """A bad argument (KVS_STATUS_INVALID_ARGUMENT): the message names it and what was expected."""


class OutOfMemoryError(Error, MemoryError):
    """An allocation failed (KVS_STATUS_OUT_OF_MEMORY), on the host or the device."""


class UnsupportedError(Error, NotImplementedError):
    """Valid but not supported here (KVS_STATUS_UNSUPPORTED): a method on a backend, a head dim..."""


class InvalidStateError(Error):
    """A call out of order (KVS_STATUS_INVALID_STATE): decode before build_index, ..."""


class LibraryIOError(Error, OSError):
    """A system call on a file failed (KVS_STATUS_IO); ``errno`` is the C errno."""


class LibraryFileNotFoundError(LibraryIOError, FileNotFoundError):
    """KVS_STATUS_IO with ENOENT: the file does not exist."""


class LibraryPermissionError(LibraryIOError, PermissionError):
    """KVS_STATUS_IO with EACCES or EPERM."""


class FormatError(Error, ValueError):
    """A tables or trace file is damaged or not one (KVS_STATUS_FORMAT_*: magic, version,
    truncation, checksum, invalid content)."""


class BackendError(Error):
    """The compute backend failed (KVS_STATUS_BACKEND: a CUDA or oneDNN error; see backend_code)."""


class AbiMismatchError(Error, ImportError):
    """The loaded library does not match this binding (KVS_STATUS_ABI_MISMATCH)."""


class InternalError(Error):
    """A bug in kvsieve (KVS_STATUS_INTERNAL): please report it with the message."""


_BY_CODE = {
    1: InvalidArgumentError,
    2: OutOfMemoryError,
    3: UnsupportedError,
    4: InvalidStateError,
    5: LibraryIOError,
    6: FormatError,
    7: FormatError,
    8: FormatError,
    9: FormatError,
    10: FormatError,
    11: BackendError,
    12: AbiMismatchError,
    13: InternalError,
}


def make(code: int, message: str, backend_code: int = 0) -> Error:
    """The exception for a library error (the binding's C side calls this)."""
    cls = _BY_CODE.get(int(code), Error)
    if cls is LibraryIOError:
        if backend_code == _errno.ENOENT:
            cls = LibraryFileNotFoundError
        elif backend_code in (_errno.EACCES, _errno.EPERM):
            cls = LibraryPermissionError
    e = cls(code, message, backend_code)
    if isinstance(e, OSError):
        e.errno = int(backend_code) or None
        e.strerror = e.message
    return e


# C API function names -> the binding's, for messages (longest names first).
_C_NAMES = [
    ("kvs_session_create", "Session()"),
    ("kvs_session_load", "Session.load"),
    ("kvs_session_to", "Session.to"),
    ("kvs_session_get_stats", "Session.stats"),
    ("kvs_session_last_selection", "Session.last_selection"),
    ("kvs_session_method_stat", "Session.method_stat"),
    ("kvs_session_layer_tokens", "Session.layer_tokens"),
    ("kvs_session_params.max_rollback", "max_rollback"),
    ("kvs_decode_batch", "kvsieve.decode_batch"),
    ("kvs_batch_create", "Batch()"),
    ("kvs_tables_describe", "kvsieve.tables_describe"),
    ("kvs_trace_open", "Trace()"),
]
_C_PREFIX = _re.compile(r"\bkvs_(session|batch|trace)_(\w+)")
_PARAMS = _re.compile(r"\b(?:params|load_params)->(\w+)")


def python_names(message: str) -> str:
    """The message with the C API's function and struct-field names replaced by the binding's."""
    for c, py in _C_NAMES:
        message = _re.sub(r"\b" + c + r"\b", py, message)
    message = _C_PREFIX.sub(lambda m: {"session": "Session.", "batch": "Batch.", "trace": "Trace."}[m.group(1)] + m.group(2), message)
    return _PARAMS.sub(r"\1", message)
