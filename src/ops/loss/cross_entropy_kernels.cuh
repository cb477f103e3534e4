// Between the cross-entropy kernels: the held-row forward (cross_entropy_held.cu) and the
// streamed forward, the backward and the row reductions (cross_entropy.cu). The options and
// arguments as the kernels take them, and the per-logit and per-row arithmetic both forwards share.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "common/row_kernel.cuh"
#include "trainscale/loss.h"

namespace trainscale::ops::loss::ce {

using detail::kLog2e;
template <class T>
using Exp = detail::ExpStorage<T>;

inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
inline constexpr float kInf = std::numeric_limits<float>::infinity();

struct Targets {
  const void* data;
  std::int64_t stride;
  bool is_64;
  __device__ __forceinline__ std::int64_t operator[](std::int64_t i) const {
    return is_64 ? static_cast<const std::int64_t*>(data)[i * stride]
                 : static_cast<const std::int32_t*>(data)[i * stride];
  }
};

// The options as the kernels use them.
struct Options {
  std::int64_t ignore_index;
  float smoothing;  // e
  float z_loss;     // lambda
  float softcap;    // c, 0 = off
  float inv_softcap;
};

// The softcapped logit c tanh(x / c) and, for the gradient, its slope 1 - tanh^2 = 4 e / (1 + e)^2
// with e = exp(-2 |x / c|): 1 - t * t cancels as |t| nears 1 (fp32, c = 5, |x| ~ 60: relative
// error 1e-4 in the gradient), the exponential form does not.
template <bool kSoftcap>
__device__ __forceinline__ float softcapped(float x, const Options& o) {
  return kSoftcap ? o.softcap * tanhf(x * o.inv_softcap) : x;
}
__device__ __forceinline__ float softcap_slope(float x, const Options& o) {
  const float e = detail::exp2_approx(-2.f * kLog2e * fabsf(x * o.inv_softcap));
  const float d = 1.f + e;
  return 4.f * e / (d * d);
}

// d loss / d raw logit for a row not ignored, before the upstream scale: raw the logit, x its
// softcapped value, lse the row's, hit whether it is the target's.
template <bool kSoftcap>
__device__ __forceinline__ float logit_gradient(float raw, float x, float lse, bool hit,
                                                float prob_weight, float smooth, const Options& o) {
  float g = detail::exp_minus(x, lse) * prob_weight - smooth;
  if (hit) g -= 1.f - o.smoothing;
  if constexpr (kSoftcap) g *= softcap_slope(raw, o);
  return g;
}

// Writes the gradient of one 16-byte slot of a row (column c of n, logits held in registers):
// zeros for an ignored row, else logit_gradient times the row's scale. Shared by the forward that
// writes the gradient in its pass and the backward from the saved lse.
template <class T, int V, bool kSoftcap>
__device__ __forceinline__ void store_gradient(T* g_row, int c, int n, bool g_vectors, const detail::Vec<T, V>& held,
                                               bool ignored, float lse, int t_col, float prob_weight,
                                               float smooth, float scale, const Options& o) {
  float v[V];
  if (ignored) {
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = 0.f;
  } else {
    detail::to_floats(held, v);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float x = softcapped<kSoftcap>(v[j], o);
      v[j] = logit_gradient<kSoftcap>(v[j], x, lse, c + j == t_col, prob_weight, smooth, o) * scale;
    }
  }
  detail::store_slot<T, V>(g_row, c, n, g_vectors && c >= 0 && c + V <= n, v);
}

struct ForwardArgs {
  const void* logits;
  std::int64_t logits_stride;
  Targets targets;
  float* loss;  // per row: the loss output (kNone) or the scratch rows (kMean / kSum)
  std::int64_t loss_stride;
  float* lse;  // optional
  std::int64_t lse_stride;
  void* grad;  // optional; may be logits
  std::int64_t grad_stride;
  const std::int64_t* valid_rows;  // kMean's gradient scale 1 / count; null: scale 1
  Options o;
  std::int64_t rows;
  int cols;
  int slots;  // 16-byte slots of the longest row
};

// A row's target as one int: its column, or kIgnoredRow, or kBadTarget for a target outside
// [0, n) (not checked on the device: that row's loss and gradient are NaN). One register where
// the target and two flags took four across the row's reduction.
inline constexpr int kIgnoredRow = -1;
inline constexpr int kBadTarget = -2;
__device__ __forceinline__ int target_column(std::int64_t target, std::int64_t ignore_index, int n) {
  if (target == ignore_index) return kIgnoredRow;
  return target >= 0 && target < n ? static_cast<int>(target) : kBadTarget;
}

// A row's lse from its online statistics: NaN without a finite maximum, or with a NaN logit (via
// the sum), as the reference.
__device__ __forceinline__ float row_lse(float max, float sum) {
  return max == -kInf ? kNaN : max + logf(sum);
}

// A row's loss from its lse, its target's (softcapped) logit and the sum of its logits; t_col as
// target_column gives it.
__device__ __forceinline__ float row_loss(float lse, float target_logit, float logit_sum, int t_col,
                                          int n, const Options& o) {
  if (t_col == kIgnoredRow) return 0.f;
  if (t_col == kBadTarget) return kNaN;
  float loss = o.z_loss * lse * lse;
  // Zero-weight terms are skipped so that a -inf logit cannot turn 0 * inf into NaN.
  if (o.smoothing < 1.f) loss += (1.f - o.smoothing) * (lse - target_logit);
  if (o.smoothing > 0.f) loss += o.smoothing * (lse - logit_sum / static_cast<float>(n));
  return loss;
}

// The forward with each row held in registers (a cluster of blocks for long rows; rows of up to
// detail::max_row_cols elements, longer ones throw): lse, the per-row loss into a.loss and, when
// a.grad is set, the gradient written from the held row in the same pass. max_shift:
// detail::rows_max_shift of the logits. kernel: kAuto or kHeld (the ring, or the direct feed
// where cross_entropy_held_direct takes the rows), or kHeldDirect (the rows straight into
// registers; other rows throw UnsupportedVariantError). Instantiated for float, __half and
// __nv_bfloat16.
template <class T>
void launch_held_forward(ForwardArgs a, bool softcap, std::int64_t cols, int max_shift,
                         CrossEntropyKernel kernel, cudaStream_t stream, const char* op);

}  // namespace trainscale::ops::loss::ce
