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

// How rows reach the registers. kAuto: the launchers' choice by shape. kDirect (for the bench
// and tests until it is measured against kAuto): rows of 1025-4096 16-byte slots (bf16 N
// 8200-32768) at 16 bytes, straight from global memory into one 512- or 1024-thread block per
// row, no ring; other rows throw UnsupportedVariantError.
enum class SoftmaxFeed { kAuto, kDirect };

// kDirect's block for rows of `slots` 16-byte slots (`aligned`: rows_at_slots for every tensor):
// 512 threads up to 2048 slots, else 1024; throws UnsupportedVariantError for rows it does not take.
inline int direct_feed_threads(const char* op, bool aligned, std::int64_t slots, std::int64_t cols) {
  if (!aligned || slots <= 1024 || slots > 4096) {
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
