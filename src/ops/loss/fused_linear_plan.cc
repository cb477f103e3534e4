#include "ops/loss/fused_linear_plan.h"

#include <algorithm>

#include "ops/loss/loss_internal.h"

namespace trainscale::ops::loss {
namespace {

constexpr std::size_t kAlign = 256;

std::size_t round_up(std::size_t v, std::size_t to) { return (v + to - 1) / to * to; }

}  // namespace

std::int64_t default_chunk_tokens(std::int64_t tokens, std::int64_t classes, std::size_t elem_bytes) {
  constexpr std::int64_t kTile = 128;
  const std::int64_t row_bytes = std::max<std::int64_t>(classes, 1) * static_cast<std::int64_t>(elem_bytes);
  const std::int64_t fit = kFusedLinearChunkBytes / row_bytes;
  if (fit >= tokens) return std::max<std::int64_t>(tokens, 1);
  return std::max(kTile, fit / kTile * kTile);
}

FusedLinearPlan plan_fused_linear(const FusedLinearCrossEntropyArgs& a,
                                  const CrossEntropyOptions& options) {
  FusedLinearPlan p;
  const std::int64_t tokens = a.hidden.size(0), classes = a.weight.size(0), dim = a.weight.size(1);
  const std::size_t elem = dtype_size(a.hidden.dtype);
  const std::int64_t per_vector = static_cast<std::int64_t>(16 / elem);
  p.logits_ld = (classes + per_vector - 1) / per_vector * per_vector;
  const auto u = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  // Chunks of a bf16 / fp16 weight summed in float32 need a [V, H] float32 buffer; when every
  // token's logits take no more memory than that buffer plus a chunk, one chunk is smaller,
  // faster (no buffer traffic, no final rounding pass) and exact in the same way.
  const bool float_sum = a.grad_weight.defined() && a.grad_weight_accumulation == DType::kFloat32 &&
                         a.weight.dtype != DType::kFloat32;
  std::int64_t chunk = a.chunk_tokens > 0 ? std::min(a.chunk_tokens, std::max<std::int64_t>(tokens, 1))
                                          : default_chunk_tokens(tokens, classes, elem);
  if (a.chunk_tokens == 0 && float_sum && chunk < tokens) {
    // Each chunk's grad_weight product reads and writes the whole float32 buffer (8 V H bytes)
    // for 2 V H chunk FLOPs: at 1024 tokens that traffic is as long as the product itself. With
    // the buffer paid for anyway, a chunk may hold as many logits bytes as the buffer (4 H / e
    // tokens, 8192 at H 4096 in bf16), which keeps the traffic near a tenth of the product.
    const std::size_t buffer = u(classes) * u(dim) * sizeof(float);
    const auto fit = static_cast<std::int64_t>(buffer / (u(p.logits_ld) * elem));
    chunk = std::min(tokens, std::max(chunk, fit / 128 * 128));
    const std::size_t all_logits = u(tokens) * u(p.logits_ld) * elem;
    const std::size_t chunked = u(chunk) * u(p.logits_ld) * elem + buffer;
    if (all_logits <= chunked) chunk = tokens;
  }
  p.chunk_tokens = chunk;
  p.chunks = (tokens + p.chunk_tokens - 1) / p.chunk_tokens;
  p.float_weight_acc = float_sum && p.chunks > 1;
  p.float_bias_acc = a.grad_bias.defined();
  const bool reduced = options.reduction != Reduction::kNone;
  // The lse is kept when the upstream gradient is per token: the gradient is then formed by a
  // second kernel from it.
  const bool per_token_upstream = !reduced && a.grad_loss.defined();
  const bool with_grad = a.grad_hidden.defined() || a.grad_weight.defined() || a.grad_bias.defined();

  std::size_t at = 0;
  const auto take = [&](std::size_t bytes) {
    const std::size_t offset = at;
    at = round_up(at + bytes, kAlign);
    return offset;
  };
  p.gemm_workspace = take(kGemmWorkspaceBytes);
  p.logits = take(u(p.chunk_tokens) * u(p.logits_ld) * elem);
  p.scalars = take(64);
  if (reduced) {
    p.row_losses = take(u(tokens) * sizeof(float));
    p.reduce_parts = take(kRowReductionPartsBytes);
  }
  if (per_token_upstream && with_grad && !a.lse.defined()) p.row_lse = take(u(tokens) * sizeof(float));
  if (p.float_weight_acc) p.weight_acc = take(u(classes) * u(dim) * sizeof(float));
  if (p.float_bias_acc) {
    p.bias_acc = take(u(classes) * sizeof(float));
    p.ones = take(u(p.chunk_tokens) * elem);
  }
  p.bytes = at;
  return p;
}

}  // namespace trainscale::ops::loss
