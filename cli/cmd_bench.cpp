// SPDX-License-Identifier: Apache-2.0
// kvsieve bench --method M --context N ...: decode timing of a method against `full` on synthetic
// data of a given shape, alternating the two in one process, beside the machine's measured read
// bandwidth (docs/perf.md). With --backend cuda (CUDA builds only: KVS_HAVE_CUDA, the CLI
// then links the CUDA runtime) the same on the GPU: random prompt K/V uploaded with cudaMemcpy,
// steps timed with CUDA events after an L2 flush, beside a device-to-device copy's bandwidth.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#ifdef KVS_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "bench.hpp"
#include "commands.hpp"
#include "common.hpp"
#include "membw.hpp"
#include "progress.hpp"
#include "rng.hpp"
#include "synth_model.hpp"

namespace kvcli {

// The command-line checks shared by both paths.
void validate_options(const BenchOptions& o) {
  if (!method_exists(o.method))
    throw UsageError("unknown method '" + o.method + "' (available: " + join(registered_methods(), ", ") + ")");
  if (o.context < 64) throw UsageError("--context must be >= 64");
  if (o.steps < 1) throw UsageError("--steps must be >= 1");
  if (o.warmup < 0) throw UsageError("--warmup must be >= 0");
  if (o.batch < 1 || o.batch > 64) throw UsageError("--batch must be in 1..64");
  if (!(o.budget > 0.0 && o.budget <= 1.0)) throw UsageError("--budget must be in (0, 1]");
  if (o.membw_mib < 0) throw UsageError("--membw-mib must be >= 0");
  if (o.device < 0) throw UsageError("--device must be >= 0");
}

#ifdef KVS_HAVE_CUDA
namespace {
int run_bench_cuda(const BenchOptions& o, DType dtype, unsigned threads, int32_t backend);
}
#endif

// The statistics named in `names` (comma-separated) of session s (nullopt: the method does not
// know the name).
static MethodStats read_method_stats(kvs_session_t s, const std::string& names) {
  MethodStats out;
  for (const auto& name : split(names, ',')) {
    double v = 0;
    kvs_error_t e = kvs_session_method_stat(s, name.c_str(), &v);
    out.emplace_back(name, e == nullptr ? std::optional<double>(v) : std::nullopt);
    kvs_error_destroy(e);
  }
  return out;
}

// "  <method> stats: a=1 b=(unknown)" (nothing without --stats), and the same as a JSON object.
static void print_method_stats(const BenchOptions& o, const MethodStats& st) {
  if (o.stats.empty()) return;
  std::printf("  %s stats:", o.method.c_str());
  for (const auto& [name, v] : st) {
    if (v) std::printf(" %s=%.4g", name.c_str(), *v);
    else std::printf(" %s=(unknown)", name.c_str());
  }
  std::printf("\n");
}
static nlohmann::ordered_json method_stats_json(const MethodStats& st) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [name, v] : st) j[name] = v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr);
  return j;
}

// "one session per kind" or "batches of B sessions per kind (kvs_decode_batch)".
static std::string batch_words(int64_t b) {
  return b == 1 ? std::string("one session per kind")
                : strfmt("batches of %lld sessions per kind (kvs_decode_batch)", static_cast<long long>(b));
}

// The o.batch sessions of each kind, each of which gets its own copy of the prompt: the method's
// (p with o.method and o.params) and `full`'s (p with method "full"), and their handles.
struct BenchSessions {
  std::vector<Session> method, full;
  std::vector<kvs_session_t> handles[2];  // [method, full]
  BenchSessions(const BenchOptions& o, kvs_session_params p) {
    kvs_session_params pf = p;
    p.method = o.method.c_str();
    p.method_params = o.params.empty() ? nullptr : o.params.c_str();
    pf.method = "full";
    const int64_t B = o.batch;
    method.reserve(size_t(B));
    full.reserve(size_t(B));
    for (int64_t b = 0; b < B; ++b) {
      method.emplace_back(p, B == 1 ? o.method : strfmt("%s[%lld]", o.method.c_str(), static_cast<long long>(b)));
      full.emplace_back(pf, B == 1 ? std::string("full") : strfmt("full[%lld]", static_cast<long long>(b)));
      handles[0].push_back(method.back().get());
      handles[1].push_back(full.back().get());
    }
  }
};

SynthTrace bench_data(const BenchOptions& o, DType dtype, unsigned threads) {
  // Structured synthetic data (docs/synth.md), so data-dependent methods see realistic attention.
  SynthConfig cfg;
  cfg.layers = 1;
  cfg.q_heads = o.q_heads;
  cfg.kv_heads = o.kv_heads;
  cfg.head_dim = o.head_dim;
  cfg.prefill = o.context;
  cfg.decode = (o.warmup + o.steps) * o.batch;
  cfg.dtype = dtype;
  cfg.seed = o.seed;
  cfg.segments = uint32_t(std::clamp<int64_t>((o.context - cfg.sinks) / 256, 1, 16));
  validate(cfg);
  Activity busy("generating synthetic data");
  return synth_generate(cfg, threads);
}

