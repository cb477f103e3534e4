// Cross-entropy: the entry points, the streamed loss-only forward, the backward and the row
// reductions; the held-row forward is in cross_entropy_held.cu, what both share in
// cross_entropy_kernels.cuh. The backward from a saved lse needs no reduction: a plain streaming
// kernel.
//
// Reductions over rows: kMean / kSum losses are written per row to a scratch buffer and then
// summed in a fixed order (double, launch_row_reduction); kMean's row count is counted likewise.
// The gradient of kMean needs that count before the rows are written: one small kernel counts
// the targets first.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "common/cluster_launch.h"
#include "common/grid_reduce.cuh"
#include "common/row_kernel.cuh"
#include "common/stream_scratch.h"
#include "ops/loss/cross_entropy_kernels.cuh"
#include "ops/loss/loss_cuda.h"
#include "trainscale/error.h"

namespace trainscale::ops::loss {
namespace {

using namespace ce;

// The loss alone (cross_entropy_streams_loss): a block per row streams it in batches of
// kLossBatch 16-byte slots per thread (that many loads in flight), folding each batch into the
// thread's online statistics (max, sum of exp, sum of logits) after its maximum is known; the
// target's logit is one load by the reporting thread. Nothing is held across the row, so a
// block needs few registers and an SM keeps many rows in flight. The kernel is bound by
// instruction issue as much as by memory (two more instructions per logit ran 3-6 % slower), so
// the sum of the logits, which only label smoothing needs, is compiled in only for it
// (kSumLogits).
constexpr int kLossThreads = 256;
constexpr int kLossBatch = 4;

template <class T, bool kSoftcap, bool kSumLogits>
__global__ void __launch_bounds__(kLossThreads, kSoftcap ? 3 : 4) cross_entropy_loss_kernel(ForwardArgs a) {
  constexpr int V = detail::kVec16<T>;
  __shared__ float scratch[kLossThreads / 32 * 3];
  const Options& o = a.o;
  const int n = a.cols;
  const T* logits = static_cast<const T*>(a.logits);
  for (std::int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* x_row = logits + row * a.logits_stride;
    const int shift = detail::row_shift(x_row);
    const bool reporter = threadIdx.x == 0;
    int t_col = kIgnoredRow;
    float target_logit = 0.f;
    if (reporter) {
      t_col = target_column(a.targets[row], o.ignore_index, n);
      if (t_col >= 0) target_logit = softcapped<kSoftcap>(detail::to_float(x_row[t_col]), o);
    }
    float stats[3] = {-kInf, 0.f, 0.f};  // max, sum of exp(x - max), sum of x
    for (int first = 0; first < a.slots; first += kLossThreads * kLossBatch) {
      // Slot first + i * kLossThreads + thread starts at column c of the row.
      const auto column = [&](int i) { return (first + i * kLossThreads + static_cast<int>(threadIdx.x)) * V - shift; };
      detail::Vec<T, V> held[kLossBatch];
      bool whole[kLossBatch];
#pragma unroll
      for (int i = 0; i < kLossBatch; ++i) {
        const int c = column(i);
        whole[i] = c >= 0 && c + V <= n;
        held[i] = detail::load_slot<T, V>(x_row, c, n, whole[i], detail::from_float<T>(-kInf));
      }
      float x[kLossBatch][V];
      float m = stats[0];
#pragma unroll
      for (int i = 0; i < kLossBatch; ++i) {
        const int c = column(i);
        detail::to_floats(held[i], x[i]);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          // Outside the row: -inf (the padding; with the softcap, tested for, as it maps -inf
          // to -c), adding nothing to either sum.
          if constexpr (kSoftcap) x[i][j] = whole[i] || detail::in_row(c + j, n) ? softcapped<true>(x[i][j], o) : -kInf;
          m = fmaxf(m, x[i][j]);
        }
      }
      const float pivot = m == -kInf ? 0.f : m;
      stats[1] *= detail::online_rescale(stats[0], m);
      stats[0] = m;
#pragma unroll
      for (int i = 0; i < kLossBatch; ++i) {
        [[maybe_unused]] const int c = column(i);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          stats[1] += detail::exp_minus(x[i][j], pivot);
          if constexpr (kSumLogits) {
            if (whole[i] || detail::in_row(c + j, n)) stats[2] += x[i][j];
          }
        }
      }
    }
    detail::row_reduce<kLossThreads, detail::OnlineSoftmaxOp>(stats, scratch);
    if (!reporter) continue;
    const float lse = row_lse(stats[0], stats[1]);
    a.loss[row * a.loss_stride] = row_loss(lse, target_logit, stats[2], t_col, n, o);
    if (a.lse) a.lse[row * a.lse_stride] = lse;
  }
}

