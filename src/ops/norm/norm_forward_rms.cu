// rmsnorm_forward on CUDA (norm_forward_launch.cuh); one translation unit per op so the
// kernel instantiations build in parallel.
#include "ops/norm/norm_forward_launch.cuh"

namespace trainscale::ops::norm {

void rmsnorm_forward_cuda(const TensorView& x, const TensorView& weight, TensorView y,
                          TensorView rstd, const RMSNormOptions& options, cudaStream_t stream) {
  ForwardArgs a = make_args(x, weight, {}, y, {}, rstd);
  a.eps = static_cast<float>(options.eps);
  a.weight_offset = static_cast<float>(options.weight_offset);
  detail::dispatch_activation_dtype(x.dtype, "rmsnorm_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_forward<T, void, Kind::kRms>(a, options.variant, stream, "rmsnorm_forward");
  });
}

}  // namespace trainscale::ops::norm
