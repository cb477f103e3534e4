// layernorm_forward on CUDA (norm_forward_launch.cuh); one translation unit per op so the
// kernel instantiations build in parallel.
#include "ops/norm/norm_forward_launch.cuh"

namespace trainscale::ops::norm {

void layernorm_forward_cuda(const TensorView& x, const TensorView& weight, const TensorView& bias,
                            TensorView y, TensorView mean, TensorView rstd,
                            const LayerNormOptions& options, cudaStream_t stream) {
  ForwardArgs a = make_args(x, weight, bias, y, mean, rstd);
  a.eps = static_cast<float>(options.eps);
  detail::dispatch_activation_dtype(x.dtype, "layernorm_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_forward<T, void, Kind::kLayer>(a, options.variant, stream, "layernorm_forward");
  });
}

}  // namespace trainscale::ops::norm
