// Softmax forward: y = exp(x - max) / sum(exp(x - max)) per row, the row held in registers.
// One reduction per row: each thread's (max, sum of exp(x - its max)) pair is merged online
// (detail::OnlineSoftmaxOp) across the row's threads and cluster. The pass that sums the
// thread's exponentials keeps them in the registers that held x (fp16 for 16-bit inputs, whose
// values in (0, 1] it holds to 2^-11; float for float32), so the output is one multiply per
// element: one exp per element, where recomputing exp(x - max) took a second one.
#include <limits>

#include "common/row_kernel.cuh"
#include "ops/softmax/softmax_cuda.h"

namespace trainscale::ops::softmax {
namespace {

struct ForwardArgs {
  const void* x;
  std::int64_t x_stride;
  void* y;
  std::int64_t y_stride;
  std::int64_t rows;
  int cols;
  int slots;  // 16-byte slots of the longest row
};

// How a row reaches the registers: through the row ring on a persistent grid (any length), or
// straight from global memory on a grid of one block per row, 2 slots per thread at 32
// registers so that 2048 threads share an SM (kDense). kDense takes rows of 256, 512 or 1024
// slots (bf16 N 2048, 4096, 8192: every thread's slots full) over at least kDenseMinRows rows:
// 4-7 % faster there (bf16 32768 x 2048-8192, 65536 x 8192), 3 % at 16384 x 8192. The ring
// stays faster over fewer rows (4096 x 8192: 3 %) and where a split leaves slots empty (N 6144,
// 7168: 5-12 %); from N 16384, 2 slots per thread spill at 32 registers (1-33 % slower).
// kDirect: SoftmaxFeed::kDirect's rows (softmax_cuda.h), 4 slots per thread at 64 registers, a
// block (or cluster) per row; kAuto gives it kDense's aligned rows (the two within 0.5 % there),
// so kDense keeps the rows that are not (and the forced row splits).
enum class Feed { kRing, kDense, kDirect };
constexpr int kDenseVecs = 2, kDenseMinSlots = 256, kDenseMaxSlots = 1024;
constexpr std::int64_t kDenseMinRows = 16384;

template <Feed kFeed>
constexpr int kFeedStages = kFeed == Feed::kRing ? detail::kRowRingStages : 0;
template <Feed kFeed, int kThreads>
constexpr int kFeedBlock = detail::row_block_threads(kThreads, kFeed == Feed::kRing);
template <Feed kFeed>
constexpr int kFeedSmThreads = kFeed == Feed::kDense ? 2048 : detail::kRowMaxThreads;

bool dense_feed(std::int64_t slots, std::int64_t rows) {
  return slots >= kDenseMinSlots && slots <= kDenseMaxSlots && (slots & (slots - 1)) == 0 &&
         rows >= kDenseMinRows;
}

template <class T, Feed kFeed, int kThreads, int kVecs, int kCluster, bool kAligned>
__global__ void __launch_bounds__(kFeedBlock<kFeed, kThreads>,
                                  kFeedSmThreads<kFeed> / kFeedBlock<kFeed, kThreads>)
    softmax_forward_kernel(ForwardArgs a) {
  constexpr int kStages = kFeedStages<kFeed>;
  using Tile = detail::RowTile<T, kThreads, kVecs, kCluster, detail::OnlineSoftmaxOp, 2, (kStages > 0),
                               false, kAligned>;
  constexpr int V = Tile::V;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  __shared__ Tile tile;
  tile.start();
  const typename Tile::Share share = Tile::share(a.slots);
  const int n = a.cols;
  int reduced = 0;
  const T* x = static_cast<const T*>(a.x);
  const auto fetch = Tile::template fetch_rows<kStages>(x, a.x_stride, share, n);
  Tile::template for_each_row<kStages>(a.rows, fetch, [&](std::int64_t row, bool valid, int stage,
                                                          auto&& refill) {
    const T* x_row = x + row * a.x_stride;
    const int shift = Tile::shift_of(x_row);
    // Elements outside the row load as -inf: no effect on the maximum, exp 0 in the sum.
    const T pad = detail::from_float<T>(-kInf);
    detail::Vec<T, V> held[kVecs];  // x, then the thread's exponentials as detail::ExpStorage<T>
    Tile::take(x_row, share, shift, n, valid, true, pad, Tile::template staged<kStages>(stage),
               held);
    // The thread's maximum (NaN skipped), then its exponentials against it; a thread without
    // finite elements takes them against 0 so that its -inf give 0 (no -inf - -inf), and NaN
    // stays NaN.
    const float m = detail::held_max(held);
    refill();  // every value taken from the stage went into m
    const float pivot = m == -kInf ? 0.f : m;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      float v[V];
      detail::to_floats(held[i], v);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        v[j] = detail::exp_minus(v[j], pivot);
        s += v[j];
      }
      const auto e = detail::to_exp_storage<T>(v);
      memcpy(&held[i], &e, sizeof(e));
    }
    float stats[2] = {m, s};
    tile.reduce(stats, reduced);
    if (!valid) return;
    // y = e * exp(pivot - max) / sum. No finite maximum (all -inf, or +inf): the factor is NaN
    // (0 / 0, or a NaN sum), as in torch. A thread holding only -inf (e = 0) takes 0 / sum, not
    // exp(0 - max), which overflows to inf (0 * inf = NaN) where the maximum is below -88.
    const float factor = (m == -kInf ? 0.f : detail::online_rescale(pivot, stats[0])) / stats[1];
    T* y_row = static_cast<T*>(a.y) + row * a.y_stride;
    const bool y_vectors = detail::same_phase(x_row, y_row);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (!Tile::owns(share, i)) continue;
      const int c = Tile::slot(share, i) * V - shift;
      detail::Vec<detail::ExpStorage<T>, V> e;
      memcpy(&e, &held[i], sizeof(e));
      float v[V];
      detail::to_floats(e, v);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] *= factor;
      detail::store_slot<T, V>(y_row, c, n, Tile::whole(c, n, y_vectors), v);
    }
  });
}

}  // namespace

