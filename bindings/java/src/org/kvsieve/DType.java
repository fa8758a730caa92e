// SPDX-License-Identifier: Apache-2.0
package org.kvsieve;

/** Element types a tensor may have (DLPack codes). */
public enum DType {
  F32(2, 32), F16(2, 16), BF16(4, 16), I32(0, 32);

  final int code, bits;

  DType(int code, int bits) { this.code = code; this.bits = bits; }

  public int bytes() { return bits / 8; }
}
