// SPDX-License-Identifier: Apache-2.0
package org.kvsieve;

import java.nio.Buffer;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.DoubleBuffer;
import java.nio.FloatBuffer;
import java.nio.IntBuffer;
import java.nio.LongBuffer;
import java.nio.ShortBuffer;

/** The checks Tensor.of makes before the native side takes a buffer's address. Nothing is copied. */
final class Tensors {
  private Tensors() {}

  static int elementBytes(Buffer b) {
    if (b instanceof ByteBuffer) return 1;
    if (b instanceof ShortBuffer) return 2;
    if (b instanceof FloatBuffer || b instanceof IntBuffer) return 4;
    if (b instanceof DoubleBuffer || b instanceof LongBuffer) return 8;
    return 2; // CharBuffer
  }

  static ByteOrder order(Buffer b) {
    if (b instanceof ByteBuffer) return ((ByteBuffer) b).order();
    if (b instanceof ShortBuffer) return ((ShortBuffer) b).order();
    if (b instanceof FloatBuffer) return ((FloatBuffer) b).order();
    if (b instanceof IntBuffer) return ((IntBuffer) b).order();
    if (b instanceof DoubleBuffer) return ((DoubleBuffer) b).order();
    if (b instanceof LongBuffer) return ((LongBuffer) b).order();
    return ByteOrder.nativeOrder();
  }

  static long bytePosition(Buffer b) { return (long) b.position() * elementBytes(b); }

  static void check(Buffer b, DType dtype, long[] shape) {
    if (b == null) throw new NullPointerException("buffer: expected a direct NIO buffer, got null");
    if (dtype == null) throw new NullPointerException("dtype: expected F32, F16, BF16 or I32, got null");
    if (!b.isDirect())
      throw new IllegalArgumentException("buffer: expected a direct NIO buffer (ByteBuffer.allocateDirect), got a heap "
          + b.getClass().getSimpleName() + " (kvsieve never copies)");
    if (order(b) != ByteOrder.nativeOrder())
      throw new IllegalArgumentException("buffer: expected native byte order (" + ByteOrder.nativeOrder() + "), got "
          + order(b));
    boolean ok = b instanceof ByteBuffer
        || (b instanceof FloatBuffer && dtype == DType.F32)
        || (b instanceof IntBuffer && dtype == DType.I32)
        || (b instanceof ShortBuffer && (dtype == DType.F16 || dtype == DType.BF16));
    if (!ok)
      throw new IllegalArgumentException("dtype: " + dtype + " does not match a " + b.getClass().getSimpleName()
          + " (expected FloatBuffer for F32, ShortBuffer for F16/BF16, IntBuffer for I32, or a ByteBuffer)");
    if (shape.length < 1 || shape.length > 8)
      throw new IllegalArgumentException("shape: expected 1 to 8 dimensions, got " + shape.length);
    long n = 1;
    for (long s : shape) {
      if (s < 0) throw new IllegalArgumentException("shape: expected non-negative extents, got " + s);
      n *= s;
    }
    long have = (long) b.remaining() * elementBytes(b), need = n * dtype.bytes();
    if (have < need)
      throw new IllegalArgumentException("buffer: expected at least " + need + " bytes from its position for shape "
          + java.util.Arrays.toString(shape) + " of " + dtype + ", got " + have);
  }
}