void softmax_forward_cuda(const TensorView& x, TensorView y, cudaStream_t stream, SoftmaxFeed feed) {
  const char* op = "softmax_forward";
  const detail::Rows xr = detail::row_layout(x);
  ForwardArgs a{x.data, xr.row_stride, y.data, detail::row_layout(y).row_stride, xr.rows,
                static_cast<int>(xr.cols), 0};
  detail::dispatch_activation_dtype(x.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int max_shift = detail::rows_max_shift(x.data, xr.row_stride, sizeof(T));
    const std::int64_t slots = detail::row_slots(xr.cols, detail::kVec16<T>, max_shift);
    // Rows at 16 bytes filling whole slots (the common case) take kernels without bounds tests.
    const bool aligned = detail::rows_at_slots(x.data, xr.row_stride, xr.cols, sizeof(T)) &&
                         detail::rows_at_slots(y.data, a.y_stride, xr.cols, sizeof(T));
    if (feed == SoftmaxFeed::kDirect || (feed == SoftmaxFeed::kAuto && direct_feed_default(aligned, slots, xr.rows, true))) {
      detail::launch_direct(op, aligned, slots, xr.rows, xr.cols, stream, [](auto threads, auto cluster) {
        constexpr int kThreads = decltype(threads)::value, kCluster = decltype(cluster)::value;
        return softmax_forward_kernel<T, Feed::kDirect, kThreads, detail::kRowVecs, kCluster, true>;
      }, a);
      return;
    }
    if (dense_feed(slots, xr.rows)) {
      detail::launch_rows<T, kDenseMinSlots / kDenseVecs, kDenseVecs, kDenseMaxSlots / kDenseVecs>(
          op, xr.rows, xr.cols, max_shift, stream,
          [aligned](auto threads, auto vecs, auto cluster) {
            return detail::with_aligned(aligned, [](auto al) {
              return softmax_forward_kernel<T, Feed::kDense, decltype(threads)::value, decltype(vecs)::value,
                                            decltype(cluster)::value, decltype(al)::value>;
            });
          },
          [](int) { return 0; }, a);
      return;
    }
    detail::launch_rows<T, 1>(
        op, xr.rows, xr.cols, max_shift, stream,
        [aligned](auto threads, auto vecs, auto cluster) {
          return detail::with_aligned(aligned, [](auto al) {
            return softmax_forward_kernel<T, Feed::kRing, decltype(threads)::value, decltype(vecs)::value,
                                          decltype(cluster)::value, decltype(al)::value>;
          });
        },
        [](int) { return detail::kRowRingStages; }, a);
  });
}

}  // namespace trainscale::ops::softmax
