// SPDX-License-Identifier: Apache-2.0
#include "io/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "io/file_util.hpp"

namespace kvs::io {

// Tensor data is handed out as raw pointers into the little-endian file.
static_assert(std::endian::native == std::endian::little, "kvsieve traces need a little-endian host");

using nlohmann::json;

namespace {

// The Python package refuses larger headers too (polyglot / memory exhaustion guard).
constexpr uint64_t kMaxHeader = 100'000'000;

std::string where(const std::string& path) { return "safetensors file '" + path + "'"; }

[[noreturn]] void st_fail(kvs_status code, const std::string& path, const std::string& msg) {
  fail(code, where(path) + ": " + msg);
}

bool mul_ok(uint64_t a, uint64_t b, uint64_t& out) { return !__builtin_mul_overflow(a, b, &out); }

const char* st_dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
  }
  return "?";
}

bool dtype_from_st(std::string_view s, DType& out) {
  if (s == "F32") out = DType::F32;
  else if (s == "F16") out = DType::F16;
  else if (s == "BF16") out = DType::BF16;
  else return false;
  return true;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

}  // namespace

size_t safetensors_dtype_size(std::string_view d) {
  if (d == "BOOL" || d == "U8" || d == "I8" || d == "F8_E5M2" || d == "F8_E4M3") return 1;
  if (d == "I16" || d == "U16" || d == "F16" || d == "BF16") return 2;
  if (d == "I32" || d == "U32" || d == "F32") return 4;
  if (d == "I64" || d == "U64" || d == "F64") return 8;
  return 0;
}

int64_t StTensor::numel() const {
  int64_t n = 1;
  for (auto e : shape) n *= e;
  return n;
}

