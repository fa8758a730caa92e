// SPDX-License-Identifier: Apache-2.0
// Issue 22 (hardening), findings 2, 3, 4 and 6, through the public C API:
//  2. header numbers of a tables file with valid checksums are range-checked at their type (a float
//     where an integer belongs, 2^32 + 8 for a uint32, a bool, a non-numeric HGCA layer key, shape or
//     parameter values a session refuses): KVS_STATUS_FORMAT_INVALID naming the file and the field;
//  3. parameters that size memory or time are bounded (refused at creation or clamped at build);
//  4. loads copy unless KVS_LOAD_MMAP: the file may be truncated or rewritten under a live session;
//  6. the cpu backend refuses non-finite q/k/v, naming the tensor and the first bad element, and
//     leaves the session as it was.
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "io/tables.hpp"
#include "kvsieve/kvsieve.h"
#include "capi_helpers.hpp"
#include "reference.hpp"

using namespace kvt;
using nlohmann::json;

namespace {

std::string tmp(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kvsieve_hl_" + std::to_string(::getpid()) + "_" + name)).string();
}

// Random q [T][Hq][d], k, v [T][Hkv][d].
struct Data {
  int hq, hkv, d;
  int64_t T;
  std::vector<float> q, k, v;
  Data(uint64_t seed, int hq_, int hkv_, int d_, int64_t T_) : hq(hq_), hkv(hkv_), d(d_), T(T_) {
    Rng rng(seed);
    q = rng.normals(size_t(T) * hq * d);
    k = rng.normals(size_t(T) * hkv * d);
    v = rng.normals(size_t(T) * hkv * d);
  }
  float* qt(int64_t t) { return q.data() + t * hq * d; }
  float* kt(int64_t t) { return k.data() + t * hkv * d; }
  float* vt(int64_t t) { return v.data() + t * hkv * d; }
};

kvs_session_params params(const Data& D, const char* method, const char* mp = nullptr, uint32_t layers = 2) {
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = layers;
  p.num_q_heads = uint32_t(D.hq);
  p.num_kv_heads = uint32_t(D.hkv);
  p.head_dim = uint32_t(D.d);
  p.kv_dtype = KVS_SCALAR_F32;
  p.method = method;
  p.method_params = mp;
  p.budget = 0.1;
  p.num_threads = 2;
  return p;
}

kvs_error_t prefill(kvs_session_t s, Data& D, uint32_t layer, int64_t from, int64_t n) {
  T q(D.qt(from), f32(), {n, D.hq, D.d}), k(D.kt(from), f32(), {n, D.hkv, D.d}), v(D.vt(from), f32(), {n, D.hkv, D.d});
  return kvs_session_prefill(s, layer, &q.t, &k.t, &v.t, nullptr, nullptr);
}

// A session of every layer prefilled with the first n tokens and indexed.
void build(Sess& S, Data& D, const kvs_session_params& p, int64_t n) {
  OK(kvs_session_create(&p, &S.s));
  for (uint32_t l = 0; l < p.num_layers; ++l) OK(prefill(S.s, D, l, 0, n));
  OK(kvs_session_build_index(S.s, nullptr));
}

kvs_error_t decode(kvs_session_t s, Data& D, uint32_t layer, int64_t t, std::vector<float>& o, std::vector<float>& lse) {
  o.assign(size_t(D.hq) * D.d, NAN);
  lse.assign(size_t(D.hq), NAN);
  T q(D.qt(t), f32(), {D.hq, D.d}), k(D.kt(t), f32(), {D.hkv, D.d}), v(D.vt(t), f32(), {D.hkv, D.d});
  T ot(o.data(), f32(), {D.hq, D.d}), lt(lse.data(), f32(), {D.hq});
  return kvs_session_decode(s, layer, &q.t, &k.t, &v.t, &ot.t, &lt.t, nullptr);
}

// Rewrites the tables file src as dst with its header edited by `edit` and every section as it
// was: a file whose checksums are all valid, so only the header checks stand between it and a
// session.
void forge(const std::string& src, const std::string& dst, const std::function<void(json&)>& edit) {
  auto f = kvs::io::TablesFile::open(src);
  json h = f->header();
  edit(h);
  kvs::io::TablesWriter w(h);
  for (auto& s : f->sections()) w.add_copy(s.tag, s.layer, s.head, s.data, s.length);
  w.write_atomic(dst);
}

struct Loaded {
  int code;
  std::string msg;
};
Loaded try_load(const std::string& path) {
  kvs_session_t s = nullptr;
  Err e{kvs_session_load(path.c_str(), nullptr, &s)};
  if (!e.e) {
    kvs_session_destroy(s);
    return {KVS_STATUS_OK, ""};
  }
  CHECK(s == nullptr);
  return {e.code(), e.msg()};
}

// The forged file loads with FORMAT_INVALID and a message naming the file and `needle`.
void expect_format_invalid(const std::string& src, const std::function<void(json&)>& edit, const std::string& needle) {
  const std::string bad = tmp("forged.kvt");
  forge(src, bad, edit);
  const Loaded r = try_load(bad);
  INFO("expected FORMAT_INVALID mentioning '" << needle << "', got " << r.code << ": " << r.msg);
  CHECK(r.code == KVS_STATUS_FORMAT_INVALID);
  CHECK(r.msg.find("tables file '" + bad + "'") != std::string::npos);
  CHECK(r.msg.find(needle) != std::string::npos);
  std::remove(bad.c_str());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Finding 2: header numbers

TEST_CASE("hardening: header numbers of the session are range-checked at their type (FORMAT_INVALID naming file and field)") {
  Data D(1, 4, 2, 16, 300);
  Sess A;
  build(A, D, params(D, "quest", "page_size=16"), 300);
  const std::string path = tmp("quest.kvt");
  OK(kvs_session_save(A.s, path.c_str(), KVS_SAVE_INCLUDE_KV));
  // The untouched rewrite loads: the edits below are what fails.
  expect_format_invalid(path, [](json& h) { h["format"] = "other"; }, "header: format");
  {
    const std::string same = tmp("same.kvt");
    forge(path, same, [](json&) {});
    CHECK(try_load(same).code == KVS_STATUS_OK);
    std::remove(same.c_str());
  }
  // Floats where integers belong were undefined behaviour in the conversion (UBSan float-cast-overflow).
  for (double x : {1e20, 1e30, 1e300, 2.0, 2.5}) {
    INFO("value " << x);
    expect_format_invalid(path, [&](json& h) { h["shape"]["num_layers"] = x; },
                          "header: shape.num_layers: expected an integer in [1, 4096], got ");
    expect_format_invalid(path, [&](json& h) { h["shape"]["kv_page_tokens"] = x; }, "shape.kv_page_tokens");
    expect_format_invalid(path, [&](json& h) { h["budget"]["tokens"] = x; }, "budget.tokens");
    expect_format_invalid(path, [&](json& h) { h["layers"][0]["tokens"] = x; }, "layers.0.tokens");
    expect_format_invalid(path, [&](json& h) { h["method"]["meta"]["indexed_tokens"]["0"] = x; },
                          "method.meta.indexed_tokens.0");
  }
  // 2^32 + 8 used to load silently as head_dim 8.
  expect_format_invalid(path, [](json& h) { h["shape"]["head_dim"] = uint64_t(4294967304ull); },
                        "shape.head_dim: expected an integer in [8, 256], got 4294967304");
  expect_format_invalid(path, [](json& h) { h["shape"]["num_kv_heads"] = -2; }, "shape.num_kv_heads");
  expect_format_invalid(path, [](json& h) { h["shape"]["num_q_heads"] = true; }, "shape.num_q_heads");
  expect_format_invalid(path, [](json& h) { h["shape"]["num_q_heads"] = "4"; }, "shape.num_q_heads");
  expect_format_invalid(path, [](json& h) { h["shape"]["softmax_scale"] = 1e300; }, "shape.softmax_scale");
  expect_format_invalid(path, [](json& h) { h["shape"]["softmax_scale"] = -1; }, "shape.softmax_scale");
  expect_format_invalid(path, [](json& h) { h["shape"]["kv_dtype"] = "f64"; }, "shape.kv_dtype");
  expect_format_invalid(path, [](json& h) { h["budget"]["fraction"] = 7.5; }, "budget.fraction");
  expect_format_invalid(path, [](json& h) { h["backend"] = 1e20; }, "header: backend");
  expect_format_invalid(path, [](json& h) { h["flags"]["kv_included"] = 1; }, "flags.kv_included");
  expect_format_invalid(path, [](json& h) { h["layers"][1]["index_built"] = "yes"; }, "layers.1.index_built");
  expect_format_invalid(path, [](json& h) { h["layers"].erase(1); }, "header: layers");
  expect_format_invalid(path, [](json& h) { h["shape"].erase("head_dim"); }, "shape.head_dim: missing");
  // Values of the right type that a session refuses are the file's fault too (they were
  // INVALID_ARGUMENT about "params->...").
  expect_format_invalid(path, [](json& h) { h["shape"]["num_q_heads"] = 3; }, "params->num_q_heads");
  expect_format_invalid(path, [](json& h) { h["method"]["params"]["page_size"] = "0"; }, "method.params");
  expect_format_invalid(path, [](json& h) { h["method"]["params"]["page_size"] = "abc"; }, "method.params");
  expect_format_invalid(path, [](json& h) { h["method"]["params"]["bogus"] = "1"; }, "method.params");
  expect_format_invalid(path, [](json& h) { h["method"]["params"]["page_size"] = 16; }, "method.params");
  expect_format_invalid(path, [](json& h) { h["method"]["name"] = "nope"; }, "method.name: unknown method");
  std::remove(path.c_str());
}

TEST_CASE("hardening: every method's loader range-checks its header numbers") {
  Data D(2, 4, 2, 16, 300);
  struct Case {
    const char* method;
    const char* params;
    std::function<void(json&)> edit;
    std::string field;
  };
  const std::vector<Case> cases = {
      {"csattention", "centroids=8", [](json& m) { m["layers"]["0"]["indexed_tokens"] = 1e20; },
       "method.meta.layers.0.indexed_tokens: expected an integer"},
      {"csattention", "centroids=8", [](json& m) { m["layers"]["0"]["list_len"] = 1e9; }, "method.meta.layers.0.list_len"},
      {"csattention", "centroids=8", [](json& m) { m["layers"]["0"]["centroids"] = 9; }, "method.meta.layers.0.centroids"},
      {"ctkvr", nullptr, [](json& m) { m["centroids"] = 640.0; }, "method.meta.centroids: expected an integer"},
      {"ctkvr", nullptr, [](json& m) { m["layers"]["0"]["tokens"] = 1e30; }, "method.meta.layers.0.tokens"},
      {"ctkvr", nullptr, [](json& m) { m["layers"]["0"]["counts"][1] = -1; }, "method.meta.layers.0.counts.1"},
      {"lfps", nullptr, [](json& m) { m["layers"]["0"]["tokens"] = 1e300; }, "method.meta.layers.0.tokens"},
      {"lfps", nullptr, [](json& m) { m["layers"]["0"]["prior_count"] = 1e20; }, "method.meta.layers.0.prior_count"},
      {"hgca", nullptr, [](json& m) { m["layers"]["0"]["window_slots"] = 1e20; }, "method.meta.layers.0.window_slots"},
      {"hgca", nullptr, [](json& m) { m["layers"]["0"]["stash_queries"] = -1; }, "method.meta.layers.0.stash_queries"},
      {"hgca", nullptr, [](json& m) { m["layers"]["0"]["salient"][0] = 1e12; }, "method.meta.layers.0.salient.0"},
      // A non-numeric layer key was INTERNAL ("stoll").
      {"hgca", nullptr, [](json& m) { m["layers"]["x"] = m["layers"]["0"]; }, "method.meta.layers: key 'x' is not a layer"},
      {"hgca", nullptr, [](json& m) { m["layers"]["+1"] = m["layers"]["0"]; }, "key '+1' is not a layer"},
      {"hgca", nullptr, [](json& m) { m["layers"]["99999999999999999999"] = m["layers"]["0"]; }, "is not a layer"},
      {"retroinfer", "update_segment=64,index_min=0,local=16", [](json& m) { m["layers"]["0"]["clusters"] = 1e20; },
       "method.meta.layers.0.clusters"},
      {"retroinfer", "update_segment=64,index_min=0,local=16", [](json& m) { m["layers"]["0"]["chunks"][0]["tokens"][1] = 1e20; },
       "method.meta.layers.0.chunks.0.tokens.1"},
  };
  for (const auto& c : cases) {
    INFO(c.method << ": " << c.field);
    Sess A;
    build(A, D, params(D, c.method, c.params), 300);
    const std::string path = tmp(std::string(c.method) + ".kvt");
    OK(kvs_session_save(A.s, path.c_str(), KVS_SAVE_INCLUDE_KV));
    CHECK(try_load(path).code == KVS_STATUS_OK);
    expect_format_invalid(path, [&](json& h) { c.edit(h["method"]["meta"]); }, c.field);
    std::remove(path.c_str());
  }
}

// Found by the tables fuzzer: a tables-only file whose header gives a layer a token count other
// than the one the method's tables cover (checksums valid). Loaded, prefilled with that many tokens
// and decoded, csattention read out of bounds and lfps, hgca and retroinfer failed with INTERNAL.
TEST_CASE("hardening: a layer's token count in the header must fit the method's tables") {
  Data D(2, 4, 2, 16, 300);
  struct Case {
    const char* method;
    const char* params;
  };
  const std::vector<Case> cases = {{"csattention", "centroids=8"}, {"lfps", nullptr},  {"hgca", nullptr},
                                   {"retroinfer", "update_segment=64,index_min=0,local=16"}, {"ctkvr", nullptr},
                                   {"quest", nullptr}};
  for (const auto& c : cases) {
    Sess A;
    build(A, D, params(D, c.method, c.params), 256);
    const std::string path = tmp(std::string(c.method) + "-tokens.kvt");
    OK(kvs_session_save(A.s, path.c_str(), KVS_SAVE_TABLES));
    CHECK(try_load(path).code == KVS_STATUS_OK);
    for (int64_t n : {int64_t(1), int64_t(36)}) {
      INFO(c.method << ": layers.0.tokens = " << n);
      expect_format_invalid(path, [&](json& h) { h["layers"][0]["tokens"] = n; }, "layers.0.tokens");
    }
    std::remove(path.c_str());
  }
}

// ---------------------------------------------------------------------------------------------
// Finding 4: copy by default, KVS_LOAD_MMAP on request

TEST_CASE("hardening: a default load copies: the file may be rewritten or truncated under the session") {
  Data D(3, 4, 2, 16, 700);
  Sess A;
  build(A, D, params(D, "exact_topk"), 600);
  const std::string path = tmp("copy.kvt");
  OK(kvs_session_save(A.s, path.c_str(), KVS_SAVE_INCLUDE_KV));
  Sess B, M;
  OK(kvs_session_load(path.c_str(), nullptr, &B.s));
  kvs_load_params lp;
  kvs_load_params_init(&lp);
  CHECK(lp.flags == 0);
  lp.flags = KVS_LOAD_MMAP;
  OK(kvs_session_load(path.c_str(), &lp, &M.s));
  kvs_session_stats sb, sm;
  sb.struct_size = sm.struct_size = sizeof sb;
  OK(kvs_session_get_stats(B.s, &sb));
  OK(kvs_session_get_stats(M.s, &sm));
  CHECK(sb.kv_bytes > 0);
  CHECK(sb.kv_shared_bytes == 0);           // copied
  CHECK(sm.kv_shared_bytes == sm.kv_bytes);  // mapped
  {
    // Overwrite the KV payload in place (same size): a mapped session would read the new bytes.
    FILE* f = std::fopen(path.c_str(), "r+b");
    REQUIRE(f);
    std::fseek(f, 0, SEEK_END);
    const long n = std::ftell(f);
    std::vector<char> junk(size_t(n / 2), 0x7f);
    std::fseek(f, n - long(junk.size()), SEEK_SET);
    std::fwrite(junk.data(), 1, junk.size(), f);
    std::fclose(f);
  }
  REQUIRE(::truncate(path.c_str(), 0) == 0);  // a mapped session would die of SIGBUS on its next decode
  std::vector<float> o1, l1, o2, l2;
  for (int64_t t = 600; t < 610; ++t)
    for (uint32_t l = 0; l < 2; ++l) {
      OK(decode(A.s, D, l, t, o1, l1));
      OK(decode(B.s, D, l, t, o2, l2));
      CHECK(std::memcmp(o1.data(), o2.data(), o1.size() * 4) == 0);
      CHECK(std::memcmp(l1.data(), l2.data(), l1.size() * 4) == 0);
    }
  kvs_session_destroy(M.s);  // never decoded: its pages point into the truncated file
  M.s = nullptr;
  std::remove(path.c_str());
}

TEST_CASE("hardening: kvs_load_params: the 0.1.0 struct size is accepted, unknown flags are refused") {
  Data D(4, 2, 1, 16, 64);
  Sess A;
  build(A, D, params(D, "full"), 64);
  const std::string path = tmp("params.kvt");
  OK(kvs_session_save(A.s, path.c_str(), KVS_SAVE_INCLUDE_KV));
  kvs_load_params lp;
  kvs_load_params_init(&lp);
  lp.struct_size = uint32_t(offsetof(kvs_load_params, flags));  // a caller built against 0.1.0
  lp.flags = KVS_LOAD_MMAP;                                       // beyond its struct: not read
  {
    Sess B;
    OK(kvs_session_load(path.c_str(), &lp, &B.s));
    kvs_session_stats st;
    st.struct_size = sizeof st;
    OK(kvs_session_get_stats(B.s, &st));
    CHECK(st.kv_shared_bytes == 0);
  }
  kvs_load_params_init(&lp);
  lp.flags = 6;
  kvs_session_t s = nullptr;
  {
    Err e{kvs_session_load(path.c_str(), &lp, &s)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find("params->flags") != std::string::npos);
  }
  kvs_load_params_init(&lp);
  lp.struct_size = 8;
  {
    Err e{kvs_session_load(path.c_str(), &lp, &s)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find("struct_size") != std::string::npos);
  }
  kvs_load_params_init(&lp);
  lp.backend = 9;
  {
    Err e{kvs_session_load(path.c_str(), &lp, &s)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find("params->backend") != std::string::npos);
  }
  CHECK(s == nullptr);
  std::remove(path.c_str());
}

// ---------------------------------------------------------------------------------------------
// Finding 3: parameters that size memory or time

TEST_CASE("hardening: csattention centroids are clamped to the sampled prompt queries; bounds are refused at creation") {
  Data D(5, 4, 2, 16, 64);
  Sess A;
  const auto t0 = std::chrono::steady_clock::now();
  // 1e6 centroids over a 64-token prompt used to run for minutes.
  build(A, D, params(D, "csattention", "centroids=1000000", 1), 64);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(secs < 30);
  kvs_session_stats st;
  st.struct_size = sizeof st;
  OK(kvs_session_get_stats(A.s, &st));
  // Per KV head: 64 queries x G = 2 rows, so at most 128 centroids per subspace: 2 heads x 128 x 16
  // centroid floats and 2 x 8 x 128 lists of at most 64 entries (4 + 2 bytes).
  CHECK(st.index_bytes <= uint64_t(2 * 128 * 16 * 4 + 2 * 8 * 128 * 64 * 6));
  std::vector<float> o, l;
  OK(decode(A.s, D, 0, 63, o, l));
  // The saved file holds the clamped count and loads again.
  const std::string path = tmp("csa.kvt");
  OK(kvs_session_save(A.s, path.c_str(), KVS_SAVE_INCLUDE_KV));
  CHECK(try_load(path).code == KVS_STATUS_OK);
  std::remove(path.c_str());

  struct Bad {
    const char* method;
    const char* params;
    const char* needle;
  };
  for (const Bad& b : {Bad{"csattention", "subspaces=4294967297", "subspaces: expected 0..16"},
                       Bad{"csattention", "iters=5000", "iters: expected 0..1000"},
                       Bad{"csattention", "centroids=2000000", "centroids: expected 1..1048576"},
                       Bad{"csattention", "sample=100000000", "sample: expected 1..1048576"},
                       Bad{"csattention", "weight_list=1e300:1:1:1:1:1:1:1", "weight_list"},
                       Bad{"ctkvr", "sinks=9223372036854775807", "sinks: expected 0..2147483647"},
                       Bad{"ctkvr", "append_queries=-2", "append_queries"},
                       Bad{"hgca", "window=2000000000", "window: expected 0..1073741824"},
                       Bad{"hgca", "maw_init=1e300", "maw_init"},
                       Bad{"hgca", "heads_per_task=100000", "heads_per_task"},
                       Bad{"retroinfer", "local=9223372036854775807", "local: expected 0..2147483647"},
                       Bad{"retroinfer", "segment_size=-1", "segment_size"}}) {
    INFO(b.method << " " << b.params);
    auto p = params(D, b.method, b.params, 1);
    kvs_session_t s = nullptr;
    Err e{kvs_session_create(&p, &s)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find(b.needle) != std::string::npos);
    CHECK(s == nullptr);
  }
}

TEST_CASE("hardening: window and FIFO memory grows with what they hold, not with the parameter") {
  Data D(6, 4, 2, 16, 80);
  kvs_session_stats st;
  st.struct_size = sizeof st;
  {
    // A window of 2^30 tokens used to allocate its K/V for 2^30 tokens up front.
    Sess A;
    build(A, D, params(D, "hgca", "window=1073741824", 1), 64);
    OK(kvs_session_get_stats(A.s, &st));
    CHECK(st.index_bytes < (uint64_t(1) << 20));
    std::vector<float> o, l;
    for (int64_t t = 64; t < 80; ++t) OK(decode(A.s, D, 0, t, o, l));
  }
  {
    // A FIFO of 2^20 centroids with lists of 128 used to allocate 2^27 list entries per KV head.
    Sess A;
    build(A, D, params(D, "ctkvr", "centroids=1048576,rho=128", 1), 64);
    OK(kvs_session_get_stats(A.s, &st));
    CHECK(st.index_bytes < (uint64_t(4) << 20));
    std::vector<float> o, l;
    for (int64_t t = 64; t < 80; ++t) OK(decode(A.s, D, 0, t, o, l));
  }
  {
    // cluster_align 4096 with one token per cluster asks for 4096 clusters over 64 tokens.
    Sess A;
    build(A, D, params(D, "retroinfer", "cluster_align=4096,cluster_size=1,update_segment=32,index_min=0,local=8,sinks=4", 1), 64);
    OK(kvs_session_get_stats(A.s, &st));
    CHECK(st.index_bytes < (uint64_t(256) << 10));
    std::vector<float> o, l;
    for (int64_t t = 64; t < 80; ++t) OK(decode(A.s, D, 0, t, o, l));
  }
}

// ---------------------------------------------------------------------------------------------
// Finding 6: non-finite inputs on the cpu backend

TEST_CASE("hardening: NaN and Inf in q/k/v are refused on the cpu backend, naming the tensor and element") {
  Data D(7, 4, 2, 16, 200);
  Sess A;
  auto p = params(D, "exact_topk", nullptr, 1);
  OK(kvs_session_create(&p, &A.s));
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  auto tokens = [&] {
    int64_t n = -1;
    OK(kvs_session_layer_tokens(A.s, 0, &n));
    return n;
  };
  {
    // Prefill: element [5, 2, 7] of q (token 5, head 2, dim 7).
    Data P = D;
    P.q[(size_t(5) * D.hq + 2) * D.d + 7] = nan;
    Err e{prefill(A.s, P, 0, 0, 100)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg() == "kvs_session_prefill: q: element [5, 2, 7] is NaN; the cpu backend accepts finite values only");
    CHECK(tokens() == 0);
    P = D;
    P.v[(size_t(99) * D.hkv + 1) * D.d + 15] = -inf;
    Err e2{prefill(A.s, P, 0, 0, 100)};
    CHECK(e2.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e2.msg().find("v: element [99, 1, 15] is -inf") != std::string::npos);
    CHECK(tokens() == 0);
  }
  OK(prefill(A.s, D, 0, 0, 100));
  OK(kvs_session_build_index(A.s, nullptr));
  std::vector<float> o, l, o_ref, l_ref;
  {
    Data P = D;
    P.v[(size_t(100) * D.hkv + 1) * D.d + 3] = inf;  // v_new [1, 3]
    Err e{decode(A.s, P, 0, 100, o, l)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find("kvs_session_decode: v_new: element [1, 3] is +inf") != std::string::npos);
    P = D;
    P.q[size_t(100) * D.hq * D.d] = nan;
    Err e2{decode(A.s, P, 0, 100, o, l)};
    CHECK(e2.msg().find("q: element [0, 0] is NaN") != std::string::npos);
    P = D;
    P.k[size_t(100) * D.hkv * D.d + 17] = nan;
    Err e3{decode(A.s, P, 0, 100, o, l)};
    CHECK(e3.msg().find("k_new: element [1, 1] is NaN") != std::string::npos);
    CHECK(tokens() == 100);
  }
  {
    // fp16 inputs: an fp16 infinity is caught after the conversion too.
    std::vector<uint16_t> q16(size_t(2) * D.hq * D.d, 0x3c00), k16(size_t(2) * D.hkv * D.d, 0x3c00),
        v16(size_t(2) * D.hkv * D.d, 0x3c00);
    k16[size_t(D.hkv) * D.d + 4] = 0x7c00;  // +inf at [1, 0, 4]
    T q(q16.data(), f16(), {2, D.hq, D.d}), k(k16.data(), f16(), {2, D.hkv, D.d}), v(v16.data(), f16(), {2, D.hkv, D.d});
    Err e{kvs_session_append(A.s, 0, &q.t, &k.t, &v.t, nullptr, nullptr)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find("kvs_session_append: k: element [1, 0, 4] is +inf") != std::string::npos);
    CHECK(tokens() == 100);
  }
  // The refused calls changed nothing: the next decode equals a fresh session's.
  Sess R;
  OK(kvs_session_create(&p, &R.s));
  OK(prefill(R.s, D, 0, 0, 100));
  OK(kvs_session_build_index(R.s, nullptr));
  OK(decode(A.s, D, 0, 100, o, l));
  OK(decode(R.s, D, 0, 100, o_ref, l_ref));
  CHECK(std::memcmp(o.data(), o_ref.data(), o.size() * 4) == 0);
  CHECK(std::memcmp(l.data(), l_ref.data(), l.size() * 4) == 0);
  {
    // decode_batch: the element index includes the batch row.
    Sess B;
    OK(kvs_session_fork(A.s, &B.s));
    std::vector<float> q2(size_t(2) * D.hq * D.d), k2(size_t(2) * D.hkv * D.d), v2(k2.size()), o2(q2.size()), l2(size_t(2) * D.hq);
    std::copy(D.qt(101), D.qt(101) + D.hq * D.d, q2.begin());
    std::copy(D.qt(101), D.qt(101) + D.hq * D.d, q2.begin() + D.hq * D.d);
    std::copy(D.kt(101), D.kt(101) + D.hkv * D.d, k2.begin());
    std::copy(D.kt(101), D.kt(101) + D.hkv * D.d, k2.begin() + D.hkv * D.d);
    std::copy(D.vt(101), D.vt(101) + D.hkv * D.d, v2.begin());
    std::copy(D.vt(101), D.vt(101) + D.hkv * D.d, v2.begin() + D.hkv * D.d);
    q2[size_t(D.hq) * D.d + size_t(3) * D.d + 9] = nan;  // [1, 3, 9]
    T q(q2.data(), f32(), {2, D.hq, D.d}), k(k2.data(), f32(), {2, D.hkv, D.d}), v(v2.data(), f32(), {2, D.hkv, D.d});
    T ot(o2.data(), f32(), {2, D.hq, D.d}), lt(l2.data(), f32(), {2, D.hq});
    kvs_session_t ss[2] = {A.s, B.s};
    Err e{kvs_decode_batch(ss, 2, 0, &q.t, &k.t, &v.t, &ot.t, &lt.t, nullptr)};
    CHECK(e.code() == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(e.msg().find("kvs_decode_batch: q: element [1, 3, 9] is NaN") != std::string::npos);
    CHECK(tokens() == 101);
  }
}