BenchTiming bench_cpu(const BenchOptions& o, DType dtype, const SynthTrace& data) {
  BenchTiming r;
  const StridedArray q = data.q(0), k = data.k(0), v = data.v(0);

  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = 1;
  p.num_q_heads = o.q_heads;
  p.num_kv_heads = o.kv_heads;
  p.head_dim = o.head_dim;
  p.kv_dtype = int32_t(dtype);
  p.backend = parse_backend(o.backend);
  p.num_threads = o.threads;
  p.budget = o.budget;
  BenchSessions ss(o, p);
  const int64_t B = o.batch;
  std::vector<Session>&methods = ss.method, &fulls = ss.full;
  Session& method = methods[0];

  const int64_t P = o.context;
  {
    Activity busy("prefill and index build");
    for (int64_t b = 0; b < B; ++b) {
      auto t0 = Clock::now();
      methods[size_t(b)].prefill(0, q.rows_view(0, P), k.rows_view(0, P), v.rows_view(0, P));
      if (b == 0) r.prefill_ms = seconds_since(t0) * 1e3;
      t0 = Clock::now();
      methods[size_t(b)].build_index();
      if (b == 0) r.index_ms = seconds_since(t0) * 1e3;
      fulls[size_t(b)].prefill(0, q.rows_view(0, P), k.rows_view(0, P), v.rows_view(0, P));
      fulls[size_t(b)].build_index();
    }
  }

  const int64_t hq = o.q_heads, d = o.head_dim;
  std::vector<float> out(static_cast<size_t>(B * hq * d)), lse(size_t(B * hq));
  const Tensor o_t = B == 1 ? Tensor(out.data(), DType::F32, {hq, d}) : Tensor(out.data(), DType::F32, {B, hq, d});
  const Tensor lse_t = B == 1 ? Tensor(lse.data(), DType::F32, {hq}) : Tensor(lse.data(), DType::F32, {B, hq});
  // Per-step wall time of the method's phases (session statistics; CPU decode only): streaming
  // update, selection, exact attention; the mean over the batch's sessions.
  static const char* const kPhases[3] = {"decode_update_seconds", "decode_select_seconds", "decode_attend_seconds"};
  auto phase_totals = [&](double* out) {
    for (int p = 0; p < 3; ++p) {
      out[p] = 0;
      for (const Session& s : methods) {
        double x = 0;
        kvs_error_destroy(kvs_session_method_stat(s.get(), kPhases[p], &x));
        out[p] += x / double(B);
      }
    }
  };
  {
    Progress bar("decoding", o.warmup + o.steps);
    for (int64_t i = 0; i < o.warmup + o.steps; ++i) {
      const int64_t t = P + i * B;  // session b decodes token t + b
      const Tensor qt = B == 1 ? q.row_view(t) : q.rows_view(t, B);
      const Tensor kt = B == 1 ? k.row_view(t) : k.rows_view(t, B);
      const Tensor vt = B == 1 ? v.row_view(t) : v.rows_view(t, B);
      // Alternate which goes first, so neither always inherits the other's cache state.
      for (int turn = 0; turn < 2; ++turn) {
        const bool m = (turn == 0) == (i % 2 == 0);
        double before[3], after[3];
        if (m) phase_totals(before);
        const auto t0 = Clock::now();
        if (B == 1) {
          (m ? methods : fulls)[0].decode(0, qt, kt, vt, o_t, &lse_t);
        } else {
          std::vector<kvs_session_t>& h = ss.handles[m ? 0 : 1];
          check(kvs_decode_batch(h.data(), size_t(B), 0, qt.get(), kt.get(), vt.get(), o_t.get(), lse_t.get(), nullptr),
                strfmt("%s: kvs_decode_batch of layer 0", m ? o.method.c_str() : "full"));
        }
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        if (i >= o.warmup) (m ? r.method_us : r.full_us).push_back(us);
        if (m && i >= o.warmup) {
          phase_totals(after);
          for (int p = 0; p < 3; ++p) r.phase_us[p].push_back((after[p] - before[p]) * 1e6);
        }
      }
      bar.advance();
    }
  }
  r.stats = method.stats();
  r.method_stats = read_method_stats(method.get(), o.stats);
  return r;
}

