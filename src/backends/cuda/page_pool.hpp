// SPDX-License-Identifier: Apache-2.0
// Device KV pages: a process-wide pool per (device, page size) that carves pages out of slabs of
// 64 MiB (one cudaMalloc per slab, not per page), reference-counted so forked sessions share their
// prefix's pages (copied before a shared page is written).
#pragma once
#ifdef KVS_HAVE_CUDA
#include <cstddef>
#include <memory>

namespace kvs {

class DevicePage {
 public:
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  ~DevicePage();
  DevicePage(const DevicePage&) = delete;
  DevicePage& operator=(const DevicePage&) = delete;

 private:
  friend class DevicePagePool;
  DevicePage(void* d, size_t b, std::shared_ptr<class DevicePagePool> pool) : data_(d), bytes_(b), pool_(std::move(pool)) {}
  void* data_;
  size_t bytes_;
  std::shared_ptr<class DevicePagePool> pool_;
};

// A new page of `bytes` on `device` (the current device must be `device`). Throws OUT_OF_MEMORY.
std::shared_ptr<DevicePage> device_page(int device, size_t bytes);

}  // namespace kvs
#endif
