// SPDX-License-Identifier: Apache-2.0
// RetroInfer's wave index (Chen et al., arXiv 2505.02922; docs/methods/retroinfer.md, after
// microsoft/RetrievalAttention@6b1228c cache_hub/kmeans.py and wave_buffer_cpu.cpp): the segmented
// spherical k-means that clusters a KV head's keys, and the per-head cluster store it fills.
//
// Store layout (one WaveHead per layer and KV head; docs/methods/retroinfer.md "Layout"):
//   meta index   centroids [C][d] fp32, value_sum [C][d] fp32, size [C] int32 (exact counts),
//                start [C] int64 (first row of the cluster in the lists)
//   lists        pos [R] int32 (original token positions), keys [R][d] and values [R][d] in the
//                KV dtype; rows are grouped cluster by cluster (cluster c owns rows
//                [start[c], start[c] + size[c]), positions ascending inside a cluster), clusters in
//                index order, so start[c] = sum of the sizes before c. A block cache pages a
//                cluster as ceil(size/page_rows) pages of page_rows consecutive rows starting at
//                start[c] (the authors' ClusterDescriptor{CPUStartIndex, BlockNum, LastBlockSize}).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "backends/cpu/gemm.hpp"
#include "core/kv_store.hpp"
#include "core/thread_pool.hpp"

namespace kvs::retro {

// Python's round(): to the nearest integer, halves to even (every rounding of the authors' config).
int64_t round_half_even(double x);
// Segments for a context of n tokens: max(round(n / segment_size), 1); segment_size 0 = one segment
// (whole context). config.py generate_config.
int64_t segment_count(int64_t n, int64_t segment_size);
// Clusters for a context of n tokens: c = max(round(n / avg_cluster_size), L) for L = lcm(align,
// segments), then the nearer of the multiples of L below and above c, the lower one on a tie
// (config.py; the multiple is the authors' CUTLASS tile constraint).
int64_t cluster_count(int64_t n, int64_t avg_cluster_size, int64_t align, int64_t segments);
// Clusters for an incremental update of u tokens: max(floor(round(u / avg) / align) * align, align)
// (UPDATE_CENTROIDS = max(round(1024/16)//8*8, 8) = 64).
int64_t update_cluster_count(int64_t u, int64_t avg_cluster_size, int64_t align);

struct KMeansConfig {
  int64_t clusters = 1;  // C, a multiple of segments
  int64_t segments = 1;  // s
  int iterations = 10;   // iterations - 1 per-segment spherical passes, then one global pass
  bool centre = true;    // subtract the keys' mean before clustering (added back to the centroids)
  bool raw_init = true;  // initial centroids: the raw keys at the authors' positions (kmeans.py), or,
                         // false, per-segment positions L2-normalised
  bool operator==(const KMeansConfig&) const = default;
};

// Segmented spherical k-means over H independent heads (kmeans.segment_k_means):
//  * X[h] is [n][d] fp32; it is centred in place when cfg.centre (mean mu[h] subtracted).
//  * Segment j holds rows [j*m, (j+1)*m), m = n / s, and centroids [j*C/s, (j+1)*C/s). raw_init
//    (kmeans.py): centroid c starts as row floor(c*n/C + n/(2*C)) of the whole run, as it is (the
//    first assignment compares raw dot products); otherwise centroid c of a segment starts as the
//    segment's row floor(c*m/Cs + m/(2*Cs)), L2-normalised.
//  * iterations - 1 passes inside each segment: assign every row to argmax_c <x, c> over the
//    segment's centroids, set each centroid to its members' mean, L2-normalise (an empty cluster
//    keeps its centroid). The n mod s remainder rows take no part.
//  * One final global pass: every row (remainder included) is assigned against all C centroids,
//    and the centroids become the un-normalised means of their members, plus mu (the true key
//    means the Jensen bound of eq. 3 needs). Empty clusters keep their last centroid (+ mu).
// Outputs assign[h] [n] in [0, C) and centroids[h] [C][d]. Parallel over (head, segment) and
// (head, row block) on the pool.
void segmented_kmeans(const std::vector<float*>& X, int64_t n, int d, const KMeansConfig& cfg, ThreadPool& pool,
                      cpu::GemmProvider gemm, std::vector<std::vector<int32_t>>& assign,
                      std::vector<std::vector<float>>& centroids);

struct WaveHead {
  std::vector<float> centroids;  // [C][d]
  std::vector<float> value_sum;  // [C][d]
  std::vector<int32_t> size;     // [C]
  std::vector<int64_t> start;    // [C]
  std::vector<int32_t> pos;      // [R]
  std::vector<std::byte> keys, values;  // [R][d] in the KV dtype
  // Decode copy of the meta index (derived from the above, not saved): centroids and value means
  // (value_sum / size, 0 for an empty cluster) [C][d] in the 16-bit dtype mdt (the authors keep
  // the meta index in the model dtype). Empty when mdt is F32: decode then reads centroids and
  // value_sum directly.
  DType mdt = DType::F32;
  std::vector<std::byte> dcent, dvmean;
  int64_t clusters() const { return int64_t(size.size()); }
  int64_t rows() const { return int64_t(pos.size()); }
  uint64_t bytes() const;
  // Drops clusters >= c and their rows (rows >= start[c]).
  void truncate_clusters(int64_t c, size_t row_bytes);
  // Brings the decode copy up to date for dtype t (converts the clusters it lacks). t = F16 falls
  // back to BF16 for the whole head once a centroid or value mean exceeds fp16's range.
  void sync_decode(DType t, int d);
};

// Appends C clusters of tokens [tok_begin, tok_begin + m) of head h: assign[i] is the cluster of
// token tok_begin + i, centroids [C][d]. Rows are copied from kv (stored dtype, bytes unchanged)
// cluster by cluster; value sums accumulate in fp64 from the stored values.
void append_clusters(WaveHead& head, const KVLayer& kv, int h, int64_t tok_begin, int64_t m, const int32_t* assign,
                     const float* centroids, int64_t C);

// Weighted attention over clusters ids of one head for query q (eqs. 2-4 of the paper):
// logit_i = scale * q.C_i, lse = log sum_i size_i e^logit_i, o = sum_i e^logit_i VS_i / sum_i size_i e^logit_i.
// Empty clusters contribute nothing; no cluster gives lse = -inf, o = 0. Reference-style (fp64
// accumulation), used by the tests and the recall probe.
void cluster_attention(const WaveHead& head, const float* q, int d, float scale, const std::vector<int32_t>& ids,
                       float* o, float* lse);

}  // namespace kvs::retro
