// SPDX-License-Identifier: Apache-2.0
package org.kvsieve;

import static org.junit.jupiter.api.Assertions.*;

import java.nio.FloatBuffer;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.EnumSet;
import java.util.HashSet;
import java.util.List;
import java.util.Random;
import java.util.Set;
import java.util.StringJoiner;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.io.TempDir;

/** versionNumber, the method registry's parameters (methodParams, methods) and tablesDescribe. */
class RegistryAndTablesTest {
  static final int L = KvsieveTest.L, HQ = KvsieveTest.HQ, HKV = KvsieveTest.HKV, D = KvsieveTest.D,
      N = KvsieveTest.N;

  @TempDir Path dir;

  @Test
  void versionNumberMatchesVersion() {
    String[] v = KvsNative.version().split("\\.");
    assertEquals(3, v.length, KvsNative.version());
    long expected = Long.parseLong(v[0]) * 10000 + Long.parseLong(v[1]) * 100 + Long.parseLong(v[2]);
    assertEquals(expected, KvsNative.versionNumber());
  }

  @Test
  void questParams() {
    List<ParamInfo> ps = KvsNative.methodParams("quest");
    ParamInfo page = ps.stream().filter(p -> p.name().equals("page_size")).findFirst().orElseThrow();
    assertEquals("int", page.type());
    assertEquals("16", page.defaultValue());
    assertTrue(page.doc().contains("tokens per page"), page.doc());
    ParamInfo gqa = ps.stream().filter(p -> p.name().equals("gqa")).findFirst().orElseThrow();
    assertEquals("enum:sum|per_query_head", gqa.type());
    assertEquals("sum", gqa.defaultValue());
    assertThrows(UnsupportedOperationException.class, () -> ps.add(page));
    assertEquals(page, KvsNative.methodParams("quest").get(ps.indexOf(page))); // value equality
    assertEquals(page.hashCode(), KvsNative.methodParams("quest").get(ps.indexOf(page)).hashCode());
    assertTrue(KvsNative.methodParams("full").isEmpty());
  }

  /** Every parameter of every method: the count kvs_method_param_count reports, a known type whose
   *  default parses, accepted by a session when given explicitly, and exactly the parameters (and
   *  values) a session created without methodParams saves in its tables file. */
  @Test
  void everyMethodsParamsAreListedWithTheirDefaults() throws Exception {
    Random r = new Random(17);
    FloatBuffer q = KvsieveTest.random(r, N * HQ * D), k = KvsieveTest.random(r, N * HKV * D);
    int total = 0;
    for (String m : KvsNative.methodNames()) {
      List<ParamInfo> ps = KvsNative.methodParams(m);
      assertEquals(KvsNative.methodParamCount(m), ps.size(), m);
      total += ps.size();
      Set<String> names = new HashSet<>();
      StringJoiner explicit = new StringJoiner(",");
      for (ParamInfo p : ps) {
        String what = m + "." + p.name();
        assertTrue(p.name().matches("[a-z_][a-z0-9_]*"), what);
        assertTrue(names.add(p.name()), what + " listed twice");
        assertFalse(p.doc().isEmpty(), what);
        String t = p.type(), d = p.defaultValue();
        if (t.equals("int")) Long.parseLong(d);
        else if (t.equals("float")) Double.parseDouble(d);
        else if (t.equals("bool")) assertTrue(d.equals("true") || d.equals("false"), what + "=" + d);
        else if (t.startsWith("enum:")) assertTrue(Arrays.asList(t.substring(5).split("\\|")).contains(d), what + "=" + d);
        else assertEquals("string", t, what);
        explicit.add(p.name() + "=" + d);
      }
      // the defaults as text are values the method accepts
      try (Session s = Session.builder(L, HQ, HKV, D).method(m).methodParams(explicit.toString()).create()) {
        assertEquals(0, s.layerTokens(0));
      }
      // a session with no methodParams saves exactly these parameters with these values
      Path file = dir.resolve(m + ".kvs");
      try (Session s = prefilled(m, q, k)) {
        s.save(file.toString(), false);
      }
      String json = KvsNative.tablesDescribe(file.toString());
      String params = paramsObject(json);
      for (ParamInfo p : ps)
        assertTrue(params.contains("\"" + p.name() + "\": \"" + p.defaultValue() + "\""), m + ": " + p + " in " + params);
      assertEquals(ps.size(), count(params, "\": \""), m + ": " + params);
    }
    assertTrue(total > 0);
  }

