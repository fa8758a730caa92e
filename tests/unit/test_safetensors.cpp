// SPDX-License-Identifier: Apache-2.0
// Safetensors reader/writer and kvsieve traces (src/io/safetensors.*, src/capi/capi_io.cpp).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "io/safetensors.hpp"
#include "kvsieve/kvsieve.h"

using kvs::DType;
using kvs::io::Piece;
using kvs::io::SafetensorsFile;
using kvs::io::Trace;
using nlohmann::json;

namespace {

struct TempDir {
  std::string path;
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/kvs_st_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    REQUIRE(::mkdtemp(buf.data()) != nullptr);
    path = buf.data();
  }
  ~TempDir() { (void)std::system(("rm -rf '" + path + "'").c_str()); }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

std::vector<uint8_t> read_all(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}
void write_all(const std::string& p, const std::vector<uint8_t>& d) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(d.data()), std::streamsize(d.size()));
}

template <class F>
kvs_status code_of(F&& f, std::string* msg = nullptr) {
  try {
    f();
  } catch (const kvs::Error& e) {
    if (msg) *msg = e.what();
    return e.code();
  }
  return KVS_STATUS_OK;
}

// Raw safetensors bytes from a header string and a data buffer; the header is padded with spaces
// to a multiple of 8 bytes (as the Python package does) unless pad is false.
std::vector<uint8_t> raw_st(std::string header, const std::vector<uint8_t>& data, bool pad = true) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  std::vector<uint8_t> d(8);
  uint64_t n = header.size();
  std::memcpy(d.data(), &n, 8);
  d.insert(d.end(), header.begin(), header.end());
  d.insert(d.end(), data.begin(), data.end());
  return d;
}

// Random values in [-2, 2) stored in dtype t; never all zero.
std::vector<uint8_t> random_tensor(std::mt19937_64& rng, DType t, size_t n) {
  std::vector<uint8_t> v(n * kvs::dtype_size(t));
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  for (size_t i = 0; i < n; ++i) {
    float x = u(rng);
    if (x == 0.f) x = 0.5f;
    kvs::store_from_f32(v.data(), t, i, x);
  }
  return v;
}

std::string golden_dir() {
#ifdef KVS_TEST_DATA_DIR
  return std::string(KVS_TEST_DATA_DIR) + "/golden";
#else
  if (const char* e = std::getenv("KVS_TEST_DATA_DIR")) return std::string(e) + "/golden";
  for (const char* c : {"tests/data", "../tests/data", "../../tests/data", "../../../tests/data"}) {
    struct stat st;
    if (::stat((std::string(c) + "/golden").c_str(), &st) == 0) return std::string(c) + "/golden";
  }
  return "tests/data/golden";
#endif
}

// A small valid trace: 6 layers, layers 0, 2, 5 present, Hq 4, Hkv 2, d 8, T 7, prefill 5.
struct TraceFixture {
  kvs::io::TraceMeta meta;
  DType dtype;
  int64_t T = 7;
  std::vector<uint32_t> layers = {5, 0, 2};
  std::vector<std::vector<uint8_t>> q, k, v;
  std::vector<int32_t> tokens;
  explicit TraceFixture(DType t, uint64_t seed = 1) : dtype(t) {
    meta.num_layers = 6;
    meta.num_q_heads = 4;
    meta.num_kv_heads = 2;
    meta.head_dim = 8;
    meta.prefill_len = 5;
    meta.source = "unit test \"trace\", caf\u00e9";
    std::mt19937_64 rng(seed);
    for (size_t i = 0; i < layers.size(); ++i) {
      q.push_back(random_tensor(rng, t, size_t(T) * 4 * 8));
      k.push_back(random_tensor(rng, t, size_t(T) * 2 * 8));
      v.push_back(random_tensor(rng, t, size_t(T) * 2 * 8));
    }
    for (int i = 0; i < T; ++i) tokens.push_back(1000 + 17 * i);
  }
  void write(const std::string& p, bool with_tokens = true) const {
    std::vector<kvs::io::TraceLayerData> ld;
    for (size_t i = 0; i < layers.size(); ++i) {
      // q split in two pieces to exercise scattered writes.
      const size_t h = q[i].size() / 3;
      ld.push_back({layers[i],
                    {Piece{q[i].data(), h}, Piece{q[i].data() + h, q[i].size() - h}},
                    {Piece{k[i].data(), k[i].size()}},
                    {Piece{v[i].data(), v[i].size()}}});
    }
    kvs::io::write_trace(p, meta, dtype, T, ld, with_tokens ? tokens.data() : nullptr);
  }
};

