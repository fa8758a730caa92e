// SPDX-License-Identifier: Apache-2.0
package org.kvsieve;

import static org.junit.jupiter.api.Assertions.*;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.FloatBuffer;
import java.nio.ShortBuffer;
import java.util.Random;
import org.junit.jupiter.api.Test;

/** The Java binding against a double-precision reference on random inputs, and its error paths. */
class KvsieveTest {
  static final int L = 2, HQ = 4, HKV = 2, D = 16, N = 96;

  static FloatBuffer direct(int n) {
    return ByteBuffer.allocateDirect(n * 4).order(ByteOrder.nativeOrder()).asFloatBuffer();
  }

  static FloatBuffer random(Random r, int n) {
    FloatBuffer b = direct(n);
    for (int i = 0; i < n; ++i) b.put(i, (float) r.nextGaussian());
    return b;
  }

  /** Dense attention of q [HQ, D] over K, V [n, HKV, D] in double: o [HQ, D], lse [HQ]. */
  static double[][] reference(FloatBuffer q, FloatBuffer k, FloatBuffer v, int n) {
    double scale = 1.0 / Math.sqrt(D);
    double[] o = new double[HQ * D], lse = new double[HQ];
    int g = HQ / HKV;
    for (int h = 0; h < HQ; ++h) {
      int kh = h / g;
      double[] s = new double[n];
      double m = Double.NEGATIVE_INFINITY;
      for (int j = 0; j < n; ++j) {
        double dot = 0;
        for (int c = 0; c < D; ++c) dot += q.get(h * D + c) * (double) k.get((j * HKV + kh) * D + c);
        s[j] = scale * dot;
        m = Math.max(m, s[j]);
      }
      double sum = 0;
      for (int j = 0; j < n; ++j) sum += Math.exp(s[j] - m);
      lse[h] = m + Math.log(sum);
      for (int c = 0; c < D; ++c) {
        double acc = 0;
        for (int j = 0; j < n; ++j) acc += Math.exp(s[j] - m) * v.get((j * HKV + kh) * D + c);
        o[h * D + c] = acc / sum;
      }
    }
    return new double[][] {o, lse};
  }

  static FloatBuffer concat(FloatBuffer a, FloatBuffer b) {
    FloatBuffer c = direct(a.capacity() + b.capacity());
    for (int i = 0; i < a.capacity(); ++i) c.put(i, a.get(i));
    for (int i = 0; i < b.capacity(); ++i) c.put(a.capacity() + i, b.get(i));
    return c;
  }

  @Test
  void registryAndVersion() {
    assertTrue(KvsNative.version().matches("\\d+\\.\\d+\\.\\d+"));
    assertEquals(0, KvsNative.abiVersion());
    assertTrue(KvsNative.methodCount() >= 4);
    for (long i = 0; i < KvsNative.methodCount(); ++i) {
      String m = KvsNative.methodName(i);
      assertNotNull(KvsNative.methodDoc(m));
      assertTrue((KvsNative.methodBackends(m) & 2) != 0, m + " runs on the CPU");
    }
    assertNull(KvsNative.methodName(KvsNative.methodCount()));
  }

  @Test
  void everyMethodDecodesAgainstTheReference() {
    Random r = new Random(7);
    for (long mi = 0; mi < KvsNative.methodCount(); ++mi) {
      String method = KvsNative.methodName(mi);
      FloatBuffer q = random(r, N * HQ * D), k = random(r, N * HKV * D), v = random(r, N * HKV * D);
      try (Session s = Session.builder(L, HQ, HKV, D).method(method).budget(1.0).kvDtype(ScalarType.F32)
               .numThreads(1).create();
           Tensor tq = Tensor.of(q, DType.F32, N, HQ, D); Tensor tk = Tensor.of(k, DType.F32, N, HKV, D);
           Tensor tv = Tensor.of(v, DType.F32, N, HKV, D)) {
        for (int layer = 0; layer < L; ++layer) s.prefill(layer, tq, tk, tv, null, 0);
        s.buildIndex(0);
        FloatBuffer qn = random(r, HQ * D), kn = random(r, HKV * D), vn = random(r, HKV * D);
        FloatBuffer o = direct(HQ * D), lse = direct(HQ);
        try (Tensor a = Tensor.of(qn, DType.F32, HQ, D); Tensor b = Tensor.of(kn, DType.F32, HKV, D);
             Tensor c = Tensor.of(vn, DType.F32, HKV, D); Tensor to = Tensor.of(o, DType.F32, HQ, D);
             Tensor tl = Tensor.of(lse, DType.F32, HQ)) {
          s.decode(1, a, b, c, to, tl, 0);
        }
        int[] sel = s.lastSelection(1, 0);
        assertTrue(sel.length >= 1 && sel.length <= N + 1, method);
        for (int i = 1; i < sel.length; ++i) assertTrue(sel[i] > sel[i - 1]);
        assertEquals(N + 1, s.layerTokens(1));
        if (sel.length == N + 1 && s.lastSelection(1, 1).length == N + 1) { // whole context: dense attention
          double[][] ref = reference(qn, concat(k, kn), concat(v, vn), N + 1);
          for (int i = 0; i < HQ * D; ++i) assertEquals(ref[0][i], o.get(i), 2e-4 + 2e-4 * Math.abs(ref[0][i]), method);
          for (int h = 0; h < HQ; ++h) assertEquals(ref[1][h], lse.get(h), 1e-4, method);
        }
        if (method.equals("full")) assertEquals(N + 1, sel.length);
        SessionStats st = s.stats();
        assertEquals(1, st.getDecodeSteps());
        assertEquals(N + 1, st.getTokens());
        assertTrue(s.methodStat("decode_attend_seconds") > 0, method);  // session-level phase timing
      }
    }
  }

