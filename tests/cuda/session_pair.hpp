// SPDX-License-Identifier: Apache-2.0
// A CPU session and a GPU session decoding the same tokens, compared step by step (outputs, LSE,
// selections): shared by the method test files that drive the public C API (csattention,
// retroinfer). Include after capi_check.hpp.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <random>
#include <vector>

#include "capi_check.hpp"
#include "kvsieve/kvsieve.h"

namespace {

struct Seq {
  std::vector<float> q, k, v;
};

// Random tokens with structure the centroids can find: queries and keys drawn around a few shared
// directions (so lists differ in quality), every 29th key louder.
Seq make_seq(int64_t T, int hq, int hkv, int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> dirs(size_t(6) * d);
  for (auto& x : dirs) x = nd(rng);
  Seq s;
  s.q.resize(size_t(T) * hq * d);
  s.k.resize(size_t(T) * hkv * d);
  s.v.resize(size_t(T) * hkv * d);
  for (int64_t t = 0; t < T; ++t) {
    for (int h = 0; h < hq; ++h) {
      const float* u = &dirs[size_t((t + h) % 6) * d];
      for (int i = 0; i < d; ++i) s.q[(size_t(t) * hq + h) * d + i] = 0.8f * u[i] + nd(rng);
    }
    for (int h = 0; h < hkv; ++h) {
      const float* u = &dirs[size_t((t * 7 + h) % 6) * d];
      const float g = t % 29 == 0 ? 3.f : 1.f;
      for (int i = 0; i < d; ++i) s.k[(size_t(t) * hkv + h) * d + i] = g * (0.5f * u[i] + nd(rng));
    }
  }
  for (auto& x : s.v) x = nd(rng);
  return s;
}

struct Cmp {
  double err = 0, lse = 0, min_overlap = 1;
  bool count_equal = true;
  // skip_flips: a session's output is compared only on the steps where its selections equal the
  // CPU's in every KV head (a near-tie at a zone boundary, e.g. retroinfer's retrieved vs estimated
  // clusters, can move a loud key from exact attention to an estimate and the output with it);
  // `flipped` counts the session-steps left out, of `rows`.
  bool skip_flips = false;
  int64_t rows = 0, flipped = 0;
};

// Appends tokens [t0, t1) of seq to `layer`: on the CPU from host fp32, on the GPU from device tensors.
bool add(kvs_session_t s, bool gpu, const Seq& x, int hq, int hkv, int d, kvs_scalar_type kvdt, int64_t t0, int64_t t1,
         bool append, const char* what, uint32_t layer = 0) {
  const int64_t n = t1 - t0;
  std::vector<float> q(x.q.begin() + t0 * hq * d, x.q.begin() + t1 * hq * d);
  std::vector<float> k(x.k.begin() + t0 * hkv * d, x.k.begin() + t1 * hkv * d);
  std::vector<float> v(x.v.begin() + t0 * hkv * d, x.v.begin() + t1 * hkv * d);
  kvs_error_t e;
  if (!gpu) {
    Tensor tq(q.data(), KVS_DEVICE_CPU, F32, {n, hq, d}), tk(k.data(), KVS_DEVICE_CPU, F32, {n, hkv, d}),
        tv(v.data(), KVS_DEVICE_CPU, F32, {n, hkv, d});
    e = append ? kvs_session_append(s, layer, &tq.t, &tk.t, &tv.t, nullptr, nullptr)
               : kvs_session_prefill(s, layer, &tq.t, &tk.t, &tv.t, nullptr, nullptr);
  } else {
    float* dq = upload(q);
    uint16_t* dk = upload(to16(k, kvdt));
    uint16_t* dv = upload(to16(v, kvdt));
    Tensor tq(dq, KVS_DEVICE_CUDA, F32, {n, hq, d}), tk(dk, KVS_DEVICE_CUDA, dt16(kvdt), {n, hkv, d}),
        tv(dv, KVS_DEVICE_CUDA, dt16(kvdt), {n, hkv, d});
    e = append ? kvs_session_append(s, layer, &tq.t, &tk.t, &tv.t, nullptr, nullptr)
               : kvs_session_prefill(s, layer, &tq.t, &tk.t, &tv.t, nullptr, nullptr);
    cudaDeviceSynchronize();
    cudaFree(dq);
    cudaFree(dk);
    cudaFree(dv);
  }
  return ok(e, what);
}

// The keys of s's last step at layer 0, KV head h (kvs_session_last_selection).
std::vector<int32_t> last_keys(kvs_session_t s, uint32_t h, uint32_t layer = 0) {
  size_t n = 0;
  kvs_session_last_selection(s, layer, h, nullptr, 0, &n);
  std::vector<int32_t> keys(n);
  kvs_session_last_selection(s, layer, h, keys.data(), n, &n);
  keys.resize(n);
  return keys;
}

// The step's rows (token pos[b] of seqs[b]: q [B][Hq][d], k, v [B][Hkv][d]) and the CPU sessions'
// decode of them one by one (ref [B][Hq][d], rlse [B][Hq]).
struct StepRows {
  std::vector<float> q, k, v, ref, rlse;
};
StepRows cpu_step(std::vector<kvs_session_t>& cpu, const std::vector<Seq>& seqs, const std::vector<int64_t>& pos, int hq,
                  int hkv, int d) {
  const int B = int(cpu.size());
  StepRows r;
  r.q.resize(size_t(B) * hq * d);
  r.ref.resize(r.q.size());
  r.rlse.resize(size_t(B) * hq);
  r.k.resize(size_t(B) * hkv * d);
  r.v.resize(r.k.size());
  std::vector<float>& hq_ = r.q;
  std::vector<float>& hk = r.k;
  std::vector<float>& hv = r.v;
  std::vector<float>& ref = r.ref;
  std::vector<float>& rlse = r.rlse;
  for (int b = 0; b < B; ++b) {
    const auto& x = seqs[size_t(b)];
    const int64_t t = pos[size_t(b)];
    std::copy(x.q.begin() + t * hq * d, x.q.begin() + (t + 1) * hq * d, hq_.begin() + size_t(b) * hq * d);
    std::copy(x.k.begin() + t * hkv * d, x.k.begin() + (t + 1) * hkv * d, hk.begin() + size_t(b) * hkv * d);
    std::copy(x.v.begin() + t * hkv * d, x.v.begin() + (t + 1) * hkv * d, hv.begin() + size_t(b) * hkv * d);
    Tensor tq(hq_.data() + size_t(b) * hq * d, KVS_DEVICE_CPU, F32, {hq, d});
    Tensor tk(hk.data() + size_t(b) * hkv * d, KVS_DEVICE_CPU, F32, {hkv, d}),
        tv(hv.data() + size_t(b) * hkv * d, KVS_DEVICE_CPU, F32, {hkv, d});
    Tensor to(ref.data() + size_t(b) * hq * d, KVS_DEVICE_CPU, F32, {hq, d}),
        tl(rlse.data() + size_t(b) * hq, KVS_DEVICE_CPU, F32, {hq});
    ok(kvs_session_decode(cpu[size_t(b)], 0, &tq.t, &tk.t, &tv.t, &to.t, &tl.t, nullptr), "decode cpu");
  }
  return r;
}

// The last selections of one layer of two sessions, every KV head (sorted token lists: the CPU's
// the reference) folded into c (counts, overlap, rows, flipped). True when the step's output
// should be compared: the selections agree, or c does not skip flips.
bool compare_selections(kvs_session_t cpu, kvs_session_t gpu, int hkv, uint32_t layer, Cmp& c) {
  bool same = true;
  for (uint32_t h = 0; h < uint32_t(hkv); ++h) {
    const std::vector<int32_t> sc = last_keys(cpu, h, layer), sg = last_keys(gpu, h, layer);
    const size_t nc = sc.size(), ng = sg.size();
    size_t common = 0;
    for (int32_t x : sg) common += std::binary_search(sc.begin(), sc.end(), x);
    c.count_equal &= nc == ng;
    c.min_overlap = std::min(c.min_overlap, nc ? double(common) / double(nc) : 1.0);
    same &= nc == ng && common == nc;
  }
  ++c.rows;
  c.flipped += !same;
  return same || !c.skip_flips;
}

// One decode step of token pos[b] for every session: the CPU one by one, the GPU as one batch.
void step(std::vector<kvs_session_t>& cpu, std::vector<kvs_session_t>& gpu, const std::vector<Seq>& seqs,
          const std::vector<int64_t>& pos, int hq, int hkv, int d, kvs_scalar_type kvdt, cudaStream_t stream, Cmp& c) {
  const int B = int(cpu.size());
  const StepRows r = cpu_step(cpu, seqs, pos, hq, hkv, d);
  std::vector<float> out, lse;
  gpu_decode_batch(gpu, r.q, to16(r.k, kvdt), to16(r.v, kvdt), hq, hkv, d, kvdt, stream, out, lse);
  for (int b = 0; b < B; ++b) {
    if (compare_selections(cpu[size_t(b)], gpu[size_t(b)], hkv, 0, c)) {
      const size_t o = size_t(b) * hq * d, l = size_t(b) * hq;
      fold_errors(std::vector<float>(out.begin() + o, out.begin() + o + size_t(hq) * d),
                  std::vector<float>(r.ref.begin() + o, r.ref.begin() + o + size_t(hq) * d),
                  std::vector<float>(lse.begin() + l, lse.begin() + l + hq),
                  std::vector<float>(r.rlse.begin() + l, r.rlse.begin() + l + hq), d, c.err, c.lse);
    }
  }
}

// Token t of x decoded by a CPU session from host fp32 tensors.
bool decode_cpu(kvs_session_t s, const Seq& x, int64_t t, int hq, int hkv, int d) {
  std::vector<float> q(x.q.begin() + t * hq * d, x.q.begin() + (t + 1) * hq * d);
  std::vector<float> k(x.k.begin() + t * hkv * d, x.k.begin() + (t + 1) * hkv * d);
  std::vector<float> v(x.v.begin() + t * hkv * d, x.v.begin() + (t + 1) * hkv * d);
  std::vector<float> o(size_t(hq) * d), l(hq);
  Tensor tq(q.data(), KVS_DEVICE_CPU, F32, {hq, d}), tk(k.data(), KVS_DEVICE_CPU, F32, {hkv, d}),
      tv(v.data(), KVS_DEVICE_CPU, F32, {hkv, d}), to(o.data(), KVS_DEVICE_CPU, F32, {hq, d}),
      tl(l.data(), KVS_DEVICE_CPU, F32, {hq});
  return ok(kvs_session_decode(s, 0, &tq.t, &tk.t, &tv.t, &to.t, &tl.t, nullptr), "decode cpu");
}

// Token t decoded by `back`, a CPU session (e.g. a GPU session moved back), after `ref`, the CPU
// session that saw the same tokens, decoded it: back's selections against ref's, into r.
void follow(kvs_session_t back, kvs_session_t ref, const Seq& x, int64_t t, int hq, int hkv, int d, Cmp& r) {
  decode_cpu(back, x, t, hq, hkv, d);
  for (uint32_t h = 0; h < uint32_t(hkv); ++h) {
    const std::vector<int32_t> s1 = last_keys(back, h), s2 = last_keys(ref, h);
    const size_t n1 = s1.size(), n2 = s2.size();
    size_t common = 0;
    for (int32_t y : s1) common += std::binary_search(s2.begin(), s2.end(), y);
    r.count_equal &= n1 == n2;
    r.min_overlap = std::min(r.min_overlap, n2 ? double(common) / double(n2) : 1.0);
  }
}

// B pairs of one-layer sessions of `method` (params p, backend set here) over seqs[b]'s first
// n0 + 37 b tokens: the prompt in two chunks on one backend (the cuda backend when gpu_build),
// the index built there, and the other made from it by kvs_session_to (the tables format), so both
// decode with the same index. False (reported) when a call fails.
bool make_pairs(kvs_session_params p, const std::vector<Seq>& seqs, int hq, int hkv, int d, kvs_scalar_type kvdt,
                int64_t n0, bool gpu_build, std::vector<kvs_session_t>& cpu, std::vector<kvs_session_t>& gpu) {
  const size_t B = seqs.size();
  cpu.assign(B, nullptr);
  gpu.assign(B, nullptr);
  for (size_t b = 0; b < B; ++b) {
    const int64_t n = n0 + 37 * int64_t(b);
    kvs_session_t src = nullptr;
    p.backend = gpu_build ? KVS_BACKEND_CUDA : KVS_BACKEND_CPU;
    if (!ok(kvs_session_create(&p, &src), "create")) return false;
    if (!add(src, gpu_build, seqs[b], hq, hkv, d, kvdt, 0, n / 3, false, "prefill") ||
        !add(src, gpu_build, seqs[b], hq, hkv, d, kvdt, n / 3, n, false, "prefill"))
      return false;
    if (!ok(kvs_session_build_index(src, nullptr), "build")) return false;
    kvs_session_t other = nullptr;
    if (!ok(kvs_session_to(src, gpu_build ? KVS_BACKEND_CPU : KVS_BACKEND_CUDA, 0, &other), "kvs_session_to"))
      return false;
    cpu[b] = gpu_build ? other : src;
    gpu[b] = gpu_build ? src : other;
  }
  return true;
}

// `turn` tokens of every sequence appended outside a step on both sides (pos[b] advances).
void append_turn(std::vector<kvs_session_t>& cpu, std::vector<kvs_session_t>& gpu, const std::vector<Seq>& seqs,
                 std::vector<int64_t>& pos, int64_t turn, int hq, int hkv, int d, kvs_scalar_type kvdt) {
  for (size_t b = 0; b < cpu.size(); ++b) {
    add(cpu[b], false, seqs[b], hq, hkv, d, kvdt, pos[b], pos[b] + turn, true, "append cpu");
    add(gpu[b], true, seqs[b], hq, hkv, d, kvdt, pos[b], pos[b] + turn, true, "append cuda");
    pos[b] += turn;
  }
}

// `count` decode steps of every session pair (pos[b] advances by one each step), compared into c.
void run_steps(std::vector<kvs_session_t>& cpu, std::vector<kvs_session_t>& gpu, const std::vector<Seq>& seqs,
               std::vector<int64_t>& pos, int count, int hq, int hkv, int d, kvs_scalar_type kvdt, cudaStream_t stream,
               Cmp& c) {
  for (int s = 0; s < count; ++s) {
    step(cpu, gpu, seqs, pos, hq, hkv, d, kvdt, stream, c);
    for (auto& x : pos) ++x;
  }
}

// Destroys both sides of every pair.
void destroy_pairs(std::vector<kvs_session_t>& cpu, std::vector<kvs_session_t>& gpu) {
  for (kvs_session_t s : cpu) kvs_session_destroy(s);
  for (kvs_session_t s : gpu) kvs_session_destroy(s);
}

}  // namespace