int run_bench(const BenchOptions& o) {
  const int32_t backend = parse_backend(o.backend);
  validate_options(o);
  const DType dtype = parse_dtype(o.dtype);
  const unsigned threads = resolve_threads(o.threads);
  if (backend != KVS_BACKEND_CUDA && o.kv_memory != "cuda")
    throw UsageError("--kv-memory applies to --backend cuda (the cpu backend keeps its KV in host memory)");
  if (backend == KVS_BACKEND_CUDA || backend == KVS_BACKEND_HYBRID) {
    // hybrid: the same driver (device tensors, CUDA events); its `full` reads the KV in pinned
    // host memory over the bus, the floor of any offloaded dense method.
#ifdef KVS_HAVE_CUDA
    return run_bench_cuda(o, dtype, threads, backend);
#else
    throw CliError(
        "bench: --backend " + o.backend + " needs a kvsieve built with CUDA (this CLI was built without the CUDA "
        "runtime, so it cannot allocate device tensors); benchmark CUDA against PyTorch with the drivers "
        "in bench/ (bench/gpu_bench.py; see docs/cli.md)",
        kExitUsage);
#endif
  }

  const SynthTrace data = bench_data(o, dtype, threads);
  const BenchTiming r = bench_cpu(o, dtype, data);
  const int64_t P = o.context;
  const double prefill_ms = r.prefill_ms, index_ms = r.index_ms;
  const std::vector<double>&method_us = r.method_us, &full_us = r.full_us;
  const std::vector<double>* phase_us = r.phase_us;
  const kvs_session_stats st = r.stats;

  double measured = 0;
  if (!o.no_membw) {
    Activity busy("measuring memory read bandwidth");
    const size_t bytes = o.membw_mib > 0 ? size_t(o.membw_mib * 1024 * 1024) : default_bandwidth_bytes();
    measured = measure_read_bandwidth(bytes, threads, 5);
  }

  const double step_us = median(method_us), full_step_us = median(full_us);
  const double es = double(dtype_size(dtype));
  const double row_bytes = double(o.kv_heads) * o.head_dim * 2.0 * es;  // one token's K and V
  const double mean_ctx = double(P + o.warmup) + double(o.steps + 1) / 2.0;
  const double B = double(o.batch);  // a step reads every session's keys
  const double full_bytes = B * mean_ctx * row_bytes;
  const double method_bytes = B * (st.mean_selected_keys * row_bytes + double(st.index_bytes));
  const double achieved = full_step_us > 0 ? full_bytes / (full_step_us * 1e-6) / 1e9 : 0.0;
  const double method_gbps = step_us > 0 ? method_bytes / (step_us * 1e-6) / 1e9 : 0.0;
  const double speedup = step_us > 0 ? full_step_us / step_us : 0.0;

  std::printf("bench %s vs full: context %lld, %u q heads / %u kv heads, d %u, %s, budget %g, %s backend, "
              "%u threads, %s, median of %lld steps after %lld warm-up\n",
              o.method.c_str(), static_cast<long long>(P), o.q_heads, o.kv_heads, o.head_dim,
              dtype_name(dtype), o.budget, o.backend.c_str(), threads, batch_words(o.batch).c_str(),
              static_cast<long long>(o.steps), static_cast<long long>(o.warmup));
  std::printf("  prefill %.1f ms, index build %.1f ms; index %s, KV %s\n", prefill_ms, index_ms,
              human_bytes(double(st.index_bytes)).c_str(), human_bytes(double(st.kv_bytes)).c_str());
  std::printf("  full     %10.1f us/step  reads %s  -> %.1f GB/s", full_step_us,
              human_bytes(full_bytes).c_str(), achieved);
  if (measured > 0) std::printf("  (%.0f%% of the measured %.1f GB/s)", 100.0 * achieved / measured, measured);
  std::printf("\n");
  std::printf("  %-8s %10.1f us/step  reads <= %s (%.0f keys/KV head + index)  -> %.1f GB/s\n",
              o.method.c_str(), step_us, human_bytes(method_bytes).c_str(), st.mean_selected_keys, method_gbps);
  std::printf("  speedup vs full: %.2fx\n", speedup);
  const double ph[3] = {median(phase_us[0]), median(phase_us[1]), median(phase_us[2])};
  const bool have_phases = ph[0] + ph[1] + ph[2] > 0;  // CPU decode only
  if (have_phases)
    std::printf("  %s phases, median us/step%s: update %.1f, select %.1f, attention %.1f\n", o.method.c_str(),
                o.batch > 1 ? " (mean of the sessions)" : "", ph[0], ph[1], ph[2]);
  std::printf("  step time p50 / p99 / mean: full %.1f / %.1f / %.1f us, %s %.1f / %.1f / %.1f us\n", full_step_us,
              percentile(full_us, 99.0), mean(full_us), o.method.c_str(), step_us, percentile(method_us, 99.0),
              mean(method_us));
  print_method_stats(o, r.method_stats);

  if (!o.json.empty()) {
    const nlohmann::ordered_json j = {{"method", o.method},
                              {"params", o.params},
                              {"backend", o.backend},
                              {"threads", threads},
                              {"context", P},
                              {"q_heads", o.q_heads},
                              {"kv_heads", o.kv_heads},
                              {"head_dim", o.head_dim},
                              {"dtype", dtype_name(dtype)},
                              {"budget", o.budget},
                              {"steps", o.steps},
                              {"batch", o.batch},
                              {"step_us", step_us},
                              {"full_step_us", full_step_us},
                              {"step_p99_us", percentile(method_us, 99.0)},
                              {"full_step_p99_us", percentile(full_us, 99.0)},
                              {"step_mean_us", mean(method_us)},
                              {"full_step_mean_us", mean(full_us)},
                              {"speedup_vs_full", speedup},
                              {"update_us", have_phases ? nlohmann::ordered_json(ph[0]) : nlohmann::ordered_json(nullptr)},
                              {"select_us", have_phases ? nlohmann::ordered_json(ph[1]) : nlohmann::ordered_json(nullptr)},
                              {"attention_us", have_phases ? nlohmann::ordered_json(ph[2]) : nlohmann::ordered_json(nullptr)},
                              {"index_build_ms", index_ms},
                              {"achieved_GBps", achieved},
                              {"measured_read_GBps", o.no_membw ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(measured)},
                              {"index_bytes", st.index_bytes},
                              {"kv_bytes", st.kv_bytes},
                              {"stats", method_stats_json(r.method_stats)}};
    write_text_file(o.json, j.dump(2) + "\n");
    std::printf("wrote %s\n", o.json.c_str());
  }
  return kExitOk;
}