  /** Truncate rolls back decoded tokens: the next step equals a session that never saw them; lse base 2. */
  @Test
  void truncateAndLseBase2() {
    Random r = new Random(21);
    FloatBuffer q = random(r, N * HQ * D), k = random(r, N * HKV * D), v = random(r, N * HKV * D);
    FloatBuffer qn = random(r, 3 * HQ * D), kn = random(r, 3 * HKV * D), vn = random(r, 3 * HKV * D);
    float[][] outs = new float[2][];
    float[][] lses = new float[2][];
    for (int run = 0; run < 2; ++run) {
      try (Session s = Session.builder(1, HQ, HKV, D).method("csattention").budget(0.5).maxRollback(8)
               .lseBase2(run == 1).numThreads(1).create();
           Tensor tq = Tensor.of(q, DType.F32, N, HQ, D); Tensor tk = Tensor.of(k, DType.F32, N, HKV, D);
           Tensor tv = Tensor.of(v, DType.F32, N, HKV, D)) {
        s.prefill(0, tq, tk, tv, null, 0);
        s.buildIndex(0);
        FloatBuffer o = direct(HQ * D), lse = direct(HQ);
        for (int t = 0; t < 3; ++t) {
          if (run == 0 && t == 2) {  // the first run decodes token 2 twice: once, then again after a rollback
            try (Tensor a = Tensor.of(slice(qn, t, HQ * D), DType.F32, HQ, D);
                 Tensor b = Tensor.of(slice(kn, t, HKV * D), DType.F32, HKV, D);
                 Tensor c = Tensor.of(slice(vn, t, HKV * D), DType.F32, HKV, D);
                 Tensor to = Tensor.of(o, DType.F32, HQ, D); Tensor tl = Tensor.of(lse, DType.F32, HQ)) {
              s.decode(0, a, b, c, to, tl, 0);
            }
            s.truncate(N + 2);
            assertEquals(N + 2, s.layerTokens(0));
            assertThrows(KvsException.class, () -> s.truncate(N + 3));
          }
          try (Tensor a = Tensor.of(slice(qn, t, HQ * D), DType.F32, HQ, D);
               Tensor b = Tensor.of(slice(kn, t, HKV * D), DType.F32, HKV, D);
               Tensor c = Tensor.of(slice(vn, t, HKV * D), DType.F32, HKV, D);
               Tensor to = Tensor.of(o, DType.F32, HQ, D); Tensor tl = Tensor.of(lse, DType.F32, HQ)) {
            s.decode(0, a, b, c, to, tl, 0);
          }
        }
        outs[run] = new float[HQ * D];
        lses[run] = new float[HQ];
        for (int i = 0; i < HQ * D; ++i) outs[run][i] = o.get(i);
        for (int h = 0; h < HQ; ++h) lses[run][h] = lse.get(h);
      }
    }
    assertArrayEquals(outs[0], outs[1]);
    for (int h = 0; h < HQ; ++h) assertEquals(lses[0][h] / Math.log(2.0), lses[1][h], 1e-5 * Math.max(1, Math.abs(lses[1][h])));
  }

