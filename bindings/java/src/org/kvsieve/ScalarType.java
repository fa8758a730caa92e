// SPDX-License-Identifier: Apache-2.0
package org.kvsieve;

/** Storage type of the KV cache (kvs_scalar_type). */
public enum ScalarType {
  F32(1), F16(2), BF16(3);

  final int value;

  ScalarType(int v) { value = v; }
}
