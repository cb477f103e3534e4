// Softmax backward: dx = y * (dy - sum(dy * y)) per row, dy and y held in registers so each is
// read once; one sum per row across its threads (and cluster).
#include "common/row_kernel.cuh"
#include "ops/softmax/softmax_cuda.h"

namespace trainscale::ops::softmax {
namespace {

struct BackwardArgs {
  const void* dy;
  std::int64_t dy_stride;
  const void* y;
  std::int64_t y_stride;
  void* dx;  // may be dy
  std::int64_t dx_stride;
  std::int64_t rows;
  int cols;
  int slots;  // 16-byte slots of dy's longest row
};

template <class T, int kThreads, int kVecs, int kCluster>
__global__ void __launch_bounds__(detail::row_block_threads(kThreads),
                                  detail::kRowMaxThreads / detail::row_block_threads(kThreads))
    softmax_backward_kernel(BackwardArgs a) {
  using Tile = detail::RowTile<T, kThreads, kVecs, kCluster, detail::SumOp, 1>;
  constexpr int V = Tile::V;
  __shared__ Tile tile;
  tile.start();
  const typename Tile::Share share = Tile::share(a.slots);
  const int n = a.cols;
  int reduced = 0;
  // No ring (kStages 0), rows loaded straight into registers: holding dy and y, a ring of one
  // stage measured 3-24 % slower (bf16, N 512 to 65536; H100) and one of two spilled at 16-bit
  // types.
  Tile::template for_each_row<0>(a.rows, [](std::int64_t, int) {}, [&](std::int64_t row, bool valid,
                                                                   int, auto&&) {
    // Slots are cut along dy's row; y and dx move by vectors where they share its phase.
    const T* dy_row = static_cast<const T*>(a.dy) + row * a.dy_stride;
    const T* y_row = static_cast<const T*>(a.y) + row * a.y_stride;
    const int shift = detail::row_shift(dy_row);
    const bool y_vectors = detail::same_phase(dy_row, y_row);
    detail::Vec<T, V> dy_held[kVecs], y_held[kVecs];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int c = Tile::slot(share, i) * V - shift;
      if (!valid || !Tile::owns(share, i)) continue;
      const bool inside = c >= 0 && c + V <= n;
      dy_held[i] = detail::load_slot<T, V>(dy_row, c, n, inside);
      y_held[i] = detail::load_slot<T, V>(y_row, c, n, inside && y_vectors);
    }
    // Elements outside the row load as 0 and add nothing.
    float dot[1] = {0.f};
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (!valid || !Tile::owns(share, i)) continue;
      float g[V], p[V];
      detail::to_floats(dy_held[i], g);
      detail::to_floats(y_held[i], p);
#pragma unroll
      for (int j = 0; j < V; ++j) dot[0] = fmaf(g[j], p[j], dot[0]);
    }
    tile.reduce(dot, reduced);
    if (!valid) return;
    T* dx_row = static_cast<T*>(a.dx) + row * a.dx_stride;
    const bool dx_vectors = detail::same_phase(dy_row, dx_row);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (!Tile::owns(share, i)) continue;
      const int c = Tile::slot(share, i) * V - shift;
      float g[V], p[V];
      detail::to_floats(dy_held[i], g);
      detail::to_floats(y_held[i], p);
#pragma unroll
      for (int j = 0; j < V; ++j) g[j] = p[j] * (g[j] - dot[0]);
      detail::store_slot<T, V>(dx_row, c, n, dx_vectors && c >= 0 && c + V <= n, g);
    }
  });
}

}  // namespace

void softmax_backward_cuda(const TensorView& dy, const TensorView& y, TensorView dx,
                           cudaStream_t stream) {
  const char* op = "softmax_backward";
  const detail::Rows r = detail::row_layout(dy);
  BackwardArgs a{dy.data, r.row_stride, y.data, detail::row_layout(y).row_stride, dx.data,
                 detail::row_layout(dx).row_stride, r.rows, static_cast<int>(r.cols), 0};
  detail::dispatch_activation_dtype(dy.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::launch_rows<T, 1>(
        op, r.rows, r.cols, detail::rows_max_shift(dy.data, r.row_stride, sizeof(T)), stream,
        [](auto threads, auto vecs, auto cluster) {
          return softmax_backward_kernel<T, decltype(threads)::value, decltype(vecs)::value,
                                         decltype(cluster)::value>;
        },
        [](int) { return 0; }, a);
  });
}

}  // namespace trainscale::ops::softmax