  /** A session over the caller's page pool (kvFromCaller, bindKv) decodes as one storing the same tokens. */
  @Test
  void callerKvMatchesAnOwnedSession() {
    final int P = 256, pages = 2;
    Random r = new Random(23);
    FloatBuffer q = random(r, (N + 2) * HQ * D), k = random(r, (N + 2) * HKV * D), v = random(r, (N + 2) * HKV * D);
    FloatBuffer pool = direct(pages * 2 * HKV * P * D);
    int[] table = {1};  // the sequence lives in the pool's second page
    for (int t = 0; t < N + 2; ++t)
      for (int h = 0; h < HKV; ++h)
        for (int j = 0; j < D; ++j) {
          pool.put(((table[0] * 2 + 0) * HKV + h) * P * D + t * D + j, k.get((t * HKV + h) * D + j));
          pool.put(((table[0] * 2 + 1) * HKV + h) * P * D + t * D + j, v.get((t * HKV + h) * D + j));
        }
    try (Session own = Session.builder(1, HQ, HKV, D).method("quest").budget(0.3).kvDtype(ScalarType.F32)
             .numThreads(1).create();
         Session cal = Session.builder(1, HQ, HKV, D).method("quest").budget(0.3).kvDtype(ScalarType.F32)
             .numThreads(1).kvFromCaller(true).create();
         Tensor tq = Tensor.of(q, DType.F32, N, HQ, D); Tensor tk = Tensor.of(k, DType.F32, N, HKV, D);
         Tensor tv = Tensor.of(v, DType.F32, N, HKV, D)) {
      own.prefill(0, tq, tk, tv, null, 0);
      assertThrows(KvsException.class, () -> cal.prefill(0, tq, null, null, null, 0));  // nothing bound yet
      cal.bindKv(0, pool, pages, P, table, N);
      cal.prefill(0, tq, null, null, null, 0);
      own.buildIndex(0);
      cal.buildIndex(0);
      for (int t = N; t < N + 2; ++t) {
        FloatBuffer o1 = direct(HQ * D), o2 = direct(HQ * D);
        try (Tensor a = Tensor.of(slice(q, t, HQ * D), DType.F32, HQ, D);
             Tensor b = Tensor.of(slice(k, t, HKV * D), DType.F32, HKV, D);
             Tensor c = Tensor.of(slice(v, t, HKV * D), DType.F32, HKV, D);
             Tensor t1 = Tensor.of(o1, DType.F32, HQ, D); Tensor t2 = Tensor.of(o2, DType.F32, HQ, D)) {
          own.decode(0, a, b, c, t1, null, 0);
          cal.bindKv(0, pool, pages, P, table, t + 1);
          cal.decode(0, a, null, null, t2, null, 0);
        }
        for (int i = 0; i < HQ * D; ++i) assertEquals(o1.get(i), o2.get(i), 0.0f);
      }
      assertEquals(0, cal.stats().getKvBytes().signum());  // (uint64: a BigInteger)
      // Two more tokens in one call (decodeTokens) equal two decode calls of the owned session.
      cal.bindKv(0, pool, pages, P, table, N + 2);
      own.truncate(N);
      cal.truncate(N);
      FloatBuffer o2 = direct(2 * HQ * D), o1 = direct(HQ * D);
      try (Tensor a = Tensor.of(slice(q, N / 2, 2 * HQ * D), DType.F32, 2, HQ, D);
           Tensor t2 = Tensor.of(o2, DType.F32, 2, HQ, D)) {
        cal.decodeTokens(0, a, null, null, t2, null, 0);
      }
      for (int t = N; t < N + 2; ++t) {
        try (Tensor a = Tensor.of(slice(q, t, HQ * D), DType.F32, HQ, D);
             Tensor b = Tensor.of(slice(k, t, HKV * D), DType.F32, HKV, D);
             Tensor c = Tensor.of(slice(v, t, HKV * D), DType.F32, HKV, D); Tensor t1 = Tensor.of(o1, DType.F32, HQ, D)) {
          own.decode(0, a, b, c, t1, null, 0);
        }
        for (int i = 0; i < HQ * D; ++i) assertEquals(o1.get(i), o2.get((t - N) * HQ * D + i), 0.0f);
      }
      KvsException e = assertThrows(KvsException.class, () -> cal.bindKv(0, pool, pages, P, new int[] {5}, N + 2));
      assertTrue(e.getMessage().contains("page_indices[0]"), e.getMessage());
      // More pages than the buffer holds: refused before the library reads past it.
      e = assertThrows(KvsException.class, () -> cal.bindKv(0, pool, pages + 1, P, table, N + 2));
      assertTrue(e.getMessage().contains("pool_bytes"), e.getMessage());
      assertThrows(IllegalArgumentException.class, () -> cal.bindKv(0, FloatBuffer.allocate(8), 1, P, table, N + 2));
      // The cuda backend's layouts (NHD, K and V in two pools) by address: the cpu backend refuses
      // them before it reads a page (so the addresses here are never dereferenced).
      e = assertThrows(KvsException.class, () -> cal.bindKv(0, 256, 0, pages, P, KvLayout.NHD, 0, 0, table, N + 2, 0));
      assertTrue(e.getMessage().contains("kv->layout: the cpu backend reads KVS_KV_LAYOUT_HND"), e.getMessage());
      e = assertThrows(KvsException.class,
          () -> cal.bindKv(0, 256, 256 + (1L << 30), pages, P, KvLayout.HND, 0, 0, table, N + 2, 0));
      assertTrue(e.getMessage().contains("kv->v_pages: the cpu backend reads K and V in one tensor"), e.getMessage());
      assertThrows(NullPointerException.class, () -> cal.bindKv(0, 256, 0, pages, P, null, 0, 0, table, N + 2, 0));
      // The V pool overlapping the K pool (half a page apart) is refused.
      e = assertThrows(KvsException.class,
          () -> cal.bindKv(0, 256, 256 + 1024, pages, P, KvLayout.HND, 0, 0, table, N + 2, 0));
      assertTrue(e.getMessage().contains("the V pool overlaps the K pool"), e.getMessage());
      // A fork keeps the bound buffer reachable, as its parent does.
      try (Session f = cal.fork()) {
        java.lang.reflect.Field bound = Session.class.getDeclaredField("boundPools");
        bound.setAccessible(true);
        assertSame(pool, ((java.util.Map<?, ?>) bound.get(f)).get(0L));
        assertEquals(N + 2, f.layerTokens(0));
      } catch (ReflectiveOperationException x) {
        fail(x);
      }
      // The owned session's tables load into a session over the caller's pool: bound and prefilled
      // again (null k, v) to the saved length, it keeps the loaded index and holds no KV.
      String path = "java_caller_kv.kvs";
      own.save(path, false);
      try (Session ld = Session.load(path, false, true);
           Tensor all = Tensor.of(q, DType.F32, N + 2, HQ, D)) {
        assertEquals(0, ld.layerTokens(0));
        ld.bindKv(0, pool, pages, P, table, N + 2);
        ld.prefill(0, all, null, null, null, 0);
        assertEquals(N + 2, ld.layerTokens(0));
        assertEquals(0, ld.stats().getKvBytes().signum());
        assertEquals(own.stats().getIndexBytes(), ld.stats().getIndexBytes());
      } finally {
        new java.io.File(path).delete();
      }
    }
  }

