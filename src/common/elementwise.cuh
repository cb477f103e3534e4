// Elementwise kernels over tensors seen as M rows of N elements, each tensor with its own base
// pointer and row stride, all of one storage type T:
//   (out_0, ..., out_k)(i, j) = op(in_0(i, j), ..., in_n(i, j)).
// Shared by the activation family and MSE; the walk (UnitWalk) also serves reductions.
//
// Layout: when every tensor's rows are contiguous the call is flattened into one row. The
// vector path moves 16-byte units (V = 16 / sizeof(T) elements) and needs every base pointer
// 16-byte aligned and every row stride a multiple of 16 bytes; the up to V - 1 elements after a
// row's last whole unit go through a scalar pass of the same kernel. Anything else (an
// unaligned view, say) takes the scalar path (V = 1) of the same template.
//
// Aliasing: each element's inputs are read before its outputs are written, by the same thread,
// and no two threads touch the same element, so an output may be exactly the same view as an
// input (y == x, da == a, ...). Loads are coherent (plain ld.global), never the read-only path.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/dtype.cuh"
#include "common/vec.cuh"

namespace trainscale::detail {

// A flat walk over n elements for kernels that stream whole contiguous tensors (the optimizer's):
// thread t of the grid takes unit t (elements [kVec t, kVec t + kVec)) below the last whole
// unit, then one element of the tail, and strides by the grid. f(first, width) gets
// std::integral_constant<int, kVec> or <int, 1> as width.
template <int kVec, class F>
__device__ __forceinline__ void for_each_unit(std::int64_t n, F&& f) {
  const std::int64_t units = n / kVec, work = units + n % kVec;
  const std::int64_t stride = std::int64_t{gridDim.x} * blockDim.x;
  for (std::int64_t t = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; t < work; t += stride) {
    if (t < units) {
      f(t * kVec, std::integral_constant<int, kVec>{});
    } else {
      f(units * kVec + (t - units), std::integral_constant<int, 1>{});
    }
  }
}

// One tensor of an elementwise call: base pointer and row stride in elements.
struct StridedRows {
  void* data;
  std::int64_t row_stride;
};

// (row, unit) position in a walk over rows x units; a unit is V consecutive elements of a row.
struct UnitPos {
  std::int64_t i;
  std::int64_t j;
};

// How a grid of kBlock-thread blocks walks rows x units in row-major order: thread t of block b
// starts at linear unit b * kBlock * kUnroll + t, takes kUnroll units kBlock apart (a "tile"),
// then jumps ahead by a whole grid's tiles. The steps are precomputed as (rows, units) pairs,
// so the loop divides nothing; a warp always covers 32 consecutive units (coalesced).
struct UnitWalk {
  std::int64_t rows = 0;     // 0 when there is nothing to do
  std::int64_t cols = 0;     // elements per row
  std::int64_t units = 1;    // whole units per row, >= 1
  std::int64_t tail = 0;     // elements per row after its last whole unit (scalar pass)
  UnitPos tile_step{0, 0};   // kBlock units
  UnitPos grid_step{0, 0};   // from a thread's last unit of one tile to its first of the next
};

// rows x cols elements in units of `vec` (cols >= vec unless empty), walked by `grid` blocks of
// `block` threads taking `unroll` units per tile.
inline UnitWalk make_walk(std::int64_t rows, std::int64_t cols, int vec, std::int64_t grid,
                          int block, int unroll) {
  UnitWalk w;
  if (rows <= 0 || cols <= 0) return w;
  w.rows = rows;
  w.cols = cols;
  w.units = cols / vec;
  w.tail = cols - w.units * vec;
  const auto step = [&](std::int64_t n) { return UnitPos{n / w.units, n % w.units}; };
  w.tile_step = step(block);
  w.grid_step = step((grid * unroll - (unroll - 1)) * static_cast<std::int64_t>(block));
  return w;
}

__device__ __forceinline__ void advance(UnitPos& p, const UnitPos& step, std::int64_t units) {
  p.i += step.i;
  p.j += step.j;
  if (p.j >= units) {
    p.j -= units;
    ++p.i;
  }
}

template <int kBlock, int kUnroll>
__device__ __forceinline__ UnitPos walk_start(const UnitWalk& w) {
  const std::int64_t lin =
      static_cast<std::int64_t>(blockIdx.x) * (kBlock * kUnroll) + threadIdx.x;
  return {lin / w.units, lin % w.units};
}

// Positions of this thread's kUnroll units of the tile starting at p (some may lie past the
// last row: check q[k].i < w.rows).
template <int kUnroll>
__device__ __forceinline__ void tile_positions(const UnitWalk& w, const UnitPos& p,
                                               UnitPos (&q)[kUnroll]) {
  q[0] = p;
#pragma unroll
  for (int k = 1; k < kUnroll; ++k) {
    q[k] = q[k - 1];
    advance(q[k], w.tile_step, w.units);
  }
}

// Host side: the layout an elementwise call runs with.
struct ElementwisePlan {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  bool vectorized = false;  // 16-byte units (else V = 1)
};

// Flattens contiguous rows into one row and decides whether 16-byte units apply.
template <std::size_t N>
ElementwisePlan plan_elementwise(std::int64_t rows, std::int64_t cols,
                                 const std::array<StridedRows, N>& tensors,
                                 std::size_t elem_bytes) {
  ElementwisePlan p{rows, cols, false};
  bool contiguous = true;
  for (const StridedRows& t : tensors) contiguous = contiguous && t.row_stride == cols;
  if (rows > 1 && contiguous) {
    p.cols = rows * cols;
    p.rows = 1;
  }
  const std::int64_t vec = 16 / static_cast<std::int64_t>(elem_bytes);
  bool aligned = p.cols >= vec;
  for (const StridedRows& t : tensors) {
    aligned = aligned && rows_16_byte_aligned(t.data, p.rows, t.row_stride * static_cast<std::int64_t>(elem_bytes));
  }
  p.vectorized = aligned;
  return p;
}

// Ops may read device-side parameters once per thread (say, an upstream gradient scalar):
// an op with `Op bind() const` is replaced by its result at the start of the kernel.
template <class Op>
__device__ __forceinline__ Op bind_op(const Op& op) {
  if constexpr (requires(const Op& o) { o.bind(); }) {
    return op.bind();
  } else {
    return op;
  }
}

// Rounds V floats to T and stores them as one unit: one 16-byte st.global (inline PTX, so the
// compiler cannot split it: plain 16-byte stores of all but the first unit of a tile came out
// of nvcc 13.0 as four 4-byte stores; __stwb keeps the width but becomes a STRONG.SM store), or
// one element when V == 1.
template <class T, int V>
__device__ __forceinline__ void store_unit(T* p, const float (&v)[V]) {
  if constexpr (V == 1) {
    p[0] = from_float<T>(v[0]);
  } else {
    static_assert(sizeof(T) * V == 16);
    unsigned w[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if constexpr (sizeof(T) == 4) {
        w[c] = __float_as_uint(v[c]);
      } else if constexpr (std::is_same_v<T, __half>) {
        const __half2 pair = __floats2half2_rn(v[2 * c], v[2 * c + 1]);  // .x at the lower address
        memcpy(&w[c], &pair, 4);
      } else {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * c], v[2 * c + 1]);
        memcpy(&w[c], &pair, 4);
      }
    }
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]),
                 "r"(w[2]), "r"(w[3])
                 : "memory");
  }
}