// ------------------------------------------------------------------------------------------------

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  auto map = MappedFile::open(path);
  const std::byte* b = map->data();
  const uint64_t n = map->size();
  if (n < 8)
    st_fail(KVS_STATUS_FORMAT_TRUNCATED, path,
            "file has " + std::to_string(n) + " bytes, expected at least the 8-byte header length");
  uint64_t hlen = 0;
  std::memcpy(&hlen, b, 8);
  if (hlen > kMaxHeader)
    st_fail(KVS_STATUS_FORMAT_INVALID, path,
            "header length " + std::to_string(hlen) + " exceeds the limit of 100000000 bytes");
  if (hlen > n - 8)
    st_fail(KVS_STATUS_FORMAT_TRUNCATED, path,
            "header of " + std::to_string(hlen) + " bytes extends past the end of the file (" +
                std::to_string(n) + " bytes)");
  if (hlen == 0 || char(b[8]) != '{')
    st_fail(KVS_STATUS_FORMAT_INVALID, path, "header must be a JSON object starting with '{'");
  json h;
  try {
    h = json::parse(reinterpret_cast<const char*>(b + 8), reinterpret_cast<const char*>(b + 8 + hlen));
  } catch (const json::exception& e) {
    st_fail(KVS_STATUS_FORMAT_INVALID, path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!h.is_object()) st_fail(KVS_STATUS_FORMAT_INVALID, path, "header must be a JSON object");

  const uint64_t data_start = 8 + hlen;
  const uint64_t data_len = n - data_start;
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object())
        st_fail(KVS_STATUS_FORMAT_INVALID, path, "__metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          st_fail(KVS_STATUS_FORMAT_INVALID, path,
                  "__metadata__." + m.key() + " must be a string, got " + m.value().type_name());
        f->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string tn = "tensor '" + name + "'";
    if (!v.is_object())
      st_fail(KVS_STATUS_FORMAT_INVALID, path, tn + ": expected an object with dtype, shape, data_offsets");
    StTensor t;
    t.name = name;
    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string())
      st_fail(KVS_STATUS_FORMAT_INVALID, path, tn + ": missing string 'dtype'");
    t.dtype = dt->get<std::string>();
    t.elem_size = safetensors_dtype_size(t.dtype);
    if (t.elem_size == 0)
      st_fail(KVS_STATUS_FORMAT_INVALID, path, tn + ": unknown dtype '" + t.dtype + "'");
    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array())
      st_fail(KVS_STATUS_FORMAT_INVALID, path, tn + ": missing array 'shape'");
    uint64_t numel = 1;
    for (auto& e : *sh) {
      if (!e.is_number_unsigned() || e.get<uint64_t>() > uint64_t(INT64_MAX))
        st_fail(KVS_STATUS_FORMAT_INVALID, path, tn + ": shape entries must be non-negative integers");
      const uint64_t x = e.get<uint64_t>();
      if (!mul_ok(numel, x, numel))
        st_fail(KVS_STATUS_FORMAT_INVALID, path, tn + ": shape overflows");
      t.shape.push_back(int64_t(x));
    }
    uint64_t bytes = 0;
    if (!mul_ok(numel, t.elem_size, bytes))
      st_fail(KVS_STATUS_FORMAT_INVALID, path, tn + ": byte size overflows");
    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      st_fail(KVS_STATUS_FORMAT_INVALID, path,
              tn + ": 'data_offsets' must be two non-negative integers [begin, end]");
    t.begin = (*off)[0].get<uint64_t>();
    t.end = (*off)[1].get<uint64_t>();
    if (t.begin > t.end)
      st_fail(KVS_STATUS_FORMAT_INVALID, path,
              tn + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                  "] end before they begin");
    if (t.end - t.begin != bytes)
      st_fail(KVS_STATUS_FORMAT_INVALID, path,
              tn + ": data_offsets span " + std::to_string(t.end - t.begin) + " bytes, but dtype " +
                  t.dtype + " and shape " + shape_str(t.shape) + " need " + std::to_string(bytes));
    if (t.end > data_len)
      st_fail(KVS_STATUS_FORMAT_TRUNCATED, path,
              tn + ": data [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                  ") extends past the end of the data buffer (" + std::to_string(data_len) +
                  " bytes)");
    if ((data_start + t.begin) % t.elem_size != 0)
      st_fail(KVS_STATUS_FORMAT_INVALID, path,
              tn + ": data at file offset " + std::to_string(data_start + t.begin) +
                  " is not aligned to its element size " + std::to_string(t.elem_size));
    t.data = b + data_start + t.begin;
    f->tensors_.push_back(std::move(t));
  }
  // The spec requires the data buffer to be fully indexed, without holes or overlap.
  std::vector<const StTensor*> order;
  for (auto& t : f->tensors_) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* c) {
    return std::tie(a->begin, a->end) < std::tie(c->begin, c->end);
  });
  uint64_t cur = 0;
  for (auto* t : order) {
    if (t->begin < cur)
      st_fail(KVS_STATUS_FORMAT_INVALID, path, "tensor '" + t->name + "' overlaps another tensor");
    if (t->begin > cur)
      st_fail(KVS_STATUS_FORMAT_INVALID, path,
              "data buffer has a hole [" + std::to_string(cur) + ", " + std::to_string(t->begin) +
                  ") before tensor '" + t->name + "'");
    cur = t->end;
  }
  if (cur != data_len)
    st_fail(KVS_STATUS_FORMAT_INVALID, path,
            std::to_string(data_len - cur) + " trailing bytes after the last tensor");
  std::sort(f->tensors_.begin(), f->tensors_.end(),
            [](const StTensor& a, const StTensor& c) { return a.name < c.name; });
  f->map_ = std::move(map);
  return f;
}

const StTensor* SafetensorsFile::find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const StTensor& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

std::string SafetensorsFile::path() const { return map_->path(); }
uint64_t SafetensorsFile::file_size() const { return map_->size(); }

// ------------------------------------------------------------------------------------------------

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

void SafetensorsWriter::add(std::string name, std::string dtype, std::vector<int64_t> shape,
                            std::vector<Piece> pieces) {
  if (name.empty() || name == "__metadata__") invalid("tensor name '" + name + "' is reserved");
  for (auto& t : tensors_)
    if (t.name == name) invalid("tensor '" + name + "' was added twice");
  const size_t es = safetensors_dtype_size(dtype);
  if (es == 0) invalid("tensor '" + name + "': unknown safetensors dtype '" + dtype + "'");
  uint64_t numel = 1, bytes = 0;
  for (auto e : shape) {
    if (e < 0) invalid("tensor '" + name + "': negative extent in shape " + shape_str(shape));
    if (!mul_ok(numel, uint64_t(e), numel)) invalid("tensor '" + name + "': shape overflows");
  }
  if (!mul_ok(numel, es, bytes)) invalid("tensor '" + name + "': byte size overflows");
  uint64_t have = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!pieces[i].data && pieces[i].size)
      invalid("tensor '" + name + "': piece " + std::to_string(i) + " has NULL data");
    have += pieces[i].size;
  }
  if (have != bytes)
    invalid("tensor '" + name + "': " + dtype + " " + shape_str(shape) + " needs " +
            std::to_string(bytes) + " bytes, got " + std::to_string(have));
  tensors_.push_back(Pending{std::move(name), std::move(dtype), std::move(shape), std::move(pieces), bytes, es});
}

