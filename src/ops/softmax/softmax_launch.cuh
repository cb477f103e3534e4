// The launch shared by the softmax kernels: the row split for the rows' length and alignment,
// and the error for rows longer than any split holds (or whose cluster of 16 cannot be
// resident).
#pragma once

#include <string>

#include "common/row_kernel.cuh"
#include "core/check.h"

namespace trainscale::ops::softmax {

// make_kernel(threads, vecs, cluster) returns the kernel compiled for that split; it is
// launched with `args` over `rows` rows of `cols` elements whose largest shift is max_shift.
template <class T, class MakeKernel, class Args>
void launch_softmax_rows(const char* op, std::int64_t rows, std::int64_t cols, int max_shift,
                         cudaStream_t stream, MakeKernel&& make_kernel, Args& args) {
  if (rows == 0) return;
  constexpr int V = detail::kVec16<T>;
  const std::int64_t slots = detail::row_slots(cols, V, max_shift);
  args.slots = static_cast<int>(std::min<std::int64_t>(slots, 1 << 30));
  const auto launch = [&](const detail::RowConfig& config) {
    return detail::with_row_config<1>(config, [&](auto threads, auto vecs, auto cluster) {
      return detail::launch_row_kernel(make_kernel(threads, vecs, cluster), threads, cluster,
                                       rows, stream, op, args);
    });
  };
  const detail::RowConfig config = detail::row_config(slots, 1);
  if (config.threads > 0 && launch(config)) return;
  detail::throw_op_error(op, "rows of " + std::to_string(cols) +
                                 " elements are longer than the CUDA kernels hold (at most " +
                                 std::to_string(detail::max_row_cols(V)) +
                                 " with rows at 16 bytes, where a cluster of 16 blocks can be resident)");
}

}  // namespace trainscale::ops::softmax