// Backward from the saved lse: elementwise within a row. A block takes kBackwardChunk slots of
// one row (the row's target, lse and scale read once per block).
constexpr int kBackwardThreads = 256;
constexpr int kBackwardVecs = 4;
constexpr int kBackwardChunk = kBackwardThreads * kBackwardVecs;

struct BackwardArgs {
  const float* grad_loss;  // kNone: per row; else one value
  std::int64_t grad_loss_stride;  // 0 for a reduced loss
  const void* logits;
  std::int64_t logits_stride;
  Targets targets;
  const float* lse;
  std::int64_t lse_stride;
  void* grad;  // may be logits
  std::int64_t grad_stride;
  const std::int64_t* valid_rows;  // kMean: divides the scale; null otherwise
  Options o;
  std::int64_t rows;
  int cols;
  int chunks;  // blocks per row
};

template <class T, bool kSoftcap>
__global__ void __launch_bounds__(kBackwardThreads) cross_entropy_backward_kernel(BackwardArgs a) {
  constexpr int V = detail::kVec16<T>;
  const Options& o = a.o;
  const int n = a.cols;
  for (std::int64_t b = blockIdx.x; b < a.rows * a.chunks; b += gridDim.x) {
    const std::int64_t row = b / a.chunks;
    const int first = static_cast<int>(b % a.chunks) * kBackwardChunk;
    const T* x_row = static_cast<const T*>(a.logits) + row * a.logits_stride;
    T* g_row = static_cast<T*>(a.grad) + row * a.grad_stride;
    const int shift = detail::row_shift(x_row);
    const bool g_vectors = detail::same_phase(x_row, g_row);
    const int t_col = target_column(a.targets[row], o.ignore_index, n);
    const bool ignored = t_col == kIgnoredRow;
    const float lse = a.lse[row * a.lse_stride];
    float scale = a.grad_loss[row * a.grad_loss_stride];
    if (a.valid_rows) scale /= static_cast<float>(*a.valid_rows);
    if (t_col == kBadTarget) scale = kNaN;
    const float prob_weight = 1.f + 2.f * o.z_loss * lse;
    const float smooth = o.smoothing / static_cast<float>(n);
    detail::Vec<T, V> held[kBackwardVecs];
#pragma unroll
    for (int i = 0; i < kBackwardVecs; ++i) {
      const int c = (first + i * kBackwardThreads + static_cast<int>(threadIdx.x)) * V - shift;
      if (c < n && !ignored) held[i] = detail::load_slot<T, V>(x_row, c, n, c >= 0 && c + V <= n);
    }
#pragma unroll
    for (int i = 0; i < kBackwardVecs; ++i) {
      const int c = (first + i * kBackwardThreads + static_cast<int>(threadIdx.x)) * V - shift;
      if (c >= n) continue;
      store_gradient<T, V, kSoftcap>(g_row, c, n, g_vectors, held[i], ignored, lse, t_col, prob_weight,
                                     smooth, scale, o);
    }
  }
}

