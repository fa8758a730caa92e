// SPDX-License-Identifier: Apache-2.0
// A session's implementation on one backend ("placement"): where its KV cache and its method's index
// live, and how prefill, append and a decode step run there. `Session` keeps only the state that is
// the same everywhere (configuration, call-order rules, statistics) and forwards to its placement;
// the placements register in src/backends/registry.cpp (cpu always, cuda when built with it), so
// nothing in session.cpp knows which backends exist.
//
// Every placement keeps the contract of docs/architecture.md: arguments are validated before any
// state changes, a failed call leaves the session as it was, and a decode of a batch is all or
// nothing.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/method.hpp"
#include "kvsieve/kvsieve.h"

namespace kvs::io {
class TablesWriter;
class TablesFile;
}  // namespace kvs::io

namespace kvs {

struct SessionConfig;
class Backend;

// The tensors of one decode step of a batch (validated by the placement: shapes depend on `single`).
struct StepTensors {
  const kvs_tensor *q, *k_new, *v_new, *o, *lse;
  void* stream;
  bool single;  // rank-2 tensors of one session (kvs_session_decode) instead of rank-3 [B, ...]
  const char* fn;
};

// What the step did, per session of the batch: the exact keys attended (mean over KV heads).
struct StepReport {
  double selected = 0;
  int64_t tokens = 0;  // the layer's tokens after the step
  bool deferred = false;  // not known yet: the placement hands it over later (settled_reports)
};

// The reports of deferred steps that have completed: how many, their selected keys summed, the latest.
struct Settled {
  int64_t steps = 0;
  double sum_selected = 0;
  StepReport last;
  void add(const StepReport& r) {
    ++steps;
    sum_selected += r.selected;
    last = r;
  }
};

// A layer's KV in the caller's paged cache (kvs_session_bind_kv, validated by the session): the
// pages of [0, ceil(tokens / page_size)) in token order, each [2][Hkv][page_size][d] (HND, v_pool
// null; kvs_paged_kv tells the others). The first `unchanged` entries are those of the layer's
// previous binding (same pools, same pages): an engine's page table mostly grows at its end, so a
// binding costs the pages that changed.
struct BoundKv {
  const void* pool;
  const void* v_pool;  // null: K and V in `pool`'s pages; else the V pool (page i at the K page's offset)
  bool nhd;            // a page's K (and V) is [page_size][Hkv][d]
  size_t page_bytes;   // from one page of a pool to the next (K and V, or one of them with v_pool)
  int64_t num_pages;
  int32_t page_size;
  std::span<const int32_t> pages;
  int64_t tokens;
  size_t unchanged = 0;
};

class Placement {
 public:
  virtual ~Placement() = default;
  virtual int32_t backend() const = 0;  // kvs_backend
  virtual const Backend& ops() const = 0;

  virtual int64_t tokens(uint32_t layer) const = 0;
  // Prompt chunks (prompt = true) and appended turns: validates q/k/v/o for this placement, stores
  // the tokens, lets the method see them, writes causal outputs into o if given. At most
  // max_tokens in the layer afterwards.
  virtual void add_tokens(uint32_t layer, const kvs_tensor* q, const kvs_tensor* k, const kvs_tensor* v,
                          const kvs_tensor* o, const char* fn, bool prompt, int64_t max_tokens, void* stream) = 0;
  virtual void build_index(uint32_t layer, void* stream) = 0;
  // kv_source = KVS_KV_CALLER: the layer's tokens are those of the caller's cache from now on (the
  // layer's count stays; add_tokens and decode then take no k/v and count the next bound tokens).
  // Checks what the session could not (page size, memory); on error the previous binding stays.
  // The default refuses (UNSUPPORTED).
  virtual void bind_kv(uint32_t layer, const BoundKv& kv, const char* fn, void* stream);
  // Once per token for a batch (batch[0] == this), before its layers' decode calls: reserve room
  // for one more token in every layer and size workspaces, so decode allocates nothing. Host work
  // (uploads of page tables in stream order). The default has nothing to reserve.
  virtual void plan(std::span<Placement* const> batch, void* stream) {}
  // One layer's decode step for a batch of placements of this same kind (batch[0] == this), each
  // layer prefilled and indexed (checked by the session). Fills reports[b]. All or nothing.
  virtual void decode(std::span<Placement* const> batch, uint32_t layer, const StepTensors& t,
                      std::span<StepReport> reports) = 0;

  // Rollback (kvs_session_truncate). The fewest tokens `layer` can be cut back to so that decoding
  // continues exactly as if the rest had never been appended, and in *why what sets that limit;
  // -1 with the reason in *why where this placement cannot truncate (the default).
  virtual int64_t truncate_floor(uint32_t layer, std::string* why) const;
  // Keeps the first n tokens of every layer; each layer holding more was checked against
  // truncate_floor by the session. The default refuses (UNSUPPORTED).
  virtual void truncate(int64_t n);
  // Whether decode writes lse in base 2 when the session asks (kvs_session_params.lse_base); the
  // session refuses KVS_LSE_BASE_2 at creation where not. The default: no.
  virtual bool lse_base2() const { return false; }

  // The keys the last decode step of the layer attended for a KV head (sorted; union over the
  // group for per-query-head methods). May synchronise with the device.
  virtual std::vector<int32_t> last_selection(uint32_t layer, uint32_t kv_head) const = 0;
  virtual void stats(kvs_session_stats& st) const = 0;  // kv_bytes, kv_shared_bytes, index_bytes, workspace_bytes
  // The steps that returned deferred (their selection is made after decode returns, in stream
  // order) and have completed since the last call, each counted once (a step that failed and was
  // taken back is not); waits for the steps in flight. The default: none.
  virtual Settled settled_reports() const { return {}; }
  virtual bool stat(std::string_view name, double* out) const = 0;

  // Tables: the method's header entries and sections, and the KV pages when with_kv.
  virtual nlohmann::json save_meta() const = 0;
  virtual void save(io::TablesWriter& w, bool with_kv) const = 0;
  // After construction: KV pages of layer l from the file (tokens[l] > 0 and with_kv), then the
  // method's sections. Copies everything out of the file, except that with map (KVS_LOAD_MMAP) a
  // placement whose KV lives in host memory may keep its pages in the file's mapping (read-only,
  // copied on the first write) instead.
  virtual void load(const std::shared_ptr<const io::TablesFile>& f, const nlohmann::json& method_meta,
                    const std::vector<int64_t>& tokens, bool with_kv, const std::string& path, bool map) = 0;
  // After load: the method's check that its index of `layer` fits `tokens` tokens (see
  // Method::index_fits).
  virtual bool index_fits(uint32_t layer, int64_t tokens, std::string* why) const = 0;
  // A copy sharing what can be shared (KV pages copy-on-write on the host).
  virtual std::unique_ptr<Placement> fork() const = 0;
};

// Creates the placement of a session (the backend in cfg), or throws UNSUPPORTED naming the reason.
std::unique_ptr<Placement> make_placement(const SessionConfig& cfg, const MethodSpec& spec, const ParamSet& params,
                                          std::shared_ptr<ThreadPool> pool);

// Whether `method` runs on `backend` in this build; if not, why (a sentence for the user).
bool method_supported(const MethodSpec& spec, int32_t backend, std::string* why_not);

}  // namespace kvs