  @Test
  void methodsListsTheRegistry() {
    List<MethodInfo> ms = KvsNative.methods();
    assertEquals(KvsNative.methodCount(), ms.size());
    assertEquals(KvsNative.methodNames(), ms.stream().map(MethodInfo::name).collect(java.util.stream.Collectors.toList()));
    for (MethodInfo mi : ms) {
      String m = mi.name();
      assertEquals(KvsNative.methodDoc(m), mi.doc());
      assertEquals(KvsNative.methodParams(m), mi.params(), m);
      assertTrue(mi.backends().contains(Backend.CPU), m);
      EnumSet<Backend> expected = EnumSet.noneOf(Backend.class);
      for (Backend b : Backend.values())
        if (KvsNative.methodUnsupportedReason(m, b) == null) expected.add(b);
      assertEquals(expected, mi.backends(), m); // the mask agrees with the unsupported reasons
      assertThrows(UnsupportedOperationException.class, () -> mi.params().clear());
      assertThrows(UnsupportedOperationException.class, () -> mi.backends().add(Backend.CUDA));
    }
    assertThrows(UnsupportedOperationException.class, () -> ms.remove(0));
    assertEquals(ms, KvsNative.methods());
    assertTrue(ms.stream().anyMatch(mi -> mi.name().equals("quest") && mi.toString().contains("page_size")));
  }

  @Test
  void unknownMethodThrows() {
    for (String bad : new String[] {"nope", "Quest", ""}) {
      KvsException e = assertThrows(KvsException.class, () -> KvsNative.methodParams(bad));
      assertEquals(KvsException.INVALID_ARGUMENT, e.code());
      assertTrue(e.getMessage().contains("'" + bad + "'"), e.getMessage());
      assertNull(e.details());
      e = assertThrows(KvsException.class, () -> KvsNative.methodParamCount(bad));
      assertTrue(e.getMessage().contains("'" + bad + "'"), e.getMessage());
    }
    KvsException e = assertThrows(KvsException.class, () -> KvsNative.methodParams(null));
    assertEquals(KvsException.INVALID_ARGUMENT, e.code());
    assertTrue(e.getMessage().contains("method"), e.getMessage());
    // the registry still answers after the errors (no error left pending on this thread)
    assertFalse(KvsNative.methodParams("quest").isEmpty());
  }

  // ---- tables files ------------------------------------------------------------------------------

  static Session prefilled(String method, FloatBuffer q, FloatBuffer k) {
    Session s = Session.builder(L, HQ, HKV, D).method(method).budget(0.25).kvDtype(ScalarType.F32).numThreads(1)
        .create();
    try (Tensor tq = Tensor.of(q, DType.F32, N, HQ, D); Tensor tk = Tensor.of(k, DType.F32, N, HKV, D)) {
      for (int layer = 0; layer < L; ++layer) s.prefill(layer, tq, tk, tk, null, 0);
    }
    s.buildIndex(0);
    return s;
  }

  static int count(String s, String sub) {
    int n = 0;
    for (int i = s.indexOf(sub); i >= 0; i = s.indexOf(sub, i + sub.length())) ++n;
    return n;
  }

  /** The text of header.method.params (a flat object of strings) in tablesDescribe's JSON. */
  static String paramsObject(String json) {
    int at = json.indexOf("\"params\": {");
    assertTrue(at >= 0, json);
    int end = json.indexOf('}', at);
    return json.substring(at, end + 1);
  }

  @Test
  void tablesDescribeOfSavedSessions() throws Exception {
    Random r = new Random(4);
    FloatBuffer q = KvsieveTest.random(r, N * HQ * D), k = KvsieveTest.random(r, N * HKV * D);
    String[][] methodAndTag = {{"quest", "quest.bounds"}, {"csattention", "csa.idx"}};
    for (String[] mt : methodAndTag) {
      String method = mt[0];
      Path tables = dir.resolve(method + "-tables.kvs"), withKv = dir.resolve(method + "-kv.kvs");
      try (Session s = prefilled(method, q, k)) {
        s.save(tables.toString(), false);
        s.save(withKv.toString(), true);
      }
      String json = KvsNative.tablesDescribe(tables.toString());
      assertTrue(json.trim().startsWith("{") && json.trim().endsWith("}"), json);
      assertTrue(json.contains("\"ok\": true"), json);
      assertTrue(json.contains("\"error\": null"), json);
      assertTrue(json.contains("\"format\": \"kvsieve-tables\""), json);
      assertTrue(json.contains("\"name\": \"" + method + "\""), json);
      assertTrue(json.contains("\"num_layers\": " + L + ","), json);
      assertTrue(json.contains("\"num_q_heads\": " + HQ + ","), json);
      assertTrue(json.contains("\"num_kv_heads\": " + HKV + ","), json);
      assertTrue(json.contains("\"head_dim\": " + D + ","), json);
      assertEquals(L, count(json, "\"index_built\": true"), json); // one entry per layer
      assertEquals(L, count(json, "\"tokens\": " + N), json);
      assertTrue(json.contains("\"kv_included\": false"), json);
      assertTrue(json.contains("\"path\": \"" + tables + "\""), json);
      assertTrue(json.contains("\"file_size\": " + Files.size(tables)), json);
      assertFalse(json.contains("\"status\": \"mismatch\""), json);
      assertTrue(count(json, "\"status\": \"ok\"") >= L, json); // each section's checksum verified
      assertEquals(L, count(json, "\"tag\": \"" + mt[1] + "\""), json); // the method's own sections, per layer
      String kv = KvsNative.tablesDescribe(withKv.toString());
      assertTrue(kv.contains("\"kv_included\": true"), kv);
      assertTrue(Files.size(withKv) > Files.size(tables));
      assertTrue(kv.contains("\"file_size\": " + Files.size(withKv)), kv);
    }
  }

