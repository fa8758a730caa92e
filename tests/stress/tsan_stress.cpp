// SPDX-License-Identifier: Apache-2.0
// ThreadSanitizer stress test of the public C API (built with KVS_TSAN=ON; scripts/test_hardening.sh).
//
// Exercises every thread-safety promise of include/kvsieve/kvsieve.h at once, for a bounded time:
//  - sessions: each worker creates, prefills (in two chunks), indexes and decodes its own sessions
//    of every CPU method (@threadsafety any / exclusive per session), some with a worker pool;
//  - forks: workers fork one shared parent per method and read it concurrently (fork, stats, layer
//    tokens, last selection, method statistics, save: the @threadsafety concurrent-const calls),
//    then decode their fork, and load the file they saved (copied or memory-mapped) and decode that;
//  - batches: workers drive kvs_batch_plan/kvs_batch_decode and kvs_decode_batch on disjoint sets
//    of sessions;
//  - traces: workers read one shared trace (concurrent-const) and write, open and read their own;
//  - logging: one thread keeps replacing the log callback (two sinks and the default) while the
//    others log (session creation logs a debug line, an index build an info line), and another
//    reads the method registry.
// Every output is compared bit for bit with the same inputs run single-threaded beforehand, so a
// race that corrupts results fails the test even where TSan would not see it. Exit status: 0 when
// everything matched; TSan itself fails the process on a report (TSAN_OPTIONS=halt_on_error=1).
//
//   kvsieve_tsan_stress [seconds]     (default: KVS_STRESS_SECONDS, else 3)
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvsieve/kvsieve.h"

