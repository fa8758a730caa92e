// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the kvsieve command: error handling, RAII over the C handles, tensor
// descriptors, scalar conversions, small formatting utilities. Everything here goes through the
// public C API (<kvsieve/kvsieve.h>) only: the CLI is a client of the library like any other.
#pragma once

#include <kvsieve/kvsieve.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#ifdef KVS_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kvcli {

// ------------------------------------------------------------------------------------------------
// Errors and exit codes
// ------------------------------------------------------------------------------------------------

// Process exit codes (documented in docs/cli.md).
enum ExitCode : int {
  kExitOk = 0,
  kExitError = 1,     // a runtime failure: the library refused, a file could not be read, ...
  kExitUsage = 2,     // bad command line
  kExitCorrupt = 3,   // `inspect`: the file failed verification
};

// Thrown anywhere in the CLI; main() prints "kvsieve: error: <what>" and exits with `code`.
class CliError : public std::runtime_error {
 public:
  explicit CliError(const std::string& msg, int code = kExitError)
      : std::runtime_error(msg), code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

// A bad command line (exit code 2).
class UsageError : public CliError {
 public:
  explicit UsageError(const std::string& msg) : CliError(msg, kExitUsage) {}
};

// Name of a kvs_status ("INVALID_ARGUMENT", ...).
const char* status_name(int32_t code);

// Throws CliError("<context>: <library message> [STATUS]") when err is not NULL; frees err.
void check(kvs_error_t err, std::string_view context);

// Like check(), but hands the status code to the caller instead of throwing (err is freed).
struct Status {
  int32_t code = KVS_STATUS_OK;
  std::string message;
  bool ok() const { return code == KVS_STATUS_OK; }
};
Status take_status(kvs_error_t err);

// ------------------------------------------------------------------------------------------------
// Scalar types
// ------------------------------------------------------------------------------------------------

enum class DType : int32_t { F32 = KVS_SCALAR_F32, F16 = KVS_SCALAR_F16, BF16 = KVS_SCALAR_BF16 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);           // "f32", "f16", "bf16"
DType parse_dtype(std::string_view name);  // throws UsageError
DType dtype_from_scalar(int32_t kvs_scalar_type);  // throws CliError
kvs_dtype to_dl(DType t);
DType from_dl(const kvs_dtype& dt);  // throws CliError for anything but f32/f16/bf16

// Round-to-nearest-even conversions, bit exact on every platform (no _Float16 needed).
float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// Element i of a buffer of type t as float / stores a float (rounded) into element i.
inline float load_elem(const void* base, DType t, size_t i) {
  switch (t) {
    case DType::F32: {
      float f;
      std::memcpy(&f, static_cast<const char*>(base) + 4 * i, 4);
      return f;
    }
    case DType::BF16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const char*>(base) + 2 * i, 2);
      return bf16_to_f32(h);
    }
    case DType::F16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const char*>(base) + 2 * i, 2);
      return f16_to_f32(h);
    }
  }
  return 0.0f;
}
void store_elem(void* base, DType t, size_t i, float value);

// ------------------------------------------------------------------------------------------------
// Tensor descriptors
// ------------------------------------------------------------------------------------------------

// A kvs_tensor that owns its shape/stride arrays (the C struct only points at them), so it can be
// copied and stored in containers. Host memory only: the CLI never touches device memory.
class Tensor {
 public:
  Tensor() { fix(); }
  // A C-contiguous host tensor over `data` (borrowed).
  Tensor(const void* data, DType dtype, std::initializer_list<int64_t> shape);
  Tensor(const Tensor& o) { *this = o; }
  Tensor& operator=(const Tensor& o);

  const kvs_tensor* get() const { return &t_; }
  // The same shape over other (C-contiguous) storage: `data` on `device`.
  Tensor on(void* data, kvs_device device) const;
  // Bytes of the tensor's elements; copy_to_contiguous writes them C-contiguously to `dst` (host).
  size_t bytes() const;
  void copy_to_contiguous(void* dst) const;
  int ndim() const { return t_.ndim; }
  int64_t dim(int i) const { return shape_[size_t(i)]; }
  DType dtype() const { return dtype_; }

 private:
  friend class StridedArray;
  void fix() {
    t_.shape = shape_.data();
    t_.strides = has_strides_ ? strides_.data() : nullptr;
  }
  kvs_tensor t_{};
  DType dtype_ = DType::F32;
  std::array<int64_t, 4> shape_{};
  std::array<int64_t, 4> strides_{};
  bool has_strides_ = false;
};

// A host array [rows, heads, dim] (as a trace stores q/k/v), possibly strided, whose row slices
// become Tensors by pointer arithmetic.
class StridedArray {
 public:
  StridedArray() = default;
  // From a library-provided view (e.g. kvs_trace_tensor); `what` names it in errors.
  StridedArray(const kvs_tensor& view, std::string_view what);
  // Over a C-contiguous buffer.
  StridedArray(const void* data, DType dtype, int64_t rows, int64_t heads, int64_t dim);

  int64_t rows() const { return shape_[0]; }
  int64_t heads() const { return shape_[1]; }
  int64_t dim() const { return shape_[2]; }
  DType dtype() const { return dtype_; }

  // Start of element (row, head, 0); the `dim` elements after it are contiguous (checked).
  const void* at(int64_t row, int64_t head) const {
    return base_ + (row * strides_[0] + head * strides_[1]) * int64_t(dtype_size(dtype_));
  }
  // Rows [row0, row0 + n) as a [n, heads, dim] tensor.
  Tensor rows_view(int64_t row0, int64_t n) const;
  // Row `row` as a [heads, dim] tensor.
  Tensor row_view(int64_t row) const;

