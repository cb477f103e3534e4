// rmsnorm_backward on CUDA (norm_backward_launch.cuh), and the workspace every backward op of the
// family sizes its scratch by; one translation unit per op so the kernel instantiations build in
// parallel.
#include "ops/norm/norm_backward_launch.cuh"

namespace trainscale::ops::norm {

std::size_t backward_workspace_bytes_cuda(std::int64_t rows, std::int64_t cols, DType /*dtype*/) {
  // The most partial rows any plan can pick (sm_count x kMaxBlocksPerSm, at most one per row),
  // for the weight and the bias gradient.
  const std::int64_t groups = blocks_for(rows, kMaxBlocksPerSm);
  return static_cast<std::size_t>(std::max<std::int64_t>(groups, 1)) * cols * sizeof(float) * 2;
}

void rmsnorm_backward_cuda(const TensorView& dy, const TensorView& x, const TensorView& weight,
                           const TensorView& rstd, TensorView dx, TensorView dw,
                           TensorView workspace, const RMSNormOptions& options,
                           cudaStream_t stream) {
  const char* op = "rmsnorm_backward";
  const NormVariant variant = options.variant;
  BackwardArgs a = make_args(dy, x, weight, {}, rstd, dx);
  a.weight_offset = static_cast<float>(options.weight_offset);
  detail::dispatch_activation_dtype(dy.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_backward<T, T, Kind::kRms>(a, dw, {}, workspace, variant, stream, op);
  });
}

}  // namespace trainscale::ops::norm