namespace {

// ---- shape and inputs --------------------------------------------------------------------------

constexpr uint32_t kLayers = 2, kQHeads = 4, kKvHeads = 2, kHeadDim = 32;
constexpr int64_t kPrompt = 160;  // prefilled in two chunks (96 + 64)
constexpr int64_t kChunk = 96;
constexpr int kSteps = 4;         // decode steps per run
constexpr int kBatch = 2;         // sessions per batch

std::atomic<int> g_failures{0};

void failure(const std::string& what) {
  static std::mutex m;
  std::lock_guard<std::mutex> g(m);
  std::fprintf(stderr, "tsan_stress: FAIL: %s\n", what.c_str());
  g_failures.fetch_add(1);
}

// Fails (and ends the process: what follows would only cascade) on an error.
void ok(kvs_error_t err, const std::string& what) {
  if (!err) return;
  std::fprintf(stderr, "tsan_stress: %s: %s [%d]\n", what.c_str(), kvs_error_message(err), kvs_error_code(err));
  kvs_error_destroy(err);
  std::exit(1);
}

// Deterministic values in [-1, 1] for (stream, layer, token, tensor, element): every run of the
// same stream sees the same inputs, whichever thread runs it.
float value(uint64_t stream, uint32_t layer, int64_t token, uint32_t which, size_t i) {
  uint64_t x = stream * 0x9E3779B97F4A7C15ull ^ (uint64_t(layer) << 56) ^ (uint64_t(token) << 20) ^
               (uint64_t(which) << 16) ^ uint64_t(i);
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return float(int64_t(x >> 40) % 2001 - 1000) / 1000.0f;
}

struct Tensor {
  std::vector<float> data;
  std::vector<int64_t> shape;
  kvs_tensor t{};
  explicit Tensor(std::vector<int64_t> dims) : shape(std::move(dims)) {
    size_t n = 1;
    for (int64_t d : shape) n *= size_t(d);
    data.assign(n, 0.0f);
    t.data = data.data();
    t.device = kvs_device{KVS_DEVICE_CPU, 0};
    t.ndim = int32_t(shape.size());
    t.dtype = kvs_dtype{KVS_DTYPE_CODE_FLOAT, 32, 1};
    t.shape = shape.data();
    t.strides = nullptr;
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  // `which` (0 q, 1 k, 2 v) of tokens [token0, token0 + rows) of a stream into rows [at, at + rows)
  // (a row: the last two dimensions, one token's heads).
  void fill(uint64_t stream, uint32_t layer, int64_t token0, uint32_t which, size_t rows = 1, size_t at = 0) {
    const size_t row = size_t(shape[shape.size() - 2] * shape.back());
    for (size_t r = 0; r < rows; ++r)
      for (size_t i = 0; i < row; ++i) data.at((at + r) * row + i) = value(stream, layer, token0 + int64_t(r), which, i);
  }
};

using Outputs = std::vector<float>;

// ---- one session's life ------------------------------------------------------------------------

struct Config {
  std::string method;
  uint32_t threads = 1;
};

// Parameters that fit the small prompt (csattention's default tables would outgrow its KV cache
// and warn on every build).
const char* small_params(const std::string& method) { return method == "csattention" ? "centroids=16" : nullptr; }

kvs_session_params params_of(const Config& c) {
  kvs_session_params p;
  kvs_session_params_init(&p);
  p.num_layers = kLayers;
  p.num_q_heads = kQHeads;
  p.num_kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.kv_dtype = KVS_SCALAR_BF16;
  p.num_threads = c.threads;
  p.method = c.method.c_str();
  p.method_params = small_params(c.method);
  p.budget = 0.2;
  return p;
}

kvs_session_t create(const Config& c) {
  const kvs_session_params p = params_of(c);
  kvs_session_t s = nullptr;
  ok(kvs_session_create(&p, &s), c.method + ": kvs_session_create");
  return s;
}

// Prefills the prompt of `stream` in two chunks, with the prompt output of each, then indexes.
void prefill(kvs_session_t s, const Config& c, uint64_t stream, Outputs* out) {
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (int64_t at = 0; at < kPrompt; at += kChunk) {
      const int64_t n = std::min(kChunk, kPrompt - at);
      Tensor q({n, kQHeads, kHeadDim}), k({n, kKvHeads, kHeadDim}), v({n, kKvHeads, kHeadDim}), o({n, kQHeads, kHeadDim});
      q.fill(stream, l, at, 0, size_t(n));
      k.fill(stream, l, at, 1, size_t(n));
      v.fill(stream, l, at, 2, size_t(n));
      ok(kvs_session_prefill(s, l, &q.t, &k.t, &v.t, &o.t, nullptr), c.method + ": kvs_session_prefill");
      out->insert(out->end(), o.data.begin(), o.data.end());
    }
  }
  ok(kvs_session_build_index(s, nullptr), c.method + ": kvs_session_build_index");
}

// Decodes tokens [first, first + kSteps) of `stream` in every layer, appending o and lse.
void decode(kvs_session_t s, const Config& c, uint64_t stream, int64_t first, Outputs* out) {
  for (int step = 0; step < kSteps; ++step)
    for (uint32_t l = 0; l < kLayers; ++l) {
      Tensor q({kQHeads, kHeadDim}), k({kKvHeads, kHeadDim}), v({kKvHeads, kHeadDim}), o({kQHeads, kHeadDim}), lse({kQHeads});
      q.fill(stream, l, first + step, 0);
      k.fill(stream, l, first + step, 1);
      v.fill(stream, l, first + step, 2);
      ok(kvs_session_decode(s, l, &q.t, &k.t, &v.t, &o.t, &lse.t, nullptr), c.method + ": kvs_session_decode");
      out->insert(out->end(), o.data.begin(), o.data.end());
      out->insert(out->end(), lse.data.begin(), lse.data.end());
    }
}

// A whole session: create, prefill, index, decode, destroy.
Outputs run_session(const Config& c, uint64_t stream) {
  Outputs out;
  kvs_session_t s = create(c);
  prefill(s, c, stream, &out);
  decode(s, c, stream, kPrompt, &out);
  kvs_session_destroy(s);
  return out;
}

// Decodes kSteps tokens of streams[b] in sessions[b] as one batch: plan + kvs_batch_decode for the
// even steps, kvs_decode_batch for the odd ones.
Outputs run_batch(const Config& c, const std::vector<uint64_t>& streams) {
  Outputs out;
  std::vector<kvs_session_t> ss;
  for (uint64_t st : streams) {
    ss.push_back(create(c));
    Outputs ignored;
    prefill(ss.back(), c, st, &ignored);
  }
  const int64_t B = int64_t(ss.size());
  kvs_batch_t batch = nullptr;
  ok(kvs_batch_create(ss.data(), ss.size(), &batch), c.method + ": kvs_batch_create");
  for (int step = 0; step < kSteps; ++step) {
    const bool planned = step % 2 == 0;
    if (planned) ok(kvs_batch_plan(batch, nullptr), c.method + ": kvs_batch_plan");
    for (uint32_t l = 0; l < kLayers; ++l) {
      Tensor q({B, kQHeads, kHeadDim}), k({B, kKvHeads, kHeadDim}), v({B, kKvHeads, kHeadDim}), o({B, kQHeads, kHeadDim}), lse({B, kQHeads});
      for (int64_t b = 0; b < B; ++b) {
        q.fill(streams[size_t(b)], l, kPrompt + step, 0, 1, size_t(b));
        k.fill(streams[size_t(b)], l, kPrompt + step, 1, 1, size_t(b));
        v.fill(streams[size_t(b)], l, kPrompt + step, 2, 1, size_t(b));
      }
      if (planned)
        ok(kvs_batch_decode(batch, l, &q.t, &k.t, &v.t, &o.t, &lse.t, nullptr), c.method + ": kvs_batch_decode");
      else
        ok(kvs_decode_batch(ss.data(), ss.size(), l, &q.t, &k.t, &v.t, &o.t, &lse.t, nullptr), c.method + ": kvs_decode_batch");
      out.insert(out.end(), o.data.begin(), o.data.end());
      out.insert(out.end(), lse.data.begin(), lse.data.end());
    }
  }
  kvs_batch_destroy(batch);
  for (kvs_session_t s : ss) kvs_session_destroy(s);
  return out;
}

// The concurrent-const calls on a shared parent (their results are checked against the values
// read single-threaded: the parent never changes while they run).
struct ParentFacts {
  int64_t tokens = 0;
  int64_t decode_steps = 0;
  size_t selection = 0;
};

ParentFacts read_parent(kvs_session_t parent, const Config& c) {
  ParentFacts f;
  ok(kvs_session_layer_tokens(parent, kLayers - 1, &f.tokens), c.method + ": kvs_session_layer_tokens");
  kvs_session_stats st;
  st.struct_size = sizeof st;
  ok(kvs_session_get_stats(parent, &st), c.method + ": kvs_session_get_stats");
  f.decode_steps = st.decode_steps;
  int32_t sel[512];
  ok(kvs_session_last_selection(parent, 0, 0, sel, 512, &f.selection), c.method + ": kvs_session_last_selection");
  double secs = 0;
  ok(kvs_session_method_stat(parent, "decode_attend_seconds", &secs), c.method + ": kvs_session_method_stat");
  return f;
}

// Forks the parent and decodes the fork on `stream`'s tokens after the parent's context.
Outputs run_fork(kvs_session_t parent, const Config& c, uint64_t stream, int64_t parent_tokens) {
  Outputs out;
  kvs_session_t f = nullptr;
  ok(kvs_session_fork(parent, &f), c.method + ": kvs_session_fork");
  decode(f, c, stream, parent_tokens, &out);
  kvs_session_destroy(f);
  return out;
}

// Saves the parent (with its KV) to `path`, loads it (copied, or memory-mapped with KVS_LOAD_MMAP)
// and decodes the loaded session.
Outputs run_save_load(kvs_session_t parent, const Config& c, uint64_t stream, int64_t parent_tokens,
                      const std::string& path, uint32_t load_flags) {
  Outputs out;
  ok(kvs_session_save(parent, path.c_str(), KVS_SAVE_INCLUDE_KV), c.method + ": kvs_session_save");
  kvs_load_params lp;
  kvs_load_params_init(&lp);
  lp.num_threads = c.threads;
  lp.flags = load_flags;
  kvs_session_t s = nullptr;
  ok(kvs_session_load(path.c_str(), &lp, &s), c.method + ": kvs_session_load");
  decode(s, c, stream, parent_tokens, &out);
  kvs_session_destroy(s);
  std::remove(path.c_str());
  return out;
}

void expect_equal(const Outputs& got, const Outputs& want, const std::string& what) {
  if (got.size() != want.size()) {
    failure(what + ": " + std::to_string(got.size()) + " outputs, single-threaded run gave " + std::to_string(want.size()));
    return;
  }
  if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0) return;
  size_t i = 0;
  while (i < got.size() && std::memcmp(&got[i], &want[i], sizeof(float)) == 0) ++i;
  failure(what + ": output " + std::to_string(i) + " is " + std::to_string(got[i]) + ", single-threaded run gave " +
          std::to_string(want[i]));
}

