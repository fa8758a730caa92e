// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness of the tables loader (format 1.0; docs/formats.md): the input is written to a
// file, described with kvs_tables_describe and loaded with kvs_session_load on the CPU backend;
// a session that loads is prefilled where its file has no KV (the lengths the header names) and
// decodes one step of its first layers, so the loaded index tables are used, not only parsed. A
// file that loads is loaded again memory-mapped (KVS_LOAD_MMAP), which must give the same results.
//
// Checksums are repaired before the file is written (preamble, JSON header, directory and every
// payload that lies inside the input): a mutated byte would otherwise stop almost every input at
// the first checksum, and the checks behind them (JSON header fields, section contents) are where
// the parsers can go wrong. The checksum checks themselves are covered bit by bit in
// tests/unit/test_tables.cpp. Inputs that are not "KVSV" files are written as they are.
// Seeds: files written by `kvsieve build` (tests/fuzz/make_corpus.sh); dictionary: tables.dict.
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "fuzz_common.hpp"

namespace {

uint64_t rd64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
void wr64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}

constexpr size_t kPreamble = 56, kEntry = 64;

// Recomputes every checksum that covers bytes present in the input (see the layout in
// docs/formats.md: preamble, then J JSON bytes, then N directory entries of 64 bytes).
void repair_checksums(std::vector<uint8_t>& f) {
  if (f.size() < kPreamble || std::memcmp(f.data(), "KVSV", 4) != 0) return;
  const uint64_t J = rd64(&f[16]), N = rd64(&f[24]);
  const size_t size = f.size();
  if (J <= size - kPreamble) {
    wr64(&f[32], XXH3_64bits(&f[kPreamble], size_t(J)));
    const size_t dir = kPreamble + size_t(J);
    if (N <= (size - dir) / kEntry) {
      for (uint64_t i = 0; i < N; ++i) {
        uint8_t* e = &f[dir + size_t(i) * kEntry];
        const uint64_t off = rd64(e + 40), len = rd64(e + 48);
        if (off <= size && len <= size - off) wr64(e + 56, XXH3_64bits(&f[size_t(off)], size_t(len)));
      }
      wr64(&f[40], XXH3_64bits(&f[dir], size_t(N) * kEntry));
    }
  }
  wr64(&f[48], XXH3_64bits(f.data(), 48));
}

// Shape of a file that loaded, from its JSON header (as kvs_tables_describe reports it).
struct Shape {
  uint32_t layers = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  bool with_kv = false;
  std::vector<int64_t> tokens;
};

// Reads the shape; returns a description of what is wrong with it, or "" when it is an integer in
// the documented range everywhere (kvs_session_params: the type it lands in). A file that loads
// must have such a header (issue 22: every number read from a file is range-checked).
std::string read_shape(const char* json, Shape* out) {
  const auto d = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (!d.is_object() || !d.contains("header")) return "kvs_tables_describe's JSON has no header";
  const auto& h = d["header"];
  std::string bad;
  try {
    const auto& sh = h.at("shape");
    auto u32 = [&](const char* key, uint32_t lo, uint32_t hi, uint32_t* dst) {
      const auto& v = sh.at(key);
      if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
        bad += std::string(bad.empty() ? "" : ", ") + "shape." + key + " = " + v.dump();
        return;
      }
      *dst = uint32_t(v.get<int64_t>());
    };
    u32("num_layers", 1, 4096, &out->layers);
    u32("num_q_heads", 1, 8192, &out->q_heads);
    u32("num_kv_heads", 1, 1024, &out->kv_heads);
    u32("head_dim", 8, 256, &out->head_dim);
    if (!bad.empty()) return bad;
    out->with_kv = h.at("flags").at("kv_included").get<bool>();
    const auto& layers = h.at("layers");
    if (!layers.is_array() || layers.size() != out->layers) return "layers does not have num_layers entries";
    for (const auto& l : layers) {
      const auto& n = l.at("tokens");
      if (!n.is_number_integer() || n.get<int64_t>() < 0) return "layers[].tokens = " + n.dump();
      out->tokens.push_back(n.get<int64_t>());
    }
  } catch (const nlohmann::json::exception& e) {
    return std::string("header field missing or mistyped: ") + e.what();
  }
  return "";
}