void SafetensorsWriter::write_atomic(const std::string& path) {
  std::vector<const Pending*> order;
  for (auto& t : tensors_) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* c) {
    return a->elem_size != c->elem_size ? a->elem_size > c->elem_size : a->name < c->name;
  });
  json h = json::object();
  if (!metadata_.empty()) h["__metadata__"] = metadata_;
  uint64_t off = 0;
  for (auto* t : order) {
    h[t->name] = {{"dtype", t->dtype}, {"shape", t->shape}, {"data_offsets", {off, off + t->nbytes}}};
    off += t->nbytes;
  }
  std::string hs;
  try {
    hs = h.dump();
  } catch (const json::exception& e) {
    invalid(std::string("safetensors header cannot be serialised: ") + e.what());
  }
  // Pad with spaces (allowed by the spec) so the data buffer starts 64-byte aligned.
  hs.append(size_t((64 - (8 + hs.size()) % 64) % 64), ' ');
  const uint64_t hlen = hs.size();
  write_file_atomic(path, [&](FileSink& f) {
    f.write(&hlen, 8);
    f.write(hs.data(), hs.size());
    for (auto* t : order)
      for (auto& p : t->pieces)
        if (p.size) f.write(p.data, p.size);
  });
}

// ------------------------------------------------------------------------------------------------
// Traces

