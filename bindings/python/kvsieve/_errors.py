# SPDX-License-Identifier: Apache-2.0
"""kvsieve.Error: a C-side kvs_error_t turned into a Python exception."""

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
        message: the library's UTF-8 message, naming the argument and what was expected.
        backend_code: the backend's own code (cudaError_t, dnnl_status_t, errno), 0 if none.
        details: for ``tables_describe``, the JSON the library could still produce (else None).
    """

    def __init__(self, code: int, message: str, backend_code: int = 0):
        self.code = int(code)
        self.status = STATUS_NAMES.get(self.code, str(self.code))
        self.message = message
        self.backend_code = int(backend_code)
        self.details = None
        super().__init__(f"[{self.status}] {message}")

    def __reduce__(self):
        return (Error, (self.code, self.message, self.backend_code))
