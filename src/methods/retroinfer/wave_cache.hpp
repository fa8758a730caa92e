// SPDX-License-Identifier: Apache-2.0
// The wave buffer's block cache of one KV head, on the host (RetroInfer, Chen et al., arXiv
// 2505.02922, section 4.3; the authors' BufferManager in wave_buffer_cpu.cpp): which clusters of
// the head's lists hold GPU cache blocks, and the LRU order they leave in. A cluster of s rows
// takes ceil(s / block_rows) blocks, anywhere in the cache (ClusterDescriptor's GPUBlockIDs); its
// k-th block holds list rows [start + k * block_rows, ...). Pure host code: the cuda retroinfer
// method (retroinfer_cuda.cpp) runs it off the step's critical path and applies the moves on the
// GPU; the unit tests run it alone.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvs::retro {

// A block's change: list rows [row0, row0 + rows) enter `block` (block >= 0) or leave the cache.
struct WaveMoveRec {
  int32_t row0, rows, block;
};

class WaveCache {
 public:
  // Empty, with `blocks` blocks of block_rows rows, for `clusters` clusters.
  void reset(int32_t blocks, int32_t block_rows, int32_t clusters);
  // Room for more clusters (an index update appended them), not cached.
  void grow(int32_t clusters);
  int32_t blocks() const { return int32_t(owner_.size()); }
  int32_t clusters() const { return int32_t(head_.size()); }

  struct Step {
    int64_t hit_rows = 0, miss_rows = 0;
  };
  // One step that read clusters ids[0, n) (of sizes size[], first list rows start[]): each read
  // cluster moves to the front of the LRU list; the misses, in the order given, are admitted while
  // enough blocks are free or can be freed from the list's tail (clusters this step did not read;
  // once the tail is one it read, the rest of the misses stay out; a cluster larger than the cache
  // never enters). Appends the evictions and admissions to moves, the missed clusters to missed.
  Step step(const int32_t* ids, int32_t n, const int32_t* start, const int32_t* size, std::vector<WaveMoveRec>& moves,
            std::vector<int32_t>& missed);

  bool cached(int32_t c) const { return head_[size_t(c)] >= 0; }
  int32_t first_block(int32_t c) const { return head_[size_t(c)]; }  // -1: not cached
  int32_t next_block(int32_t b) const { return link_[size_t(b)]; }    // the cluster's next, -1: last
  int32_t owner(int32_t b) const { return owner_[size_t(b)]; }        // the first list row, -1: free

 private:
  void unlink(int32_t c);
  void push_front(int32_t c);

  int32_t rows_ = 8;
  std::vector<int32_t> head_, prev_, next_;  // per cluster: first block; LRU neighbours (most recent first)
  std::vector<int64_t> stamp_;               // per cluster: the last step that read it
  std::vector<int32_t> link_, owner_, free_; // per block: the next block of its cluster, its first row; free blocks
  int32_t first_ = -1, last_ = -1;
  int64_t step_ = 0;
};

}  // namespace kvs::retro
