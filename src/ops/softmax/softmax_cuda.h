// CUDA launchers of the softmax family (softmax_forward.cu, softmax_backward.cu); arguments
// arrive validated by softmax.cc. Each row is read once and written once: the whole row sits
// in registers, across a thread-block cluster for long rows (common/row_kernel.cuh), rows of
// any length up to detail::max_row_cols and any alignment. Longer rows throw.
#pragma once

#include <cstdint>

#include "common/row_config.h"
#include "trainscale/softmax.h"

namespace trainscale::ops::softmax {

// How rows reach the registers. kAuto: the launchers' choice by shape, kDirect where
// direct_feed_default takes the rows, else kRowSplits. kDirect: detail::direct_split's rows
// (aligned, 129-32768 16-byte slots: bf16 N 1032-262144) straight from global memory into a
// block, or beyond 4096 slots a cluster of blocks, per row, no ring; other rows throw
// UnsupportedVariantError. kRowSplits: launch_rows's split by row length (a ring, the dense
// feed, clusters for long rows), any row. The last two are for the bench and tests.
enum class SoftmaxFeed { kAuto, kDirect, kRowSplits };

// kDirect over many rows of 1025-4096 slots: 13-15 % faster forward and 9-15 % backward than
// the row splits at bf16 32768 x 16384 and x 32768 (docs/perf/softmax.md). A grid of a block per
// row wants many rows, as the dense feed does; fewer rows keep the row splits. Shorter rows
// (the dense feed's) and clusters (rows over 4096 slots) are taken only where forced until
// measured.
constexpr std::int64_t kDirectDefaultMinSlots = 1025, kDirectMinRows = 16384;
inline bool direct_feed_default(bool aligned, std::int64_t slots, std::int64_t rows) {
  return aligned && slots >= kDirectDefaultMinSlots && slots <= detail::kDirectBlockSlots && rows >= kDirectMinRows;
}

void softmax_forward_cuda(const TensorView& x, TensorView y, cudaStream_t stream,
                          SoftmaxFeed feed = SoftmaxFeed::kAuto);
void softmax_backward_cuda(const TensorView& dy, const TensorView& y, TensorView dx,
                           cudaStream_t stream, SoftmaxFeed feed = SoftmaxFeed::kAuto);

}  // namespace trainscale::ops::softmax
