// Non-owning tensor views and the vocabulary shared by every TrainScale entry point.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

// Same type as the CUDA runtime's, so callers pass their streams unchanged and a
// CUDA-less build still compiles the public headers.
typedef struct CUstream_st* cudaStream_t;

namespace trainscale {

enum class DType : std::uint8_t {
  kFloat64,  // CPU reference only (finite differences, gradcheck)
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat8E4M3,
  kFloat8E5M2,
  kInt32,
  kInt64,
};

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
bool is_floating(DType dtype);

enum class DeviceType : std::uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  static Device cpu() { return {}; }
  static Device cuda(int index = 0) { return {DeviceType::kCUDA, index}; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const;
};

inline constexpr int kMaxDims = 6;

// A view of memory someone else owns. Strides are in elements. A default-constructed
// view is "absent" (ndim == -1) and stands for an optional argument left out.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int ndim = -1;
  std::array<std::int64_t, kMaxDims> shape{};
  std::array<std::int64_t, kMaxDims> strides{};
  Device device{};

  TensorView() = default;
  // Row-major contiguous view.
  TensorView(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
             Device device = Device::cpu());
  TensorView(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
             std::initializer_list<std::int64_t> strides, Device device = Device::cpu());
  // Same, from arrays (bindings build views from runtime shapes).
  static TensorView from_arrays(void* data, DType dtype, int ndim, const std::int64_t* shape,
                                const std::int64_t* strides, Device device);

  bool defined() const { return ndim >= 0; }
  std::int64_t size(int dim) const;    // negative dims count from the end
  std::int64_t stride(int dim) const;  // likewise
  std::int64_t numel() const;
  std::size_t element_size() const { return dtype_size(dtype); }
  bool is_contiguous() const;
  bool is_cuda() const { return device.is_cuda(); }
  std::string shape_str() const;    // "[4, 8]"
  std::string strides_str() const;  // "[8, 1]"
  std::string describe() const;     // "bfloat16[4, 8] (strides [8, 1]) on cuda:0"

  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

}  // namespace trainscale
