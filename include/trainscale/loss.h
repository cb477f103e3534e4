// Losses: mean squared error, cross-entropy, fused linear cross-entropy.
#pragma once

#include <cstddef>
#include <cstdint>

#include "trainscale/tensor.h"

namespace trainscale {

enum class Reduction { kNone, kMean, kSum };
const char* reduction_name(Reduction reduction);

// out = (a - b)^2 elementwise (kNone), or its mean / sum over every element (one float32
// element). a and b: same shape and dtype (float32, float16, bfloat16; float64 on the CPU),
// rows of the last dim contiguous.
void mse_forward(const TensorView& a, const TensorView& b, TensorView out, Reduction reduction,
                 cudaStream_t stream = nullptr);

// grad_a = 2 (a - b) * grad_out (divided by numel for kMean), grad_b = -grad_a. grad_out has
// out's shape and dtype; grad_a / grad_b have a's; either may be absent (TensorView{}).
void mse_backward(const TensorView& grad_out, const TensorView& a, const TensorView& b,
                  TensorView grad_a, TensorView grad_b, Reduction reduction,
                  cudaStream_t stream = nullptr);

// The CUDA forward's kernel (cross_entropy_forward; the CPU path, the backward and the fused
// linear cross-entropy ignore it). A forced kernel that cannot run the call throws
// UnsupportedVariantError.
enum class CrossEntropyKernel {
  kAuto,      // for the loss alone: kStreamed on 256 rows or more of over 1024 16-byte
              // vectors (bf16 / fp16 V > 8192, fp32 4096), kHeldDirect on 4096 rows or more
              // of 129-1024 aligned vectors (no softcap); kHeld otherwise
  kHeld,      // each row held in registers (a thread-block cluster for long rows) while it is
              // reduced; the gradient, when asked, written from them in the same pass
  kStreamed,  // the loss alone (no grad_logits): each row streamed through a block once,
              // nothing held; any row length
  kHeldDirect,  // kHeld with each row loaded straight into registers, no ring: rows at 16 bytes
                // of 129-32768 16-byte vectors (bf16 / fp16 V 1032-262144), no softcap; a
                // block, or a cluster of blocks, per row
};

struct CrossEntropyOptions {
  std::int64_t ignore_index = -100;  // rows with this target contribute 0 and leave the mean
  double label_smoothing = 0.0;      // e in [0, 1]
  double z_loss = 0.0;               // lambda >= 0: adds lambda * lse^2 per row
  double softcap = 0.0;              // c > 0: logits x <- c * tanh(x / c) first; 0 = off
  Reduction reduction = Reduction::kMean;
  CrossEntropyKernel kernel = CrossEntropyKernel::kAuto;
};

// Per row i with target t (x = the softcapped logits, lse = logsumexp(x), e, lambda above):
//   loss_i = (1 - e)(lse - x_t) + e (lse - mean(x)) + lambda lse^2, and 0 for ignored rows.
// logits: [M, V] (float32, float16, bfloat16; float64 on the CPU), V >= 1, rows contiguous.
// targets: [M] int32/int64, each in [0, V) or ignore_index (checked on the CPU path).
// loss: kNone -> [M]; kMean / kSum -> one element; float32 (float64 on the CPU). As torch,
//   kMean divides by the count of non-ignored rows, so it is NaN when every row is ignored.
// lse: optional [M] float32 (float64 on the CPU): logsumexp of the softcapped logits of every
//   row, ignored rows included.
// grad_logits: optional, like logits: when given, the same pass writes d(sum of loss)/d(logits)
//   (an upstream gradient of 1; 0 on ignored rows). It may be exactly logits' view (the
//   gradient overwrites the logits) or disjoint from it.
void cross_entropy_forward(const TensorView& logits, const TensorView& targets, TensorView loss,
                           TensorView lse, TensorView grad_logits,
                           const CrossEntropyOptions& options = {}, cudaStream_t stream = nullptr);

// grad_logits = grad_loss * d(loss)/d(logits):
//   (softmax(x) (1 + 2 lambda lse) - (1 - e) onehot(t) - e / V) * (1 - tanh^2(raw / c)),
// scaled by 1 / (non-ignored rows) for kMean; 0 on ignored rows. grad_loss: like forward's loss.
// lse: forward's lse output (required). grad_logits: like logits, may be exactly logits' view.
void cross_entropy_backward(const TensorView& grad_loss, const TensorView& logits,
                            const TensorView& targets, const TensorView& lse,
                            TensorView grad_logits, const CrossEntropyOptions& options = {},
                            cudaStream_t stream = nullptr);

// cross_entropy_forward(hidden @ weight^T + bias, targets) and its gradients without
// materializing every row's logits at once: tokens go in chunks, and only one chunk's logits
// (then their gradient, in place) are live.
//   hidden [T, H], weight [V, H], bias [V] (optional): one dtype (float32, float16, bfloat16;
//     float64 on the CPU), rows contiguous.
//   targets, loss, lse: as cross_entropy_forward with M = T.
//   grad_loss: optional upstream gradient of loss (float32; [T] for kNone, else one element);
//     absent means 1 (for kNone: 1 for every token, the gradient of the sum of loss).
//   grad_hidden [T, H], grad_weight [V, H], grad_bias [V] (needs bias): optional outputs in the
//     dtypes of their inputs, computed in the same call.
//   workspace (CUDA only): at least fused_linear_cross_entropy_workspace_bytes(args, options)
//     bytes, 256-byte aligned; the call owns it until the stream reaches its end.
//   chunk_tokens: tokens per chunk, 0 = chosen from the shape: at most kFusedLinearChunkBytes
//     of logits live, or, with the float32 grad_weight buffer below, up to as many bytes as
//     that buffer (or every token when that takes no more memory). Results do not depend on
//     it except through the GEMMs' accumulation order and grad_weight's per-chunk rounding.
//   grad_weight_accumulation: kFloat32 sums the chunks' contributions to grad_weight (and
//     grad_bias) in float32 and rounds once at the end (a [V, H] float32 buffer in the workspace
//     when there is more than one chunk and the weight is not float32); the weight's own dtype
//     accumulates in grad_weight itself (no buffer; one rounding per chunk).
// Every GEMM accumulates in float32. Deterministic: the same bits every run for the same
// arguments. The tensors are named at the call so that none can be swapped:
//   fused_linear_cross_entropy_forward({.hidden = h, .weight = w, .targets = t, .loss = loss},
//                                      options, stream);
struct FusedLinearCrossEntropyArgs {
  TensorView hidden;
  TensorView weight;
  TensorView bias;  // optional
  TensorView targets;
  TensorView loss;
  TensorView lse;          // optional
  TensorView grad_loss;    // optional
  TensorView grad_hidden;  // optional
  TensorView grad_weight;  // optional
  TensorView grad_bias;    // optional, needs bias
  TensorView workspace;    // CUDA only
  std::int64_t chunk_tokens = 0;
  DType grad_weight_accumulation = DType::kFloat32;
};
inline constexpr std::int64_t kFusedLinearChunkBytes = std::int64_t{512} << 20;
void fused_linear_cross_entropy_forward(const FusedLinearCrossEntropyArgs& args,
                                        const CrossEntropyOptions& options = {},
                                        cudaStream_t stream = nullptr);
// Bytes of workspace the CUDA path of fused_linear_cross_entropy_forward needs for these
// arguments (their shapes, dtypes and which outputs are given; data pointers are not read).
std::size_t fused_linear_cross_entropy_workspace_bytes(const FusedLinearCrossEntropyArgs& args,
                                                       const CrossEntropyOptions& options = {});

}  // namespace trainscale