  private static FloatBuffer slice(FloatBuffer b, int i, int n) {
    FloatBuffer out = direct(n);
    for (int j = 0; j < n; ++j) out.put(j, b.get(i * n + j));
    return out;
  }

  @Test
  void bfloat16ThroughShortBuffers() {
    Random r = new Random(3);
    ShortBuffer q = ByteBuffer.allocateDirect(N * HQ * D * 2).order(ByteOrder.nativeOrder()).asShortBuffer();
    ShortBuffer k = ByteBuffer.allocateDirect(N * HKV * D * 2).order(ByteOrder.nativeOrder()).asShortBuffer();
    for (int i = 0; i < q.capacity(); ++i) q.put(i, (short) (Float.floatToIntBits((float) r.nextGaussian()) >>> 16));
    for (int i = 0; i < k.capacity(); ++i) k.put(i, (short) (Float.floatToIntBits((float) r.nextGaussian()) >>> 16));
    try (Session s = Session.builder(1, HQ, HKV, D).create();
         Tensor tq = Tensor.of(q, DType.BF16, N, HQ, D); Tensor tk = Tensor.of(k, DType.BF16, N, HKV, D)) {
      s.prefill(0, tq, tk, tk, null, 0);
      assertEquals(N, s.layerTokens(0));
    }
  }

  @Test
  void buffersAreChecked() {
    FloatBuffer heap = FloatBuffer.allocate(HQ * D);
    IllegalArgumentException e = assertThrows(IllegalArgumentException.class, () -> Tensor.of(heap, DType.F32, HQ, D));
    assertTrue(e.getMessage().contains("direct"));
    FloatBuffer swapped = ByteBuffer.allocateDirect(HQ * D * 4)
        .order(ByteOrder.nativeOrder() == ByteOrder.BIG_ENDIAN ? ByteOrder.LITTLE_ENDIAN : ByteOrder.BIG_ENDIAN)
        .asFloatBuffer();
    e = assertThrows(IllegalArgumentException.class, () -> Tensor.of(swapped, DType.F32, HQ, D));
    assertTrue(e.getMessage().contains("byte order"));
    e = assertThrows(IllegalArgumentException.class, () -> Tensor.of(direct(HQ * D), DType.F16, HQ, D));
    assertTrue(e.getMessage().contains("F16"));
    e = assertThrows(IllegalArgumentException.class, () -> Tensor.of(direct(HQ * D - 1), DType.F32, HQ, D));
    assertTrue(e.getMessage().contains("at least"));
    FloatBuffer pos = direct(HQ * D);
    pos.position(1); // the tensor starts at the position: one element short now
    assertThrows(IllegalArgumentException.class, () -> Tensor.of(pos, DType.F32, HQ, D));
  }

  @Test
  void errorsCarryCodeAndMessage() {
    KvsException e = assertThrows(KvsException.class, () -> Session.builder(L, HQ, HKV, D).method("nope").create());
    assertEquals(KvsException.INVALID_ARGUMENT, e.code());
    assertTrue(e.getMessage().contains("nope"));
    e = assertThrows(KvsException.class, () -> Session.builder(L, HQ + 1, HKV, D).create());
    assertEquals(KvsException.INVALID_ARGUMENT, e.code());
    // pinned host KV is the cuda backend's: the cpu backend refuses it, naming the field
    e = assertThrows(KvsException.class, () -> Session.builder(L, HQ, HKV, D).kvInPinnedHostMemory(true).create());
    assertEquals(KvsException.UNSUPPORTED, e.code());
    assertTrue(e.getMessage().contains("kv_memory"));
    e = assertThrows(KvsException.class, () -> Session.load("/nonexistent/kvsieve.kvs"));
    assertEquals(KvsException.IO, e.code());
    assertEquals(2, e.backendCode()); // ENOENT
    try (Session s = Session.builder(L, HQ, HKV, D).create();
         Tensor q = Tensor.of(direct(HQ * D), DType.F32, HQ, D); Tensor k = Tensor.of(direct(HKV * D), DType.F32, HKV, D);
         Tensor o = Tensor.of(direct(HQ * D), DType.F32, HQ, D)) {
      e = assertThrows(KvsException.class, () -> s.decode(0, q, k, k, o, null, 0));
      assertEquals(KvsException.INVALID_STATE, e.code());
      e = assertThrows(KvsException.class, () -> s.prefill(0, q, k, k, null, 0)); // rank 2 where 3 is expected
      assertEquals(KvsException.INVALID_ARGUMENT, e.code());
      assertTrue(e.getMessage().contains("q"));
    }
  }