// ---- traces ------------------------------------------------------------------------------------

constexpr int64_t kTraceTokens = 24;

// Writes a trace of `stream` (every layer, f32, with tokens) to `path`.
void write_trace(const std::string& path, uint64_t stream) {
  std::vector<std::unique_ptr<Tensor>> q, k, v;
  std::vector<const kvs_tensor*> pq, pk, pv;
  std::vector<uint32_t> layers;
  for (uint32_t l = 0; l < kLayers; ++l) {
    layers.push_back(l);
    q.push_back(std::make_unique<Tensor>(std::vector<int64_t>{kTraceTokens, kQHeads, kHeadDim}));
    k.push_back(std::make_unique<Tensor>(std::vector<int64_t>{kTraceTokens, kKvHeads, kHeadDim}));
    v.push_back(std::make_unique<Tensor>(std::vector<int64_t>{kTraceTokens, kKvHeads, kHeadDim}));
    q.back()->fill(stream, l, 0, 0, kTraceTokens);
    k.back()->fill(stream, l, 0, 1, kTraceTokens);
    v.back()->fill(stream, l, 0, 2, kTraceTokens);
    pq.push_back(&q.back()->t);
    pk.push_back(&k.back()->t);
    pv.push_back(&v.back()->t);
  }
  std::vector<int32_t> tok(kTraceTokens);
  for (int64_t t = 0; t < kTraceTokens; ++t) tok[size_t(t)] = int32_t(stream * 1000 + uint64_t(t));
  int64_t tok_shape[1] = {kTraceTokens};
  kvs_tensor tt{tok.data(), {KVS_DEVICE_CPU, 0}, 1, {KVS_DTYPE_CODE_INT, 32, 1}, tok_shape, nullptr, 0};
  kvs_trace_info info;
  kvs_trace_info_init(&info);
  info.num_layers = kLayers;
  info.num_q_heads = kQHeads;
  info.num_kv_heads = kKvHeads;
  info.head_dim = kHeadDim;
  info.prefill_len = kTraceTokens / 2;
  info.total_len = kTraceTokens;
  info.dtype = KVS_SCALAR_F32;
  info.source = "tsan_stress";
  ok(kvs_trace_write(path.c_str(), &info, layers.data(), layers.size(), pq.data(), pk.data(), pv.data(), &tt),
     "kvs_trace_write");
}