bool cuda_device_visible() {
#ifdef KVS_HAVE_CUDA
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
#else
  return false;
#endif
}

namespace {

#ifdef KVS_HAVE_CUDA
// ------------------------------------------------------------------------------------------------
// --backend cuda: the library alone on the GPU, for users without PyTorch (bench/gpu_bench.py
// compares against torch's SDPA). Every CUDA runtime call is checked.
// ------------------------------------------------------------------------------------------------

class CudaStream {
 public:
  CudaStream() { cuda_check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~CudaStream() { cudaStreamDestroy(s_); }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return s_; }
  void sync() const { cuda_check(cudaStreamSynchronize(s_), "cudaStreamSynchronize"); }

 private:
  cudaStream_t s_ = nullptr;
};

// n timing events.
class CudaEvents {
 public:
  explicit CudaEvents(size_t n) : ev_(n, nullptr) {
    for (auto& e : ev_) cuda_check(cudaEventCreate(&e), "cudaEventCreate");
  }
  ~CudaEvents() {
    for (auto e : ev_)
      if (e) cudaEventDestroy(e);
  }
  CudaEvents(const CudaEvents&) = delete;
  CudaEvents& operator=(const CudaEvents&) = delete;
  cudaEvent_t operator[](size_t i) const { return ev_[i]; }

 private:
  std::vector<cudaEvent_t> ev_;
};

double elapsed_us(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  cuda_check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  return double(ms) * 1e3;
}

// A C-contiguous CUDA tensor over borrowed device memory (the kvs_tensor points at its own shape
// array, so it is neither copied nor moved).
class DeviceTensor {
 public:
  DeviceTensor(const void* data, DType dtype, int device, std::initializer_list<int64_t> shape)
      : DeviceTensor(data, dtype, device, std::vector<int64_t>(shape)) {}
  DeviceTensor(const void* data, DType dtype, int device, const std::vector<int64_t>& shape) {
    if (shape.size() > shape_.size()) throw CliError("bench: a device tensor of more than 3 dimensions");
    std::copy(shape.begin(), shape.end(), shape_.begin());
    t_.data = const_cast<void*>(data);
    t_.device = kvs_device{KVS_DEVICE_CUDA, device};
    t_.ndim = int32_t(shape.size());
    t_.dtype = to_dl(dtype);
    t_.shape = shape_.data();
    t_.strides = nullptr;
    t_.byte_offset = 0;
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  const kvs_tensor* get() const { return &t_; }

 private:
  kvs_tensor t_{};
  std::array<int64_t, 3> shape_{};
};

// Fills `n` elements of `dst` (device, dtype t) with independent uniform values of unit variance,
// generated on the host in pieces of kPiece elements (bounded host memory) and copied up on `st`
// (synchronised after each piece: the host buffer is reused, and the copy is complete before any
// later work on `st` reads it). Element i depends only on (seed, what, i / 2^20), not on the
// thread count.
void upload_random(char* dst, size_t n, DType t, uint64_t seed, uint64_t what, unsigned threads, cudaStream_t st) {
  constexpr size_t kBlock = size_t(1) << 20;
  constexpr size_t kPiece = 32 * kBlock;
  const size_t es = dtype_size(t);
  std::vector<char> host(std::min(n, kPiece) * es);
  const double a = std::sqrt(3.0);
  for (size_t p0 = 0; p0 < n; p0 += kPiece) {
    const size_t pn = std::min(kPiece, n - p0);
    parallel_for((pn + kBlock - 1) / kBlock, threads, [&](size_t b) {
      Rng rng(derive_seed(seed, {what, (p0 + b * kBlock) / kBlock}));
      const size_t e = std::min(pn, (b + 1) * kBlock);
      for (size_t i = b * kBlock; i < e; ++i) store_elem(host.data(), t, i, float(rng.uniform(-a, a)));
    });
    cuda_check(cudaMemcpyAsync(dst + p0 * es, host.data(), pn * es, cudaMemcpyHostToDevice, st),
               "cudaMemcpyAsync(upload)");
    cuda_check(cudaStreamSynchronize(st), "cudaStreamSynchronize(upload)");
  }
}

// Random q [q_rows, Hq, d] and k, v [kv_rows, Hkv, d] on the device, from upload_random's streams
// what = {q, k, v} of `seed`.
struct RandomQKV {
  DeviceBuffer q, k, v;
  RandomQKV(int64_t q_rows, int64_t kv_rows, int64_t hq, int64_t hkv, int64_t d, DType t, uint64_t seed,
            std::array<uint64_t, 3> what, unsigned threads, cudaStream_t st, const std::string& label)
      : q(size_t(q_rows * hq * d) * dtype_size(t), ("cudaMalloc(" + label + " q)").c_str()),
        k(size_t(kv_rows * hkv * d) * dtype_size(t), ("cudaMalloc(" + label + " K)").c_str()),
        v(size_t(kv_rows * hkv * d) * dtype_size(t), ("cudaMalloc(" + label + " V)").c_str()) {
    upload_random(q.get(), size_t(q_rows * hq * d), t, seed, what[0], threads, st);
    upload_random(k.get(), size_t(kv_rows * hkv * d), t, seed, what[1], threads, st);
    upload_random(v.get(), size_t(kv_rows * hkv * d), t, seed, what[2], threads, st);
  }
};

// Best of `reps` device-to-device copies of `bytes`, in GB/s counting bytes read and written.
double measure_copy_bandwidth(size_t bytes, cudaStream_t stream, int reps) {
  DeviceBuffer a(bytes, "cudaMalloc(bandwidth probe)"), b(bytes, "cudaMalloc(bandwidth probe)");
  cuda_check(cudaMemsetAsync(a.get(), 1, bytes, stream), "cudaMemsetAsync(bandwidth probe)");
  CudaEvents ev(2);
  double best = 0;
  for (int r = 0; r < reps + 1; ++r) {  // the first pass warms up
    cuda_check(cudaEventRecord(ev[0], stream), "cudaEventRecord");
    cuda_check(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync(probe)");
    cuda_check(cudaEventRecord(ev[1], stream), "cudaEventRecord");
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    const double us = elapsed_us(ev[0], ev[1]);
    if (r > 0 && us > 0) best = std::max(best, 2.0 * double(bytes) / (us * 1e-6) / 1e9);
  }
  return best;
}

int run_bench_cuda(const BenchOptions& o, DType dtype, unsigned threads, int32_t backend) {
  int count = 0;
  const cudaError_t ce = cudaGetDeviceCount(&count);
  if (ce != cudaSuccess || count == 0)
    throw CliError(strfmt("bench: --backend %s: no CUDA device is visible (%s)", o.backend.c_str(),
                          ce != cudaSuccess ? cudaGetErrorString(ce) : "0 devices"));
  if (o.device >= count) throw UsageError(strfmt("--device must be < %d (the visible CUDA devices)", count));
  cuda_check(cudaSetDevice(o.device), "cudaSetDevice");
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, o.device), "cudaGetDeviceProperties");
  const std::string device_name = prop.name;