 private:
  const char* base_ = nullptr;
  DType dtype_ = DType::F32;
  std::array<int64_t, 3> shape_{};
  std::array<int64_t, 3> strides_{};
};

// ------------------------------------------------------------------------------------------------
// RAII over the C handles
// ------------------------------------------------------------------------------------------------

// A string the library allocated (kvs_string_free).
struct LibStringDeleter {
  void operator()(char* s) const { kvs_string_free(s); }
};
using LibString = std::unique_ptr<char, LibStringDeleter>;

class Trace {
 public:
  explicit Trace(const std::string& path);
  const kvs_trace_info& info() const { return info_; }
  const std::string& path() const { return path_; }
  // Layer indices present in the file, in file order.
  const std::vector<uint32_t>& present_layers() const { return layers_; }
  // "q", "k" or "v" of a present layer.
  StridedArray tensor(uint32_t layer, const char* name) const;
  double softmax_scale() const;
  DType dtype() const { return dtype_from_scalar(info_.dtype); }

 private:
  struct Deleter {
    void operator()(kvs_trace_s* t) const { kvs_trace_destroy(t); }
  };
  std::unique_ptr<kvs_trace_s, Deleter> handle_;
  std::string path_;
  kvs_trace_info info_{};
  std::vector<uint32_t> layers_;
};

#ifdef KVS_HAVE_CUDA
// A CUDA runtime error as a CliError ("CUDA: what: message").
void cuda_check(cudaError_t e, const char* what);

// Device memory owned for the scope (cudaMalloc / cudaFree) on the current device.
class DeviceBuffer {
 public:
  DeviceBuffer(size_t bytes, const char* what) : bytes_(bytes) {
    cuda_check(cudaMalloc(&p_, bytes > 0 ? bytes : 1), what);
  }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* get() const { return static_cast<char*>(p_); }
  size_t bytes() const { return bytes_; }
  void reset() {
    if (p_) cudaFree(p_);
    p_ = nullptr;
  }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};
#endif

struct DeviceStage;  // host tensors staged on the GPU (common.cpp; CUDA builds)

// A session; errors are prefixed with `label` (usually the method name). The commands pass it host
// tensors; on the cuda and hybrid backends (which take device tensors) prefill and decode copy them
// to the session's device and the outputs back.
class Session {
 public:
  Session(const kvs_session_params& params, std::string label);
  kvs_session_t get() const { return handle_.get(); }
  const std::string& label() const { return label_; }

  void prefill(uint32_t layer, const Tensor& q, const Tensor& k, const Tensor& v);
  void build_index();
  void decode(uint32_t layer, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
              const Tensor* lse);
  // Fills `out` with the last decode step's exact keys of (layer, kv_head).
  void last_selection(uint32_t layer, uint32_t kv_head, std::vector<int32_t>& out) const;
  kvs_session_stats stats() const;
  void save(const std::string& path, uint32_t flags) const;

 private:
  struct Deleter {
    void operator()(kvs_session_s* s) const { kvs_session_destroy(s); }
  };
  std::unique_ptr<kvs_session_s, Deleter> handle_;
  std::string label_;
  std::shared_ptr<DeviceStage> stage_;  // null on the cpu backend
};

// Session parameters of a trace's model shape (layers, heads, head dim, scale, KV dtype).
kvs_session_params session_params_for(const kvs_trace_info& info);

// ------------------------------------------------------------------------------------------------
// Registry and option parsing
// ------------------------------------------------------------------------------------------------

std::vector<std::string> registered_methods();
bool method_exists(std::string_view name);
// "cpu,cuda" from a kvs_method_backends mask.
std::string backends_string(uint32_t mask);
std::vector<std::string> backends_list(uint32_t mask);

int32_t parse_backend(std::string_view name);  // throws UsageError
const char* backend_name(int32_t backend);

// Splits on `sep`, trimming blanks; empty items are dropped.
std::vector<std::string> split(std::string_view s, char sep);
std::string join(const std::vector<std::string>& items, std::string_view sep);
// Comma-separated unsigned integers ("0,3,7").
std::vector<uint32_t> parse_index_list(std::string_view s, std::string_view what);

// Hardware threads when `requested` is 0.
unsigned resolve_threads(unsigned requested);

// Runs fn(i) for i in [0, n) on up to `threads` threads (the caller's included); the first
// exception thrown by any fn is rethrown after all have finished.
void parallel_for(size_t n, unsigned threads, const std::function<void(size_t)>& fn);

// ------------------------------------------------------------------------------------------------
// Output helpers
// ------------------------------------------------------------------------------------------------

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// printf-style formatting into a std::string.
std::string strfmt(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// "1.5 MiB"
std::string human_bytes(double bytes);

// A text table: right-aligns columns flagged numeric, left-aligns the others.
class TextTable {
 public:
  explicit TextTable(std::vector<std::string> headers, std::vector<bool> numeric = {});
  void add_row(std::vector<std::string> cells);
  // Every line is prefixed with `indent` spaces.
  std::string render(int indent = 0) const;

 private:
  std::vector<std::string> headers_;
  std::vector<bool> numeric_;
  std::vector<std::vector<std::string>> rows_;
};

// Writes text to a file, throwing CliError naming the path on failure.
void write_text_file(const std::string& path, const std::string& text);

// Median of a sample (copied); 0 for an empty one.
double median(std::vector<double> v);
// p-th percentile (0..100) with linear interpolation between closest ranks; 0 when empty.
double percentile(std::vector<double> v, double p);
// The arithmetic mean (0 for none): with the median, it shows work a method does every few steps.
double mean(const std::vector<double>& v);

}  // namespace kvcli
