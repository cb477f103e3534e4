// Storage types on the device and their float conversions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/check.h"

namespace trainscale::detail {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <class T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<T>{}) with T the device storage type of a float16/bfloat16/float32 dtype.
template <class Fn>
decltype(auto) dispatch_activation_dtype(DType dtype, std::string_view op, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(TypeTag<float>{});
    case DType::kFloat16: return fn(TypeTag<__half>{});
    case DType::kBFloat16: return fn(TypeTag<__nv_bfloat16>{});
    default: throw_op_error(op, std::string("no CUDA kernel for dtype ") + dtype_name(dtype));
  }
}

// Loads element i of a float32 or `T` array chosen at run time (parameters read once).
template <class T>
__device__ __forceinline__ float load_param(const void* p, bool is_float32, long long i) {
  return is_float32 ? static_cast<const float*>(p)[i] : to_float(static_cast<const T*>(p)[i]);
}

}  // namespace trainscale::detail