  // Sessions first: a method, dtype or head dim the cuda backend refuses fails here, before any
  // large allocation.
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = 1;
  p.num_q_heads = o.q_heads;
  p.num_kv_heads = o.kv_heads;
  p.head_dim = o.head_dim;
  p.kv_dtype = int32_t(dtype);
  p.backend = backend;
  p.device_id = o.device;
  if (backend == KVS_BACKEND_HYBRID) p.kv_memory = 0;  // pinned host memory, the hybrid backend's own
  else if (o.kv_memory == "cuda_host") p.kv_memory = KVS_DEVICE_CUDA_HOST;
  else if (o.kv_memory == "cuda") p.kv_memory = KVS_DEVICE_CUDA;
  else throw CliError("bench: --kv-memory: expected cuda or cuda_host, got '" + o.kv_memory + "'");
  p.num_threads = o.threads;
  p.budget = o.budget;
  BenchSessions ss(o, p);
  const int64_t B = o.batch;
  std::vector<Session>&methods = ss.method, &fulls = ss.full;
  Session& method = methods[0];
  Session& full = fulls[0];

  CudaStream stream;
  const cudaStream_t st = stream.get();
  const int dev = o.device;
  const int64_t P = o.context, S = o.warmup + o.steps;
  const int64_t hq = o.q_heads, hkv = o.kv_heads, d = o.head_dim;
  const size_t es = dtype_size(dtype);
  // Prompt queries: one random chunk reused for every prefill chunk (the cuda backend reads only
  // their shape; the prompt is given in chunks of kChunk tokens, as an engine would).
  constexpr int64_t kChunk = 16384;
  const int64_t chunk = std::min(P, kChunk);

  // Device memory the method's session takes (cudaMemGetInfo deltas: what its allocations reserve on
  // the GPU, the caching of the page pool included): by its prefill and index build, and by its first
  // decode step (workspace, selection buffers, graphs). Only this process allocates meanwhile.
  auto device_free = [] {
    size_t f = 0, t = 0;
    return cudaMemGetInfo(&f, &t) == cudaSuccess ? int64_t(f) : int64_t(-1);
  };
  auto taken = [](int64_t before, int64_t after) { return before >= 0 && after >= 0 ? before - after : int64_t(0); };
  int64_t dev_prompt = 0, dev_step = 0;
  double prefill_ms = 0, index_ms = 0;
  {
    Activity busy("uploading random K/V, prefill and index build");
    const RandomQKV prompt(chunk, P, hq, hkv, d, dtype, o.seed, {3, 1, 2}, threads, st, "prompt");
    const char *kp = prompt.k.get(), *vp = prompt.v.get(), *qp = prompt.q.get();
    for (int64_t which = 0; which < 2 * B; ++which) {  // method[0], full[0], method[1], ...
      Session& s = which % 2 == 0 ? methods[size_t(which / 2)] : fulls[size_t(which / 2)];
      const int64_t free0 = which == 0 ? device_free() : 0;
      auto t0 = Clock::now();
      for (int64_t c0 = 0; c0 < P; c0 += chunk) {
        const int64_t n = std::min(chunk, P - c0);
        const size_t off = size_t(c0) * hkv * d * es;
        const DeviceTensor q(qp, dtype, dev, {n, hq, d});
        const DeviceTensor k(kp + off, dtype, dev, {n, hkv, d});
        const DeviceTensor v(vp + off, dtype, dev, {n, hkv, d});
        check(kvs_session_prefill(s.get(), 0, q.get(), k.get(), v.get(), nullptr, st),
              s.label() + ": prefill of layer 0");
      }
      stream.sync();
      if (which == 0) prefill_ms = seconds_since(t0) * 1e3;
      t0 = Clock::now();
      check(kvs_session_build_index(s.get(), st), s.label() + ": building the index");
      stream.sync();
      if (which == 0) {
        index_ms = seconds_since(t0) * 1e3;
        dev_prompt = taken(free0, device_free());
      }
    }
  }  // the sessions hold their own copies: the prompt buffers go (stream synchronised above)

