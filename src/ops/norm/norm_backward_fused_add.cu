// fused_add_rmsnorm_backward on CUDA (norm_backward_launch.cuh), the residual in the activation
// dtype or in fp32; one translation unit per op.
#include "ops/norm/norm_backward_launch.cuh"

namespace trainscale::ops::norm {

void fused_add_rmsnorm_backward_cuda(const TensorView& dy, const TensorView& d_residual,
                                     const TensorView& residual, const TensorView& weight,
                                     const TensorView& rstd, TensorView dx, TensorView dw,
                                     TensorView workspace, const RMSNormOptions& options,
                                     cudaStream_t stream) {
  const char* op = "fused_add_rmsnorm_backward";
  const NormVariant variant = options.variant;
  BackwardArgs a = make_args(dy, residual, weight, {}, rstd, dx);
  a.weight_offset = static_cast<float>(options.weight_offset);
  if (d_residual.defined()) {
    a.d_residual = d_residual.data;
    a.d_residual_stride = detail::row_layout(d_residual).row_stride;
  }
  detail::dispatch_activation_dtype(dy.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (residual.dtype == DType::kFloat32) {
      launch_backward<T, float, Kind::kRms>(a, dw, {}, workspace, variant, stream, op);
    } else {
      launch_backward<T, T, Kind::kRms>(a, dw, {}, workspace, variant, stream, op);
    }
  });
}

}  // namespace trainscale::ops::norm