// The row reductions (kMean's count of rows not ignored, the loss's sum of row losses) over up
// to kReduceMaxParts blocks of one cooperative launch: each block sums a contiguous range of
// rows (kReduceRowsPerThread per thread, in flight together) in a fixed order, then block 0 adds
// the blocks' partials in block order after a grid barrier. The part count depends only on the
// rows, so the loss has the same bits on every run. One block over every row (at 32768 rows
// about 7 us for the count and 10 for the loss) waited on one SM's loads. Where the device
// cannot hold the cooperative grid, one block takes every row (other bits, the same on every
// run there).
constexpr int kReduceThreads = 1024, kReduceRowsPerThread = 8, kReduceMaxParts = kRowReductionMaxParts;

int reduce_parts(std::int64_t rows) {
  const std::int64_t per_part = std::int64_t{kReduceThreads} * kReduceRowsPerThread;
  return static_cast<int>(std::clamp<std::int64_t>((rows + per_part - 1) / per_part, 1, kReduceMaxParts));
}

// Sums v over the rows [begin, end) of this block's part of `rows`, then over the grid; true
// in thread 0 of block 0, which then holds the totals. parts: kCount doubles per block.
template <int kCount>
__device__ __forceinline__ bool reduce_rows(std::int64_t rows, double* parts,
                                            double (&v)[kCount], auto&& row_values) {
  __shared__ double scratch[kReduceThreads / 32 * kCount];
  const std::int64_t chunk = (rows + gridDim.x - 1) / gridDim.x;
  const std::int64_t begin = blockIdx.x * chunk, end = begin + chunk < rows ? begin + chunk : rows;
#pragma unroll 8  // kReduceRowsPerThread
  for (std::int64_t i = begin + threadIdx.x; i < end; i += kReduceThreads) row_values(i, v);
  detail::row_reduce<kReduceThreads, detail::SumOp>(v, scratch);
  if (gridDim.x == 1) return threadIdx.x == 0;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int c = 0; c < kCount; ++c) parts[blockIdx.x * kCount + c] = v[c];
  }
  detail::grid_barrier();
  if (blockIdx.x != 0 || threadIdx.x != 0) return false;
#pragma unroll
  for (int c = 0; c < kCount; ++c) v[c] = 0;
  for (unsigned b = 0; b < gridDim.x; ++b) {
#pragma unroll
    for (int c = 0; c < kCount; ++c) v[c] += __ldcg(&parts[b * kCount + c]);
  }
  return true;
}

__global__ void __launch_bounds__(kReduceThreads)
    count_valid_kernel(Targets targets, std::int64_t rows, std::int64_t ignore_index,
                       double* parts, std::int64_t* count) {
  double c[1] = {0};
  if (reduce_rows(rows, parts, c, [&](std::int64_t i, double(&v)[1]) { v[0] += targets[i] != ignore_index; })) {
    *count = static_cast<std::int64_t>(c[0]);
  }
}

// loss = the sum of the row losses, divided by the rows not ignored for kMean (0 / 0 = NaN
// when all are ignored, as torch).
__global__ void __launch_bounds__(kReduceThreads)
    reduce_losses_kernel(const float* row_losses, Targets targets, std::int64_t rows,
                         std::int64_t ignore_index, bool mean, double* parts, float* loss) {
  double v[2] = {0, 0};  // sum, count
  if (reduce_rows(rows, parts, v, [&](std::int64_t i, double(&s)[2]) {
        s[0] += row_losses[i];
        s[1] += targets[i] != ignore_index;
      })) {
    *loss = static_cast<float>(mean ? v[0] / v[1] : v[0]);
  }
}

// Scratch of the row reductions (common/stream_scratch.h): the valid-row count, the reductions'
// partials, then one float per row.
struct Scratch {
  std::int64_t* count;
  double* parts;
  float* rows;
};

constexpr std::size_t kScratchHead = 2 * sizeof(std::int64_t) + kRowReductionPartsBytes;

