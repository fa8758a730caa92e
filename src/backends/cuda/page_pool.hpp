// SPDX-License-Identifier: Apache-2.0
// KV pages of the cuda placement: a process-wide pool per (device, page size, memory) that carves
// pages out of slabs of 64 MiB (one allocation per slab, not per page), reference-counted so forked
// sessions share their prefix's pages (copied before a shared page is written). The memory is the
// device's own (cudaMalloc), or pinned host memory mapped into the device's address space
// (cudaHostAlloc, mapped and portable): the kernels then read and write the pages over the bus, so
// a context larger than the GPU's memory fits, at the bus's bandwidth.
#pragma once
#ifdef KVS_HAVE_CUDA
#include <cstddef>
#include <memory>

namespace kvs {

enum class PageMemory { Device, PinnedHost };

class DevicePage {
 public:
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  PageMemory memory() const { return mem_; }
  // A page of the caller's KV cache (kv_source = KVS_KV_CALLER): wrapped, never freed or written.
  static std::shared_ptr<DevicePage> wrap(void* d, size_t b) {
    return std::shared_ptr<DevicePage>(new DevicePage(d, b, PageMemory::Device, nullptr));
  }
  bool external() const { return pool_ == nullptr; }
  ~DevicePage();
  DevicePage(const DevicePage&) = delete;
  DevicePage& operator=(const DevicePage&) = delete;

 private:
  friend class DevicePagePool;
  DevicePage(void* d, size_t b, PageMemory m, std::shared_ptr<class DevicePagePool> pool)
      : data_(d), bytes_(b), mem_(m), pool_(std::move(pool)) {}
  void* data_;
  size_t bytes_;
  PageMemory mem_;
  std::shared_ptr<class DevicePagePool> pool_;
};

// A new page of `bytes` for `device` (the current device must be `device`), in `mem`; data() is a
// device address either way. Throws OUT_OF_MEMORY.
std::shared_ptr<DevicePage> device_page(int device, size_t bytes, PageMemory mem = PageMemory::Device);

}  // namespace kvs
#endif
