// SPDX-License-Identifier: Apache-2.0
package org.kvsieve;

/** Where a session's data lives and work runs (kvs_backend). */
public enum Backend {
  CPU(1), CUDA(2), HYBRID(3);

  final int value;

  Backend(int v) { value = v; }
}
