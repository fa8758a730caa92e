// SPDX-License-Identifier: Apache-2.0
// Safetensors files (8-byte little-endian header length, JSON header, raw little-endian data),
// read through a read-only mmap and written atomically, and the kvsieve trace format on top of
// them (docs/formats.md, "Trace"). Files written by Python's `safetensors` package read as-is.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.hpp"
#include "io/tables.hpp"  // Piece

namespace kvs::io {

class MappedFile;

// Bytes per element of a safetensors dtype name ("F32", "BF16", "I32", ...); 0 if unknown.
size_t safetensors_dtype_size(std::string_view dtype);

struct StTensor {
  std::string name;
  std::string dtype;           // safetensors name: "F32", "F16", "BF16", "I32", ...
  size_t elem_size = 0;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // data_offsets, relative to the start of the data buffer
  const std::byte* data = nullptr;  // into the mapping, aligned to elem_size
  uint64_t nbytes() const { return end - begin; }
  int64_t numel() const;
};

// A validated safetensors file: header JSON well-formed, every tensor's dtype known, its byte
// size matching its shape, its data inside the file and aligned to its element size, and the
// tensors covering the data buffer exactly (no overlap, no hole, no trailing bytes).
// Throws FORMAT_TRUNCATED (data shorter than the header says), FORMAT_INVALID (anything else),
// KVS_STATUS_IO. @threadsafety concurrent-const
class SafetensorsFile {
 public:
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<StTensor>& tensors() const { return tensors_; }
  const StTensor* find(std::string_view name) const;
  std::string path() const;
  uint64_t file_size() const;

 private:
  SafetensorsFile() = default;
  std::shared_ptr<MappedFile> map_;
  std::map<std::string, std::string> metadata_;
  std::vector<StTensor> tensors_;  // sorted by name
};

// Writes a safetensors file atomically. Tensor data is borrowed (pieces written back to back)
// until write_atomic returns. Tensors are laid out by descending element size, then name (as
// the Python package does), and the data buffer starts 64-byte aligned.
class SafetensorsWriter {
 public:
  void set_metadata(std::string key, std::string value);
  // Throws KVS_STATUS_INVALID_ARGUMENT for an unknown dtype, a duplicate name, a negative extent
  // or pieces whose total size does not match the shape.
  void add(std::string name, std::string dtype, std::vector<int64_t> shape, std::vector<Piece> pieces);
  void write_atomic(const std::string& path);

 private:
  struct Pending {
    std::string name, dtype;
    std::vector<int64_t> shape;
    std::vector<Piece> pieces;
    uint64_t nbytes;
    size_t elem_size;
  };
  std::map<std::string, std::string> metadata_;
  std::vector<Pending> tensors_;
};

// ------------------------------------------------------------------------------------------------
// Traces ("kvsieve-trace", version 1)

struct TraceMeta {
  uint32_t num_layers = 0;
  uint32_t num_q_heads = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  int64_t prefill_len = 0;
  float softmax_scale = 0.f;  // 0 = absent (1/sqrt(head_dim))
  std::string source;         // empty = absent
};

struct TraceTensor {
  const void* data = nullptr;  // read-only mapping
  DType dtype = DType::F32;
  int64_t shape[3] = {0, 0, 0};  // [T, H, d], C-contiguous
  uint64_t nbytes = 0;
};

// A memory-mapped, validated trace. @threadsafety concurrent-const
class Trace {
 public:
  // Throws FORMAT_INVALID naming the tensor or metadata key and what was expected,
  // FORMAT_VERSION for a trace version other than 1, FORMAT_TRUNCATED, KVS_STATUS_IO.
  static std::shared_ptr<Trace> open(const std::string& path);

  const TraceMeta& meta() const { return meta_; }
  int64_t total_len() const { return total_len_; }  // T
  DType dtype() const { return dtype_; }
  float softmax_scale() const;                       // resolved: meta().softmax_scale or 1/sqrt(d)
  const std::vector<uint32_t>& layers() const { return layers_; }  // ascending
  bool has_layer(uint32_t layer) const;
  // name: "q", "k" or "v". Throws KVS_STATUS_INVALID_ARGUMENT for an absent layer or bad name.
  TraceTensor tensor(uint32_t layer, std::string_view name) const;
  const int32_t* tokens() const { return tokens_; }  // [T] or nullptr
  std::string path() const;

 private:
  Trace() = default;
  std::shared_ptr<SafetensorsFile> file_;
  TraceMeta meta_;
  int64_t total_len_ = 0;
  DType dtype_ = DType::F32;
  std::vector<uint32_t> layers_;
  std::vector<std::array<const StTensor*, 3>> qkv_;  // parallel to layers_
  const int32_t* tokens_ = nullptr;
};

// One present layer for write_trace: q [T, Hq, d], k and v [T, Hkv, d], C-contiguous bytes of the
// trace dtype, each possibly split into several pieces written back to back.
struct TraceLayerData {
  uint32_t layer;
  std::vector<Piece> q, k, v;
};

// Validates (same rules as Trace::open) and writes atomically. tokens: [T] int32 or nullptr.
// Throws KVS_STATUS_INVALID_ARGUMENT naming what is wrong, KVS_STATUS_IO.
void write_trace(const std::string& path, const TraceMeta& meta, DType dtype, int64_t total_len,
                 const std::vector<TraceLayerData>& layers, const int32_t* tokens);

}  // namespace kvs::io