template <class T, int NIn, int NOut>
struct ElementwiseArgs {
  const T* in[NIn];
  std::int64_t in_stride[NIn];
  T* out[NOut];
  std::int64_t out_stride[NOut];
  UnitWalk walk;
};

inline constexpr int kElementwiseBlock = 256;

// Op: static constexpr int kIn, kOut; __device__ void operator()(const float (&)[kIn],
// float (&)[kOut]) const, in fp32.
template <class T, int V, int kUnroll, class Op>
__global__ void __launch_bounds__(kElementwiseBlock)
    elementwise_kernel(const ElementwiseArgs<T, Op::kIn, Op::kOut> a, const Op op) {
  constexpr int kBlock = kElementwiseBlock;
  constexpr int NIn = Op::kIn;
  constexpr int NOut = Op::kOut;
  const Op f = bind_op(op);
  const UnitWalk& w = a.walk;
  for (UnitPos p = walk_start<kBlock, kUnroll>(w); p.i < w.rows;) {
    UnitPos q[kUnroll];
    tile_positions(w, p, q);
    // Every load of the tile first (kUnroll * NIn independent 16-byte loads in flight).
    Vec<T, V> x[kUnroll][NIn];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (q[k].i >= w.rows) continue;
#pragma unroll
      for (int n = 0; n < NIn; ++n) {
        x[k][n] = load_raw<T, V>(a.in[n] + q[k].i * a.in_stride[n] + q[k].j * V);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (q[k].i >= w.rows) continue;
      float y[NOut][V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        float in[NIn];
        float out[NOut];
#pragma unroll
        for (int n = 0; n < NIn; ++n) in[n] = to_float(x[k][n].v[e]);
        f(in, out);
#pragma unroll
        for (int n = 0; n < NOut; ++n) y[n][e] = out[n];
      }
#pragma unroll
      for (int n = 0; n < NOut; ++n) {
        store_unit<T, V>(a.out[n] + q[k].i * a.out_stride[n] + q[k].j * V, y[n]);
      }
    }
    p = q[kUnroll - 1];
    advance(p, w.grid_step, w.units);
  }
  // The last cols % V elements of every row (vector path only).
  if constexpr (V > 1) {
    const std::int64_t count = w.rows * w.tail;
    const std::int64_t first = w.units * V;
    for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kBlock + threadIdx.x;
         t < count; t += static_cast<std::int64_t>(gridDim.x) * kBlock) {
      const std::int64_t i = t / w.tail;
      const std::int64_t j = first + (t - i * w.tail);
      float in[NIn];
      float out[NOut];
#pragma unroll
      for (int n = 0; n < NIn; ++n) in[n] = to_float(a.in[n][i * a.in_stride[n] + j]);
      f(in, out);
#pragma unroll
      for (int n = 0; n < NOut; ++n) a.out[n][i * a.out_stride[n] + j] = from_float<T>(out[n]);
    }
  }
}

