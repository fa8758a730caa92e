// SPDX-License-Identifier: Apache-2.0
// The bad-input matrix of the C API on the cuda placement (issue 22, "the GPU paths get the same
// treatment"), through the public C API only. For sessions with backend = KVS_BACKEND_CUDA, every
// tensor argument of kvs_session_prefill, kvs_session_append, kvs_session_decode, kvs_decode_batch
// and kvs_batch_decode is replaced in turn by:
//   NULL; host memory (KVS_DEVICE_CPU) where device memory is expected; pinned host memory
//   (KVS_DEVICE_CUDA_HOST); a tensor on another device id (device 1: claimed when this machine has
//   one device, real memory there when it has two); a wrong dtype; a non-contiguous layout; data
//   misaligned by 2 bytes (through the pointer and through byte_offset)
// and each call must be refused with INVALID_ARGUMENT (prefill/append's o: UNSUPPORTED, the cuda
// backend computes no prompt outputs) naming the argument. Also: decode, kvs_decode_batch and
// kvs_batch_plan before kvs_session_build_index (INVALID_STATE); batches mixing backends, methods,
// devices or one session twice (kvs_batch_create and kvs_decode_batch refuse); a device id that
// does not exist; a method without a cuda implementation (hgca: UNSUPPORTED, the message
// carrying kvs_method_unsupported_reason's sentence).
//
// No refused call may change state: after every refused call the sessions take their next token
// (the same mode of call, valid tensors) and their outputs are compared with cpu sessions fed the
// same tokens (relative L2 error per query head < 1e-2, lse within 1e-3, natural log); a refused
// prefill leaves the layer's token count as it was (and the decodes after build_index compare the
// KV it would have corrupted).
//
//   kvsieve_backend_error_tests
// Prints PASS/FAIL lines and "N passed, M failed"; exits 77 (skipped) without a CUDA device.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "kvsieve/kvsieve.h"
#include "../cuda/crash_report.hpp"
#include "../cuda/cuda_check.hpp"

namespace {

int g_pass = 0, g_fail = 0;
int g_devices = 0;

void report(bool ok, const std::string& name, const std::string& detail = "") {
  (ok ? g_pass : g_fail)++;
  std::printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.empty() ? "" : ": ", detail.c_str());
  std::fflush(stdout);
}


// A call that must succeed; false (and a FAIL line) otherwise.
bool ok(kvs_error_t e, const std::string& what) {
  if (!e) return true;
  report(false, what, std::string("unexpected error: ") + kvs_error_message(e));
  kvs_error_destroy(e);
  return false;
}

// A call that must be refused with `code` (-1: any code) and a message containing every word.
void refused(kvs_error_t e, int32_t code, const std::vector<std::string>& words, const std::string& what) {
  if (!e) {
    report(false, what, "accepted; expected a refusal");
    return;
  }
  const std::string msg = kvs_error_message(e);
  bool good = code < 0 || kvs_error_code(e) == code;
  for (const auto& w : words) good = good && msg.find(w) != std::string::npos;
  report(good, what + " refused", "code " + std::to_string(kvs_error_code(e)) + ": " + msg);
  kvs_error_destroy(e);
}

const kvs_dtype F32{KVS_DTYPE_CODE_FLOAT, 32, 1}, F16{KVS_DTYPE_CODE_FLOAT, 16, 1}, BF16{KVS_DTYPE_CODE_BFLOAT, 16, 1};

