// The CUDA kernels' element type for an attention call's dtype (the launchers' dispatch).
#pragma once

#include <string>

#include <cutlass/numeric_types.h>

#include "common/dtype.cuh"
#include "core/check.h"

namespace trainscale::ops::attention {

// fn(detail::TypeTag<cutlass::bfloat16_t>) or fn(detail::TypeTag<cutlass::half_t>); any other
// dtype is `op`'s error (the entry points let only these reach the CUDA path).
template <class Fn>
void with_element_type(DType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case DType::kBFloat16: fn(detail::TypeTag<cutlass::bfloat16_t>{}); return;
    case DType::kFloat16: fn(detail::TypeTag<cutlass::half_t>{}); return;
    default: detail::throw_op_error(op, std::string("no CUDA kernel for dtype ") + dtype_name(dtype));
  }
}

}  // namespace trainscale::ops::attention