  @Test
  void closeIsIdempotentAndForksOutliveTheirParent() throws Exception {
    Random r = new Random(11);
    Session parent = Session.builder(1, HQ, HKV, D).method("streaming").create();
    try (Tensor q = Tensor.of(random(r, N * HQ * D), DType.F32, N, HQ, D);
         Tensor k = Tensor.of(random(r, N * HKV * D), DType.F32, N, HKV, D)) {
      parent.prefill(0, q, k, k, null, 0);
    }
    parent.buildIndex(0);
    Session child = parent.fork();
    Session copy = parent.to(Backend.CPU, 0);
    assertEquals(N, copy.layerTokens(0));
    copy.close();
    parent.close();
    parent.close();
    try (Tensor q = Tensor.of(random(r, HQ * D), DType.F32, HQ, D); Tensor k = Tensor.of(random(r, HKV * D), DType.F32, HKV, D);
         Tensor o = Tensor.of(direct(HQ * D), DType.F32, HQ, D)) {
      child.decode(0, q, k, k, o, null, 0);
    }
    assertEquals(N + 1, child.layerTokens(0));
    child.close();
    child.close();
  }

  // ---- batches: plan once per token, decode per layer --------------------------------------------

  /** A session of every layer prefilled with (q, k, v) and indexed. */
  static Session prefilled(String method, FloatBuffer q, FloatBuffer k, FloatBuffer v) {
    Session s = Session.builder(L, HQ, HKV, D).method(method).budget(0.25).kvDtype(ScalarType.F32).numThreads(1)
        .create();
    try (Tensor tq = Tensor.of(q, DType.F32, N, HQ, D); Tensor tk = Tensor.of(k, DType.F32, N, HKV, D);
         Tensor tv = Tensor.of(v, DType.F32, N, HKV, D)) {
      for (int layer = 0; layer < L; ++layer) s.prefill(layer, tq, tk, tv, null, 0);
    }
    s.buildIndex(0);
    return s;
  }

  /** Row b of a [B, ...] buffer as its own direct buffer. */
  static FloatBuffer row(FloatBuffer x, int b, int n) {
    FloatBuffer r = direct(n);
    for (int i = 0; i < n; ++i) r.put(i, x.get(b * n + i));
    return r;
  }

  @Test
  void batchEqualsPerSessionDecodes() {
    final int B = 2;
    Random r = new Random(21);
    for (long mi = 0; mi < KvsNative.methodCount(); ++mi) {
      String method = KvsNative.methodName(mi);
      Session[] batched = new Session[B], single = new Session[B];
      FloatBuffer[] ks = new FloatBuffer[B], vs = new FloatBuffer[B];
      for (int b = 0; b < B; ++b) {
        FloatBuffer q = random(r, N * HQ * D);
        ks[b] = random(r, N * HKV * D);
        vs[b] = random(r, N * HKV * D);
        batched[b] = prefilled(method, q, ks[b], vs[b]);
        single[b] = prefilled(method, q, ks[b], vs[b]);
      }
      try (Batch batch = Batch.of(batched)) {
        assertEquals(B, batch.size());
        for (int step = 0; step < 2; ++step) {
          batch.plan(0);
          for (int layer = 0; layer < L; ++layer) {
            FloatBuffer q = random(r, B * HQ * D), k = random(r, B * HKV * D), v = random(r, B * HKV * D);
            FloatBuffer o = direct(B * HQ * D), lse = direct(B * HQ);
            try (Tensor tq = Tensor.of(q, DType.F32, B, HQ, D); Tensor tk = Tensor.of(k, DType.F32, B, HKV, D);
                 Tensor tv = Tensor.of(v, DType.F32, B, HKV, D); Tensor to = Tensor.of(o, DType.F32, B, HQ, D);
                 Tensor tl = Tensor.of(lse, DType.F32, B, HQ)) {
              batch.decode(layer, tq, tk, tv, to, tl, 0);
            }
            for (int b = 0; b < B; ++b) {
              FloatBuffer qb = row(q, b, HQ * D), kb = row(k, b, HKV * D), vb = row(v, b, HKV * D);
              FloatBuffer so = direct(HQ * D), sl = direct(HQ);
              try (Tensor tq = Tensor.of(qb, DType.F32, HQ, D); Tensor tk = Tensor.of(kb, DType.F32, HKV, D);
                   Tensor tv = Tensor.of(vb, DType.F32, HKV, D); Tensor to = Tensor.of(so, DType.F32, HQ, D);
                   Tensor tl = Tensor.of(sl, DType.F32, HQ)) {
                single[b].decode(layer, tq, tk, tv, to, tl, 0);
              }
              for (int i = 0; i < HQ * D; ++i)
                assertEquals(so.get(i), o.get(b * HQ * D + i), 1e-6 + 1e-6 * Math.abs(so.get(i)), method);
              for (int h = 0; h < HQ; ++h) assertEquals(sl.get(h), lse.get(b * HQ + h), 1e-6, method);
              if (method.equals("full") && step == 0) { // dense attention over prompt + the new token
                double[][] ref = reference(qb, concat(ks[b], kb), concat(vs[b], vb), N + 1);
                for (int i = 0; i < HQ * D; ++i)
                  assertEquals(ref[0][i], o.get(b * HQ * D + i), 2e-4 + 2e-4 * Math.abs(ref[0][i]));
                for (int h = 0; h < HQ; ++h) assertEquals(ref[1][h], lse.get(b * HQ + h), 1e-4);
              }
            }
          }
        }
        for (Session s : batch.sessions()) assertEquals(N + 2, s.layerTokens(L - 1));
      } finally {
        for (int b = 0; b < B; ++b) { batched[b].close(); single[b].close(); }
      }
    }
  }

