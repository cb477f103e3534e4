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

// Whether kDirect takes rows of `slots` 16-byte slots (`aligned`: rows_at_slots for every tensor).
inline bool direct_feed(bool aligned, std::int64_t slots) { return aligned && slots > 1024 && slots <= 4096; }

[[noreturn]] inline void throw_direct_unsupported(const char* op, std::int64_t cols) {
  throw UnsupportedVariantError(std::string("trainscale ") + op +
                                ": the direct feed takes rows at 16 bytes of 1025-4096 16-byte slots; got rows of " +
                                std::to_string(cols) + " elements");
}

void softmax_forward_cuda(const TensorView& x, TensorView y, cudaStream_t stream,
                          SoftmaxFeed feed = SoftmaxFeed::kAuto);
void softmax_backward_cuda(const TensorView& dy, const TensorView& y, TensorView dx,
                           cudaStream_t stream, SoftmaxFeed feed = SoftmaxFeed::kAuto);

}  // namespace trainscale::ops::softmax