  // Each step's new tokens: q [S * B, Hq, d] and k, v [S * B, Hkv, d], random, uploaded before
  // timing (session b of a batch takes row b of each step's B rows).
  const RandomQKV steps(S * B, S * B, hq, hkv, d, dtype, o.seed, {4, 5, 6}, threads, st, "step");
  const DeviceBuffer &qs = steps.q, &ks = steps.k, &vs = steps.v;
  // fp32 outputs (one set per kind), as the CPU path.
  DeviceBuffer out(2 * size_t(B * hq) * d * sizeof(float), "cudaMalloc(o)");
  DeviceBuffer lse(2 * size_t(B * hq) * sizeof(float), "cudaMalloc(lse)");
  // L2 flush before every timed step: a write of max(2x L2, 256 MiB), which also hides the host's
  // enqueue time behind GPU work (the events time the GPU, the host time is reported apart).
  const size_t flush_bytes = std::max<size_t>(2 * size_t(std::max(prop.l2CacheSize, 0)), size_t(256) << 20);
  DeviceBuffer flush(flush_bytes, "cudaMalloc(L2 flush)");
  CudaEvents ev(size_t(4 * S));  // [session][start/end][step]
  auto event = [&](int m, int end, int64_t i) { return ev[size_t((m * 2 + end) * S + i)]; };