// Loads in flight per thread: about four 16-byte vectors.
template <int NIn>
inline constexpr int kElementwiseUnroll = NIn == 1 ? 4 : 2;

template <class T, int V, class Op>
void launch_elementwise_with(const char* op_name, const ElementwisePlan& plan,
                             const std::array<StridedRows, Op::kIn>& in,
                             const std::array<StridedRows, Op::kOut>& out, const Op& op,
                             cudaStream_t stream) {
  constexpr int kUnroll = kElementwiseUnroll<Op::kIn>;
  constexpr int kBlock = kElementwiseBlock;
  const auto kernel = elementwise_kernel<T, V, kUnroll, Op>;
  const std::int64_t grid = grid_for_tiles(plan.rows * (plan.cols / V), kBlock * kUnroll);
  ElementwiseArgs<T, Op::kIn, Op::kOut> a{};
  for (int n = 0; n < Op::kIn; ++n) {
    a.in[n] = static_cast<const T*>(in[n].data);
    a.in_stride[n] = in[n].row_stride;
  }
  for (int n = 0; n < Op::kOut; ++n) {
    a.out[n] = static_cast<T*>(out[n].data);
    a.out_stride[n] = out[n].row_stride;
  }
  a.walk = make_walk(plan.rows, plan.cols, V, grid, kBlock, kUnroll);
  kernel<<<static_cast<unsigned>(grid), kBlock, 0, stream>>>(a, op);
  check_launch(op_name);
}

// Runs `op` over rows x cols elements of T (device storage type); launches nothing when empty.
template <class T, class Op>
void launch_elementwise(const char* op_name, std::int64_t rows, std::int64_t cols,
                        const std::array<StridedRows, Op::kIn>& in,
                        const std::array<StridedRows, Op::kOut>& out, const Op& op,
                        cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  std::array<StridedRows, Op::kIn + Op::kOut> all{};
  for (int n = 0; n < Op::kIn; ++n) all[n] = in[n];
  for (int n = 0; n < Op::kOut; ++n) all[Op::kIn + n] = out[n];
  const ElementwisePlan plan = plan_elementwise(rows, cols, all, sizeof(T));
  if (plan.vectorized) {
    launch_elementwise_with<T, kVec16<T>, Op>(op_name, plan, in, out, op, stream);
  } else {
    launch_elementwise_with<T, 1, Op>(op_name, plan, in, out, op, stream);
  }
}

}  // namespace trainscale::detail
