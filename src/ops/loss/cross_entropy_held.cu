// Cross-entropy forward with each row held in registers (common/row_kernel.cuh, a cluster of
// blocks for long vocabularies), reducing four statistics in one pass: the online-softmax pair
// (max, sum of exp) and the plain sums of the logits (label smoothing) and of the target's logit.
// The gradient, when asked, is written from the held row in the same pass, so the logits are read
// once and the gradient written once (over the logits in place): without the softcap the sum's
// exponentials are kept in place of the logits (one exponential per logit), with it the logits
// themselves (the softcap's slope needs them). Its own translation unit: the row splits times
// the dtypes make it the family's heaviest compile.
#include "ops/loss/cross_entropy_kernels.cuh"
#include "ops/loss/loss_internal.h"

namespace trainscale::ops::loss::ce {
namespace {

// Whether the V columns from c hold column t (t may be one of target_column's negative flags,
// which may fall in a slot's padding before the row: the loss tests the flags first).
template <int V>
__device__ __forceinline__ bool holds_column(int c, int t) {
  return static_cast<unsigned>(t - c) < static_cast<unsigned>(V);
}

// kStages: the row ring's stages, or 0 for the direct feed (rows straight into registers).
template <class T, bool kSoftcap, int kThreads, int kVecs, int kCluster, bool kAligned,
          int kStages = detail::kRowRingStages>
__global__ void __launch_bounds__(detail::row_block_threads(kThreads, kStages > 0),
                                  detail::kRowMaxThreads / detail::row_block_threads(kThreads, kStages > 0))
    cross_entropy_forward_kernel(ForwardArgs a) {
  // (max, sum of exp(x - max), sum of x, x[target]) of the softcapped logits.
  // One barrier per row on the cluster kernels: 2.4-4.6 % faster with the gradient at bf16 N
  // 65536-262144 and 128256; on a single block it was up to 4 % slower (32768 x 32768).
  using Tile = detail::RowTile<T, kThreads, kVecs, kCluster, detail::OnlineSoftmaxOp, 4, (kStages > 0),
                               (kCluster > 1), kAligned>;
  constexpr int V = Tile::V;
  constexpr int kForwardStages = kStages;
  __shared__ Tile tile;
  tile.start();
  const typename Tile::Share share = Tile::share(a.slots);
  const Options& o = a.o;
  const int n = a.cols;
  // kMean's gradient scale, read once: a load per row would wait on it before the writes.
  const float scale = a.valid_rows ? 1.f / static_cast<float>(*a.valid_rows) : 1.f;
  int reduced = 0;
  const T* logits = static_cast<const T*>(a.logits);
  const auto fetch = Tile::template fetch_rows<kForwardStages>(logits, a.logits_stride, share, n);
  Tile::template for_each_row<kForwardStages>(a.rows, fetch, [&](std::int64_t row, bool valid,
                                                                 int stage, auto&& refill) {
    const T* x_row = logits + row * a.logits_stride;
    const int shift = Tile::shift_of(x_row);
    const int t_col = valid ? target_column(a.targets[row], o.ignore_index, n) : kIgnoredRow;
    // Elements outside the row load as -inf: no effect on the maximum, exp 0 in the sum (with
    // the softcap, which maps them to -c, they are tested for instead).
    const T pad = detail::from_float<T>(-kInf);
    detail::Vec<T, V> held[kVecs];
    Tile::take(x_row, share, shift, n, valid, true, pad,
               Tile::template staged<kForwardStages>(stage), held);
    const auto logit = [&](float raw, int col) {
      if constexpr (kSoftcap) {
        return detail::in_row(col, n) ? softcapped<true>(raw, o) : -kInf;
      } else {
        return raw;
      }
    };
    // The softcap is increasing: the maximum of the raw logits, softcapped.
    const float m = softcapped<kSoftcap>(detail::held_max(held), o);
    refill();  // every value taken from the stage went into m
    // Summed against 0 when the thread has no finite maximum (see softmax_forward.cu).
    const float pivot = m == -kInf ? 0.f : m;
    if constexpr (kSoftcap) detail::reconvert_after(held);
    float stats[4] = {m, 0.f, 0.f, 0.f};
    // The kernel is bound by instruction issue as much as by memory (at 8192 x 128256 one
    // 1024-thread block per SM runs about 1300 instructions per thread and row), so work that
    // every logit would repeat is taken out of the loops: the sum of the logits only where label
    // smoothing needs it (a uniform branch, the loop compiled twice), the target's logit and
    // gradient only in the one slot that holds the target (not with the softcap, whose kernels
    // spill with either).
    const auto fold = [&](auto sum_logits) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        // Slots the thread does not own hold the padding and match no column of the row.
        const int c = Tile::column(share, i, shift, n);
        const bool owned = Tile::owns(share, i);
        float v[V];
        detail::to_floats(held[i], v);
        float ex[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float x = logit(v[j], c + j);
          ex[j] = detail::exp_minus(x, pivot);
          stats[1] += ex[j];
          if constexpr (decltype(sum_logits)::value) {
            if (kAligned ? owned : detail::in_row(c + j, n)) stats[2] += x;  // skips the padding
          }
          if constexpr (kSoftcap) {
            if (c + j == t_col) stats[3] = x;  // recomputing the tanh below spills
          }
        }
        if constexpr (!kSoftcap) {
          if (holds_column<V>(c, t_col)) {
#pragma unroll
            for (int j = 0; j < V; ++j)
              if (c + j == t_col) stats[3] = v[j];
          }
          // The gradient needs only the exponentials: kept in place of x.
          const auto e = detail::to_exp_storage<T>(ex);
          memcpy(&held[i], &e, sizeof(e));
        }
      }
    };
    if constexpr (kSoftcap) {
      fold(std::true_type{});  // one loop: the softcap kernels spill with two
    } else if (o.smoothing > 0.f) {
      fold(std::true_type{});
    } else {
      fold(std::false_type{});
    }
    tile.reduce(stats, reduced);
    if (!valid) return;
    const float lse = row_lse(stats[0], stats[1]);
    const bool ignored = t_col == kIgnoredRow;
    // Every thread forms the loss (the reporting thread writes it below): four statistics less
    // held through the gradient's pass.
    const float loss = row_loss(lse, stats[3], stats[2], t_col, n, o);
    if (Tile::reporter()) {
      a.loss[row * a.loss_stride] = loss;
      if (a.lse) a.lse[row * a.lse_stride] = lse;
    }
    if (a.grad == nullptr) return;
    T* g_row = static_cast<T*>(a.grad) + row * a.grad_stride;
    const bool g_vectors = detail::row_shift(g_row) == shift;
    const float prob_weight = 1.f + 2.f * o.z_loss * lse;
    const float smooth = o.smoothing / static_cast<float>(n);
    const float row_scale = t_col == kBadTarget ? kNaN : scale;
    if constexpr (kSoftcap) {
      detail::reconvert_after(held);
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        if (!Tile::owns(share, i)) continue;
        const int c = Tile::slot(share, i) * V - shift;
        store_gradient<T, V, true>(g_row, c, n, g_vectors, held[i], ignored, lse, t_col,
                                   prob_weight, smooth, row_scale, o);
      }
    } else {
      // p = e exp(pivot - lse), one multiply where exp(x - lse) took a second exponential per
      // logit. A thread holding only -inf (e = 0) takes 0 (NaN with a NaN lse), not exp(0 - lse),
      // which overflows where lse is below -88.
      // g = (p - smooth - [target] (1 - smoothing)) row_scale, as one FMA per logit; an
      // ignored row (uniform across the block) writes zeros.
      const float factor =
          (m == -kInf ? (lse == lse ? 0.f : kNaN) : detail::exp_minus(pivot, lse)) * prob_weight * row_scale;
      const float offset = smooth * row_scale, target_offset = (1.f - o.smoothing) * row_scale;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        if (!Tile::owns(share, i)) continue;
        const int c = Tile::slot(share, i) * V - shift;
        float g[V];
        if (ignored) {
#pragma unroll
          for (int j = 0; j < V; ++j) g[j] = 0.f;
        } else {
          detail::Vec<Exp<T>, V> e;
          memcpy(&e, &held[i], sizeof(e));
          detail::to_floats(e, g);
#pragma unroll
          for (int j = 0; j < V; ++j) g[j] = fmaf(g[j], factor, -offset);
          if (holds_column<V>(c, t_col)) {
#pragma unroll
            for (int j = 0; j < V; ++j)
              if (c + j == t_col) g[j] -= target_offset;
          }
        }
        detail::store_slot<T, V>(g_row, c, n, Tile::whole(c, n, g_vectors), g);
      }
    }
  });
}

}  // namespace

