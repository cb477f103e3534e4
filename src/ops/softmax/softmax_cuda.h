// CUDA launchers of the softmax family (softmax_forward.cu, softmax_backward.cu); arguments
// arrive validated by softmax.cc. Each row is read once and written once: the whole row sits
// in registers, across a thread-block cluster for long rows (common/row_kernel.cuh), rows of
// any length up to detail::max_row_cols and any alignment. Longer rows throw.
#pragma once

#include <cstdint>
#include <string>

#include "trainscale/error.h"
#include "trainscale/softmax.h"

namespace trainscale::ops::softmax {

// How rows reach the registers. kAuto: the launchers' choice by shape, kDirect where
// direct_feed_default takes the rows, else kRowSplits. kDirect: rows of 1025-4096 16-byte slots
// (bf16 N 8200-32768) at 16 bytes, straight from global memory into one 512- or 1024-thread block
// per row, no ring; other rows throw UnsupportedVariantError. kRowSplits: launch_rows's split by
// row length (a ring, clusters for long rows), any row. The last two are for the bench and tests.
enum class SoftmaxFeed { kAuto, kDirect, kRowSplits };

constexpr std::int64_t kDirectMinSlots = 1025, kDirectMaxSlots = 4096;
// kDirect over many rows: 13-15 % faster forward and 9-15 % backward than the row splits at bf16
// 32768 x 16384 and x 32768 (docs/perf/softmax.md). A grid of a block per row wants many rows,
// as the dense feed does; fewer rows keep the row splits.
constexpr std::int64_t kDirectMinRows = 16384;
inline bool direct_feed_default(bool aligned, std::int64_t slots, std::int64_t rows) {
  return aligned && slots >= kDirectMinSlots && slots <= kDirectMaxSlots && rows >= kDirectMinRows;
}

// kDirect's block for rows of `slots` 16-byte slots (`aligned`: rows_at_slots for every tensor):
// 512 threads up to 2048 slots, else 1024; throws UnsupportedVariantError for rows it does not take.
inline int direct_feed_threads(const char* op, bool aligned, std::int64_t slots, std::int64_t cols) {
  if (!aligned || slots < kDirectMinSlots || slots > kDirectMaxSlots) {
    throw UnsupportedVariantError(std::string("trainscale ") + op +
                                  ": the direct feed takes rows at 16 bytes of 1025-4096 16-byte slots; got rows of " +
                                  std::to_string(cols) + " elements");
  }
  return slots <= 2048 ? 512 : 1024;
}

void softmax_forward_cuda(const TensorView& x, TensorView y, cudaStream_t stream,
                          SoftmaxFeed feed = SoftmaxFeed::kAuto);
void softmax_backward_cuda(const TensorView& dy, const TensorView& y, TensorView dx,
                           cudaStream_t stream, SoftmaxFeed feed = SoftmaxFeed::kAuto);

}  // namespace trainscale::ops::softmax
