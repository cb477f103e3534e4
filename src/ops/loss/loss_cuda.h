// CUDA launchers of the loss family; arguments arrive validated by loss.cc: MSE (mse.cu),
// cross-entropy (cross_entropy.cu, cross_entropy_held.cu), fused linear cross-entropy
// (fused_linear_cross_entropy.cu).
#pragma once

#include "ops/loss/loss_internal.h"

namespace trainscale::ops::loss {

// kNone: one elementwise kernel. kMean / kSum: one launch of one thread-block cluster (8
// blocks of 1024 threads) that sums in a fixed order (bit-identical results run to run, no
// atomics, no workspace, nothing shared between calls: safe on concurrent streams and in
// CUDA graphs). out is float32 there.
void mse_forward_cuda(const TensorView& a, const TensorView& b, TensorView out,
                      Reduction reduction, cudaStream_t stream);
// One elementwise kernel; a reduced grad_out (float32, one element) is read on the device.
void mse_backward_cuda(const TensorView& grad_out, const TensorView& a, const TensorView& b,
                       TensorView grad_a, TensorView grad_b, Reduction reduction,
                       cudaStream_t stream);

// One pass over the logits: each row held in registers (a cluster of blocks for long rows; rows
// of up to detail::max_row_cols elements, longer ones throw), lse, the loss and, when given,
// grad_logits written from the held row (over the logits when grad_logits is their view); or,
// for the loss alone (options.kernel, cross_entropy_streams_loss), each row streamed through a
// block, any length.
// loss, lse: float32. Targets are not range-checked on the device: a target outside [0, V) that
// is not ignore_index gives NaN for that row's loss and gradient (and so a NaN mean / sum).
// kMean / kSum add the per-row losses in a fixed order (double) in a second one-block kernel:
// bit-identical results run to run. Their row losses go to an internal scratch buffer per
// (device, stream), allocated on first use and grown (after synchronizing the stream) when a
// call has more rows: under CUDA-graph capture, make an uncaptured call of the largest size on
// that stream first. kMean with grad_logits counts the rows not ignored first (a third small
// kernel), since every gradient is divided by that count.
void cross_entropy_forward_cuda(const TensorView& logits, const TensorView& targets,
                                TensorView loss, TensorView lse, TensorView grad_logits,
                                const CrossEntropyOptions& options, cudaStream_t stream);
// Streaming, no reduction over the row (lse is given); kMean counts the rows not ignored first
// (the count lives in the scratch above). grad_loss: float32.
void cross_entropy_backward_cuda(const TensorView& grad_loss, const TensorView& logits,
                                 const TensorView& targets, const TensorView& lse,
                                 TensorView grad_logits, const CrossEntropyOptions& options,
                                 cudaStream_t stream);

// The row reductions of cross_entropy.cu, for the fused linear cross-entropy: targets not
// ignore_index counted into *count, and loss = the sum of row_losses (one per target; over
// the rows not ignored for mean), each in a fixed order that depends only on the rows (the
// same bits on every run). parts: kRowReductionPartsBytes of device memory for the partials.
void count_valid_rows_cuda(const TensorView& targets, std::int64_t ignore_index, std::int64_t* count,
                           double* parts, cudaStream_t stream, const char* op);
void reduce_row_losses_cuda(const float* row_losses, const TensorView& targets,
                            std::int64_t ignore_index, bool mean, float* loss, double* parts,
                            cudaStream_t stream, const char* op);

// Chunks of tokens through cuBLASLt and the cross-entropy kernel (fused_linear_plan.h); every
// result bit-identical run to run. loss, lse, grad_loss: float32.
void fused_linear_cross_entropy_forward_cuda(const FusedLinearCrossEntropyArgs& args,
                                             const CrossEntropyOptions& options,
                                             cudaStream_t stream);

}  // namespace trainscale::ops::loss
