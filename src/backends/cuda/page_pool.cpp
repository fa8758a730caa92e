// SPDX-License-Identifier: Apache-2.0
#ifdef KVS_HAVE_CUDA
#include "backends/cuda/page_pool.hpp"

#include <map>
#include <tuple>
#include <mutex>
#include <utility>
#include <vector>

#include "backends/cuda/cuda_util.hpp"

namespace kvs {

class DevicePagePool : public std::enable_shared_from_this<DevicePagePool> {
 public:
  DevicePagePool(int device, size_t page_bytes, PageMemory mem) : device_(device), page_bytes_(page_bytes), mem_(mem) {}
  // Slabs live as long as the pool (the process): freed pages are reused, not returned.
  ~DevicePagePool() {
    for (void* s : slabs_) mem_ == PageMemory::Device ? cudaFree(s) : cudaFreeHost(s);
  }
  std::shared_ptr<DevicePage> take() {
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (free_.empty()) grow();
      p = free_.back();
      free_.pop_back();
    }
    return std::shared_ptr<DevicePage>(new DevicePage(p, page_bytes_, mem_, shared_from_this()));
  }
  void give(void* p) {
    std::lock_guard<std::mutex> lk(mu_);
    free_.push_back(p);
  }

 private:
  void grow() {
    const size_t per_slab = std::max<size_t>(1, (size_t(64) << 20) / page_bytes_);
    void* s = nullptr;
    void* dev = nullptr;  // the slab's device address
    if (mem_ == PageMemory::Device) {
      cudautil::check(cudaMalloc(&s, per_slab * page_bytes_), "cudaMalloc(KV page slab)");
      dev = s;
    } else {
      cudautil::check(cudaHostAlloc(&s, per_slab * page_bytes_, cudaHostAllocMapped | cudaHostAllocPortable),
                      "cudaHostAlloc(KV page slab, pinned host)");
      if (cudaError_t e = cudaHostGetDevicePointer(&dev, s, 0); e != cudaSuccess) {
        cudaFreeHost(s);
        cudautil::check(e, "cudaHostGetDevicePointer(KV page slab)");
      }
    }
    slabs_.push_back(s);
    for (size_t i = per_slab; i-- > 0;) free_.push_back(static_cast<char*>(dev) + i * page_bytes_);
  }
  int device_;
  size_t page_bytes_;
  PageMemory mem_;
  std::mutex mu_;
  std::vector<void*> slabs_, free_;
};

DevicePage::~DevicePage() {
  if (pool_) pool_->give(data_);
}

std::shared_ptr<DevicePage> device_page(int device, size_t bytes, PageMemory mem) {
  static std::mutex mu;
  // Never destroyed: pools outlive every session, including sessions freed during exit.
  static auto* pools = new std::map<std::tuple<int, size_t, int>, std::shared_ptr<DevicePagePool>>();
  std::shared_ptr<DevicePagePool> pool;
  {
    std::lock_guard<std::mutex> lk(mu);
    auto& p = (*pools)[{device, bytes, int(mem)}];
    if (!p) p = std::make_shared<DevicePagePool>(device, bytes, mem);
    pool = p;
  }
  return pool->take();
}

}  // namespace kvs
#endif
