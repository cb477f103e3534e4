// Between the loss family's entry points (loss.cc), its CPU reference (loss_cpu.cc) and its
// CUDA kernels (loss.cu). Arguments arrive validated.
#pragma once

#include <cstddef>

#include "common/row_config.h"
#include "core/check.h"
#include "trainscale/loss.h"

namespace trainscale::ops::loss {

void mse_forward_cpu(const TensorView& a, const TensorView& b, TensorView out,
                     Reduction reduction);
void mse_backward_cpu(const TensorView& grad_out, const TensorView& a, const TensorView& b,
                      TensorView grad_a, TensorView grad_b, Reduction reduction);

void cross_entropy_forward_cpu(const TensorView& logits, const TensorView& targets,
                               TensorView loss, TensorView lse, TensorView grad_logits,
                               const CrossEntropyOptions& options);
void cross_entropy_backward_cpu(const TensorView& grad_loss, const TensorView& logits,
                                const TensorView& targets, const TensorView& lse,
                                TensorView grad_logits, const CrossEntropyOptions& options);

// Whether the forward computes loss and lse without holding rows (cross_entropy_loss_kernel: a
// block per row streams it once, keeping the online statistics only). kAuto takes it for the
// loss alone (no gradient, which needs the row held) on rows of more than 1024 16-byte slots
// (bf16 / fp16 N > 8192, fp32 4096) when there are enough rows to fill the GPU with blocks
// (256): held in registers, such rows leave an SM one or two rows whose reductions wait on their
// loads (bf16 32768 x 16384: streamed 0.47 ms, held 0.59). At 1024 slots holding is 3 % faster
// (32768 x 8192). Fewer and longer rows keep the register path, whose clusters spread a row
// over several SMs. A forced kStreamed with a gradient is the caller's error (checked before).
inline constexpr std::int64_t kStreamedLossMinSlots = 1025;
inline constexpr std::int64_t kStreamedLossMinRows = 256;
constexpr bool cross_entropy_streams_loss(CrossEntropyKernel kernel, std::int64_t rows,
                                          std::int64_t slots, bool grad) {
  if (kernel != CrossEntropyKernel::kAuto) return kernel == CrossEntropyKernel::kStreamed;
  return !grad && slots >= kStreamedLossMinSlots && rows >= kStreamedLossMinRows;
}

// Whether a held forward loads each row straight into registers (kHeldDirect) rather than
// through the row ring. kAuto takes it for the loss alone on aligned rows (no softcap) of
// detail::kDirectMinSlots to 1024 slots (bf16 N 1032-8192) over 4096 rows or more: at bf16
// 32768 x 4096 and x 8192 4-5 % faster than the ring, equal at x 2048. With the gradient, and
// for the loss on longer rows, the direct feed ran 0-85 % slower (docs/perf/cross-entropy.md).
inline constexpr std::int64_t kHeldDirectLossMaxSlots = 1024, kHeldDirectLossMinRows = 4096;
constexpr bool cross_entropy_held_direct(CrossEntropyKernel kernel, bool aligned, std::int64_t rows,
                                         std::int64_t slots, bool grad) {
  if (kernel != CrossEntropyKernel::kAuto) return kernel == CrossEntropyKernel::kHeldDirect;
  return aligned && !grad && rows >= kHeldDirectLossMinRows && slots >= detail::kDirectMinSlots &&
         slots <= kHeldDirectLossMaxSlots;
}

// The row reductions (kMean's valid-row count, a reduced loss's sum; cross_entropy.cu) run over
// at most kRowReductionMaxParts blocks, whose partials take kRowReductionPartsBytes of device
// memory that the caller provides.
inline constexpr int kRowReductionMaxParts = 32;
inline constexpr std::size_t kRowReductionPartsBytes = 2 * kRowReductionMaxParts * sizeof(double);

// Rows of logits the fused linear cross-entropy reference holds (in double) at once. The
// results do not depend on it; tests pass other values to show that.
inline constexpr std::int64_t kFusedLinearChunkRows = 32;
// The reference ignores workspace, chunk_tokens and grad_weight_accumulation: it accumulates
// every gradient in double and rounds once.
void fused_linear_cross_entropy_forward_cpu(const FusedLinearCrossEntropyArgs& args,
                                            const CrossEntropyOptions& options,
                                            std::int64_t chunk_rows = kFusedLinearChunkRows);

}  // namespace trainscale::ops::loss
