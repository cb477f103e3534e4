// Softmax forward: y = exp(x - max) / sum(exp(x - max)) per row, the row held in registers.
// One reduction per row: each thread's (max, sum of exp(x - its max)) pair is merged online
// (detail::OnlineSoftmaxOp) across the row's threads and cluster, then y = exp(x - max) / sum
// is recomputed from the held x: a second exp per element rather than 4 more registers per
// element held as float.
#include <limits>

#include "ops/softmax/softmax_cuda.h"
#include "ops/softmax/softmax_launch.cuh"

namespace trainscale::ops::softmax {
namespace {

using detail::kLog2e;

struct ForwardArgs {
  const void* x;
  std::int64_t x_stride;
  void* y;
  std::int64_t y_stride;
  std::int64_t rows;
  int cols;
  int slots;  // 16-byte slots of the longest row
};

template <class T, int kThreads, int kVecs, int kCluster>
__global__ void __launch_bounds__(detail::row_block_threads(kThreads),
                                  detail::kRowMaxThreads / detail::row_block_threads(kThreads))
    softmax_forward_kernel(ForwardArgs a) {
  using Tile = detail::RowTile<T, kThreads, kVecs, kCluster, detail::OnlineSoftmaxOp, 2>;
  constexpr int V = Tile::V;
  __shared__ Tile tile;
  tile.start();
  const typename Tile::Share share = Tile::share(a.slots);
  const int n = a.cols;
  int reduced = 0;
  Tile::for_each_row(a.rows, [&](std::int64_t row, bool valid) {
    const T* x_row = static_cast<const T*>(a.x) + row * a.x_stride;
    const int shift = detail::row_shift(x_row);
    detail::Vec<T, V> held[kVecs];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int c = Tile::slot(share, i) * V - shift;
      if (valid && Tile::owns(share, i)) held[i] = detail::load_slot<T, V>(x_row, c, n, c >= 0 && c + V <= n);
    }
    // The thread's maximum (NaN skipped), then its sum of exp(x - max); a thread without finite
    // elements sums against 0 so that its -inf give 0 (no -inf - -inf), and NaN stays NaN.
    float m = -std::numeric_limits<float>::infinity();
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (!valid || !Tile::owns(share, i)) continue;
      const int c = Tile::slot(share, i) * V - shift;
      float v[V];
      detail::to_floats(held[i], v);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (detail::in_row(c + j, n)) m = fmaxf(m, v[j]);
      }
    }
    const float pivot = m == -std::numeric_limits<float>::infinity() ? 0.f : m;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (!valid || !Tile::owns(share, i)) continue;
      const int c = Tile::slot(share, i) * V - shift;
      float v[V];
      detail::to_floats(held[i], v);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (detail::in_row(c + j, n)) s += exp2f((v[j] - pivot) * kLog2e);
      }
    }
    float stats[2] = {m, s};
    tile.reduce(stats, reduced);
    if (!valid) return;
    // No finite maximum (all -inf, or +inf): x - max is NaN for every element, as in torch.
    const float max = stats[0];
    const float inv_sum = 1.f / stats[1];
    T* y_row = static_cast<T*>(a.y) + row * a.y_stride;
    const bool y_vectors = detail::same_phase(x_row, y_row);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (!Tile::owns(share, i)) continue;
      const int c = Tile::slot(share, i) * V - shift;
      float v[V];
      detail::to_floats(held[i], v);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = exp2f((v[j] - max) * kLog2e) * inv_sum;
      detail::store_slot<T, V>(y_row, c, n, y_vectors && c >= 0 && c + V <= n, v);
    }
  });
}

}  // namespace

void softmax_forward_cuda(const TensorView& x, TensorView y, cudaStream_t stream) {
  const char* op = "softmax_forward";
  const detail::OpChecker c(op);
  const detail::Rows xr = c.rows(x, "x");
  ForwardArgs a{x.data, xr.row_stride, y.data, c.rows(y, "y").row_stride, xr.rows,
                static_cast<int>(xr.cols), 0};
  detail::dispatch_activation_dtype(x.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_softmax_rows<T>(op, xr.rows, xr.cols, detail::rows_max_shift(x.data, xr.row_stride, sizeof(T)),
                           stream, [](auto threads, auto vecs, auto cluster) {
                             return softmax_forward_kernel<T, decltype(threads)::value,
                                                           decltype(vecs)::value,
                                                           decltype(cluster)::value>;
                           }, a);
  });
}

}  // namespace trainscale::ops::softmax