Scratch scratch_for(std::int64_t rows, cudaStream_t stream, const char* op) {
  const std::size_t need = kScratchHead + static_cast<std::size_t>(rows) * sizeof(float);
  char* data = static_cast<char*>(detail::stream_scratch(need, stream, "cross_entropy", op));
  return {reinterpret_cast<std::int64_t*>(data), reinterpret_cast<double*>(data + 2 * sizeof(std::int64_t)),
          reinterpret_cast<float*>(data + kScratchHead)};
}

// Launches a row reduction over reduce_parts(rows) blocks, or one block where the device cannot
// hold them at once.
template <class... Params, class... Args>
void launch_row_reduction(void (*kernel)(Params...), std::int64_t rows, cudaStream_t stream, const char* op,
                          Args... args) {
  const int parts = reduce_parts(rows);
  if (parts == 1 || !detail::cooperative_launch_supported(op) ||
      !detail::launch_cooperative(kernel, parts, kReduceThreads, 0, stream, op, args...)) {
    kernel<<<1, kReduceThreads, 0, stream>>>(args...);
    detail::check_launch(op);
  }
}

Targets targets_of(const TensorView& t) {
  return {t.data, t.stride(0), t.dtype == DType::kInt64};
}

Options options_of(const CrossEntropyOptions& o) {
  const auto cap = static_cast<float>(o.softcap);
  return {o.ignore_index, static_cast<float>(o.label_smoothing), static_cast<float>(o.z_loss), cap,
          cap > 0.f ? 1.f / cap : 0.f};
}

std::int64_t* count_valid(const Targets& targets, std::int64_t rows, std::int64_t ignore_index,
                          std::int64_t* count, double* parts, cudaStream_t stream, const char* op) {
  launch_row_reduction(count_valid_kernel, rows, stream, op, targets, rows, ignore_index, parts, count);
  return count;
}

}  // namespace

void count_valid_rows_cuda(const TensorView& targets, std::int64_t ignore_index, std::int64_t* count,
                           double* parts, cudaStream_t stream, const char* op) {
  count_valid(targets_of(targets), targets.size(0), ignore_index, count, parts, stream, op);
}

void reduce_row_losses_cuda(const float* row_losses, const TensorView& targets,
                            std::int64_t ignore_index, bool mean, float* loss, double* parts,
                            cudaStream_t stream, const char* op) {
  const std::int64_t rows = targets.size(0);
  launch_row_reduction(reduce_losses_kernel, rows, stream, op, row_losses, targets_of(targets), rows, ignore_index,
                       mean, parts, loss);
}

