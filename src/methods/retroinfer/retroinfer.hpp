// SPDX-License-Identifier: Apache-2.0
// The CPU retroinfer method's index and step rules as another placement reads them: the cuda
// placement (retroinfer_cuda.cpp) keeps the CPU method as its host index (built and updated by
// the same code, saved in the same tables sections) and mirrors its meta index on the device.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/method.hpp"
#include "methods/retroinfer/wave_index.hpp"

namespace kvs::retro {

// One layer's index (the CPU method's, read only while the method is not changed).
struct IndexView {
  const std::vector<WaveHead>* heads = nullptr;  // Hkv heads; empty: nothing indexed
  int64_t indexed_end = 0;                       // tokens [sinks, indexed_end) are clustered
  int64_t r = 0, e = 0;                          // budget=paper retrieval clusters; estimation clusters
  uint64_t generation = 0;                       // differs after any change to the layer's index
  // Differs after any change other than clusters appended (an update): while it holds, the
  // clusters, rows and meta rows seen before are unchanged (a device copy need only send the new).
  uint64_t lineage = 0;
};

// How one step of a session lays out its zones before any cluster is ranked (the CPU method's
// select prologue).
struct StepLayout {
  enum Mode { All, Streaming, Paper, Session, Scaled } mode = All;
  int64_t sk = 0, lb = 0;    // steady zone [0, sk) and [lb, n)
  int64_t sinks_end = 0;     // min(sinks, n)
  int64_t room = 0;          // session modes: exact keys left for clusters and fill
  int64_t overrun = 0;       // session modes: how far the steady zone exceeds the budget
  int64_t lw = 0;            // Streaming: the recent window
};

struct Rules {
  int64_t sinks = 0, local = 0, update_segment = 0;
  bool mask_after = true;    // mask_empty=after_softmax
  bool rank_model = false;   // rank_dtype=model
  bool paper = false;        // budget=paper (the steps' zones by the r_fixed largest-ranked clusters)
  KMeansConfig update_kmeans;  // the k-means of an incremental update (update_segment tokens, one segment)
  int64_t index_min = 0;       // clusterable tokens a layer without an index waits for (more than this)
};

// m must be the CPU retroinfer method (retroinfer_spec().create): anything else is an internal error.
IndexView index_view(const Method& m, uint32_t layer);
// True when the layer, holding n tokens, is due an index update (the CPU method's on_append rule).
bool update_due(const Method& m, uint32_t layer, int64_t n);
StepLayout step_layout(const Method& m, uint32_t layer, int64_t n, int64_t budget_keys);
Rules rules(const Method& m);
// The CPU method's step statistics replaced (for its stat()): the last step's figures (KV head
// averages), and the budget unused / overrun added up over `steps` selects (every layer of every
// step, as the CPU counts them).
struct StepFigures {
  double retrieval_clusters = 0, retrieval_tokens = 0, estimation_clusters = 0, estimation_tokens = 0,
         steady_tokens = 0, fill_tokens = 0, budget_unused = 0, budget_overrun = 0;
};
void record_steps(Method& m, const StepFigures& last, double sum_unused, double sum_overrun, int64_t steps);

// Replaces the CPU k-means of m's index builds and updates (another placement clusters where its
// keys are): clusters tokens [b, b + n) of every KV head of the layer with cfg's clusters and
// segments, filling assign [Hkv][n] and centroids [Hkv][C * d] as retro::segmented_kmeans does.
// The rest of the build (lists, value sums, zones) stays the CPU method's. Null: the CPU k-means.
using Clusterer = std::function<void(uint32_t layer, int64_t b, int64_t n, const KMeansConfig& cfg,
                                     std::vector<std::vector<int32_t>>& assign, std::vector<std::vector<float>>& centroids)>;
void set_clusterer(Method& m, Clusterer c);

}  // namespace kvs::retro
