// layernorm_backward on CUDA (norm_backward_launch.cuh); one translation unit per op.
#include "ops/norm/norm_backward_launch.cuh"

namespace trainscale::ops::norm {

void layernorm_backward_cuda(const TensorView& dy, const TensorView& x, const TensorView& weight,
                             const TensorView& mean, const TensorView& rstd, TensorView dx,
                             TensorView dw, TensorView db, TensorView workspace,
                             const LayerNormOptions& options, cudaStream_t stream) {
  const char* op = "layernorm_backward";
  const NormVariant variant = options.variant;
  BackwardArgs a = make_args(dy, x, weight, mean, rstd, dx);
  detail::dispatch_activation_dtype(dy.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_backward<T, T, Kind::kLayer>(a, dw, db, workspace, variant, stream, op);
  });
}

}  // namespace trainscale::ops::norm
