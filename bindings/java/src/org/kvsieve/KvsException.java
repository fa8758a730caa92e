// SPDX-License-Identifier: Apache-2.0
package org.kvsieve;

/** An error reported by the library: the kvs_status code, its message (naming the argument and
 *  what was expected) and the backend's own code (cudaError_t, dnnl_status_t, errno; 0 if none). */
public class KvsException extends RuntimeException {
  public static final int INVALID_ARGUMENT = 1, OUT_OF_MEMORY = 2, UNSUPPORTED = 3, INVALID_STATE = 4, IO = 5,
      FORMAT_MAGIC = 6, FORMAT_VERSION = 7, FORMAT_TRUNCATED = 8, FORMAT_CHECKSUM = 9, FORMAT_INVALID = 10,
      BACKEND = 11, ABI_MISMATCH = 12, INTERNAL = 13;

  private final int code;
  private final long backendCode;
  private final String details;

  public KvsException(int code, String message, long backendCode) { this(code, message, backendCode, null); }

  /** details: what the failed call could still report (see {@link #details()}), or null. */
  public KvsException(int code, String message, long backendCode, String details) {
    super("[" + code + "] " + message);
    this.code = code;
    this.backendCode = backendCode;
    this.details = details;
  }

  /** The kvs_status value (INVALID_ARGUMENT, ...). */
  public int code() { return code; }

  public long backendCode() { return backendCode; }

  /** What the failed call could still report, or null: for {@link KvsNative#tablesDescribe} of a
   *  corrupt file, the JSON description of what was readable ("ok": false, "error": ...), as
   *  Python's Error.details. */
  public String details() { return details; }
}
