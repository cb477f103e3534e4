// CUDA launchers of the fp8 family (fp8_quantize.cu, fp8_dequantize.cu); arguments arrive validated by fp8.cc.
#pragma once

#include "trainscale/fp8.h"

namespace trainscale::ops::fp8 {

void fp8_quantize_cuda(const TensorView& x, TensorView q, TensorView scales, TensorView q_t,
                       TensorView scales_t, const Fp8QuantizeOptions& options,
                       cudaStream_t stream);
void fp8_dequantize_cuda(const TensorView& q, const TensorView& scales, TensorView y,
                         const Fp8QuantizeOptions& options, cudaStream_t stream);

}  // namespace trainscale::ops::fp8