  @Test
  void tablesDescribeErrorsNameThePath() throws Exception {
    Path missing = dir.resolve("missing.kvs");
    KvsException e = assertThrows(KvsException.class, () -> KvsNative.tablesDescribe(missing.toString()));
    assertEquals(KvsException.IO, e.code());
    assertEquals(2, e.backendCode()); // ENOENT
    assertTrue(e.getMessage().contains(missing.toString()), e.getMessage());
    assertNull(e.details()); // nothing was readable

    Path garbage = dir.resolve("garbage.kvs");
    byte[] noise = new byte[4096];
    new Random(9).nextBytes(noise);
    Files.write(garbage, noise);
    e = assertThrows(KvsException.class, () -> KvsNative.tablesDescribe(garbage.toString()));
    assertEquals(KvsException.FORMAT_MAGIC, e.code(), e.getMessage());
    assertTrue(e.getMessage().contains(garbage.toString()), e.getMessage());
    assertNotNull(e.details());
    assertTrue(e.details().contains("\"ok\": false"), e.details());
    assertTrue(e.details().contains("\"error_code\": " + KvsException.FORMAT_MAGIC), e.details());

    Path empty = dir.resolve("empty.kvs");
    Files.write(empty, new byte[0]);
    e = assertThrows(KvsException.class, () -> KvsNative.tablesDescribe(empty.toString()));
    assertTrue(e.getMessage().contains(empty.toString()), e.getMessage());

    // a saved file with one byte flipped in the middle: the checksum of its section fails, and the
    // JSON of what was readable comes with the exception
    Random r = new Random(6);
    Path good = dir.resolve("good.kvs"), bad = dir.resolve("bad.kvs");
    try (Session s = prefilled("quest", KvsieveTest.random(r, N * HQ * D), KvsieveTest.random(r, N * HKV * D))) {
      s.save(good.toString(), true);
    }
    byte[] data = Files.readAllBytes(good);
    data[data.length / 2] ^= (byte) 0xFF;
    Files.write(bad, data);
    e = assertThrows(KvsException.class, () -> KvsNative.tablesDescribe(bad.toString()));
    assertEquals(KvsException.FORMAT_CHECKSUM, e.code(), e.getMessage());
    assertTrue(e.getMessage().contains(bad.toString()), e.getMessage());
    assertNotNull(e.details());
    assertTrue(e.details().contains("\"ok\": false"), e.details());
    assertTrue(e.details().contains("\"status\": \"mismatch\""), e.details());
    assertTrue(e.details().contains("\"name\": \"quest\""), e.details()); // the header was readable
    assertThrows(KvsException.class, () -> Session.load(bad.toString()));

    e = assertThrows(KvsException.class, () -> KvsNative.tablesDescribe(null));
    assertEquals(KvsException.INVALID_ARGUMENT, e.code());
    assertTrue(e.getMessage().contains("path"), e.getMessage());
    // later calls are unaffected by the earlier errors
    assertTrue(KvsNative.tablesDescribe(good.toString()).contains("\"ok\": true"));
  }

  /** Repeated failing calls: each exception carries its own details, and no call's details end up
   *  in the exception of the next (the native side takes the pending error and details once). */
  @Test
  void repeatedErrorsKeepTheirOwnDetails() throws Exception {
    Path garbage = dir.resolve("g.kvs");
    Files.write(garbage, "not a kvsieve file at all, but long enough to hold a preamble of 56 bytes".getBytes());
    Path missing = dir.resolve("none.kvs");
    List<KvsException> errs = new ArrayList<>();
    for (int i = 0; i < 200; ++i) {
      errs.add(assertThrows(KvsException.class, () -> KvsNative.tablesDescribe(garbage.toString())));
      KvsException m = assertThrows(KvsException.class, () -> KvsNative.tablesDescribe(missing.toString()));
      assertNull(m.details());
      KvsException u = assertThrows(KvsException.class, () -> KvsNative.methodParams("nope"));
      assertNull(u.details());
    }
    for (KvsException e : errs) {
      assertEquals(KvsException.FORMAT_MAGIC, e.code());
      assertTrue(e.details().contains(garbage.toString()));
    }
  }
}
