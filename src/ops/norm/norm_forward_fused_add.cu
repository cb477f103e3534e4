// fused_add_rmsnorm_forward on CUDA (norm_forward_launch.cuh); one translation unit per op so
// the kernel instantiations build in parallel.
#include "ops/norm/norm_forward_launch.cuh"

namespace trainscale::ops::norm {

void fused_add_rmsnorm_forward_cuda(const TensorView& x, const TensorView& residual,
                                    const TensorView& weight, TensorView y, TensorView residual_out,
                                    TensorView rstd, const RMSNormOptions& options,
                                    cudaStream_t stream) {
  const char* op = "fused_add_rmsnorm_forward";
  ForwardArgs a = make_args(x, weight, {}, y, {}, rstd);
  a.residual = residual.data;
  a.residual_stride = detail::row_layout(residual).row_stride;
  a.residual_out = residual_out.data;
  a.residual_out_stride = detail::row_layout(residual_out).row_stride;
  a.eps = static_cast<float>(options.eps);
  a.weight_offset = static_cast<float>(options.weight_offset);
  detail::dispatch_activation_dtype(x.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (residual.dtype == DType::kFloat32) {
      launch_forward<T, float, Kind::kRms>(a, options.variant, stream, op);
    } else {
      launch_forward<T, T, Kind::kRms>(a, options.variant, stream, op);
    }
  });
}

}  // namespace trainscale::ops::norm