// Reads every view of an open trace (the concurrent-const calls) and checks it holds `stream`.
void check_trace(kvs_trace_t tr, uint64_t stream, const std::string& what) {
  kvs_trace_info info;
  kvs_trace_info_init(&info);
  ok(kvs_trace_get_info(tr, &info), what + ": kvs_trace_get_info");
  if (info.total_len != kTraceTokens || info.num_present_layers != kLayers) failure(what + ": wrong info");
  for (uint32_t i = 0; i < info.num_present_layers; ++i) {
    uint32_t layer = 0;
    ok(kvs_trace_layer_index(tr, i, &layer), what + ": kvs_trace_layer_index");
    for (uint32_t which = 0; which < 3; ++which) {
      kvs_tensor t{};
      ok(kvs_trace_tensor(tr, layer, which == 0 ? "q" : which == 1 ? "k" : "v", &t), what + ": kvs_trace_tensor");
      const auto* f = reinterpret_cast<const float*>(static_cast<const char*>(t.data) + t.byte_offset);
      const size_t row = size_t(t.shape[1] * t.shape[2]);
      for (int64_t tok = 0; tok < t.shape[0]; ++tok)
        for (size_t e = 0; e < row; ++e)
          if (f[size_t(tok) * row + e] != value(stream, layer, tok, which, e)) {
            failure(what + ": layer " + std::to_string(layer) + " tensor " + std::to_string(which) + " differs");
            return;
          }
    }
  }
  kvs_tensor t{};
  ok(kvs_trace_tensor(tr, 0, "tokens", &t), what + ": kvs_trace_tensor(tokens)");
  const auto* tok = static_cast<const int32_t*>(t.data);
  for (int64_t i = 0; i < kTraceTokens; ++i)
    if (tok[i] != int32_t(stream * 1000 + uint64_t(i))) {
      failure(what + ": tokens differ");
      return;
    }
}

// ---- logging -----------------------------------------------------------------------------------

struct Sink {
  std::atomic<uint64_t> lines{0};
  std::atomic<uint64_t> bad{0};
};
Sink g_sinks[2];

