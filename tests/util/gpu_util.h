// Device-side helpers for GPU tests; every GPU test starts with TS_REQUIRE_GPU() so it skips
// cleanly on machines (and builds) without CUDA.
#pragma once

#include "util/test_util.h"

namespace trainscale::test {

bool cuda_available();

#define TS_REQUIRE_GPU()                                                            \
  do {                                                                              \
    if (!::trainscale::test::cuda_available()) GTEST_SKIP() << "no CUDA device";    \
  } while (0)

// Device copy of a HostTensor with the same dtype, shape and strides.
class DeviceTensor {
 public:
  explicit DeviceTensor(const HostTensor& host, bool copy = true);
  ~DeviceTensor();
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;

  TensorView view() const { return view_; }
  void poison();                       // every byte 0xFF: NaN in float dtypes
  void copy_to(HostTensor& host) const;  // same layout
  HostTensor to_host() const;

 private:
  HostTensor layout_;
  void* data_ = nullptr;
  std::int64_t bytes_ = 0;
  TensorView view_;
};

void device_synchronize();

}  // namespace trainscale::test