  @Test
  void batchErrors() {
    Random r = new Random(5);
    FloatBuffer q = random(r, N * HQ * D), k = random(r, N * HKV * D);
    Session a = prefilled("quest", q, k, k), c = prefilled("quest", q, k, k);
    assertThrows(IllegalArgumentException.class, () -> Batch.of());
    assertThrows(NullPointerException.class, () -> Batch.of(a, null));
    KvsException e = assertThrows(KvsException.class, () -> Batch.of(a, a));
    assertEquals(KvsException.INVALID_ARGUMENT, e.code());
    assertTrue(e.getMessage().contains("twice"));
    try (Session other = Session.builder(L, HQ, HKV, D).method("streaming").create()) {
      e = assertThrows(KvsException.class, () -> Batch.of(a, other));
      assertEquals(KvsException.INVALID_ARGUMENT, e.code());
      assertTrue(e.getMessage().contains("sessions[1]"));
    }
    FloatBuffer o = direct(2 * HQ * D);
    Batch batch = Batch.of(a, c);
    try (Tensor tq = Tensor.of(random(r, 2 * HQ * D), DType.F32, 2, HQ, D);
         Tensor tk = Tensor.of(random(r, 2 * HKV * D), DType.F32, 2, HKV, D);
         Tensor to = Tensor.of(o, DType.F32, 2, HQ, D);
         Tensor shortQ = Tensor.of(random(r, HQ * D), DType.F32, 1, HQ, D)) {
      e = assertThrows(KvsException.class, () -> batch.decode(0, tq, tk, tk, to, null, 0));
      assertEquals(KvsException.INVALID_STATE, e.code()); // no plan
      batch.plan(0);
      e = assertThrows(KvsException.class, () -> batch.decode(L, tq, tk, tk, to, null, 0));
      assertEquals(KvsException.INVALID_ARGUMENT, e.code());
      e = assertThrows(KvsException.class, () -> batch.decode(0, shortQ, tk, tk, to, null, 0));
      assertEquals(KvsException.INVALID_ARGUMENT, e.code());
      assertTrue(e.getMessage().contains("q"));
      batch.decode(0, tq, tk, tk, to, null, 0);
      e = assertThrows(KvsException.class, () -> batch.decode(0, tq, tk, tk, to, null, 0));
      assertEquals(KvsException.INVALID_STATE, e.code()); // layer 0 twice under one plan
      assertEquals(N + 1, a.layerTokens(0));
      c.close(); // a session closed under the batch: refused before any native call
      IllegalStateException ise = assertThrows(IllegalStateException.class, () -> batch.plan(0));
      assertTrue(ise.getMessage().contains("sessions[1]"));
      assertThrows(IllegalStateException.class, () -> batch.decode(1, tq, tk, tk, to, null, 0));
      assertThrows(IllegalStateException.class, () -> Batch.of(a, c));
    }
    batch.close();
    batch.close(); // idempotent
    assertThrows(IllegalStateException.class, () -> batch.plan(0));
    assertThrows(IllegalStateException.class, batch::size);
    a.close();
  }

  // ---- Session.decodeBatch: kvs_decode_batch, one call per layer and token ------------------------

  static float[] floats(FloatBuffer b) {
    float[] out = new float[b.capacity()];
    for (int i = 0; i < out.length; ++i) out[i] = b.get(i);
    return out;
  }