  std::vector<double> host_us[2];
  {
    Activity busy("decoding");
    // [B, ...] tensors for a batch, [...] for one session.
    auto shape = [B](std::initializer_list<int64_t> dims) {
      std::vector<int64_t> v;
      if (B > 1) v.push_back(B);
      v.insert(v.end(), dims);
      return v;
    };
    for (int64_t i = 0; i < S; ++i) {
      const DeviceTensor qt(qs.get() + size_t(i * B) * hq * d * es, dtype, dev, shape({hq, d}));
      const DeviceTensor kt(ks.get() + size_t(i * B) * hkv * d * es, dtype, dev, shape({hkv, d}));
      const DeviceTensor vt(vs.get() + size_t(i * B) * hkv * d * es, dtype, dev, shape({hkv, d}));
      // Alternate which goes first, so neither always runs right after the other.
      for (int turn = 0; turn < 2; ++turn) {
        const int m = (turn == 0) == (i % 2 == 0) ? 0 : 1;  // 0 = method, 1 = full
        const DeviceTensor ot(out.get() + size_t(m * B) * hq * d * sizeof(float), DType::F32, dev, shape({hq, d}));
        const DeviceTensor lt(lse.get() + size_t(m * B) * hq * sizeof(float), DType::F32, dev, shape({hq}));
        cuda_check(cudaMemsetAsync(flush.get(), int(i & 0xff), flush_bytes, st), "cudaMemsetAsync(L2 flush)");
        cuda_check(cudaEventRecord(event(m, 0, i), st), "cudaEventRecord");
        const int64_t free0 = i == 0 && m == 0 ? device_free() : 0;
        Session& s = m == 0 ? method : full;
        const auto t0 = Clock::now();
        const kvs_error_t err =
            B == 1 ? kvs_session_decode(s.get(), 0, qt.get(), kt.get(), vt.get(), ot.get(), lt.get(), st)
                   : kvs_decode_batch(ss.handles[m].data(), size_t(B), 0, qt.get(), kt.get(), vt.get(), ot.get(), lt.get(), st);
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        if (err != nullptr) check(err, s.label() + ": decode of layer 0");
        if (i == 0 && m == 0) dev_step = taken(free0, device_free());
        cuda_check(cudaEventRecord(event(m, 1, i), st), "cudaEventRecord");
        if (i >= o.warmup) host_us[m].push_back(us);
      }
    }
    stream.sync();
  }
  // The host time of one kvs_batch_decode of a batch (here of the full session alone): a plan per
  // token, then the layer's decode, whose launches replay a captured CUDA graph.
  std::vector<double> batch_host_us;
  double graph_launches = 0, graph_captures = 0;
  {
    kvs_batch_t bh = nullptr;
    kvs_session_t one = full.get();
    check(kvs_batch_create(&one, 1, &bh), "kvs_batch_create");
    const int64_t n = std::min<int64_t>(S, 64);
    for (int64_t i = 0; i < n; ++i) {
      const DeviceTensor qt(qs.get() + size_t(i) * hq * d * es, dtype, dev, {1, hq, d});
      const DeviceTensor kt(ks.get() + size_t(i) * hkv * d * es, dtype, dev, {1, hkv, d});
      const DeviceTensor vt(vs.get() + size_t(i) * hkv * d * es, dtype, dev, {1, hkv, d});
      const DeviceTensor ot(out.get() + size_t(hq) * d * sizeof(float), DType::F32, dev, {1, hq, d});
      const DeviceTensor lt(lse.get() + size_t(hq) * sizeof(float), DType::F32, dev, {1, hq});
      kvs_error_t err = kvs_batch_plan(bh, st);
      if (err == nullptr) {
        stream.sync();  // the stream idle: the call's own host time
        const auto t0 = Clock::now();
        err = kvs_batch_decode(bh, 0, qt.get(), kt.get(), vt.get(), ot.get(), lt.get(), st);
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        if (i >= 4) batch_host_us.push_back(us);
      }
      if (err != nullptr) {
        kvs_batch_destroy(bh);
        check(err, "full: kvs_batch_decode");
      }
    }
    stream.sync();
    kvs_batch_destroy(bh);
    // (cuda only: the hybrid backend has no graphs, and answers with an error, freed here)
    kvs_error_destroy(kvs_session_method_stat(full.get(), "cuda_graph_launches", &graph_launches));
    kvs_error_destroy(kvs_session_method_stat(full.get(), "cuda_graph_captures", &graph_captures));
  }
  cuda_check(cudaGetLastError(), "after the decode steps");
  std::vector<double> method_us, full_us;
  for (int64_t i = o.warmup; i < S; ++i) {
    method_us.push_back(elapsed_us(event(0, 0, i), event(0, 1, i)));
    full_us.push_back(elapsed_us(event(1, 0, i), event(1, 1, i)));
  }
  // The last step's outputs must be finite (a cheap guard against a broken kernel).
  {
    std::vector<float> h(2 * size_t(hq) * d);
    cuda_check(cudaMemcpy(h.data(), out.get(), h.size() * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy(o)");
    for (size_t i = 0; i < h.size(); ++i)
      if (!std::isfinite(h[i]))
        throw CliError(strfmt("bench: %s: the last decode step wrote a non-finite output (element %zu)",
                              i < h.size() / 2 ? o.method.c_str() : "full", i % (h.size() / 2)));
  }
  const kvs_session_stats stt = method.stats();

  double measured = 0;
  if (!o.no_membw) {
    Activity busy("measuring device copy bandwidth");
    size_t bytes = o.membw_mib > 0 ? size_t(o.membw_mib * 1024 * 1024) : size_t(1) << 30;
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) bytes = std::min(bytes, free_b / 4);
    measured = measure_copy_bandwidth(std::max<size_t>(bytes, 1 << 20), st, 5);
  }

  const double step_us = median(method_us), full_step_us = median(full_us);
  const double host_step = median(host_us[0]), host_full = median(host_us[1]);
  const double row_bytes = double(hkv) * d * 2.0 * double(es);  // one token's K and V
  const double mean_ctx = double(P + o.warmup) + double(o.steps + 1) / 2.0;
  const double full_bytes = double(B) * mean_ctx * row_bytes;  // a step reads every session's keys
  const double method_bytes = double(B) * (stt.mean_selected_keys * row_bytes + double(stt.index_bytes));
  const double achieved = full_step_us > 0 ? full_bytes / (full_step_us * 1e-6) / 1e9 : 0.0;
  const double method_gbps = step_us > 0 ? method_bytes / (step_us * 1e-6) / 1e9 : 0.0;
  const double speedup = step_us > 0 ? full_step_us / step_us : 0.0;

  std::printf("bench %s vs full: context %lld, %u q heads / %u kv heads, d %u, %s, budget %g, %s backend "
              "on %s (device %d), KV in %s, %s, median of %lld steps after %lld warm-up, L2 flushed (%s) before each\n",
              o.method.c_str(), static_cast<long long>(P), o.q_heads, o.kv_heads, o.head_dim, dtype_name(dtype),
              o.budget, o.backend.c_str(), device_name.c_str(), dev, backend == KVS_BACKEND_HYBRID || o.kv_memory == "cuda_host" ? "pinned host memory" : "GPU memory",
              batch_words(B).c_str(), static_cast<long long>(o.steps), static_cast<long long>(o.warmup),
              human_bytes(double(flush_bytes)).c_str());
  std::printf("  prefill %.1f ms, index build %.1f ms; index %s, KV %s\n", prefill_ms, index_ms,
              human_bytes(double(stt.index_bytes)).c_str(), human_bytes(double(stt.kv_bytes)).c_str());
  std::printf("  GPU memory of the %s session: %s after prefill and index build, %s more at its first decode "
              "step%s (cudaMemGetInfo)\n",
              B == 1 ? o.method.c_str() : (o.method + "[0]").c_str(),
              human_bytes(double(std::max<int64_t>(dev_prompt, 0))).c_str(),
              human_bytes(double(std::max<int64_t>(dev_step, 0))).c_str(), B == 1 ? "" : " (the whole batch's)");
  std::printf("  full     %10.1f us/step  reads %s  -> %.1f GB/s", full_step_us, human_bytes(full_bytes).c_str(),
              achieved);
  if (measured > 0)
    std::printf("  (%.0f%% of the measured device copy, %.1f GB/s read+write)", 100.0 * achieved / measured, measured);
  std::printf("\n");
  std::printf("  %-8s %10.1f us/step  reads <= %s (%.0f keys/KV head + index)  -> %.1f GB/s\n", o.method.c_str(),
              step_us, human_bytes(method_bytes).c_str(), stt.mean_selected_keys, method_gbps);
  std::printf("  speedup vs full: %.2fx\n", speedup);
  std::printf("  step time p50 / p99 / mean (CUDA events): full %.1f / %.1f / %.1f us, %s %.1f / %.1f / %.1f us\n",
              full_step_us, percentile(full_us, 99.0), mean(full_us), o.method.c_str(), step_us,
              percentile(method_us, 99.0), mean(method_us));
  std::printf("  host time of one decode call (median): full %.1f us, %s %.1f us\n", host_full, o.method.c_str(),
              host_step);
  const double batch_host = batch_host_us.empty() ? 0.0 : median(batch_host_us);
  std::printf("  host time of one kvs_batch_decode of full (median; CUDA graph replays %.0f, captures %.0f): %.1f us\n",
              graph_launches, graph_captures, batch_host);
  const MethodStats stats = read_method_stats(method.get(), o.stats);
  print_method_stats(o, stats);

  if (!o.json.empty()) {
    using J = nlohmann::ordered_json;
    const J j = {{"method", o.method},
                 {"params", o.params},
                 {"backend", o.backend},
                 {"threads", threads},
                 {"kv_memory", backend == KVS_BACKEND_HYBRID ? std::string("cuda_host") : o.kv_memory},
                 {"device", device_name},
                 {"context", P},
                 {"q_heads", o.q_heads},
                 {"kv_heads", o.kv_heads},
                 {"head_dim", o.head_dim},
                 {"dtype", dtype_name(dtype)},
                 {"budget", o.budget},
                 {"steps", o.steps},
                 {"batch", B},
                 {"step_us", step_us},
                 {"full_step_us", full_step_us},
                 {"step_p99_us", percentile(method_us, 99.0)},
                 {"full_step_p99_us", percentile(full_us, 99.0)},
                 {"step_mean_us", mean(method_us)},
                 {"full_step_mean_us", mean(full_us)},
                 {"device_bytes_prompt", std::max<int64_t>(dev_prompt, 0)},
                 {"device_bytes_first_step", std::max<int64_t>(dev_step, 0)},
                 {"speedup_vs_full", speedup},
                 {"update_us", J(nullptr)},  // CPU phase timings only
                 {"select_us", J(nullptr)},
                 {"attention_us", J(nullptr)},
                 {"host_step_us", host_step},
                 {"full_host_step_us", host_full},
                 {"full_batch_host_step_us", batch_host},
                 {"index_build_ms", index_ms},
                 {"achieved_GBps", achieved},
                 {"measured_read_GBps", o.no_membw ? J(nullptr) : J(measured)},
                 {"index_bytes", stt.index_bytes},
                 {"kv_bytes", stt.kv_bytes},
                 {"stats", method_stats_json(stats)}};
    write_text_file(o.json, j.dump(2) + "\n");
    std::printf("wrote %s\n", o.json.c_str());
  }
  return kExitOk;
}
#endif  // KVS_HAVE_CUDA

}  // namespace

Command add_bench_command(CLI::App& root) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = root.add_subcommand(
      "bench", "time decode steps of a method against full on synthetic data (CPU, or CUDA in CUDA builds)");
  cmd->add_option("--method", o->method, "method name (see `kvsieve methods`)")->required();
  cmd->add_option("--params", o->params, "method parameters: key=value,key=value");
  cmd->add_option("--context", o->context, "prompt tokens before the timed steps");
  cmd->add_option("--q-heads", o->q_heads, "query heads");
  cmd->add_option("--kv-heads", o->kv_heads, "KV heads");
  cmd->add_option("--head-dim", o->head_dim, "head dimension");
  cmd->add_option("--dtype", o->dtype, "KV dtype: f32, f16 or bf16");
  cmd->add_option("--budget", o->budget, "exact keys per step, as a fraction of the context, (0, 1]");
  cmd->add_option("--backend", o->backend, "cpu, cuda or hybrid (CUDA builds: device tensors, CUDA events; hybrid: the KV in pinned host memory, the search on the CPU)");
  cmd->add_option("--device", o->device, "CUDA device of --backend cuda");
  cmd->add_option("--kv-memory", o->kv_memory,
                  "--backend cuda: where both sessions keep the KV cache: cuda (GPU memory) or cuda_host (pinned "
                  "host memory read over the bus)");
  cmd->add_option("--threads", o->threads,
                  "library threads and bandwidth-probe (cuda: data-generation) threads (0 = all)");
  cmd->add_option("--steps", o->steps, "timed decode steps of each session");
  cmd->add_option("--warmup", o->warmup, "untimed decode steps first");
  cmd->add_option("--batch", o->batch,
                  "sessions of each kind (each with its own copy of the prompt), stepped together by "
                  "kvs_decode_batch; times are of the whole batch's step (1..64)");
  cmd->add_option("--seed", o->seed, "seed of the synthetic data");
  cmd->add_option("--membw-mib", o->membw_mib,
                  "bandwidth probe buffer in MiB (0 = 4x LLC, 256 MiB..2 GiB; cuda: device copy, 0 = 1 GiB)");
  cmd->add_flag("--no-membw", o->no_membw, "skip the bandwidth probe (measured_read_GBps: null)");
  cmd->add_option("--stats", o->stats,
                  "comma-separated method statistics to print after the run (kvs_session_method_stat; unknown names skipped)");
  cmd->add_option("--json", o->json, "also write the results as JSON to this file");
  return {cmd, [o] { return run_bench(*o); }};
}

}  // namespace kvcli
