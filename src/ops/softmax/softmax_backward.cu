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

// Rows in flight per thread beyond the one it works on (common/row_kernel.cuh's ring), each as
// dy and y: two for rows of up to a warp (bf16 N <= 1024; 64 KiB per 256-thread block, 9-12 %
// faster there on an H100). Rows of 129 to 1024 slots (the 2-slot split below) load straight into
// registers: two stages measured the same at N 2048 and 5-8 % slower at 4096-8192, one stage
// 3-24 % slower. Longer rows (4 slots per thread on 512 or 1024 threads, clusters beyond) take
// one: a block per SM (two of 512) reduces and writes its row while the next row's copies land
// (64 or 128 KiB per block), 7-10 % faster at bf16 32768 x 16384-65536 and 23 % at 16384 x 131072
// and 8192 x 262144 than straight into registers.
constexpr int kRingMaxThreads = 32;  // rows of up to kRingMaxThreads * kRowVecs = 128 slots
constexpr int kDenseVecs = 2, kDenseMinThreads = 128, kDenseMaxThreads = 512;
// kDirect: SoftmaxFeed::kDirect's rows (no ring), 4 slots per thread at 64 registers.
enum class Occupancy { kDefault, kSparse, kDirect };
constexpr int backward_stages(int threads, int vecs, Occupancy occupancy = Occupancy::kDefault) {
  if (occupancy == Occupancy::kDirect) return 0;
  if (threads <= kRingMaxThreads) return 2;
  return vecs == detail::kRowVecs ? 1 : 0;
}
// The ring's buffers for launch_rows: dy and y per stage.
template <int kVecs>
constexpr auto kRingBuffers = [](int threads) { return 2 * backward_stages(threads, kVecs); };

// Rows of 129 to 1024 slots (bf16 N 1025-8192) take 2 slots per thread on twice the threads,
// at 40 registers: 1536 threads per SM instead of 1024 hide more of the loads of a kernel that
// holds its row. Where that split leaves slots empty (a row length not a power of two), at 32
// registers and 2048 threads per SM (kSparse): 2-20 % faster at bf16 N 6144 and 7168 (4096 to
// 65536 rows), where full rows (N 2048-8192) ran 5-9 % slower so (32 registers spill 28 bytes).
// Longer rows keep 4 slots per thread: a 1024-thread block of 2 was slower (docs/perf/softmax.md).
template <int kVecs, int kCluster, Occupancy kOccupancy>
constexpr int kSmThreads = kOccupancy == Occupancy::kSparse               ? 2048
                           : kVecs == kDenseVecs && kCluster == 1 ? 1536
                                                                  : detail::kRowMaxThreads;
template <int kThreads, int kVecs, Occupancy kOccupancy>
constexpr int kBackwardBlock =
    detail::row_block_threads(kThreads, backward_stages(kThreads, kVecs, kOccupancy) > 0);

template <class T, int kThreads, int kVecs, int kCluster, Occupancy kOccupancy, bool kAligned>
__global__ void __launch_bounds__(kBackwardBlock<kThreads, kVecs, kOccupancy>,
                                  kSmThreads<kVecs, kCluster, kOccupancy> / kBackwardBlock<kThreads, kVecs, kOccupancy>)
    softmax_backward_kernel(BackwardArgs a) {
  constexpr int kStages = backward_stages(kThreads, kVecs, kOccupancy);
  using Tile = detail::RowTile<T, kThreads, kVecs, kCluster, detail::SumOp, 1, (kStages > 0), false,
                               kAligned>;
  constexpr int V = Tile::V;
  __shared__ Tile tile;
  tile.start();
  const typename Tile::Share share = Tile::share(a.slots);
  const int n = a.cols;
  int reduced = 0;
  // Slots are cut along dy's row; y and dx move by vectors where they share its phase.
  const auto dy_row_of = [&](std::int64_t row) {
    return static_cast<const T*>(a.dy) + row * a.dy_stride;
  };
  const auto y_row_of = [&](std::int64_t row) {
    return static_cast<const T*>(a.y) + row * a.y_stride;
  };
  // Ring buffers: dy of stage s in 2 s, y in 2 s + 1.
  const auto fetch = [&](std::int64_t row, int stage) {
    const T* dy_row = dy_row_of(row);
    const T* y_row = y_row_of(row);
    const int shift = Tile::shift_of(dy_row);
    Tile::fetch(dy_row, share, shift, n, true, Tile::template staged<kStages>(2 * stage));
    Tile::fetch(y_row, share, shift, n, detail::same_phase(dy_row, y_row),
                Tile::template staged<kStages>(2 * stage + 1));
  };
  Tile::template for_each_row<kStages>(a.rows, fetch, [&](std::int64_t row, bool valid, int stage,
                                                          auto&& refill) {
    const T* dy_row = dy_row_of(row);
    const T* y_row = y_row_of(row);
    const int shift = Tile::shift_of(dy_row);
    const bool y_vectors = detail::same_phase(dy_row, y_row);
    const uint4* dy_staged = Tile::template staged<kStages>(2 * stage);
    const uint4* y_staged = Tile::template staged<kStages>(2 * stage + 1);
    // Elements outside the row load as 0 and add nothing.
    detail::Vec<T, V> dy_held[kVecs], y_held[kVecs];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int c = Tile::slot(share, i) * V - shift;
      if (!valid || !Tile::owns(share, i)) continue;
      Tile::take_slot(dy_row, c, n, Tile::whole(c, n, true), T(0.f), dy_staged, i, dy_held[i]);
      Tile::take_slot(y_row, c, n, Tile::whole(c, n, y_vectors), T(0.f), y_staged, i, y_held[i]);
    }
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
    refill();  // every value taken from the stage went into dot
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
      detail::store_slot<T, V>(dx_row, c, n, Tile::whole(c, n, dx_vectors), g);
    }
  });
}

}  // namespace