  /** decodeBatch against per-session decodes of twin sessions: bit for bit on full, every method to
   *  the tolerance of the Batch test; two tokens over every layer, with and without lse. */
  @Test
  void decodeBatchEqualsPerSessionDecodes() {
    final int B = 3;
    Random r = new Random(33);
    for (long mi = 0; mi < KvsNative.methodCount(); ++mi) {
      String method = KvsNative.methodName(mi);
      Session[] batched = new Session[B], single = new Session[B];
      for (int b = 0; b < B; ++b) {
        FloatBuffer q = random(r, N * HQ * D), k = random(r, N * HKV * D), v = random(r, N * HKV * D);
        batched[b] = prefilled(method, q, k, v);
        single[b] = prefilled(method, q, k, v);
      }
      try {
        for (int step = 0; step < 2; ++step) {
          for (int layer = 0; layer < L; ++layer) {
            boolean withLse = (step + layer) % 2 == 0;
            FloatBuffer q = random(r, B * HQ * D), k = random(r, B * HKV * D), v = random(r, B * HKV * D);
            FloatBuffer o = direct(B * HQ * D), lse = direct(B * HQ);
            try (Tensor tq = Tensor.of(q, DType.F32, B, HQ, D); Tensor tk = Tensor.of(k, DType.F32, B, HKV, D);
                 Tensor tv = Tensor.of(v, DType.F32, B, HKV, D); Tensor to = Tensor.of(o, DType.F32, B, HQ, D);
                 Tensor tl = Tensor.of(lse, DType.F32, B, HQ)) {
              Session.decodeBatch(batched, layer, tq, tk, tv, to, withLse ? tl : null, 0);
            }
            for (int b = 0; b < B; ++b) {
              FloatBuffer so = direct(HQ * D), sl = direct(HQ);
              try (Tensor tq = Tensor.of(row(q, b, HQ * D), DType.F32, HQ, D);
                   Tensor tk = Tensor.of(row(k, b, HKV * D), DType.F32, HKV, D);
                   Tensor tv = Tensor.of(row(v, b, HKV * D), DType.F32, HKV, D);
                   Tensor to = Tensor.of(so, DType.F32, HQ, D); Tensor tl = Tensor.of(sl, DType.F32, HQ)) {
                single[b].decode(layer, tq, tk, tv, to, tl, 0);
              }
              float[] got = floats(row(o, b, HQ * D)), want = floats(so);
              if (method.equals("full")) {
                assertArrayEquals(want, got, method + " o, step " + step + ", layer " + layer + ", row " + b);
              } else {
                for (int i = 0; i < HQ * D; ++i) assertEquals(want[i], got[i], 1e-6 + 1e-6 * Math.abs(want[i]), method);
              }
              float[] gotLse = floats(row(lse, b, HQ)), wantLse = floats(sl);
              if (!withLse) continue;
              if (method.equals("full")) assertArrayEquals(wantLse, gotLse, method + " lse");
              else for (int h = 0; h < HQ; ++h) assertEquals(wantLse[h], gotLse[h], 1e-6, method);
            }
          }
        }
        for (int b = 0; b < B; ++b) {
          assertEquals(N + 2, batched[b].layerTokens(L - 1), method);
          assertEquals(single[b].stats().getDecodeSteps(), batched[b].stats().getDecodeSteps(), method);
          assertArrayEquals(single[b].lastSelection(L - 1, 0), batched[b].lastSelection(L - 1, 0), method);
        }
      } finally {
        for (int b = 0; b < B; ++b) { batched[b].close(); single[b].close(); }
      }
    }
  }

