// SPDX-License-Identifier: Apache-2.0
// Shared by the libFuzzer harnesses: a scratch file the parsers read the input from, and the
// small tensors the harnesses hand to a session. Public C API only (include/kvsieve/kvsieve.h).
#pragma once
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kvsieve/kvsieve.h"

namespace kvs_fuzz {

// The file the readers take the input from (they take a path and memory-map it): an in-memory
// file (memfd, reached as /proc/self/fd/N), rewritten for every input. A file on disk would be
// about ten times slower: ext4 writes back a file truncated and rewritten on close. Nothing may
// still map it when it is rewritten (a mapped load is live on its file), so every harness destroys
// what it opened before returning.
class ScratchFile {
 public:
  ScratchFile() {
    fd_ = memfd_create("kvsieve-fuzz", MFD_CLOEXEC);
    if (fd_ >= 0) {
      path_ = "/proc/self/fd/" + std::to_string(fd_);
    } else {  // no memfd: a file in TMPDIR, one per process (-fork/-jobs run several)
      const char* dir = std::getenv("TMPDIR");
      path_ = std::string(dir && *dir ? dir : "/tmp") + "/kvsieve-fuzz." + std::to_string(getpid());
      fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      unlink_ = true;
    }
    if (fd_ < 0) die("cannot create a scratch file");
  }
  ~ScratchFile() {
    close(fd_);
    if (unlink_) unlink(path_.c_str());
  }
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;

  // Replaces the contents; returns the path to open.
  const std::string& write(const uint8_t* data, size_t size) {
    if (ftruncate(fd_, 0) != 0) die("ftruncate");
    size_t done = 0;
    while (done < size) {
      const ssize_t n = pwrite(fd_, data + done, size - done, off_t(done));
      if (n <= 0) die("pwrite");
      done += size_t(n);
    }
    return path_;
  }

 private:
  // The harness cannot run at all: not a finding, but never a silent pass.
  [[noreturn]] void die(const char* what) {
    std::perror(what);
    std::abort();
  }
  int fd_ = -1;
  bool unlink_ = false;
  std::string path_;
};

// One per process; destroyed at exit (libFuzzer ends with exit(), so static destructors run).
inline ScratchFile& scratch() {
  static ScratchFile f;
  return f;
}

// An error the parser returned: fine (that is what rejecting bad input looks like) unless it is an
// INTERNAL error, which no input may produce (issue 22: "no INTERNAL from a parser"). Frees it.
inline void expect_not_internal(kvs_error_t err, const char* call) {
  if (!err) return;
  if (kvs_error_code(err) == KVS_STATUS_INTERNAL) {
    std::fprintf(stderr, "%s returned KVS_STATUS_INTERNAL: %s\n", call, kvs_error_message(err));
    std::abort();
  }
  kvs_error_destroy(err);
}

// A C-contiguous fp32 host tensor with deterministic, non-zero contents.
struct Tensor {
  std::vector<float> data;
  std::vector<int64_t> shape;
  kvs_tensor t{};
  Tensor(std::vector<int64_t> dims, uint32_t seed) : shape(std::move(dims)) {
    size_t n = 1;
    for (int64_t d : shape) n *= size_t(d);
    data.resize(n);
    uint32_t x = seed * 2654435761u + 12345u;
    for (float& f : data) {
      x = x * 1664525u + 1013904223u;
      f = float(int32_t(x >> 8) % 2001 - 1000) / 1000.0f;
    }
    t.data = data.data();
    t.device = kvs_device{KVS_DEVICE_CPU, 0};
    t.ndim = int32_t(shape.size());
    t.dtype = kvs_dtype{KVS_DTYPE_CODE_FLOAT, 32, 1};
    t.shape = shape.data();
    t.strides = nullptr;
    t.byte_offset = 0;
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
};

}  // namespace kvs_fuzz
