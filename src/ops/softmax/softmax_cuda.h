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

// kAuto takes kDirect for aligned rows of 129 slots and more over at least 4096 rows. One engine
// run (bf16) against the row splits: forward 10-13 % faster at N 6144-7168 and at 4096 x 8192
// (where the ring's 2-slot split leaves slots empty), within 0.5 % of the dense feed on its rows
// (N 2048-8192 over 16384 rows), 13-15 % at N 16384-32768, 5-6 % at 65536-131072 (clusters of 2
// and 4); backward 12-14 % from N 65536, within 2 % at 2048-32768 (docs/perf/softmax.md). The
// forward's clusters of 8 (N 131080-262144) ran 13 % slower than the ring, which keeps those
// rows. Fewer rows keep the row splits (not measured).
constexpr std::int64_t kDirectMinRows = 4096, kDirectForwardMaxSlots = 4 * detail::kDirectBlockSlots;
inline bool direct_feed_default(bool aligned, std::int64_t slots, std::int64_t rows, bool forward) {
  return aligned && rows >= kDirectMinRows && slots >= detail::kDirectMinSlots &&
         slots <= (forward ? kDirectForwardMaxSlots : detail::kDirectMaxSlots);
}

void softmax_forward_cuda(const TensorView& x, TensorView y, cudaStream_t stream,
                          SoftmaxFeed feed = SoftmaxFeed::kAuto);
void softmax_backward_cuda(const TensorView& dy, const TensorView& y, TensorView dx,
                           cudaStream_t stream, SoftmaxFeed feed = SoftmaxFeed::kAuto);

}  // namespace trainscale::ops::softmax
