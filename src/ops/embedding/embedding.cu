// The embedding family's CUDA kernels. One warp per row (a token's row in the forward, a table
// row in the backward), 16-byte units along the row when every row start is 16-byte aligned.
//
// Backward: the ids are sorted with their positions (CUB's radix sort, stable), so the tokens of
// table row v form one run of the sorted ids; the warp of row v finds it by binary search and
// sums those tokens' gradient rows in increasing position, in float32 — a fixed order, the same
// bits every run, no atomics. Rows that no id names are written as zeros by the same pass: the
// table gradient is written once (V x H elements) and the output gradient read once per token,
// where a zero fill followed by a scatter-add would write the table twice.
#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>

#include "common/cuda_check.h"
#include "common/dtype.cuh"
#include "common/vec.cuh"
#include "ops/embedding/embedding_internal.h"

namespace trainscale::ops::embedding {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr std::size_t kAlign = 256;

__device__ __forceinline__ std::int64_t first_warp() { return blockIdx.x * std::int64_t{kWarps} + threadIdx.x / 32; }
__device__ __forceinline__ std::int64_t warp_stride() { return std::int64_t{gridDim.x} * kWarps; }
__device__ __forceinline__ int lane() { return threadIdx.x % 32; }

template <class T, int N>
__device__ __forceinline__ void fill_row(T* row, std::int64_t cols, float value) {
  float v[N];
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = value;
  for (std::int64_t j = std::int64_t{lane()} * N; j < cols; j += 32 * N) detail::store_floats<T, N>(row + j, v);
}

// Token t's row of out = table row ids[t]; a row of NaN for an id outside [0, vocab).
template <int N, class T, class Id>
__global__ void __launch_bounds__(kThreads)
    embedding_forward_kernel(const T* weight, std::int64_t weight_stride, std::int64_t vocab, const Id* ids,
                             T* out, std::int64_t out_stride, std::int64_t tokens, std::int64_t cols) {
  for (std::int64_t t = first_warp(); t < tokens; t += warp_stride()) {
    const std::int64_t id = ids[t];
    T* dst = out + t * out_stride;
    if (id < 0 || id >= vocab) {
      fill_row<T, N>(dst, cols, __int_as_float(0x7fc00000));
      continue;
    }
    const T* src = weight + id * weight_stride;
    for (std::int64_t j = std::int64_t{lane()} * N; j < cols; j += 32 * N)
      detail::store_raw<T, N>(dst + j, detail::load_raw<T, N>(src + j));
  }
}

// Sort keys: the id, vocab for padding_idx (summed nowhere), vocab + 1 for an id outside
// [0, vocab) (sorts last, where the row kernel looks for it).
template <class Id>
__global__ void __launch_bounds__(kThreads)
    sort_keys_kernel(const Id* ids, std::int64_t tokens, std::int64_t vocab, std::int64_t padding_idx,
                     std::uint32_t* keys, std::uint32_t* positions) {
  for (std::int64_t t = blockIdx.x * std::int64_t{kThreads} + threadIdx.x; t < tokens;
       t += std::int64_t{gridDim.x} * kThreads) {
    const std::int64_t id = ids[t];
    const std::int64_t key = (id < 0 || id >= vocab) ? vocab + 1 : (id == padding_idx ? vocab : id);
    keys[t] = static_cast<std::uint32_t>(key);
    positions[t] = static_cast<std::uint32_t>(t);
  }
}

// First index in keys[0, n) whose key is >= v.
__device__ __forceinline__ std::int64_t lower_bound(const std::uint32_t* keys, std::int64_t n, std::uint32_t v) {
  std::int64_t lo = 0;
  while (n > 0) {
    const std::int64_t half = n / 2;
    if (keys[lo + half] < v) {
      lo += half + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  return lo;
}

// Table row v = the sum of the output gradient's rows at positions[lo, hi), where keys[lo, hi)
// is the run of v; every element NaN when an id was out of range.
template <int N, class T>
__global__ void __launch_bounds__(kThreads)
    embedding_backward_kernel(const T* grad_output, std::int64_t grad_stride, const std::uint32_t* keys,
                              const std::uint32_t* positions, std::int64_t tokens, T* grad_weight,
                              std::int64_t vocab, std::int64_t cols) {
  const bool poisoned = tokens > 0 && keys[tokens - 1] == static_cast<std::uint32_t>(vocab + 1);
  for (std::int64_t v = first_warp(); v < vocab; v += warp_stride()) {
    T* dst = grad_weight + v * cols;
    if (poisoned) {
      fill_row<T, N>(dst, cols, __int_as_float(0x7fc00000));
      continue;
    }
    const std::int64_t lo = lower_bound(keys, tokens, static_cast<std::uint32_t>(v));
    const std::int64_t hi = lo + lower_bound(keys + lo, tokens - lo, static_cast<std::uint32_t>(v + 1));
    for (std::int64_t j = std::int64_t{lane()} * N; j < cols; j += 32 * N) {
      float sum[N] = {};
      for (std::int64_t k = lo; k < hi; ++k) {
        float x[N];
        detail::load_floats<T, N>(grad_output + positions[k] * grad_stride + j, x);
#pragma unroll
        for (int i = 0; i < N; ++i) sum[i] += x[i];
      }
      detail::store_floats<T, N>(dst + j, sum);
    }
  }
}

unsigned warp_grid(std::int64_t rows) { return static_cast<unsigned>(detail::grid_for_tiles(rows, kWarps)); }

// 16-byte units when every row start is 16-byte aligned, single elements otherwise.
template <class T>
bool rows_aligned16(const TensorView& t, std::int64_t rows, std::int64_t row_stride) {
  return detail::rows_16_byte_aligned(t.data, rows, row_stride * static_cast<std::int64_t>(sizeof(T)));
}

template <class T, class Launch>
void with_width(bool vector, std::int64_t cols, Launch&& launch) {
  constexpr int kVec = detail::kVec16<T>;
  if (vector && cols % kVec == 0) {
    launch(std::integral_constant<int, kVec>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

template <class Fn>
decltype(auto) dispatch_ids(DType dtype, Fn&& fn) {
  return dtype == DType::kInt32 ? fn(detail::TypeTag<std::int32_t>{}) : fn(detail::TypeTag<std::int64_t>{});
}

std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// CUB's temporary storage for sorting `tokens` 32-bit keys with their positions over all 32 bits
// (at least what any narrower bit range needs).
std::size_t sort_temp_bytes(std::int64_t tokens) {
  std::size_t bytes = 0;
  detail::check_cuda(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const std::uint32_t*>(nullptr),
                                                     static_cast<std::uint32_t*>(nullptr),
                                                     static_cast<const std::uint32_t*>(nullptr),
                                                     static_cast<std::uint32_t*>(nullptr), static_cast<int>(tokens)),
                     "embedding_backward", "cub::DeviceRadixSort::SortPairs (size query)");
  return bytes;
}

}  // namespace

void embedding_forward_cuda(const TensorView& weight, const TensorView& ids, TensorView out, cudaStream_t stream) {
  const detail::Rows w = detail::row_layout(weight), o = detail::row_layout(out);
  detail::dispatch_activation_dtype(weight.dtype, "embedding_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_ids(ids.dtype, [&](auto id_tag) {
      using Id = typename decltype(id_tag)::type;
      const bool vector =
          rows_aligned16<T>(weight, w.rows, w.row_stride) && rows_aligned16<T>(out, o.rows, o.row_stride);
      with_width<T>(vector, o.cols, [&](auto width) {
        embedding_forward_kernel<decltype(width)::value><<<warp_grid(o.rows), kThreads, 0, stream>>>(
            weight.ptr<const T>(), w.row_stride, w.rows, ids.ptr<const Id>(), out.ptr<T>(), o.row_stride, o.rows,
            o.cols);
      });
    });
  });
  detail::check_launch("embedding_forward");
}

std::size_t embedding_backward_workspace_bytes_cuda(std::int64_t num_ids) {
  if (num_ids == 0) return 0;
  return 4 * aligned(static_cast<std::size_t>(num_ids) * sizeof(std::uint32_t)) + sort_temp_bytes(num_ids);
}

void embedding_backward_cuda(const TensorView& grad_output, const TensorView& ids, TensorView grad_weight,
                             std::int64_t padding_idx, TensorView workspace, cudaStream_t stream) {
  const detail::Rows g = detail::row_layout(grad_output);
  const std::int64_t tokens = g.rows, vocab = grad_weight.size(0), cols = g.cols;
  std::uint32_t* sorted_keys = nullptr;
  std::uint32_t* sorted_positions = nullptr;
  if (tokens > 0) {
    const std::size_t array = aligned(static_cast<std::size_t>(tokens) * sizeof(std::uint32_t));
    auto* base = static_cast<unsigned char*>(workspace.data);
    auto* keys = reinterpret_cast<std::uint32_t*>(base);
    auto* positions = reinterpret_cast<std::uint32_t*>(base + array);
    sorted_keys = reinterpret_cast<std::uint32_t*>(base + 2 * array);
    sorted_positions = reinterpret_cast<std::uint32_t*>(base + 3 * array);
    dispatch_ids(ids.dtype, [&](auto id_tag) {
      using Id = typename decltype(id_tag)::type;
      const auto grid = static_cast<unsigned>(detail::grid_for_tiles(tokens, kThreads));
      sort_keys_kernel<<<grid, kThreads, 0, stream>>>(ids.ptr<const Id>(), tokens, vocab, padding_idx, keys,
                                                      positions);
    });
    detail::check_launch("embedding_backward");
    std::size_t temp_bytes = workspace.numel() * workspace.element_size() - 4 * array;
    const int end_bit = std::bit_width(static_cast<std::uint64_t>(vocab + 1));
    detail::check_cuda(cub::DeviceRadixSort::SortPairs(base + 4 * array, temp_bytes, keys, sorted_keys, positions,
                                                       sorted_positions, static_cast<int>(tokens), 0, end_bit, stream),
                       "embedding_backward", "cub::DeviceRadixSort::SortPairs");
  }
  detail::dispatch_activation_dtype(grad_output.dtype, "embedding_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool vector =
        rows_aligned16<T>(grad_output, g.rows, g.row_stride) && rows_aligned16<T>(grad_weight, vocab, cols);
    with_width<T>(vector, cols, [&](auto width) {
      embedding_backward_kernel<decltype(width)::value><<<warp_grid(vocab), kThreads, 0, stream>>>(
          grad_output.ptr<const T>(), g.row_stride, sorted_keys, sorted_positions, tokens, grad_weight.ptr<T>(), vocab,
          cols);
    });
  });
  detail::check_launch("embedding_backward");
}

}  // namespace trainscale::ops::embedding