template <class T>
void launch_held_forward(ForwardArgs a, bool softcap, std::int64_t cols, int max_shift,
                         CrossEntropyKernel kernel, cudaStream_t stream, const char* op) {
  // The softmax's split, from one thread per row: with a warp per row at least, a short row
  // filled one 16-byte slot of the four each thread holds, four times the instructions per
  // logit.
  constexpr int kMinThreads = 1;
  // Rows at 16 bytes filling whole slots take kernels without bounds tests (not softcapped).
  const bool aligned =
      !softcap && detail::rows_at_slots(a.logits, a.logits_stride, cols, sizeof(T)) &&
      (a.grad == nullptr || detail::rows_at_slots(a.grad, a.grad_stride, cols, sizeof(T)));
  if (kernel == CrossEntropyKernel::kHeldDirect && softcap) {
    throw UnsupportedVariantError(std::string("trainscale ") + op + ": the direct feed does not take the softcap");
  }
  const std::int64_t slots = detail::row_slots(cols, detail::kVec16<T>, max_shift);
  if (cross_entropy_held_direct(kernel, aligned, a.rows, slots, a.grad != nullptr)) {
    detail::launch_direct(op, aligned, slots, a.rows, cols, stream, [](auto threads, auto cluster) {
      constexpr int kThreads = decltype(threads)::value, kCluster = decltype(cluster)::value;
      return cross_entropy_forward_kernel<T, false, kThreads, detail::kRowVecs, kCluster, true, 0>;
    }, a);
    return;
  }
  detail::launch_rows<T, kMinThreads>(
      op, a.rows, cols, max_shift, stream,
      [&](auto threads, auto vecs, auto cluster) {
        constexpr int kThreads = decltype(threads)::value;
        constexpr int kVecs = decltype(vecs)::value;
        constexpr int kCluster = decltype(cluster)::value;
        if (softcap) return cross_entropy_forward_kernel<T, true, kThreads, kVecs, kCluster, false>;
        return detail::with_aligned(aligned, [](auto al) {
          return cross_entropy_forward_kernel<T, false, kThreads, kVecs, kCluster, decltype(al)::value>;
        });
      },
      [](int) { return detail::kRowRingStages; }, a);
}

template void launch_held_forward<float>(ForwardArgs, bool, std::int64_t, int, CrossEntropyKernel,
                                         cudaStream_t, const char*);
template void launch_held_forward<__half>(ForwardArgs, bool, std::int64_t, int, CrossEntropyKernel,
                                          cudaStream_t, const char*);
template void launch_held_forward<__nv_bfloat16>(ForwardArgs, bool, std::int64_t, int, CrossEntropyKernel,
                                                 cudaStream_t, const char*);

}  // namespace trainscale::ops::loss::ce