const char* st_name(DType t) { return t == DType::F32 ? "F32" : t == DType::F16 ? "F16" : "BF16"; }

// A hand-written trace header for malformed-input tests: one layer (0), Hq=Hkv=1, d=2, T=2.
std::string trace_header(const std::string& meta_extra = "", const std::string& q_dtype = "F32",
                         const std::string& q_shape = "[2,1,2]") {
  return std::string("{\"__metadata__\":{\"format\":\"kvsieve-trace\",\"version\":\"1\",\"num_layers\":\"1\","
                     "\"num_q_heads\":\"1\",\"num_kv_heads\":\"1\",\"head_dim\":\"2\",\"prefill_len\":\"1\","
                     "\"layers\":\"0\"") + meta_extra + "},"
         "\"layers.0.q\":{\"dtype\":\"" + q_dtype + "\",\"shape\":" + q_shape + ",\"data_offsets\":[0,16]},"
         "\"layers.0.k\":{\"dtype\":\"F32\",\"shape\":[2,1,2],\"data_offsets\":[16,32]},"
         "\"layers.0.v\":{\"dtype\":\"F32\",\"shape\":[2,1,2],\"data_offsets\":[32,48]}}";
}
std::vector<uint8_t> data48() {
  std::vector<uint8_t> d(48);
  for (size_t i = 0; i < 48; ++i) d[i] = uint8_t(i * 7 + 1);
  return d;
}

}  // namespace

TEST_CASE("trace: write/read round trip in F32, F16 and BF16") {
  for (DType t : {DType::F32, DType::F16, DType::BF16}) {
    CAPTURE(kvs::dtype_name(t));
    TempDir td;
    TraceFixture fx(t, 100 + uint64_t(t));
    fx.meta.softmax_scale = t == DType::F16 ? 0.3f : 0.f;
    const std::string p = td.file("trace.safetensors");
    fx.write(p);
    auto tr = Trace::open(p);
    CHECK(tr->dtype() == t);
    CHECK(tr->total_len() == fx.T);
    CHECK(tr->meta().num_layers == 6);
    CHECK(tr->meta().num_q_heads == 4);
    CHECK(tr->meta().num_kv_heads == 2);
    CHECK(tr->meta().head_dim == 8);
    CHECK(tr->meta().prefill_len == 5);
    CHECK(tr->meta().source == fx.meta.source);
    if (t == DType::F16)
      CHECK(tr->softmax_scale() == 0.3f);
    else
      CHECK(tr->softmax_scale() == doctest::Approx(1.0 / std::sqrt(8.0)));
    CHECK(tr->layers() == std::vector<uint32_t>{0, 2, 5});
    CHECK(tr->has_layer(2));
    CHECK_FALSE(tr->has_layer(1));
    for (size_t i = 0; i < fx.layers.size(); ++i) {
      const std::vector<uint8_t>* want[3] = {&fx.q[i], &fx.k[i], &fx.v[i]};
      const char* nm[3] = {"q", "k", "v"};
      for (int j = 0; j < 3; ++j) {
        auto tt = tr->tensor(fx.layers[i], nm[j]);
        CHECK(tt.dtype == t);
        CHECK(tt.shape[0] == fx.T);
        CHECK(tt.shape[1] == (j == 0 ? 4 : 2));
        CHECK(tt.shape[2] == 8);
        REQUIRE(tt.nbytes == want[j]->size());
        CHECK(std::memcmp(tt.data, want[j]->data(), tt.nbytes) == 0);
        CHECK(reinterpret_cast<uintptr_t>(tt.data) % kvs::dtype_size(t) == 0);
      }
    }
    REQUIRE(tr->tokens() != nullptr);
    CHECK(std::memcmp(tr->tokens(), fx.tokens.data(), fx.tokens.size() * 4) == 0);
    CHECK(code_of([&] { tr->tensor(1, "q"); }) == KVS_STATUS_INVALID_ARGUMENT);
    CHECK(code_of([&] { tr->tensor(0, "o"); }) == KVS_STATUS_INVALID_ARGUMENT);

    // Without tokens.
    fx.write(p, false);
    CHECK(Trace::open(p)->tokens() == nullptr);

    // The file is a plain safetensors file with the documented metadata.
    auto st = SafetensorsFile::open(p);
    CHECK(st->metadata().at("format") == "kvsieve-trace");
    CHECK(st->metadata().at("layers") == "0,2,5");
    CHECK(st->find("layers.2.k")->dtype == st_name(t));
    CHECK(st->find("nothing") == nullptr);
  }
}

