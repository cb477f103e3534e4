// Between the loss family's entry points (loss.cc), its CPU reference (loss_cpu.cc) and its
// CUDA kernels (loss.cu). Arguments arrive validated.
#pragma once

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

// Rows of logits the fused linear cross-entropy reference holds (in double) at once. The
// results do not depend on it; tests pass other values to show that.
inline constexpr std::int64_t kFusedLinearChunkRows = 32;
// The reference ignores workspace, chunk_tokens and grad_weight_accumulation: it accumulates
// every gradient in double and rounds once.
void fused_linear_cross_entropy_forward_cpu(const FusedLinearCrossEntropyArgs& args,
                                            const CrossEntropyOptions& options,
                                            std::int64_t chunk_rows = kFusedLinearChunkRows);

}  // namespace trainscale::ops::loss