  @Test
  void decodeBatchErrors() {
    Random r = new Random(12);
    FloatBuffer q = random(r, N * HQ * D), k = random(r, N * HKV * D);
    Session a = prefilled("full", q, k, k), c = prefilled("full", q, k, k);
    FloatBuffer o = direct(2 * HQ * D);
    try (Tensor tq = Tensor.of(random(r, 2 * HQ * D), DType.F32, 2, HQ, D);
         Tensor tk = Tensor.of(random(r, 2 * HKV * D), DType.F32, 2, HKV, D);
         Tensor to = Tensor.of(o, DType.F32, 2, HQ, D);
         Tensor shortQ = Tensor.of(random(r, HQ * D), DType.F32, 1, HQ, D)) {
      // refused on the Java side, before any native call
      NullPointerException npe =
          assertThrows(NullPointerException.class, () -> Session.decodeBatch(null, 0, tq, tk, tk, to, null, 0));
      assertTrue(npe.getMessage().contains("sessions"));
      IllegalArgumentException iae = assertThrows(IllegalArgumentException.class,
          () -> Session.decodeBatch(new Session[0], 0, tq, tk, tk, to, null, 0));
      assertTrue(iae.getMessage().contains("at least one"));
      npe = assertThrows(NullPointerException.class,
          () -> Session.decodeBatch(new Session[] {a, null}, 0, tq, tk, tk, to, null, 0));
      assertTrue(npe.getMessage().contains("sessions[1]"), npe.getMessage());
      // the library's checks
      KvsException e = assertThrows(KvsException.class,
          () -> Session.decodeBatch(new Session[] {a, a}, 0, tq, tk, tk, to, null, 0));
      assertEquals(KvsException.INVALID_ARGUMENT, e.code());
      assertTrue(e.getMessage().contains("twice"), e.getMessage());
      e = assertThrows(KvsException.class,
          () -> Session.decodeBatch(new Session[] {a, c}, L, tq, tk, tk, to, null, 0));
      assertEquals(KvsException.INVALID_ARGUMENT, e.code());
      assertTrue(e.getMessage().contains("layer"), e.getMessage());
      e = assertThrows(KvsException.class,
          () -> Session.decodeBatch(new Session[] {a, c}, 0, shortQ, tk, tk, to, null, 0)); // B = 1, not 2
      assertEquals(KvsException.INVALID_ARGUMENT, e.code());
      assertTrue(e.getMessage().contains("q"), e.getMessage());
      e = assertThrows(KvsException.class,
          () -> Session.decodeBatch(new Session[] {a, c}, 0, tq, tk, tk, null, null, 0));
      assertEquals(KvsException.INVALID_ARGUMENT, e.code());
      try (Session other = Session.builder(L, HQ, HKV, D).method("streaming").create()) {
        e = assertThrows(KvsException.class,
            () -> Session.decodeBatch(new Session[] {a, other}, 0, tq, tk, tk, to, null, 0));
        assertEquals(KvsException.INVALID_ARGUMENT, e.code());
        assertTrue(e.getMessage().contains("sessions[1]"), e.getMessage());
      }
      try (Session fresh = Session.builder(L, HQ, HKV, D).kvDtype(ScalarType.F32).create()) { // not prefilled
        e = assertThrows(KvsException.class,
            () -> Session.decodeBatch(new Session[] {a, fresh}, 0, tq, tk, tk, to, null, 0));
        assertEquals(KvsException.INVALID_STATE, e.code(), e.getMessage());
      }
      // all or nothing: none of the failed calls appended a token
      assertEquals(N, a.layerTokens(0));
      assertEquals(N, c.layerTokens(0));
      Session.decodeBatch(new Session[] {a, c}, 0, tq, tk, tk, to, null, 0);
      assertEquals(N + 1, a.layerTokens(0));
      assertEquals(N + 1, c.layerTokens(0));
      c.close();
      IllegalStateException ise = assertThrows(IllegalStateException.class,
          () -> Session.decodeBatch(new Session[] {a, c}, 1, tq, tk, tk, to, null, 0));
      assertTrue(ise.getMessage().contains("sessions[1]"), ise.getMessage());
      assertEquals(N, a.layerTokens(1)); // refused before any native call
    } finally {
      a.close();
      c.close();
    }
  }

  /** The only reference to the sessions is the batch's own. */
  static Batch unreferencedSessions(Random r) {
    FloatBuffer q = random(r, N * HQ * D), k = random(r, N * HKV * D);
    return Batch.of(prefilled("exact_topk", q, k, k), prefilled("exact_topk", q, k, k));
  }

  @Test
  void batchKeepsItsSessionsReachable() throws Exception {
    Random r = new Random(8);
    Batch batch = unreferencedSessions(r);
    for (int i = 0; i < 5; ++i) { // finalizers of unreachable sessions would free them now
      System.gc();
      System.runFinalization();
      Thread.sleep(10);
    }
    FloatBuffer o = direct(2 * HQ * D);
    FloatBuffer q1 = random(r, HQ * D), k1 = random(r, HKV * D);
    try (Tensor tq = Tensor.of(concat(q1, q1), DType.F32, 2, HQ, D); // the same token for both sessions
         Tensor tk = Tensor.of(concat(k1, k1), DType.F32, 2, HKV, D);
         Tensor to = Tensor.of(o, DType.F32, 2, HQ, D)) {
      batch.plan(0);
      for (int layer = 0; layer < L; ++layer) batch.decode(layer, tq, tk, tk, to, null, 0);
    }
    for (int i = 0; i < 2 * HQ * D; ++i) assertTrue(Float.isFinite(o.get(i)));
    // identical sessions and inputs: identical rows
    for (int i = 0; i < HQ * D; ++i) assertEquals(o.get(i), o.get(HQ * D + i));
    for (Session s : batch.sessions()) assertEquals(N + 1, s.layerTokens(0));
    batch.close();
  }

  @Test
  void methodUnsupportedReason() {
    for (long i = 0; i < KvsNative.methodCount(); ++i) {
      String m = KvsNative.methodName(i);
      assertNull(KvsNative.methodUnsupportedReason(m, Backend.CPU), m);
      String hybrid = KvsNative.methodUnsupportedReason(m, Backend.HYBRID);
      // hybrid runs every method exactly where the build has CUDA (full runs on cuda)
      assertEquals(hybrid == null, KvsNative.methodUnsupportedReason("full", Backend.CUDA) == null, m);
      assertEquals(hybrid == null, (KvsNative.methodBackends(m) & (1 << 3)) != 0, m);
      String cuda = KvsNative.methodUnsupportedReason(m, Backend.CUDA);
      assertEquals(cuda == null, (KvsNative.methodBackends(m) & (1 << 2)) != 0, m);
    }
    assertNull(KvsNative.methodUnsupportedReason("nope", Backend.HYBRID));
    assertTrue(KvsNative.methodUnsupportedReason("full", 7).contains("backend"));
    assertTrue(KvsNative.methodUnsupportedReason("full", 0).contains("backend"));
  }
}