TEST_CASE("trace: writer rejects inconsistent input") {
  TempDir td;
  TraceFixture fx(DType::F32);
  const std::string p = td.file("w.safetensors");
  auto code = [&](auto mutate) {
    TraceFixture f2 = fx;
    mutate(f2);
    return code_of([&] { f2.write(p); });
  };
  CHECK(code([](TraceFixture& f) { f.meta.prefill_len = 8; }) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code([](TraceFixture& f) { f.meta.prefill_len = 0; }) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code([](TraceFixture& f) { f.meta.num_kv_heads = 3; }) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code([](TraceFixture& f) { f.layers[0] = 6; }) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code([](TraceFixture& f) { f.layers[0] = 0; }) == KVS_STATUS_INVALID_ARGUMENT);  // twice
  CHECK(code([](TraceFixture& f) { f.k[1].pop_back(); }) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code([](TraceFixture& f) { f.meta.softmax_scale = -1.f; }) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(::access(p.c_str(), F_OK) != 0);  // nothing was written
}

TEST_CASE("safetensors: malformed headers are rejected with the right code") {
  TempDir td;
  const std::string p = td.file("bad.safetensors");
  auto open_code = [&](const std::vector<uint8_t>& bytes, std::string* msg = nullptr) {
    write_all(p, bytes);
    return code_of([&] { Trace::open(p); }, msg);
  };
  std::string msg;
  // The hand-written header is valid to begin with.
  REQUIRE(open_code(raw_st(trace_header(), data48())) == KVS_STATUS_OK);

  CHECK(open_code({}) == KVS_STATUS_FORMAT_TRUNCATED);
  CHECK(open_code({1, 0, 0}) == KVS_STATUS_FORMAT_TRUNCATED);
  CHECK(open_code(raw_st("{\"a\":", {})) == KVS_STATUS_FORMAT_INVALID);       // bad JSON
  CHECK(open_code(raw_st("[1,2]", {})) == KVS_STATUS_FORMAT_INVALID);         // not an object
  CHECK(open_code(raw_st("", {})) == KVS_STATUS_FORMAT_INVALID);
  auto big = raw_st(trace_header(), data48());
  uint64_t huge = uint64_t(1) << 40;
  std::memcpy(big.data(), &huge, 8);
  CHECK(open_code(big) == KVS_STATUS_FORMAT_INVALID);  // above the 100 MB header limit
  huge = 1000;
  std::memcpy(big.data(), &huge, 8);
  CHECK(open_code(big, &msg) == KVS_STATUS_FORMAT_TRUNCATED);

  // Offsets out of range: the data is shorter than the header says.
  auto d = data48();
  d.resize(40);
  CHECK(open_code(raw_st(trace_header(), d), &msg) == KVS_STATUS_FORMAT_TRUNCATED);
  CHECK(msg.find("layers.0.v") != std::string::npos);
  // Trailing data, a hole, overlap.
  d = data48();
  d.push_back(9);
  CHECK(open_code(raw_st(trace_header(), d)) == KVS_STATUS_FORMAT_INVALID);
  std::string h = trace_header();
  h.replace(h.find("[16,32]"), 7, "[20,36]");
  CHECK(open_code(raw_st(h, data48()), &msg) == KVS_STATUS_FORMAT_INVALID);
  h = trace_header();
  h.replace(h.find("[32,48]"), 7, "[28,44]");
  CHECK(open_code(raw_st(h, data48()), &msg) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("overlaps") != std::string::npos);
  h = trace_header();
  h.replace(h.find("[32,48]"), 7, "[48,32]");
  CHECK(open_code(raw_st(h, data48())) == KVS_STATUS_FORMAT_INVALID);
  h = trace_header();
  h.replace(h.find("[32,48]"), 7, "[32,-48]");
  CHECK(open_code(raw_st(h, data48())) == KVS_STATUS_FORMAT_INVALID);
  h = trace_header();
  h.replace(h.find("[32,48]"), 7, "[32,18446744073709551615]");
  CHECK(open_code(raw_st(h, data48())) != KVS_STATUS_OK);

  // Shape/dtype inconsistent with the byte size, unknown dtype, misalignment.
  CHECK(open_code(raw_st(trace_header("", "F16"), data48()), &msg) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("layers.0.q") != std::string::npos);
  CHECK(open_code(raw_st(trace_header("", "F32", "[2,1,3]"), data48())) == KVS_STATUS_FORMAT_INVALID);
  CHECK(open_code(raw_st(trace_header("", "F32", "[2,1,-2]"), data48())) == KVS_STATUS_FORMAT_INVALID);
  CHECK(open_code(raw_st(trace_header("", "F32", "[2,1.5,2]"), data48())) == KVS_STATUS_FORMAT_INVALID);
  CHECK(open_code(raw_st(trace_header("", "Q4"), data48())) == KVS_STATUS_FORMAT_INVALID);
  h = trace_header();
  h.append((8 - h.size() % 8) % 8 + 2, ' ');
  CHECK(open_code(raw_st(h, data48(), false), &msg) == KVS_STATUS_FORMAT_INVALID);  // misaligned
  CHECK(msg.find("aligned") != std::string::npos);

  // Valid safetensors, invalid traces.
  CHECK(open_code(raw_st(trace_header("", "I32"), data48()), &msg) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("expected F32, F16 or BF16") != std::string::npos);
  CHECK(open_code(raw_st(trace_header("", "F32", "[4,1,1]"), data48()), &msg) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("expected [") != std::string::npos);
  h = trace_header();
  h.replace(h.find("kvsieve-trace"), 13, "something-els");
  CHECK(open_code(raw_st(h, data48()), &msg) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("not a kvsieve trace") != std::string::npos);
  h = trace_header();
  h.replace(h.find("\"version\":\"1\""), 13, "\"version\":\"2\"");
  CHECK(open_code(raw_st(h, data48())) == KVS_STATUS_FORMAT_VERSION);
  h = trace_header();
  h.replace(h.find("\"prefill_len\":\"1\""), 17, "\"prefill_len\":\"3\"");
  CHECK(open_code(raw_st(h, data48()), &msg) == KVS_STATUS_FORMAT_INVALID);  // T = 2 < 3
  h = trace_header();
  h.replace(h.find("\"prefill_len\":\"1\""), 17, "\"prefill_len\":\"x\"");
  CHECK(open_code(raw_st(h, data48())) == KVS_STATUS_FORMAT_INVALID);
  h = trace_header();
  h.replace(h.find("\"layers\":\"0\""), 12, "\"layers\":\"1\"");
  CHECK(open_code(raw_st(h, data48())) == KVS_STATUS_FORMAT_INVALID);  // 1 >= num_layers
  h = trace_header();
  h.replace(h.find("\"num_layers\":\"1\""), 16, "\"num_layers\":\"2\"");
  h.replace(h.find("\"layers\":\"0\""), 12, "\"layers\":\"0,1\"");
  CHECK(open_code(raw_st(h, data48()), &msg) == KVS_STATUS_FORMAT_INVALID);  // layer 1 missing
  CHECK(msg.find("layers.1.q") != std::string::npos);
  h = trace_header(",\"softmax_scale\":\"nan\"");
  CHECK(open_code(raw_st(h, data48())) == KVS_STATUS_FORMAT_INVALID);
  h = trace_header(",\"softmax_scale\":\"0.25\"");
  REQUIRE(open_code(raw_st(h, data48())) == KVS_STATUS_OK);
  CHECK(Trace::open(p)->softmax_scale() == 0.25f);
  h = trace_header(",\"extra\":3");
  CHECK(open_code(raw_st(h, data48())) == KVS_STATUS_FORMAT_INVALID);  // metadata values are strings

  // A tensor of an unlisted layer; mixed dtypes; tokens of the wrong dtype.
  h = trace_header();
  h.pop_back();
  h += ",\"layers.3.k\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[48,52]}}";
  auto d52 = data48();
  d52.resize(52, 1);
  CHECK(open_code(raw_st(h, d52), &msg) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("layers.3.k") != std::string::npos);
  h = trace_header();
  h.pop_back();
  h += ",\"tokens\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[48,56]}}";
  auto d56 = data48();
  d56.resize(56, 1);
  CHECK(open_code(raw_st(h, d56), &msg) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("tokens") != std::string::npos);
  h.replace(h.find("\"tokens\":{\"dtype\":\"F32\""), 23, "\"tokens\":{\"dtype\":\"I32\"");
  CHECK(open_code(raw_st(h, d56)) == KVS_STATUS_OK);
  h = trace_header();
  {
    const std::string from = "\"layers.0.k\":{\"dtype\":\"F32\",\"shape\":[2,1,2]";
    h.replace(h.find(from), from.size(), "\"layers.0.k\":{\"dtype\":\"F16\",\"shape\":[2,1,4]");
  }
  CHECK(open_code(raw_st(h, data48()), &msg) == KVS_STATUS_FORMAT_INVALID);
  CHECK(msg.find("one dtype per trace") != std::string::npos);
}

TEST_CASE("trace: random corruption never crashes") {
  TempDir td;
  TraceFixture fx(DType::BF16, 5);
  const std::string p = td.file("t.safetensors"), q = td.file("c.safetensors");
  fx.write(p);
  const auto full = read_all(p);
  std::mt19937_64 rng(99);
  write_all(q, full);
  const int fd = ::open(q.c_str(), O_WRONLY);
  REQUIRE(fd >= 0);
  for (int it = 0; it < 1500; ++it) {
    // Edit in place (rewriting whole files is slow on some CI disks): truncate, or flip bits
    // mostly in the JSON header, where flips change the structure.
    std::vector<size_t> touched;
    if (it % 4 == 0) {
      REQUIRE(::ftruncate(fd, off_t(rng() % full.size())) == 0);
    } else {
      const size_t hl = 8 + size_t(full[0]) + 256 * size_t(full[1]);
      for (int f = 0; f < 1 + int(rng() % 3); ++f) {
        const size_t pos = rng() % hl;
        const uint8_t b = uint8_t(full[pos] ^ (1u << (rng() % 8)));
        REQUIRE(::pwrite(fd, &b, 1, off_t(pos)) == 1);
        touched.push_back(pos);
      }
    }
    try {
      auto tr = Trace::open(q);
      for (uint32_t l : tr->layers()) (void)tr->tensor(l, "v");
    } catch (const kvs::Error&) {
    }
    if (it % 4 == 0) {
      REQUIRE(::pwrite(fd, full.data(), full.size(), 0) == ssize_t(full.size()));
    } else {
      for (size_t pos : touched) REQUIRE(::pwrite(fd, &full[pos], 1, off_t(pos)) == 1);
    }
  }
  ::close(fd);
}

TEST_CASE("trace: C API open/info/tensor/write with strided inputs") {
  TempDir td;
  const std::string p = td.file("c.safetensors");
  const int64_t T = 5, Hq = 2, Hkv = 1, d = 4;
  std::mt19937_64 rng(21);
  // q as a strided view: [T, Hq, d] inside a [T, Hq, 2d] buffer (every other block of d).
  std::vector<uint16_t> qbuf(size_t(T * Hq * 2 * d)), kbuf(size_t(T * Hkv * d)), vbuf(size_t(T * Hkv * d));
  for (auto& x : qbuf) x = kvs::f32_to_bf16(float(int(rng() % 200) - 100) / 16.f + 0.03125f);
  for (auto& x : kbuf) x = kvs::f32_to_bf16(float(int(rng() % 200) - 100) / 16.f + 0.03125f);
  for (auto& x : vbuf) x = kvs::f32_to_bf16(float(int(rng() % 200) - 100) / 16.f + 0.03125f);
  int64_t qshape[3] = {T, Hq, d}, qstr[3] = {Hq * 2 * d, 2 * d, 1};
  int64_t kvshape[3] = {T, Hkv, d};
  const kvs_dtype bf16{KVS_DTYPE_CODE_BFLOAT, 16, 1};
  kvs_tensor qt{qbuf.data(), {KVS_DEVICE_CPU, 0}, 3, bf16, qshape, qstr, 0};
  kvs_tensor kt{kbuf.data(), {KVS_DEVICE_CPU, 0}, 3, bf16, kvshape, nullptr, 0};
  kvs_tensor vt{vbuf.data(), {KVS_DEVICE_CPU, 0}, 3, bf16, kvshape, nullptr, 0};
  std::vector<int32_t> tok = {1, 2, 3, 4, 5};
  int64_t tshape[1] = {T};
  kvs_tensor tokt{tok.data(), {KVS_DEVICE_CPU, 0}, 1, {KVS_DTYPE_CODE_INT, 32, 1}, tshape, nullptr, 0};
  const kvs_tensor* qa[1] = {&qt};
  const kvs_tensor* ka[1] = {&kt};
  const kvs_tensor* va[1] = {&vt};
  const uint32_t layers[1] = {1};

  kvs_trace_info info;
  kvs_trace_info_init(&info);
  CHECK(info.struct_size == sizeof info);
  info.num_layers = 2;
  info.num_q_heads = uint32_t(Hq);
  info.num_kv_heads = uint32_t(Hkv);
  info.head_dim = uint32_t(d);
  info.prefill_len = 3;
  info.dtype = KVS_SCALAR_BF16;
  info.source = "capi";

  auto code = [](kvs_error_t e) {
    int32_t c = kvs_error_code(e);
    kvs_error_destroy(e);
    return c;
  };
  CHECK(code(kvs_trace_write(nullptr, &info, layers, 1, qa, ka, va, nullptr)) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code(kvs_trace_write(p.c_str(), nullptr, layers, 1, qa, ka, va, nullptr)) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code(kvs_trace_write(p.c_str(), &info, nullptr, 1, qa, ka, va, nullptr)) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code(kvs_trace_write(p.c_str(), &info, layers, 1, qa, nullptr, va, nullptr)) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code(kvs_trace_write(p.c_str(), &info, layers, 0, qa, ka, va, nullptr)) == KVS_STATUS_INVALID_ARGUMENT);
  const kvs_tensor* nulla[1] = {nullptr};
  kvs_error_t e = kvs_trace_write(p.c_str(), &info, layers, 1, qa, nulla, va, nullptr);
  CHECK(kvs_error_code(e) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(std::string(kvs_error_message(e)).find("k[0]") != std::string::npos);
  kvs_error_destroy(e);
  info.dtype = KVS_SCALAR_F32;  // tensors are bf16
  e = kvs_trace_write(p.c_str(), &info, layers, 1, qa, ka, va, nullptr);
  CHECK(kvs_error_code(e) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(std::string(kvs_error_message(e)).find("q[0]") != std::string::npos);
  kvs_error_destroy(e);
  info.dtype = KVS_SCALAR_BF16;
  REQUIRE(kvs_trace_write(p.c_str(), &info, layers, 1, qa, ka, va, &tokt) == nullptr);

  kvs_trace_t tr = nullptr;
  CHECK(code(kvs_trace_open(nullptr, &tr)) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code(kvs_trace_open(p.c_str(), nullptr)) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code(kvs_trace_open(td.file("nope").c_str(), &tr)) == KVS_STATUS_IO);
  CHECK(tr == nullptr);
  REQUIRE(kvs_trace_open(p.c_str(), &tr) == nullptr);
  REQUIRE(tr != nullptr);

  kvs_trace_info got;
  CHECK(code(kvs_trace_get_info(tr, nullptr)) == KVS_STATUS_INVALID_ARGUMENT);
  got.struct_size = 4;
  CHECK(code(kvs_trace_get_info(tr, &got)) == KVS_STATUS_INVALID_ARGUMENT);
  kvs_trace_info_init(&got);
  REQUIRE(kvs_trace_get_info(tr, &got) == nullptr);
  CHECK(got.num_layers == 2);
  CHECK(got.num_q_heads == 2);
  CHECK(got.num_kv_heads == 1);
  CHECK(got.head_dim == 4);
  CHECK(got.prefill_len == 3);
  CHECK(got.total_len == T);
  CHECK(got.num_present_layers == 1);
  CHECK(got.softmax_scale == doctest::Approx(0.5));
  CHECK(got.dtype == KVS_SCALAR_BF16);
  CHECK(std::string(got.source) == "capi");

  uint32_t li = 99;
  REQUIRE(kvs_trace_layer_index(tr, 0, &li) == nullptr);
  CHECK(li == 1);
  CHECK(code(kvs_trace_layer_index(tr, 1, &li)) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code(kvs_trace_layer_index(tr, 0, nullptr)) == KVS_STATUS_INVALID_ARGUMENT);

  kvs_tensor out;
  CHECK(code(kvs_trace_tensor(tr, 0, "q", &out)) == KVS_STATUS_INVALID_ARGUMENT);  // layer 0 absent
  CHECK(code(kvs_trace_tensor(tr, 1, "x", &out)) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code(kvs_trace_tensor(tr, 1, nullptr, &out)) == KVS_STATUS_INVALID_ARGUMENT);
  CHECK(code(kvs_trace_tensor(nullptr, 1, "q", &out)) == KVS_STATUS_INVALID_ARGUMENT);
  REQUIRE(kvs_trace_tensor(tr, 1, "q", &out) == nullptr);
  CHECK(out.ndim == 3);
  CHECK(out.shape[0] == T);
  CHECK(out.shape[1] == Hq);
  CHECK(out.shape[2] == d);
  CHECK(out.strides[0] == Hq * d);
  CHECK(out.strides[2] == 1);
  CHECK(out.dtype.code == KVS_DTYPE_CODE_BFLOAT);
  CHECK(out.device.device_type == KVS_DEVICE_CPU);
  const auto* qd = static_cast<const uint16_t*>(out.data);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t j = 0; j < d; ++j)
        CHECK(qd[(t * Hq + h) * d + j] == qbuf[size_t(t * qstr[0] + h * qstr[1] + j)]);
  kvs_tensor ko;
  REQUIRE(kvs_trace_tensor(tr, 1, "k", &ko) == nullptr);
  CHECK(ko.shape[1] == Hkv);
  CHECK(std::memcmp(ko.data, kbuf.data(), kbuf.size() * 2) == 0);
  CHECK(out.shape[1] == Hq);  // views do not share mutable storage between q and k
  kvs_tensor tk;
  REQUIRE(kvs_trace_tensor(tr, 0, "tokens", &tk) == nullptr);
  CHECK(tk.ndim == 1);
  CHECK(tk.dtype.code == KVS_DTYPE_CODE_INT);
  CHECK(std::memcmp(tk.data, tok.data(), tok.size() * 4) == 0);
  kvs_trace_destroy(tr);
  kvs_trace_destroy(nullptr);
}

TEST_CASE("trace: a file written by Python's safetensors package reads") {
  // Generated by the script in docs/formats.md ("Golden files"): numpy float16, safetensors 0.8.
  const std::string p = golden_dir() + "/trace_v1_python.safetensors";
  INFO("golden file " << p);
  auto tr = Trace::open(p);
  CHECK(tr->dtype() == DType::F16);
  CHECK(tr->meta().num_layers == 3);
  CHECK(tr->layers() == std::vector<uint32_t>{0, 2});
  CHECK(tr->total_len() == 6);
  CHECK(tr->meta().prefill_len == 4);
  CHECK(tr->meta().num_q_heads == 4);
  CHECK(tr->meta().num_kv_heads == 2);
  CHECK(tr->meta().head_dim == 8);
  CHECK(tr->meta().source == "python golden");
  CHECK(tr->softmax_scale() == doctest::Approx(0.35));
  REQUIRE(tr->tokens() != nullptr);
  for (int i = 0; i < 6; ++i) CHECK(tr->tokens()[i] == 100 + i);
  // Values: layers.{l}.{q,k,v}[t, h, j] = ((l*7 + c*3 + t*5 + h*11 + j) % 17 - 8) / 4, c = 0, 1, 2.
  const char* nm[3] = {"q", "k", "v"};
  for (uint32_t l : tr->layers())
    for (int c = 0; c < 3; ++c) {
      auto tt = tr->tensor(l, nm[c]);
      const auto* h16 = static_cast<const uint16_t*>(tt.data);
      for (int64_t t = 0; t < tt.shape[0]; ++t)
        for (int64_t h = 0; h < tt.shape[1]; ++h)
          for (int64_t j = 0; j < tt.shape[2]; ++j) {
            const float want = float((int64_t(l) * 7 + c * 3 + t * 5 + h * 11 + j) % 17 - 8) / 4.f;
            CHECK(kvs::f16_to_f32(h16[(t * tt.shape[1] + h) * tt.shape[2] + j]) == want);
          }
    }
}