uint16_t f2bf(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
float bf2f(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Device memory with slack (2x + 256 bytes, zeroed), so that a strided or offset view stays inside
// it even if a bug let one through.
struct Dev {
  void* p = nullptr;
  Dev(size_t bytes, int dev = 0) {
    int prev = 0;
    KVS_TEST_CK(cudaGetDevice(&prev));
    KVS_TEST_CK(cudaSetDevice(dev));
    KVS_TEST_CK(cudaMalloc(&p, 2 * bytes + 256));
    KVS_TEST_CK(cudaMemset(p, 0, 2 * bytes + 256));
    KVS_TEST_CK(cudaDeviceSynchronize());  // the sessions' stream does not wait for the legacy one
    KVS_TEST_CK(cudaSetDevice(prev));
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
};

// A kvs_tensor with its own shape/stride storage (copies re-point at their own arrays).
struct Tn {
  kvs_tensor t{};
  int64_t shape[4]{}, strides[4]{};
  Tn() = default;
  Tn(void* data, int32_t dev_type, kvs_dtype dt, std::initializer_list<int64_t> dims) {
    t.data = data;
    t.device = kvs_device{dev_type, 0};
    t.dtype = dt;
    t.ndim = int32_t(dims.size());
    int i = 0;
    for (auto x : dims) shape[i++] = x;
    t.shape = shape;
    t.strides = nullptr;
  }
  Tn(const Tn& o) { *this = o; }
  Tn& operator=(const Tn& o) {
    if (this != &o) {
      t = o.t;
      std::memcpy(shape, o.shape, sizeof shape);
      std::memcpy(strides, o.strides, sizeof strides);
      t.shape = shape;
      t.strides = o.t.strides ? strides : nullptr;
    }
    return *this;
  }
};

// Memory the bad variants point into: host, pinned host and (with two devices) device-1 buffers,
// each larger than any tensor of this test.
constexpr size_t kScratchBytes = size_t(1) << 20;
struct Scratch {
  std::vector<char> host = std::vector<char>(kScratchBytes);
  void* pinned = nullptr;
  Dev* dev1 = nullptr;
};
Scratch* g_scratch = nullptr;

// A bad variant of a valid device tensor: what it is, the tensor (or NULL), the words its refusal
// names.
struct Variant {
  std::string label;
  Tn t;
  bool null = false;
  std::vector<std::string> words;
};

// Every bad variant of `good` (a valid cuda tensor named `name`); `wrong` is a dtype the argument
// does not accept. The variants share good's memory where they keep it on the device.
std::vector<Variant> variants(const Tn& good, const std::string& name, kvs_dtype wrong) {
  std::vector<Variant> v;
  const std::string c = name + ":";
  auto add = [&](const std::string& label, const Tn& t, std::vector<std::string> w, bool null = false) {
    Variant x;
    x.label = label;
    x.t = t;
    x.null = null;
    x.words = std::move(w);
    v.push_back(std::move(x));
  };
  add("NULL", good, {c}, true);
  {
    Tn t = good;
    t.t.data = g_scratch->host.data();
    t.t.device = kvs_device{KVS_DEVICE_CPU, 0};
    add("host pointer (KVS_DEVICE_CPU)", t, {c, "CUDA"});
  }
  {
    Tn t = good;
    t.t.data = g_scratch->pinned;
    t.t.device = kvs_device{KVS_DEVICE_CUDA_HOST, 0};
    add("pinned host pointer (KVS_DEVICE_CUDA_HOST)", t, {c, "CUDA"});
  }
  {
    Tn t = good;
    t.t.device.device_id = 1;
    if (g_scratch->dev1) {
      t.t.data = g_scratch->dev1->p;
      add("memory of device 1", t, {c, "device"});
    } else {
      add("a tensor claiming device 1", t, {c, "device"});
    }
  }
  {
    Tn t = good;
    t.t.dtype = wrong;
    add("wrong dtype", t, {c, "dtype"});
  }
  {
    // The last two dimensions swapped (same footprint), or a stride of 2 for a vector.
    Tn t = good;
    const int n = t.t.ndim;
    int64_t s = 1;
    for (int i = n - 1; i >= 0; --i) {
      t.strides[i] = s;
      s *= t.shape[i];
    }
    if (n >= 2) {
      t.strides[n - 1] = t.shape[n - 2];
      t.strides[n - 2] = 1;
    } else {
      t.strides[0] = 2;
    }
    t.t.strides = t.strides;
    add("non-contiguous strides", t, {c, "contiguous"});
  }
  {
    Tn t = good;
    t.t.data = static_cast<char*>(t.t.data) + 2;
    add("data + 2 bytes (misaligned)", t, {c, "aligned"});
  }
  {
    Tn t = good;
    t.t.byte_offset = 2;
    add("byte_offset 2 (misaligned)", t, {c, "aligned"});
  }
  return v;
}

// ---- sessions and their reference ------------------------------------------------------------

struct Shape {
  int layers = 2, hq = 8, hkv = 2, d = 64;
};
const Shape SH;

// One sequence: q [T, Hq, d] f32, k/v [T, Hkv, d] f32 already rounded to bf16 (both placements
// store the same values), per layer.
struct Seq {
  std::vector<std::vector<float>> q, k, v;
};

Seq random_seq(int64_t T, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  Seq s;
  s.q.resize(size_t(SH.layers));
  s.k.resize(size_t(SH.layers));
  s.v.resize(size_t(SH.layers));
  for (int l = 0; l < SH.layers; ++l) {
    s.q[size_t(l)].resize(size_t(T) * SH.hq * SH.d);
    s.k[size_t(l)].resize(size_t(T) * SH.hkv * SH.d);
    s.v[size_t(l)].resize(size_t(T) * SH.hkv * SH.d);
    for (auto& x : s.q[size_t(l)]) x = nd(rng);
    for (auto& x : s.k[size_t(l)]) x = bf2f(f2bf(nd(rng)));
    for (auto& x : s.v[size_t(l)]) x = bf2f(f2bf(nd(rng)));
    for (int64_t t = 0; t < T; t += 17)  // some keys stand out (sinks, heavy hitters)
      for (int i = 0; i < SH.hkv * SH.d; ++i) {
        float& x = s.k[size_t(l)][size_t(t) * SH.hkv * SH.d + size_t(i)];
        x = bf2f(f2bf(3.f * x));
      }
  }
  return s;
}

std::vector<uint16_t> to_bf16(const float* x, size_t n) {
  std::vector<uint16_t> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = f2bf(x[i]);
  return r;
}

kvs_session_params params(const char* method, int32_t backend, int32_t device_id = 0) {
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = uint32_t(SH.layers);
  p.num_q_heads = uint32_t(SH.hq);
  p.num_kv_heads = uint32_t(SH.hkv);
  p.head_dim = uint32_t(SH.d);
  p.kv_dtype = KVS_SCALAR_BF16;
  p.method = method;
  p.budget = std::strcmp(method, "full") ? 0.25 : 0.0;
  p.backend = backend;
  p.device_id = device_id;
  return p;
}

// A cuda session and the cpu session that takes the same tokens.
struct Pair {
  kvs_session_t gpu = nullptr, cpu = nullptr;
  Seq seq;
  int64_t pos = 0;  // the next token
};

cudaStream_t g_stream;

// Device copies of tokens [t0, t0 + n) of one layer: q f32, k/v bf16 ([n, H, d]).
struct DevChunk {
  Dev q, k, v;
  DevChunk(const Seq& s, int l, int64_t t0, int64_t n)
      : q(size_t(n) * SH.hq * SH.d * 4), k(size_t(n) * SH.hkv * SH.d * 2), v(size_t(n) * SH.hkv * SH.d * 2) {
    const size_t qs = size_t(SH.hq) * SH.d, ks = size_t(SH.hkv) * SH.d;
    KVS_TEST_CK(cudaMemcpy(q.p, s.q[size_t(l)].data() + t0 * qs, size_t(n) * qs * 4, cudaMemcpyHostToDevice));
    auto kb = to_bf16(s.k[size_t(l)].data() + t0 * ks, size_t(n) * ks);
    auto vb = to_bf16(s.v[size_t(l)].data() + t0 * ks, size_t(n) * ks);
    KVS_TEST_CK(cudaMemcpy(k.p, kb.data(), kb.size() * 2, cudaMemcpyHostToDevice));
    KVS_TEST_CK(cudaMemcpy(v.p, vb.data(), vb.size() * 2, cudaMemcpyHostToDevice));
    KVS_TEST_CK(cudaDeviceSynchronize());  // g_stream is non-blocking: the copies must be complete first
  }
};

// Tokens [t0, t1) of every layer into both sessions (prefill or append).
bool add_tokens(Pair& p, int64_t t0, int64_t t1, bool append, const std::string& what) {
  const int64_t n = t1 - t0;
  const size_t qs = size_t(SH.hq) * SH.d, ks = size_t(SH.hkv) * SH.d;
  for (int l = 0; l < SH.layers; ++l) {
    Tn hq(p.seq.q[size_t(l)].data() + t0 * qs, KVS_DEVICE_CPU, F32, {n, SH.hq, SH.d});
    Tn hk(p.seq.k[size_t(l)].data() + t0 * ks, KVS_DEVICE_CPU, F32, {n, SH.hkv, SH.d});
    Tn hv(p.seq.v[size_t(l)].data() + t0 * ks, KVS_DEVICE_CPU, F32, {n, SH.hkv, SH.d});
    DevChunk c(p.seq, l, t0, n);
    Tn dq(c.q.p, KVS_DEVICE_CUDA, F32, {n, SH.hq, SH.d}), dk(c.k.p, KVS_DEVICE_CUDA, BF16, {n, SH.hkv, SH.d}),
        dv(c.v.p, KVS_DEVICE_CUDA, BF16, {n, SH.hkv, SH.d});
    auto fn = append ? kvs_session_append : kvs_session_prefill;
    if (!ok(fn(p.cpu, uint32_t(l), &hq.t, &hk.t, &hv.t, nullptr, nullptr), what + " (cpu)")) return false;
    if (!ok(fn(p.gpu, uint32_t(l), &dq.t, &dk.t, &dv.t, nullptr, g_stream), what + " (cuda)")) return false;
    KVS_TEST_CK(cudaStreamSynchronize(g_stream));
  }
  return true;
}

// The valid device tensors of one decode step of `pairs` (B = pairs.size()), for layer l, filled
// with each pair's next token: q [B, Hq, d] f32, k/v [B, Hkv, d] bf16, o [B, Hq, d] f32 and
// lse [B, Hq] f32 poisoned with NaN. `single` gives the 2-D/1-D views of row 0 instead.
struct Step {
  int B;
  Dev q, k, v, o, lse;
  Tn tq, tk, tv, to, tl;
  Step(const std::vector<Pair*>& pairs, int l, bool single)
      : B(int(pairs.size())),
        q(size_t(B) * SH.hq * SH.d * 4),
        k(size_t(B) * SH.hkv * SH.d * 2),
        v(size_t(B) * SH.hkv * SH.d * 2),
        o(size_t(B) * SH.hq * SH.d * 4),
        lse(size_t(B) * SH.hq * 4) {
    const size_t qs = size_t(SH.hq) * SH.d, ks = size_t(SH.hkv) * SH.d;
    std::vector<float> hq(size_t(B) * qs);
    std::vector<uint16_t> hk(size_t(B) * ks), hv(size_t(B) * ks);
    for (int b = 0; b < B; ++b) {
      const Pair& p = *pairs[size_t(b)];
      std::memcpy(hq.data() + size_t(b) * qs, p.seq.q[size_t(l)].data() + p.pos * int64_t(qs), qs * 4);
      auto kb = to_bf16(p.seq.k[size_t(l)].data() + p.pos * int64_t(ks), ks);
      auto vb = to_bf16(p.seq.v[size_t(l)].data() + p.pos * int64_t(ks), ks);
      std::memcpy(hk.data() + size_t(b) * ks, kb.data(), ks * 2);
      std::memcpy(hv.data() + size_t(b) * ks, vb.data(), ks * 2);
    }
    KVS_TEST_CK(cudaMemcpy(q.p, hq.data(), hq.size() * 4, cudaMemcpyHostToDevice));
    KVS_TEST_CK(cudaMemcpy(k.p, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
    KVS_TEST_CK(cudaMemcpy(v.p, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));
    KVS_TEST_CK(cudaMemset(o.p, 0xff, size_t(B) * qs * 4));
    KVS_TEST_CK(cudaMemset(lse.p, 0xff, size_t(B) * SH.hq * 4));
    KVS_TEST_CK(cudaDeviceSynchronize());  // g_stream is non-blocking: copies and poison must be complete first
    if (single) {
      tq = Tn(q.p, KVS_DEVICE_CUDA, F32, {SH.hq, SH.d});
      tk = Tn(k.p, KVS_DEVICE_CUDA, BF16, {SH.hkv, SH.d});
      tv = Tn(v.p, KVS_DEVICE_CUDA, BF16, {SH.hkv, SH.d});
      to = Tn(o.p, KVS_DEVICE_CUDA, F32, {SH.hq, SH.d});
      tl = Tn(lse.p, KVS_DEVICE_CUDA, F32, {SH.hq});
    } else {
      tq = Tn(q.p, KVS_DEVICE_CUDA, F32, {B, SH.hq, SH.d});
      tk = Tn(k.p, KVS_DEVICE_CUDA, BF16, {B, SH.hkv, SH.d});
      tv = Tn(v.p, KVS_DEVICE_CUDA, BF16, {B, SH.hkv, SH.d});
      to = Tn(o.p, KVS_DEVICE_CUDA, F32, {B, SH.hq, SH.d});
      tl = Tn(lse.p, KVS_DEVICE_CUDA, F32, {B, SH.hq});
    }
  }
  Tn* slot(int i) { return i == 0 ? &tq : i == 1 ? &tk : i == 2 ? &tv : i == 3 ? &to : &tl; }
};

const char* const kSlots[5] = {"q", "k_new", "v_new", "o", "lse"};
const kvs_dtype kWrong[5] = {F16, F32, F32, F16, BF16};  // KV is bf16: q/o take f32 or bf16, lse f32

enum Mode { kSingle = 0, kDecodeBatch = 1, kBatchDecode = 2 };
const char* const kModeName[3] = {"kvs_session_decode", "kvs_decode_batch", "kvs_batch_decode"};

kvs_error_t call(Mode mode, const std::vector<Pair*>& pairs, kvs_batch_t batch, uint32_t layer, const kvs_tensor* q,
                 const kvs_tensor* k, const kvs_tensor* v, const kvs_tensor* o, const kvs_tensor* lse) {
  if (mode == kSingle) return kvs_session_decode(pairs[0]->gpu, layer, q, k, v, o, lse, g_stream);
  if (mode == kDecodeBatch) {
    std::vector<kvs_session_t> hs;
    for (auto* p : pairs) hs.push_back(p->gpu);
    return kvs_decode_batch(hs.data(), hs.size(), layer, q, k, v, o, lse, g_stream);
  }
  return kvs_batch_decode(batch, layer, q, k, v, o, lse, g_stream);
}

// One valid token of every layer through `mode` on the cuda sessions and one by one on the cpu
// sessions; compares; advances. In kBatchDecode mode the caller has planned already (plan_done)
// or it plans here.
bool valid_step(Mode mode, const std::vector<Pair*>& pairs, kvs_batch_t batch, const std::string& label,
                bool plan_done = false) {
  const int B = int(pairs.size());
  const size_t qs = size_t(SH.hq) * SH.d, ks = size_t(SH.hkv) * SH.d;
  double err = 0, lerr = 0;
  if (mode == kBatchDecode && !plan_done && !ok(kvs_batch_plan(batch, g_stream), label + ": kvs_batch_plan")) return false;
  for (int l = 0; l < SH.layers; ++l) {
    Step s(pairs, l, mode == kSingle);
    kvs_error_t e = call(mode, pairs, batch, uint32_t(l), &s.tq.t, &s.tk.t, &s.tv.t, &s.to.t, &s.tl.t);
    if (!ok(e, label + ": valid " + kModeName[mode] + " of layer " + std::to_string(l))) return false;
    KVS_TEST_CK(cudaStreamSynchronize(g_stream));
    std::vector<float> o(size_t(B) * qs), lse(size_t(B) * SH.hq);
    KVS_TEST_CK(cudaMemcpy(o.data(), s.o.p, o.size() * 4, cudaMemcpyDeviceToHost));
    KVS_TEST_CK(cudaMemcpy(lse.data(), s.lse.p, lse.size() * 4, cudaMemcpyDeviceToHost));
    for (int b = 0; b < B; ++b) {
      Pair& p = *pairs[size_t(b)];
      std::vector<float> ro(qs), rl(size_t(SH.hq));
      Tn hq(p.seq.q[size_t(l)].data() + p.pos * int64_t(qs), KVS_DEVICE_CPU, F32, {SH.hq, SH.d});
      Tn hk(p.seq.k[size_t(l)].data() + p.pos * int64_t(ks), KVS_DEVICE_CPU, F32, {SH.hkv, SH.d});
      Tn hv(p.seq.v[size_t(l)].data() + p.pos * int64_t(ks), KVS_DEVICE_CPU, F32, {SH.hkv, SH.d});
      Tn ho(ro.data(), KVS_DEVICE_CPU, F32, {SH.hq, SH.d}), hl(rl.data(), KVS_DEVICE_CPU, F32, {SH.hq});
      if (!ok(kvs_session_decode(p.cpu, uint32_t(l), &hq.t, &hk.t, &hv.t, &ho.t, &hl.t, nullptr), label + ": cpu decode"))
        return false;
      for (int h = 0; h < SH.hq; ++h) {
        double num = 0, den = 0;
        for (int i = 0; i < SH.d; ++i) {
          const double a = o[size_t(b) * qs + size_t(h) * SH.d + size_t(i)], r = ro[size_t(h) * SH.d + size_t(i)];
          num += (a - r) * (a - r);
          den += r * r;
        }
        const double e1 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
        err = std::isfinite(e1) ? std::max(err, e1) : 1e9;
        const double e2 = std::fabs(double(lse[size_t(b) * SH.hq + size_t(h)]) - double(rl[size_t(h)]));
        lerr = std::isfinite(e2) ? std::max(lerr, e2) : 1e9;
      }
    }
  }
  for (auto* p : pairs) ++p->pos;
  const bool good = err < 1e-2 && lerr < 1e-3;
  report(good, label + ": the next " + kModeName[mode] + " matches the cpu sessions",
         "rel err " + std::to_string(err) + ", lse err " + std::to_string(lerr));
  return good;
}

int64_t tokens(kvs_session_t s, uint32_t layer) {
  int64_t n = -1;
  kvs_error_t e = kvs_session_layer_tokens(s, layer, &n);
  kvs_error_destroy(e);
  return n;
}

// ---- the matrix -------------------------------------------------------------------------------

// Prefill (before build_index) or append (after) of 5 tokens to layer 0: each of q, k, v replaced
// by its bad variants, and an o given (host or device: the cuda backend computes no prompt
// outputs): refused; the layer's token count unchanged; after a refused append, the next decode
// step matches the cpu session.
void chunk_matrix(Pair& p, bool append, const std::string& m) {
  const std::string fn = append ? "kvs_session_append" : "kvs_session_prefill";
  auto call_chunk = append ? kvs_session_append : kvs_session_prefill;
  const int64_t n = 5;
  const uint32_t l = 0;
  const char* names[3] = {"q", "k", "v"};
  const kvs_dtype wrong[3] = {F16, F32, F32};
  auto after = [&](const std::string& what, int64_t before) {
    report(tokens(p.gpu, l) == before, what + ": layer tokens unchanged");
    if (append) valid_step(kSingle, {&p}, nullptr, m + ": after " + what);
  };
  for (int slot = 0; slot < 3; ++slot) {
    const size_t count = variants(Tn(nullptr, KVS_DEVICE_CUDA, F32, {1}), "x", F16).size();
    for (size_t i = 0; i < count; ++i) {
      DevChunk c(p.seq, int(l), p.pos, n);
      Tn args[3] = {Tn(c.q.p, KVS_DEVICE_CUDA, F32, {n, SH.hq, SH.d}), Tn(c.k.p, KVS_DEVICE_CUDA, BF16, {n, SH.hkv, SH.d}),
                    Tn(c.v.p, KVS_DEVICE_CUDA, BF16, {n, SH.hkv, SH.d})};
      const Variant x = variants(args[slot], names[slot], wrong[slot])[i];
      args[slot] = x.t;
      const kvs_tensor* a[3] = {&args[0].t, &args[1].t, &args[2].t};
      if (x.null) a[slot] = nullptr;
      const int64_t before = tokens(p.gpu, l);
      const std::string what = m + ": " + fn + " " + names[slot] + ": " + x.label;
      refused(call_chunk(p.gpu, l, a[0], a[1], a[2], nullptr, g_stream), KVS_STATUS_INVALID_ARGUMENT, x.words, what);
      KVS_TEST_CK(cudaStreamSynchronize(g_stream));
      after(what, before);
    }
  }
  for (int dev = 0; dev < 2; ++dev) {
    DevChunk c(p.seq, int(l), p.pos, n);
    Dev od(size_t(n) * SH.hq * SH.d * 4);
    Tn q(c.q.p, KVS_DEVICE_CUDA, F32, {n, SH.hq, SH.d}), k(c.k.p, KVS_DEVICE_CUDA, BF16, {n, SH.hkv, SH.d}),
        v(c.v.p, KVS_DEVICE_CUDA, BF16, {n, SH.hkv, SH.d});
    Tn o = dev ? Tn(od.p, KVS_DEVICE_CUDA, F32, {n, SH.hq, SH.d}) : Tn(g_scratch->host.data(), KVS_DEVICE_CPU, F32, {n, SH.hq, SH.d});
    const std::string what = m + ": " + fn + " o: " + (dev ? "a device tensor" : "host pointer (KVS_DEVICE_CPU)");
    const int64_t before = tokens(p.gpu, l);
    refused(call_chunk(p.gpu, l, &q.t, &k.t, &v.t, &o.t, g_stream), -1, {"o:"}, what);
    KVS_TEST_CK(cudaStreamSynchronize(g_stream));
    after(what, before);
  }
}

// Decode through `mode`: each of q, k_new, v_new, o, lse replaced by its bad variants (lse NULL is
// valid: skipped); refused; then the next valid step (same mode; for kvs_batch_decode under the
// same plan, so the refused call must not have used up layer 0) matches the cpu sessions.
void decode_matrix(Mode mode, const std::vector<Pair*>& pairs, kvs_batch_t batch, const std::string& m) {
  const size_t count = variants(Tn(nullptr, KVS_DEVICE_CUDA, F32, {1}), "x", F16).size();
  for (int slot = 0; slot < 5; ++slot)
    for (size_t i = 0; i < count; ++i) {
      if (mode == kBatchDecode && !ok(kvs_batch_plan(batch, g_stream), m + ": kvs_batch_plan")) return;
      Step s(pairs, 0, mode == kSingle);
      const Variant x = variants(*s.slot(slot), kSlots[slot], kWrong[slot])[i];
      if (x.null && slot == 4) continue;
      const kvs_tensor* a[5] = {&s.tq.t, &s.tk.t, &s.tv.t, &s.to.t, &s.tl.t};
      a[slot] = x.null ? nullptr : &x.t.t;
      const std::string what = m + ": " + kModeName[mode] + " " + kSlots[slot] + ": " + x.label;
      refused(call(mode, pairs, batch, 0, a[0], a[1], a[2], a[3], a[4]), KVS_STATUS_INVALID_ARGUMENT, x.words, what);
      KVS_TEST_CK(cudaStreamSynchronize(g_stream));
      valid_step(mode, pairs, batch, m + ": after " + what, /*plan_done=*/mode == kBatchDecode);
    }
}

// A prefilled, indexed pair of sessions (cuda and cpu) of `method` at position n0.
bool make_pair(Pair& p, const char* method, int64_t n0, int64_t total, uint32_t seed, bool build, const std::string& m) {
  p.seq = random_seq(total, seed);
  auto pg = params(method, KVS_BACKEND_CUDA), pc = params(method, KVS_BACKEND_CPU);
  if (!ok(kvs_session_create(&pg, &p.gpu), m + ": create cuda session") ||
      !ok(kvs_session_create(&pc, &p.cpu), m + ": create cpu session") || !add_tokens(p, 0, n0, false, m + ": prefill"))
    return false;
  p.pos = n0;
  if (!build) return true;
  const bool good = ok(kvs_session_build_index(p.gpu, g_stream), m + ": build_index (cuda)") &&
                    ok(kvs_session_build_index(p.cpu, nullptr), m + ": build_index (cpu)");
  KVS_TEST_CK(cudaStreamSynchronize(g_stream));
  return good;
}

void run_method(const char* method) {
  const std::string m = std::string(method) + " on cuda";
  const int64_t n0 = 150, total = 1200;
  const uint32_t seed = 100u + uint32_t(std::strlen(method)) * 10u;
  Pair P[2];
  auto cleanup = [&] {
    for (auto& p : P) {
      kvs_session_destroy(p.gpu);
      kvs_session_destroy(p.cpu);
    }
  };
  // Prompts: session 0 gets the first half, the prefill matrix, then the second half.
  if (!make_pair(P[0], method, n0 / 2, total, seed, false, m) || !make_pair(P[1], method, n0, total, seed + 1, false, m))
    return cleanup();
  chunk_matrix(P[0], false, m);
  if (!add_tokens(P[0], n0 / 2, n0, false, m + ": prefill second half")) return cleanup();
  P[0].pos = n0;
  std::vector<Pair*> one = {&P[0]}, both = {&P[0], &P[1]};

  // Decode before build_index: refused by every entry point; nothing changes.
  {
    Step s1(one, 0, true), sb(both, 0, false);
    refused(kvs_session_decode(P[0].gpu, 0, &s1.tq.t, &s1.tk.t, &s1.tv.t, &s1.to.t, &s1.tl.t, g_stream),
            KVS_STATUS_INVALID_STATE, {"build_index"}, m + ": kvs_session_decode before build_index");
    kvs_session_t hs[2] = {P[0].gpu, P[1].gpu};
    refused(kvs_decode_batch(hs, 2, 0, &sb.tq.t, &sb.tk.t, &sb.tv.t, &sb.to.t, &sb.tl.t, g_stream),
            KVS_STATUS_INVALID_STATE, {"build_index"}, m + ": kvs_decode_batch before build_index");
    kvs_batch_t early = nullptr;
    if (ok(kvs_batch_create(hs, 2, &early), m + ": kvs_batch_create before build_index (allowed: checked at plan)"))
      refused(kvs_batch_plan(early, g_stream), KVS_STATUS_INVALID_STATE, {"build_index"},
              m + ": kvs_batch_plan before build_index");
    kvs_batch_destroy(early);
    KVS_TEST_CK(cudaStreamSynchronize(g_stream));
    bool same = true;
    for (int l = 0; l < SH.layers; ++l) same = same && tokens(P[0].gpu, uint32_t(l)) == n0 && tokens(P[1].gpu, uint32_t(l)) == n0;
    report(same, m + ": layer tokens unchanged by the calls before build_index");
  }
  for (auto& p : P)
    if (!ok(kvs_session_build_index(p.gpu, g_stream), m + ": build_index (cuda)") ||
        !ok(kvs_session_build_index(p.cpu, nullptr), m + ": build_index (cpu)"))
      return cleanup();
  KVS_TEST_CK(cudaStreamSynchronize(g_stream));
  if (!valid_step(kSingle, one, nullptr, m + ": first step") || !valid_step(kDecodeBatch, both, nullptr, m + ": first batch step"))
    return cleanup();

  // A layer out of range.
  {
    Step s(one, 0, true);
    refused(kvs_session_decode(P[0].gpu, uint32_t(SH.layers), &s.tq.t, &s.tk.t, &s.tv.t, &s.to.t, &s.tl.t, g_stream),
            KVS_STATUS_INVALID_ARGUMENT, {"layer"}, m + ": kvs_session_decode of layer " + std::to_string(SH.layers));
    valid_step(kSingle, one, nullptr, m + ": after a layer out of range");
  }

  decode_matrix(kSingle, one, nullptr, m);
  decode_matrix(kDecodeBatch, both, nullptr, m);
  {
    kvs_session_t hs[2] = {P[0].gpu, P[1].gpu};
    kvs_batch_t batch = nullptr;
    if (ok(kvs_batch_create(hs, 2, &batch), m + ": kvs_batch_create")) {
      decode_matrix(kBatchDecode, both, batch, m);
      // A layer decoded twice under one plan: refused, nothing changes.
      if (ok(kvs_batch_plan(batch, g_stream), m + ": kvs_batch_plan") &&
          valid_step(kBatchDecode, both, batch, m + ": a planned token", /*plan_done=*/true)) {
        Step s(both, 0, false);
        refused(kvs_batch_decode(batch, 0, &s.tq.t, &s.tk.t, &s.tv.t, &s.to.t, &s.tl.t, g_stream), KVS_STATUS_INVALID_STATE,
                {"already decoded"}, m + ": kvs_batch_decode of layer 0 twice under one plan");
        KVS_TEST_CK(cudaStreamSynchronize(g_stream));
        valid_step(kBatchDecode, both, batch, m + ": after a layer decoded twice under one plan");
      }
    }
    kvs_batch_destroy(batch);
  }

  // Batches mixing backends, methods, devices, or one session twice: kvs_batch_create and
  // kvs_decode_batch refuse; the sessions then decode a valid batch correctly.
  {
    const char* other_method = std::strcmp(method, "full") ? "full" : "exact_topk";
    auto po = params(other_method, KVS_BACKEND_CUDA);
    kvs_session_t other = nullptr, dev1 = nullptr;
    ok(kvs_session_create(&po, &other), m + ": create a cuda session of method " + other_method);
    struct Mix {
      std::string label;
      kvs_session_t s[2];
      const char* word;
    };
    std::vector<Mix> mixes = {{"a cuda and a cpu session", {P[0].gpu, P[1].cpu}, "sessions[1]"},
                              {std::string("methods ") + method + " and " + other_method, {P[0].gpu, other}, "sessions[1]"},
                              {"one session twice", {P[0].gpu, P[0].gpu}, "twice"}};
    if (g_devices > 1) {
      auto p1 = params(method, KVS_BACKEND_CUDA, 1);
      if (ok(kvs_session_create(&p1, &dev1), m + ": create a session on device 1"))
        mixes.push_back({"sessions on devices 0 and 1", {P[0].gpu, dev1}, "sessions[1]"});
    }
    for (auto& x : mixes) {
      if (!x.s[1]) continue;
      kvs_batch_t b = nullptr;
      refused(kvs_batch_create(x.s, 2, &b), KVS_STATUS_INVALID_ARGUMENT, {x.word}, m + ": kvs_batch_create of " + x.label);
      report(b == nullptr, m + ": kvs_batch_create of " + x.label + ": no batch returned");
      kvs_batch_destroy(b);
      Step s(both, 0, false);
      refused(kvs_decode_batch(x.s, 2, 0, &s.tq.t, &s.tk.t, &s.tv.t, &s.to.t, &s.tl.t, g_stream), KVS_STATUS_INVALID_ARGUMENT,
              {x.word}, m + ": kvs_decode_batch of " + x.label);
      KVS_TEST_CK(cudaStreamSynchronize(g_stream));
      valid_step(kDecodeBatch, both, nullptr, m + ": after a batch of " + x.label);
    }
    kvs_session_destroy(other);
    kvs_session_destroy(dev1);
  }

  // Appends: each of q, k, v bad and an o given, then a valid append and a step.
  chunk_matrix(P[0], true, m);
  if (add_tokens(P[0], P[0].pos, P[0].pos + 7, true, m + ": a valid append")) {
    P[0].pos += 7;
    valid_step(kSingle, one, nullptr, m + ": after a valid append");
  }
  report(P[0].pos < total && P[1].pos < total, m + ": the test stayed inside its token sequences");
  cleanup();
}

}  // namespace

int main() {
  install_crash_report();
  if (cudaGetDeviceCount(&g_devices) != cudaSuccess || g_devices == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  Scratch scratch;
  KVS_TEST_CK(cudaMallocHost(&scratch.pinned, kScratchBytes));
  std::memset(scratch.pinned, 0, kScratchBytes);
  if (g_devices > 1) scratch.dev1 = new Dev(kScratchBytes / 2, 1);
  g_scratch = &scratch;
  KVS_TEST_CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  std::printf("%d CUDA device(s)\n", g_devices);

  // A device that does not exist, and a method without a cuda implementation.
  {
    auto p = params("full", KVS_BACKEND_CUDA, g_devices);
    kvs_session_t s = nullptr;
    refused(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, {"device_id"},
            "kvs_session_create on device " + std::to_string(g_devices));
    report(s == nullptr, "kvs_session_create on a missing device: no session returned");
    p = params("full", KVS_BACKEND_CUDA, -1);
    refused(kvs_session_create(&p, &s), KVS_STATUS_INVALID_ARGUMENT, {"device_id"}, "kvs_session_create on device -1");
    const char* why = kvs_method_unsupported_reason("hgca", KVS_BACKEND_CUDA);
    report(why != nullptr && std::strlen(why) > 10, "kvs_method_unsupported_reason(hgca, cuda) is a sentence",
           why ? why : "(NULL)");
    p = params("hgca", KVS_BACKEND_CUDA);
    refused(kvs_session_create(&p, &s), KVS_STATUS_UNSUPPORTED, {"hgca", why ? why : "?"},
            "kvs_session_create of hgca on cuda");
    report(s == nullptr, "kvs_session_create of hgca on cuda: no session returned");
    report((kvs_method_backends("hgca") & (1u << KVS_BACKEND_CUDA)) == 0,
           "kvs_method_backends(hgca) has no cuda bit");
  }

  run_method("full");
  run_method("quest");

  cudaStreamDestroy(g_stream);
  cudaFreeHost(scratch.pinned);
  delete scratch.dev1;
  std::printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