namespace {

const char* kQkv[3] = {"q", "k", "v"};

// Shared by the reader (code FORMAT_INVALID) and the writer (code INVALID_ARGUMENT).
void check_meta(const TraceMeta& m, int64_t T, kvs_status code, const std::string& ctx) {
  auto bad = [&](const std::string& msg) { fail(code, ctx + msg); };
  if (m.num_layers < 1) bad("num_layers must be >= 1");
  if (m.num_q_heads < 1) bad("num_q_heads must be >= 1");
  if (m.num_kv_heads < 1) bad("num_kv_heads must be >= 1");
  if (m.num_q_heads % m.num_kv_heads != 0)
    bad("num_q_heads (" + std::to_string(m.num_q_heads) + ") must be a multiple of num_kv_heads (" +
        std::to_string(m.num_kv_heads) + ")");
  if (m.head_dim < 1) bad("head_dim must be >= 1");
  if (m.prefill_len < 1) bad("prefill_len must be >= 1, is " + std::to_string(m.prefill_len));
  if (T < m.prefill_len)
    bad("total length T = " + std::to_string(T) + " must be >= prefill_len = " +
        std::to_string(m.prefill_len));
  if (!(m.softmax_scale >= 0.f) || !std::isfinite(m.softmax_scale))
    bad("softmax_scale must be finite and > 0 (0 = default)");
}

bool parse_u64(const std::string& s, uint64_t& out) {
  if (s.empty()) return false;
  auto r = std::from_chars(s.data(), s.data() + s.size(), out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size();
}

}  // namespace

std::shared_ptr<Trace> Trace::open(const std::string& path) {
  auto file = SafetensorsFile::open(path);
  const std::string ctx = "trace '" + path + "': ";
  auto bad = [&](const std::string& msg) -> void { fail(KVS_STATUS_FORMAT_INVALID, ctx + msg); };
  const auto& md = file->metadata();
  auto get = [&](const char* key, bool required) -> const std::string* {
    auto it = md.find(key);
    if (it == md.end()) {
      if (required) bad(std::string("__metadata__ lacks '") + key + "'");
      return nullptr;
    }
    return &it->second;
  };
  auto fmt = md.find("format");
  if (fmt == md.end() || fmt->second != "kvsieve-trace")
    bad("not a kvsieve trace: __metadata__.format is " +
        (fmt == md.end() ? std::string("absent") : "'" + fmt->second + "'") +
        ", expected 'kvsieve-trace'");
  const std::string& ver = *get("version", true);
  if (ver != "1")
    fail(KVS_STATUS_FORMAT_VERSION, ctx + "trace version '" + ver + "' is not supported, expected '1'");
  auto get_uint = [&](const char* key, uint64_t max) -> uint64_t {
    const std::string& s = *get(key, true);
    uint64_t v = 0;
    if (!parse_u64(s, v) || v > max)
      bad(std::string("__metadata__.") + key + " = '" + s + "' is not an integer in [0, " +
          std::to_string(max) + "]");
    return v;
  };
  std::shared_ptr<Trace> t(new Trace());
  TraceMeta& m = t->meta_;
  m.num_layers = uint32_t(get_uint("num_layers", 1u << 20));
  m.num_q_heads = uint32_t(get_uint("num_q_heads", 1u << 20));
  m.num_kv_heads = uint32_t(get_uint("num_kv_heads", 1u << 20));
  m.head_dim = uint32_t(get_uint("head_dim", 1u << 20));
  m.prefill_len = int64_t(get_uint("prefill_len", uint64_t(INT64_MAX)));
  if (auto* s = get("softmax_scale", false)) {
    char* end = nullptr;
    float v = std::strtof(s->c_str(), &end);
    if (s->empty() || end != s->c_str() + s->size() || !(v > 0.f) || !std::isfinite(v))
      bad("__metadata__.softmax_scale = '" + *s + "' is not a finite number > 0");
    m.softmax_scale = v;
  }
  if (auto* s = get("source", false)) m.source = *s;

  // layers: comma-separated, unique, each < num_layers, at least one.
  const std::string& ls = *get("layers", true);
  size_t pos = 0;
  while (pos <= ls.size()) {
    size_t comma = ls.find(',', pos);
    if (comma == std::string::npos) comma = ls.size();
    std::string item = ls.substr(pos, comma - pos);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    uint64_t l = 0;
    if (!parse_u64(item, l) || l >= m.num_layers)
      bad("__metadata__.layers = '" + ls + "': entry '" + item + "' is not a layer index below num_layers = " +
          std::to_string(m.num_layers));
    t->layers_.push_back(uint32_t(l));
    pos = comma + 1;
  }
  std::sort(t->layers_.begin(), t->layers_.end());
  if (std::adjacent_find(t->layers_.begin(), t->layers_.end()) != t->layers_.end())
    bad("__metadata__.layers = '" + ls + "' lists a layer twice");

  check_meta(m, INT64_MAX, KVS_STATUS_FORMAT_INVALID, ctx);  // fields alone; T is checked below
  bool have_dtype = false;
  int64_t T = -1;
  for (uint32_t l : t->layers_) {
    std::array<const StTensor*, 3> qkv{};
    for (int i = 0; i < 3; ++i) {
      const std::string name = "layers." + std::to_string(l) + "." + kQkv[i];
      const StTensor* st = file->find(name);
      if (!st) bad("tensor '" + name + "' is missing (layer " + std::to_string(l) + " is listed in __metadata__.layers)");
      DType dt;
      if (!dtype_from_st(st->dtype, dt))
        bad("tensor '" + name + "' has dtype " + st->dtype + ", expected F32, F16 or BF16");
      if (!have_dtype) {
        t->dtype_ = dt;
        have_dtype = true;
      } else if (dt != t->dtype_) {
        bad("tensor '" + name + "' has dtype " + st->dtype + ", but other tensors are " +
            st_dtype_name(t->dtype_) + " (one dtype per trace)");
      }
      const int64_t H = i == 0 ? m.num_q_heads : m.num_kv_heads;
      if (T < 0 && st->shape.size() == 3) T = st->shape[0];
      if (st->shape.size() != 3 || st->shape[0] != T || st->shape[1] != H || st->shape[2] != m.head_dim)
        bad("tensor '" + name + "' has shape " + shape_str(st->shape) + ", expected [" +
            (T < 0 ? std::string("T") : std::to_string(T)) + ", " + std::to_string(H) + ", " +
            std::to_string(m.head_dim) + "]");
      qkv[size_t(i)] = st;
    }
    t->qkv_.push_back(qkv);
  }
  // A layers.{l}.q/k/v tensor for an unlisted layer means the metadata and the tensors disagree.
  for (auto& st : file->tensors()) {
    if (st.name.rfind("layers.", 0) != 0) continue;
    const size_t dot = st.name.find('.', 7);
    if (dot == std::string::npos) continue;
    const std::string suffix = st.name.substr(dot + 1);
    if (suffix != "q" && suffix != "k" && suffix != "v") continue;
    uint64_t l = 0;
    if (parse_u64(st.name.substr(7, dot - 7), l) && l <= UINT32_MAX &&
        std::binary_search(t->layers_.begin(), t->layers_.end(), uint32_t(l)))
      continue;
    bad("tensor '" + st.name + "' belongs to no layer listed in __metadata__.layers = '" + ls + "'");
  }
  t->total_len_ = T;
  if (T < 1) bad("the trace has no tokens (T = 0)");
  check_meta(m, T, KVS_STATUS_FORMAT_INVALID, ctx);
  if (const StTensor* tok = file->find("tokens")) {
    if (tok->dtype != "I32" || tok->shape.size() != 1 || tok->shape[0] != T)
      bad("tensor 'tokens' is " + tok->dtype + " " + shape_str(tok->shape) + ", expected I32 [" +
          std::to_string(T) + "]");
    t->tokens_ = reinterpret_cast<const int32_t*>(tok->data);
  }
  t->file_ = std::move(file);
  return t;
}

float Trace::softmax_scale() const {
  return meta_.softmax_scale > 0.f ? meta_.softmax_scale : 1.f / std::sqrt(float(meta_.head_dim));
}

bool Trace::has_layer(uint32_t layer) const {
  return std::binary_search(layers_.begin(), layers_.end(), layer);
}

TraceTensor Trace::tensor(uint32_t layer, std::string_view name) const {
  auto it = std::lower_bound(layers_.begin(), layers_.end(), layer);
  if (it == layers_.end() || *it != layer)
    invalid("trace '" + path() + "': layer " + std::to_string(layer) + " is not present");
  int i = name == "q" ? 0 : name == "k" ? 1 : name == "v" ? 2 : -1;
  if (i < 0) invalid("trace tensor name '" + std::string(name) + "' must be \"q\", \"k\" or \"v\"");
  const StTensor* st = qkv_[size_t(it - layers_.begin())][size_t(i)];
  TraceTensor r;
  r.data = st->data;
  r.dtype = dtype_;
  for (int j = 0; j < 3; ++j) r.shape[j] = st->shape[size_t(j)];
  r.nbytes = st->nbytes();
  return r;
}

std::string Trace::path() const { return file_->path(); }

void write_trace(const std::string& path, const TraceMeta& meta, DType dtype, int64_t total_len,
                 const std::vector<TraceLayerData>& layers, const int32_t* tokens) {
  const std::string ctx = "trace to write to '" + path + "': ";
  check_meta(meta, total_len, KVS_STATUS_INVALID_ARGUMENT, ctx);
  if (meta.num_layers > (1u << 20) || meta.num_q_heads > (1u << 20) || meta.head_dim > (1u << 20))
    invalid(ctx + "num_layers, head counts and head_dim must be <= 1048576");
  if (layers.empty()) invalid(ctx + "at least one layer is needed");
  SafetensorsWriter w;
  std::vector<uint32_t> idx;
  for (auto& l : layers) {
    if (l.layer >= meta.num_layers)
      invalid(ctx + "layer " + std::to_string(l.layer) + " must be < num_layers = " +
              std::to_string(meta.num_layers));
    idx.push_back(l.layer);
    const std::vector<Piece>* parts[3] = {&l.q, &l.k, &l.v};
    for (int i = 0; i < 3; ++i) {
      const int64_t H = i == 0 ? meta.num_q_heads : meta.num_kv_heads;
      w.add("layers." + std::to_string(l.layer) + "." + kQkv[i], st_dtype_name(dtype),
            {total_len, H, int64_t(meta.head_dim)}, *parts[i]);
    }
  }
  std::sort(idx.begin(), idx.end());
  if (std::adjacent_find(idx.begin(), idx.end()) != idx.end()) invalid(ctx + "a layer appears twice");
  std::string ls;
  for (size_t i = 0; i < idx.size(); ++i) ls += (i ? "," : "") + std::to_string(idx[i]);
  if (tokens) w.add("tokens", "I32", {total_len}, {Piece{tokens, uint64_t(total_len) * 4}});
  w.set_metadata("format", "kvsieve-trace");
  w.set_metadata("version", "1");
  w.set_metadata("num_layers", std::to_string(meta.num_layers));
  w.set_metadata("num_q_heads", std::to_string(meta.num_q_heads));
  w.set_metadata("num_kv_heads", std::to_string(meta.num_kv_heads));
  w.set_metadata("head_dim", std::to_string(meta.head_dim));
  w.set_metadata("prefill_len", std::to_string(meta.prefill_len));
  w.set_metadata("layers", ls);
  if (meta.softmax_scale > 0.f) {
    // Shortest text that reads back as the same float.
    char buf[32];
    for (int prec = 6; prec <= 9; ++prec) {
      std::snprintf(buf, sizeof buf, "%.*g", prec, double(meta.softmax_scale));
      if (std::strtof(buf, nullptr) == meta.softmax_scale) break;
    }
    w.set_metadata("softmax_scale", buf);
  }
  if (!meta.source.empty()) w.set_metadata("source", meta.source);
  w.write_atomic(path);
}

}  // namespace kvs::io
