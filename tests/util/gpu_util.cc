#include "util/gpu_util.h"

#include <cstring>

#if TRAINSCALE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace trainscale::test {

#if TRAINSCALE_HAVE_CUDA
namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("test CUDA call ") + what + ": " + cudaGetErrorString(e));
}
}  // namespace

bool cuda_available() {
  static const bool available = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }();
  return available;
}

DeviceTensor::DeviceTensor(const HostTensor& host, bool copy)
    : layout_(host), bytes_(host.storage_bytes()) {
  check(cudaMalloc(&data_, bytes_), "cudaMalloc");
  if (copy) {
    check(cudaMemcpy(data_, host.data(), bytes_, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  } else {
    poison();
  }
  view_ = host.view();
  view_.data = data_;
  view_.device = Device::cuda(0);
}

DeviceTensor::~DeviceTensor() { cudaFree(data_); }

void DeviceTensor::poison() { check(cudaMemset(data_, 0xFF, bytes_), "cudaMemset"); }

void DeviceTensor::copy_to(HostTensor& host) const {
  check(cudaDeviceSynchronize(), "kernel (cudaDeviceSynchronize)");
  check(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
}

HostTensor DeviceTensor::to_host() const {
  HostTensor h = layout_;
  copy_to(h);
  return h;
}

void device_synchronize() { check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

#else

bool cuda_available() { return false; }
DeviceTensor::DeviceTensor(const HostTensor& host, bool) : layout_(host) {
  throw Error("DeviceTensor: built without CUDA");
}
DeviceTensor::~DeviceTensor() = default;
void DeviceTensor::poison() {}
void DeviceTensor::copy_to(HostTensor&) const {}
HostTensor DeviceTensor::to_host() const { return layout_; }
void device_synchronize() {}

#endif

}  // namespace trainscale::test