void softmax_backward_cuda(const TensorView& dy, const TensorView& y, TensorView dx,
                           cudaStream_t stream, SoftmaxFeed feed) {
  const char* op = "softmax_backward";
  const detail::Rows r = detail::row_layout(dy);
  BackwardArgs a{dy.data, r.row_stride, y.data, detail::row_layout(y).row_stride, dx.data,
                 detail::row_layout(dx).row_stride, r.rows, static_cast<int>(r.cols), 0};
  detail::dispatch_activation_dtype(dy.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int max_shift = detail::rows_max_shift(dy.data, r.row_stride, sizeof(T));
    const std::int64_t slots = detail::row_slots(r.cols, detail::kVec16<T>, max_shift);
    // The dense split's occupancy where it leaves slots empty.
    const bool sparse = (slots & (slots - 1)) != 0;
    // Rows at 16 bytes filling whole slots (the common case) take kernels without bounds tests.
    const bool aligned = detail::rows_at_slots(dy.data, r.row_stride, r.cols, sizeof(T)) &&
                         detail::rows_at_slots(y.data, a.y_stride, r.cols, sizeof(T)) &&
                         detail::rows_at_slots(dx.data, a.dx_stride, r.cols, sizeof(T));
    const auto kernel = [sparse, aligned](auto threads, auto vecs, auto cluster) {
      constexpr int kThreads = decltype(threads)::value, kVecs = decltype(vecs)::value,
                    kCluster = decltype(cluster)::value;
      return detail::with_aligned(aligned, [sparse](auto al) {
        constexpr bool kAligned = decltype(al)::value;
        if constexpr (kVecs == kDenseVecs) {
          if (sparse) return softmax_backward_kernel<T, kThreads, kVecs, kCluster, Occupancy::kSparse, kAligned>;
        }
        return softmax_backward_kernel<T, kThreads, kVecs, kCluster, Occupancy::kDefault, kAligned>;
      });
    };
    if (feed == SoftmaxFeed::kDirect || (feed == SoftmaxFeed::kAuto && direct_feed_default(aligned, slots, r.rows, false))) {
      detail::launch_direct(op, aligned, slots, r.rows, r.cols, stream, [](auto threads, auto cluster) {
        constexpr int kThreads = decltype(threads)::value, kCluster = decltype(cluster)::value;
        return softmax_backward_kernel<T, kThreads, detail::kRowVecs, kCluster, Occupancy::kDirect, true>;
      }, a);
      return;
    }
    // Three ranges of the row length, each compiling only the splits it uses.
    if (slots <= kRingMaxThreads * detail::kRowVecs) {
      detail::launch_rows<T, 1, detail::kRowVecs, kRingMaxThreads>(op, r.rows, r.cols, max_shift, stream,
                                                                    kernel, kRingBuffers<detail::kRowVecs>, a);
    } else if (slots <= kDenseMaxThreads * kDenseVecs) {
      detail::launch_rows<T, kDenseMinThreads, kDenseVecs, kDenseMaxThreads>(
          op, r.rows, r.cols, max_shift, stream, kernel, kRingBuffers<kDenseVecs>, a);
    } else {
      detail::launch_rows<T, kDenseMaxThreads>(op, r.rows, r.cols, max_shift, stream, kernel,
                                               kRingBuffers<detail::kRowVecs>, a);
    }
  });
}

}  // namespace trainscale::ops::softmax