// Prefills the layers a KV-less file left empty (same lengths), then decodes one step of the first
// layers. Returns what came out: each call's status, the outputs and the selection sizes.
// Bounded: small shapes only, so one input stays well under libFuzzer's timeout.
std::vector<float> exercise(kvs_session_t s, const Shape& sh) {
  std::vector<float> out;
  auto status = [&](kvs_error_t err, const char* call) {
    out.push_back(float(kvs_error_code(err)));
    kvs_fuzz::expect_not_internal(err, call);
  };
  const int64_t row_q = int64_t(sh.q_heads) * sh.head_dim;
  if (row_q > 16384) return out;
  const uint32_t layers = std::min<uint32_t>(sh.layers, 4);
  for (uint32_t l = 0; l < layers; ++l) {
    const int64_t n = sh.tokens[l];
    if (!sh.with_kv && n > 0) {
      if (n > (int64_t(1) << 20) / row_q) return out;
      kvs_fuzz::Tensor q({n, sh.q_heads, sh.head_dim}, 1 + l), k({n, sh.kv_heads, sh.head_dim}, 2 + l),
          v({n, sh.kv_heads, sh.head_dim}, 3 + l);
      status(kvs_session_prefill(s, l, &q.t, &k.t, &v.t, nullptr, nullptr), "kvs_session_prefill");
    }
  }
  for (uint32_t l = 0; l < layers; ++l) {
    kvs_fuzz::Tensor q({sh.q_heads, sh.head_dim}, 10 + l), k({sh.kv_heads, sh.head_dim}, 20 + l),
        v({sh.kv_heads, sh.head_dim}, 30 + l), o({sh.q_heads, sh.head_dim}, 0), lse({sh.q_heads}, 0);
    status(kvs_session_decode(s, l, &q.t, &k.t, &v.t, &o.t, &lse.t, nullptr), "kvs_session_decode");
    out.insert(out.end(), o.data.begin(), o.data.end());
    out.insert(out.end(), lse.data.begin(), lse.data.end());
    size_t count = 0;
    status(kvs_session_last_selection(s, l, 0, nullptr, 0, &count), "kvs_session_last_selection");
    out.push_back(float(count));
  }
  kvs_session_stats st;
  st.struct_size = sizeof st;
  status(kvs_session_get_stats(s, &st), "kvs_session_get_stats");
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvs_set_log_callback(nullptr, nullptr, KVS_LOG_OFF);
  kvs_fuzz::scratch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> file(data, data + size);
  repair_checksums(file);
  const std::string& path = kvs_fuzz::scratch().write(file.data(), file.size());

  char* json = nullptr;
  kvs_error_t err = kvs_tables_describe(path.c_str(), &json);
  // The one function that fills its output on error: the JSON must be there either way.
  if (!json) {
    std::fprintf(stderr, "kvs_tables_describe returned no JSON (%s)\n", err ? kvs_error_message(err) : "no error");
    std::abort();
  }
  const bool described = err == nullptr;
  kvs_fuzz::expect_not_internal(err, "kvs_tables_describe");
  Shape shape;
  const std::string shape_error = described ? read_shape(json, &shape) : "not described";
  kvs_string_free(json);

  kvs_load_params lp;
  kvs_load_params_init(&lp);
  lp.backend = KVS_BACKEND_CPU;
  lp.num_threads = 1;
  kvs_session_t s = nullptr;
  err = kvs_session_load(path.c_str(), &lp, &s);
  if (err) {
    if (s) std::abort();  // outputs are untouched on error
    kvs_fuzz::expect_not_internal(err, "kvs_session_load");
    return 0;
  }
  if (!described) {
    std::fprintf(stderr, "kvs_session_load accepted a file kvs_tables_describe rejects\n");
    std::abort();
  }
  if (!shape_error.empty()) {
    std::fprintf(stderr, "kvs_session_load accepted a header with %s\n", shape_error.c_str());
    std::abort();
  }
  const std::vector<float> copied = exercise(s, shape);
  kvs_session_destroy(s);

  // The same file memory-mapped (KVS_LOAD_MMAP) must load and decode exactly as the copy does.
  lp.flags = KVS_LOAD_MMAP;
  s = nullptr;
  err = kvs_session_load(path.c_str(), &lp, &s);
  if (err) {
    std::fprintf(stderr, "a file that loads copied fails mapped: %s\n", kvs_error_message(err));
    std::abort();
  }
  const std::vector<float> mapped = exercise(s, shape);
  kvs_session_destroy(s);
  if (mapped.size() != copied.size() || std::memcmp(mapped.data(), copied.data(), copied.size() * sizeof(float)) != 0) {
    std::fprintf(stderr, "a mapped load decodes differently from a copied one\n");
    std::abort();
  }
  return 0;
}