void cross_entropy_forward_cuda(const TensorView& logits, const TensorView& targets,
                                TensorView loss, TensorView lse, TensorView grad_logits,
                                const CrossEntropyOptions& options, cudaStream_t stream) {
  const char* op = "cross_entropy_forward";
  if (options.kernel == CrossEntropyKernel::kStreamed && grad_logits.defined()) {
    throw UnsupportedVariantError(std::string("trainscale ") + op +
                                  ": the streamed kernel computes the loss alone; grad_logits was given");
  }
  const detail::Rows r = detail::row_layout(logits);
  const bool per_row = options.reduction == Reduction::kNone;
  ForwardArgs a{};
  a.logits = logits.data;
  a.logits_stride = r.row_stride;
  a.targets = targets_of(targets);
  a.lse = lse.defined() ? lse.ptr<float>() : nullptr;
  a.lse_stride = lse.defined() ? lse.stride(0) : 0;
  a.grad = grad_logits.defined() ? grad_logits.data : nullptr;
  a.grad_stride = grad_logits.defined() ? detail::row_layout(grad_logits).row_stride : 0;
  a.o = options_of(options);
  a.rows = r.rows;
  a.cols = static_cast<int>(std::min<std::int64_t>(r.cols, 1 << 30));
  Scratch scratch{};
  if (per_row) {
    a.loss = loss.ptr<float>();
    a.loss_stride = loss.stride(0);
  } else {
    scratch = scratch_for(r.rows, stream, op);
    a.loss = scratch.rows;
    a.loss_stride = 1;
    if (options.reduction == Reduction::kMean && a.grad != nullptr) {
      a.valid_rows = count_valid(a.targets, r.rows, options.ignore_index, scratch.count, scratch.parts, stream, op);
    }
  }
  detail::dispatch_activation_dtype(logits.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int max_shift = detail::rows_max_shift(logits.data, r.row_stride, sizeof(T));
    const std::int64_t slots = detail::row_slots(r.cols, detail::kVec16<T>, max_shift);
    if (cross_entropy_streams_loss(options.kernel, r.rows, slots, a.grad != nullptr)) {
      if (slots > std::int64_t{std::numeric_limits<int>::max()} - kLossThreads * kLossBatch)
        detail::throw_op_error(op, "rows of " + std::to_string(r.cols) + " logits are too long");
      a.slots = static_cast<int>(slots);
      const bool soft = options.softcap > 0, smooth = options.label_smoothing > 0;
      const auto kernel = soft ? (smooth ? cross_entropy_loss_kernel<T, true, true> : cross_entropy_loss_kernel<T, true, false>)
                               : (smooth ? cross_entropy_loss_kernel<T, false, true> : cross_entropy_loss_kernel<T, false, false>);
      kernel<<<static_cast<unsigned>(detail::grid_for_tiles(r.rows, 1)), kLossThreads, 0, stream>>>(a);
      detail::check_launch(op);
      return;
    }
    launch_held_forward<T>(a, options.softcap > 0, r.cols, max_shift, options.kernel, stream, op);
  });
  if (!per_row) {
    reduce_row_losses_cuda(scratch.rows, targets, options.ignore_index,
                           options.reduction == Reduction::kMean, loss.ptr<float>(), scratch.parts, stream, op);
  }
}

void cross_entropy_backward_cuda(const TensorView& grad_loss, const TensorView& logits,
                                 const TensorView& targets, const TensorView& lse,
                                 TensorView grad_logits, const CrossEntropyOptions& options,
                                 cudaStream_t stream) {
  const char* op = "cross_entropy_backward";
  const detail::Rows r = detail::row_layout(logits);
  if (r.rows == 0) return;
  const bool per_row = options.reduction == Reduction::kNone;
  BackwardArgs a{};
  a.grad_loss = grad_loss.ptr<const float>();
  a.grad_loss_stride = per_row ? grad_loss.stride(0) : 0;
  a.logits = logits.data;
  a.logits_stride = r.row_stride;
  a.targets = targets_of(targets);
  a.lse = lse.ptr<const float>();
  a.lse_stride = lse.stride(0);
  a.grad = grad_logits.data;
  a.grad_stride = detail::row_layout(grad_logits).row_stride;
  a.o = options_of(options);
  a.rows = r.rows;
  if (options.reduction == Reduction::kMean) {
    const Scratch scratch = scratch_for(0, stream, op);
    a.valid_rows = count_valid(a.targets, r.rows, options.ignore_index, scratch.count, scratch.parts, stream, op);
  }
  detail::dispatch_activation_dtype(logits.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = detail::kVec16<T>;
    const std::int64_t slots =
        detail::row_slots(r.cols, V, detail::rows_max_shift(logits.data, r.row_stride, sizeof(T)));
    if (slots > std::int64_t{std::numeric_limits<int>::max()} - kBackwardChunk)
      detail::throw_op_error(op, "rows of " + std::to_string(r.cols) + " logits are too long");
    a.cols = static_cast<int>(r.cols);
    a.chunks = static_cast<int>((slots + kBackwardChunk - 1) / kBackwardChunk);
    const std::int64_t grid = detail::grid_for_tiles(r.rows * a.chunks, 1);
    const auto kernel = options.softcap > 0 ? cross_entropy_backward_kernel<T, true>
                                            : cross_entropy_backward_kernel<T, false>;
    kernel<<<static_cast<unsigned>(grid), kBackwardThreads, 0, stream>>>(a);
    detail::check_launch(op);
  });
}

}  // namespace trainscale::ops::loss