void on_log(int32_t level, const char* line, void* user) {
  auto* s = static_cast<Sink*>(user);
  const size_t n = line ? std::strlen(line) : 0;
  if (n == 0 || std::strchr(line, '\n') || level < KVS_LOG_DEBUG || level > KVS_LOG_ERROR) s->bad.fetch_add(1);
  s->lines.fetch_add(1);
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 3;
  if (const char* e = std::getenv("KVS_STRESS_SECONDS")) seconds = std::atof(e);
  if (argc > 1) seconds = std::atof(argv[1]);
  if (!(seconds >= 0)) {
    std::fprintf(stderr, "usage: kvsieve_tsan_stress [seconds]\n");
    return 2;
  }
  ok(kvs_abi_check(KVS_ABI_VERSION), "kvs_abi_check");

  std::vector<std::string> methods;
  for (size_t i = 0; i < kvs_method_count(); ++i)
    if (kvs_method_backends(kvs_method_name(i)) & (1u << KVS_BACKEND_CPU)) methods.emplace_back(kvs_method_name(i));
  std::printf("tsan_stress: %zu methods, %.1f s\n", methods.size(), seconds);
  std::fflush(stdout);

  const std::string dir = [] {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/kvsieve-tsan.XXXXXX";
    if (!mkdtemp(tmpl.data())) {
      std::perror("mkdtemp");
      std::exit(1);
    }
    return tmpl;
  }();

  // ---- single-threaded references --------------------------------------------------------------
  // Sessions: every method, two streams, with 1 and 2 library threads.
  constexpr uint64_t kStreams = 2;
  std::map<std::pair<std::string, uint32_t>, std::vector<Outputs>> ref_session;
  for (const auto& m : methods)
    for (uint32_t th : {1u, 2u})
      for (uint64_t st = 0; st < kStreams; ++st) ref_session[{m, th}].push_back(run_session({m, th}, st));
  // Batches: kBatch sessions of streams 10, 11, ... per method.
  std::map<std::string, Outputs> ref_batch;
  std::vector<uint64_t> batch_streams;
  for (int b = 0; b < kBatch; ++b) batch_streams.push_back(10 + uint64_t(b));
  for (const auto& m : methods) ref_batch[m] = run_batch({m, 1}, batch_streams);
  // Forks: one parent per method (prompt of stream 100 and kSteps decode steps, so its last KV page
  // is partly filled and a fork's first write copies it); forks decode streams 200, 201.
  struct Parent {
    Config c;
    kvs_session_t s = nullptr;
    ParentFacts facts;
    std::vector<Outputs> fork_ref, load_ref;
  };
  std::vector<Parent> parents;
  for (const auto& m : methods) {
    Parent p;
    p.c = {m, 1};
    p.s = create(p.c);
    Outputs ignored;
    prefill(p.s, p.c, 100, &ignored);
    decode(p.s, p.c, 100, kPrompt, &ignored);
    p.facts = read_parent(p.s, p.c);
    for (uint64_t st = 0; st < kStreams; ++st) {
      p.fork_ref.push_back(run_fork(p.s, p.c, 200 + st, p.facts.tokens));
      p.load_ref.push_back(run_save_load(p.s, p.c, 200 + st, p.facts.tokens, dir + "/ref.kvs", 0));
    }
    parents.push_back(std::move(p));
  }

  // Traces: one shared by every trace worker (concurrent-const reads).
  write_trace(dir + "/shared.safetensors", 300);
  kvs_trace_t shared_trace = nullptr;
  ok(kvs_trace_open((dir + "/shared.safetensors").c_str(), &shared_trace), "kvs_trace_open");
  check_trace(shared_trace, 300, "shared trace");

  // ---- concurrent phase ------------------------------------------------------------------------
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                    std::chrono::duration<double>(seconds));
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> rounds{0}, log_swaps{0};
  auto worker = [&](const std::function<void(uint64_t)>& round) {
    return [&, round] {
      // At least one round each, then until the deadline.
      for (uint64_t r = 0; r == 0 || std::chrono::steady_clock::now() < deadline; ++r) {
        round(r);
        rounds.fetch_add(1);
      }
    };
  };
  std::vector<std::thread> threads;
  // Sessions: two workers, each its own sessions, cycling through methods, streams and pool sizes.
  for (uint64_t w = 0; w < 2; ++w)
    threads.emplace_back(worker([&, w](uint64_t r) {
      const std::string& m = methods[size_t(w + r) % methods.size()];
      const uint32_t th = uint32_t((w + r / methods.size()) % 2) + 1;
      const uint64_t st = (w + r) % kStreams;
      expect_equal(run_session({m, th}, st), ref_session.at({m, th})[st], "session " + m + " (" + std::to_string(th) + " threads)");
    }));
  // Forks: two workers on the shared parents: concurrent-const reads, fork + decode, save + load.
  for (uint64_t w = 0; w < 2; ++w)
    threads.emplace_back(worker([&, w](uint64_t r) {
      const Parent& p = parents[size_t(w + r) % parents.size()];
      const uint64_t st = (w + r) % kStreams;
      const ParentFacts f = read_parent(p.s, p.c);
      if (f.tokens != p.facts.tokens || f.decode_steps != p.facts.decode_steps || f.selection != p.facts.selection)
        failure("parent " + p.c.method + ": a concurrent read differs from the single-threaded one");
      expect_equal(run_fork(p.s, p.c, 200 + st, p.facts.tokens), p.fork_ref[st], "fork of " + p.c.method);
      const std::string path = dir + "/w" + std::to_string(w) + "-" + std::to_string(r) + ".kvs";
      // Copied and mapped loads alternate; both must decode as the single-threaded copied load did.
      const uint32_t flags = r % 2 ? KVS_LOAD_MMAP : 0;
      expect_equal(run_save_load(p.s, p.c, 200 + st, p.facts.tokens, path, flags), p.load_ref[st],
                   std::string(flags ? "mapped" : "copied") + " save/load of " + p.c.method);
    }));
  // Batches: two workers, each on its own set of sessions.
  for (uint64_t w = 0; w < 2; ++w)
    threads.emplace_back(worker([&, w](uint64_t r) {
      const std::string& m = methods[size_t(w * 3 + r) % methods.size()];
      expect_equal(run_batch({m, 1}, batch_streams), ref_batch.at(m), "batch of " + m);
    }));
  // Traces: two workers read the shared trace, and write, open and read their own files.
  for (uint64_t w = 0; w < 2; ++w)
    threads.emplace_back(worker([&, w](uint64_t r) {
      check_trace(shared_trace, 300, "shared trace");
      const std::string path = dir + "/t" + std::to_string(w) + "-" + std::to_string(r) + ".safetensors";
      write_trace(path, 400 + w);
      kvs_trace_t tr = nullptr;
      ok(kvs_trace_open(path.c_str(), &tr), "kvs_trace_open");
      check_trace(tr, 400 + w, "trace " + path);
      kvs_trace_destroy(tr);
      std::remove(path.c_str());
    }));
  // Logging: the callback replaced over and over (two sinks, then the default sink) while the
  // workers log; and the registry read (@threadsafety any) at the same time.
  std::thread swapper([&] {
    for (uint64_t i = 0; !stop.load(); ++i) {
      if (i % 3 == 2) kvs_set_log_callback(nullptr, nullptr, KVS_LOG_WARN);
      else kvs_set_log_callback(on_log, &g_sinks[i % 3], KVS_LOG_DEBUG);
      log_swaps.fetch_add(1);
      for (size_t m = 0; m < kvs_method_count(); ++m) {
        const char* name = kvs_method_name(m);
        size_t n = 0;
        ok(kvs_method_param_count(name, &n), "kvs_method_param_count");
        for (size_t j = 0; j < n; ++j) {
          kvs_param_info pi;
          pi.struct_size = sizeof pi;
          ok(kvs_method_param(name, j, &pi), "kvs_method_param");
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  for (auto& t : threads) t.join();
  stop.store(true);
  swapper.join();
  kvs_set_log_callback(nullptr, nullptr, KVS_LOG_WARN);
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  for (auto& p : parents) kvs_session_destroy(p.s);
  kvs_trace_destroy(shared_trace);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);

  const uint64_t lines = g_sinks[0].lines + g_sinks[1].lines, bad = g_sinks[0].bad + g_sinks[1].bad;
  if (lines == 0) failure("no log line reached a callback");
  if (bad) failure(std::to_string(bad) + " log lines were empty, held a newline or had a bad level");
  std::printf("tsan_stress: %llu rounds in %.1f s, %llu callback swaps, %llu log lines; %s\n",
              (unsigned long long)rounds.load(), elapsed, (unsigned long long)log_swaps.load(),
              (unsigned long long)lines, g_failures ? "FAILED" : "ok");
  return g_failures ? 1 : 0;
}
