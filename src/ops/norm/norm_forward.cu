// Forward kernels: RMSNorm, fused add + RMSNorm (in place) and LayerNorm share one row kernel.
#include <limits>

#include "common/async_copy.cuh"
#include "common/carveout.h"
#include "common/cluster_launch.h"
#include "core/check.h"
#include "ops/norm/norm_common.cuh"

namespace trainscale::ops::norm {
namespace {

using detail::load_floats;
using detail::load_param;
using detail::row_sum;
using detail::store_floats;
using detail::to_float;
using detail::from_float;
using detail::Vec;

constexpr int kForwardBlock = 256;
// Threads of a block of the register kernels: kThreads per row, several rows when short.
template <int kThreads>
constexpr int kBlockFor = kThreads > kForwardBlock ? kThreads : kForwardBlock;
// The register kernel's static reduction scratch at most (1024 threads, 3 sums), and the
// shared memory a kernel gets without raising its limit.
constexpr std::size_t kMaxScratchBytes = 1024 / 32 * 3 * sizeof(float);
constexpr std::size_t kDefaultSharedBytes = 48 * 1024;

struct ForwardArgs {
  const void* x;
  std::int64_t x_stride;
  void* residual;  // fused add: read, then overwritten with x + residual
  std::int64_t residual_stride;
  const void* weight;
  bool weight_f32;
  const void* bias;
  bool bias_f32;
  void* y;
  std::int64_t y_stride;
  float* mean;
  float* rstd;
  std::int64_t rows;
  std::int64_t cols;
  float eps;
  float weight_offset;
};

template <class T>
__device__ __forceinline__ float load_shift(const ForwardArgs& a, std::int64_t col) {
  return a.bias ? load_param<T>(a.bias, a.bias_f32, col) : 0.f;
}

// What a row's input is kept as between its reduction and its output: x, or with the fused
// add the sum x + residual rounded to the residual's dtype.
template <class T, class R>
using Held = std::conditional_t<std::is_void_v<R>, T, R>;

// x + residual rounded to the residual's dtype, written back to the residual at r_ptr.
template <class T, class R, int V>
__device__ __forceinline__ Vec<R, V> add_residual(R* r_ptr, const Vec<T, V>& x,
                                                  const Vec<R, V>& r) {
  Vec<R, V> sum;
#pragma unroll
  for (int j = 0; j < V; ++j) sum.v[j] = from_float<R>(to_float(x.v[j]) + to_float(r.v[j]));
  detail::store_raw(r_ptr, sum);
  return sum;
}

// x (+ residual, rounded to the residual's dtype and written back) for V elements at col, in
// its storage type: bf16 rows then take half the registers of floats.
template <class T, class R, int V>
__device__ __forceinline__ Vec<Held<T, R>, V> load_input_raw(const ForwardArgs& a,
                                                             std::int64_t row, std::int64_t col) {
  const T* x_ptr = static_cast<const T*>(a.x) + row * a.x_stride + col;
  if constexpr (std::is_void_v<R>) {
    return detail::load_raw<T, V>(x_ptr);
  } else {
    R* r_ptr = static_cast<R*>(a.residual) + row * a.residual_stride + col;
    return add_residual<T, R, V>(r_ptr, detail::load_raw<T, V>(x_ptr),
                                 detail::load_raw<R, V>(r_ptr));
  }
}

// 16-byte chunks of a residual vector of V elements (none without a residual).
template <class R, int V>
constexpr int residual_chunks() {
  if constexpr (std::is_void_v<R>) {
    return 0;
  } else {
    return static_cast<int>(sizeof(Vec<R, V>) / 16);
  }
}

// kPipelined's ring of two stages in shared memory, each a block's row group, filled by
// cp.async while the previous group is reduced and written. A thread copies and later reads
// only its own vectors, so its cp.async.wait_group is all the ordering needed (no barrier), and
// a stage is refilled only after the thread's values from it were consumed. Layout: 16-byte
// chunks by [stage][row slot][chunk][vector], chunk 0 x and chunks 1.. the residual (fused
// add), so a warp's 16-byte shared accesses are consecutive.
template <class T, class R, int kThreads, int kVecs>
struct RowRing {
  static constexpr int V = detail::kVec16<T>;
  static constexpr int kRowsPerBlock = kBlockFor<kThreads> / kThreads;
  static constexpr int kResidualChunks = residual_chunks<R, V>();
  static constexpr int kChunks = 1 + kResidualChunks;
  uint4* base;
  int vecs;  // per row

  static std::size_t bytes(std::int64_t vecs) {
    return static_cast<std::size_t>(2 * kRowsPerBlock * kChunks) * static_cast<std::size_t>(vecs) *
           sizeof(uint4);
  }

  __device__ __forceinline__ uint4* chunk(int stage, int slot, int c, int u) const {
    return base + ((stage * kRowsPerBlock + slot) * kChunks + c) * vecs + u;
  }

  // Starts the copies of the thread's vectors of `row` into `stage`.
  __device__ __forceinline__ void fetch(const ForwardArgs& a, std::int64_t row, int slot, int lane,
                                        int stage) const {
    const auto* x_row =
        reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + row * a.x_stride);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int u = i * kThreads + lane;
      if (u >= vecs) continue;
      detail::cp_async_16(chunk(stage, slot, 0, u), x_row + u);
      if constexpr (kResidualChunks > 0) {
        const auto* r_row = reinterpret_cast<const uint4*>(static_cast<const R*>(a.residual) +
                                                           row * a.residual_stride);
#pragma unroll
        for (int c = 0; c < kResidualChunks; ++c) {
          detail::cp_async_16(chunk(stage, slot, 1 + c, u), r_row + u * kResidualChunks + c);
        }
      }
    }
  }

  // The thread's vector u of `row` from `stage`, as held: x, or with the fused add the rounded
  // sum, written back to the residual.
  __device__ __forceinline__ Vec<Held<T, R>, V> take(const ForwardArgs& a, std::int64_t row,
                                                     int slot, int stage, int u) const {
    Vec<T, V> x;
    const uint4 x_raw = *chunk(stage, slot, 0, u);
    memcpy(&x, &x_raw, sizeof(x));
    if constexpr (kResidualChunks == 0) {
      return x;
    } else {
      uint4 r_raw[kResidualChunks];
#pragma unroll
      for (int c = 0; c < kResidualChunks; ++c) r_raw[c] = *chunk(stage, slot, 1 + c, u);
      Vec<R, V> r;
      memcpy(&r, r_raw, sizeof(r));
      return add_residual<T, R, V>(
          static_cast<R*>(a.residual) + row * a.residual_stride + static_cast<std::int64_t>(u) * V,
          x, r);
    }
  }
};

template <class T, class R, int V>
__device__ __forceinline__ void load_input(const ForwardArgs& a, std::int64_t row,
                                           std::int64_t col, float (&v)[V]) {
  detail::to_floats(load_input_raw<T, R, V>(a, row, col), v);
}

// LayerNorm variance sums are shifted by the row's first input, which keeps
// E[(x-p)^2] - E[x-p]^2 exact enough when |mean| >> std. With a residual, callers must read it
// before any thread of the row rewrites it.
template <class T, class R>
__device__ __forceinline__ float load_pivot(const ForwardArgs& a, std::int64_t row) {
  const float x = to_float(static_cast<const T*>(a.x)[row * a.x_stride]);
  if constexpr (std::is_void_v<R>) {
    return x;
  } else {
    return to_float(
        from_float<R>(x + to_float(static_cast<const R*>(a.residual)[row * a.residual_stride])));
  }
}

// Row sums: RMSNorm x^2; LayerNorm x (for the saved mean), x - pivot and (x - pivot)^2 (for
// the variance and the centring).
template <Kind kKind>
constexpr int kSums = kKind == Kind::kLayer ? 3 : 1;

template <Kind kKind, int V>
__device__ __forceinline__ void accumulate(const float (&v)[V], float pivot,
                                           float (&sums)[kSums<kKind>]) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if constexpr (kKind == Kind::kLayer) {
      const float d = v[j] - pivot;
      sums[0] += v[j];
      sums[1] += d;
      sums[2] += d * d;
    } else {
      sums[0] += v[j] * v[j];
    }
  }
}

struct RowStats {
  // Saved: from the plain sum. pivot + (mean - pivot) loses the mean near 0 on long rows (the
  // partial sums of x - pivot grow with the row): at bf16 32768x65536 its relative L2 error
  // exceeded the fp32 tolerance of 1e-5.
  float mean;
  float rstd;
  float offset;  // LayerNorm: -(mean - pivot) * rstd, so x-hat = (x - pivot) * rstd + offset
};

template <Kind kKind>
__device__ __forceinline__ RowStats row_stats(const float (&sums)[kSums<kKind>], std::int64_t n,
                                              float eps) {
  const float inv_n = 1.f / static_cast<float>(n);
  if constexpr (kKind == Kind::kLayer) {
    // Centred on the pivot, exact when |mean| >> std.
    const float shifted_mean = sums[1] * inv_n;
    const float raw_var = sums[2] * inv_n - shifted_mean * shifted_mean;
    // Clamp the rounding-negative variance without fmaxf, which would turn NaN into 0.
    const float var = raw_var < 0.f ? 0.f : raw_var;
    const float rstd = rsqrtf(var + eps);
    return {sums[0] * inv_n, rstd, -shifted_mean * rstd};
  } else {
    return {0.f, rsqrtf(sums[0] * inv_n + eps), 0.f};
  }
}

// One FMA per element for LayerNorm's x-hat. The bf16 kRows kernel at N = 8192 issues 21
// instructions per element with every parameter given (SASS of the whole kernel over a
// thread's 32 elements), RMSNorm's 15; fewer instructions did not make LayerNorm faster
// (docs/perf-notes.md, session 8).
template <Kind kKind>
__device__ __forceinline__ float normalize(float v, float pivot, const RowStats& st, float scale,
                                           float shift) {
  if constexpr (kKind == Kind::kLayer) {
    return fmaf(v - pivot, st.rstd, st.offset) * scale + shift;
  } else {
    return v * st.rstd * scale;
  }
}

// Per-column scale (weight, + offset for RMSNorm) and LayerNorm shift (bias), staged once per
// block in shared memory as floats. They are read again for every row instead of being held
// in registers (up to 64 floats per thread, which capped occupancy at 2 blocks per SM), and
// the per-row shared loads cannot be hoisted into registers across the row's reduction
// barrier. Layout: column vector u of V elements is stored as V / 4 chunks of 4 floats, chunk
// c at (c * vecs + u) * 4, so the 16-byte shared loads of a warp are consecutive (no bank
// conflicts).
template <Kind kKind>
constexpr int kParamTables = kKind == Kind::kLayer ? 2 : 1;

template <Kind kKind, int V>
struct StagedParams {
  static constexpr int kChunks = V / 4;
  float* base;
  int vecs;

  __device__ __forceinline__ float* at(int table, int col) const {
    const int u = col / V;
    const int j = col % V;
    return base + ((table * kChunks + j / 4) * vecs + u) * 4 + j % 4;
  }
  __device__ __forceinline__ void load(int table, int col, float (&out)[V]) const {
    const int u = col / V;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const float4 q = reinterpret_cast<const float4*>(base)[(table * kChunks + c) * vecs + u];
      out[c * 4 + 0] = q.x;
      out[c * 4 + 1] = q.y;
      out[c * 4 + 2] = q.z;
      out[c * 4 + 3] = q.w;
    }
  }
  // Scale and shift of the row vector at col.
  __device__ __forceinline__ void scale_shift(const ForwardArgs&, int col, float (&scale)[V],
                                              float (&shift)[V]) const {
    load(0, col, scale);
    if constexpr (kKind == Kind::kLayer) load(1, col, shift);
  }
};

// Rows variant: weight (and bias) read from global memory per row as stored (W, B: float or
// T, known at compile time: loads of both kinds behind the runtime flags spilled), 16 bytes
// per load, L1/L2-resident since every row reads them. Their lines are prefetched into L1
// before the row's reduction, so the latency overlaps it without holding registers: the kernel
// is at its 64-register cap, and parameters held across the reduction spilled. kPresent: the
// caller checked that every parameter is given (the usual case), so no vector tests for null
// (two 64-bit compares each, which the compiler re-issued per vector).
template <class T, class W, class B, Kind kKind, int V, int kVecs>
struct GlobalParams {
  static __device__ __forceinline__ bool all_present(const ForwardArgs& a) {
    return a.weight != nullptr && (kKind == Kind::kRms || a.bias != nullptr);
  }
  // The thread's columns of a block holding `block_cols` columns from first_col.
  template <bool kPresent>
  static __device__ __forceinline__ void prefetch(const ForwardArgs& a, int first_col,
                                                  int block_cols, int lane, int threads) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int in_block = (i * threads + lane) * V;
      if (in_block >= block_cols) continue;
      const int col = first_col + in_block;
      if (kPresent || a.weight) detail::prefetch_l1(static_cast<const W*>(a.weight) + col);
      if constexpr (kKind == Kind::kLayer) {
        if (kPresent || a.bias) detail::prefetch_l1(static_cast<const B*>(a.bias) + col);
      }
    }
  }
  template <bool kPresent>
  static __device__ __forceinline__ void scale_shift(const ForwardArgs& a, int col,
                                                     float (&scale)[V], float (&shift)[V]) {
    if (kPresent || a.weight) {
      load_floats<W, V, false>(static_cast<const W*>(a.weight) + col, scale);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) scale[j] = 1.f;
    }
    if constexpr (kKind == Kind::kRms) {
#pragma unroll
      for (int j = 0; j < V; ++j) scale[j] += a.weight_offset;
    } else if (kPresent || a.bias) {
      load_floats<B, V, false>(static_cast<const B*>(a.bias) + col, shift);
    }
  }
};

// Dynamic shared memory of the register kernel for rows of `cols` elements.
template <Kind kKind>
__host__ __device__ std::size_t staged_param_bytes(std::int64_t cols) {
  return static_cast<std::size_t>(cols) * sizeof(float) * kParamTables<kKind>;
}

// Fills the staged tables; the loads are batched so each thread has several in flight.
template <class T, Kind kKind, int kBlock, int V>
__device__ __forceinline__ void stage_params(const ForwardArgs& a,
                                             const StagedParams<kKind, V>& p) {
  constexpr int kBatch = 8;
  const int n = static_cast<int>(a.cols);
  for (int base = threadIdx.x; base < n; base += kBlock * kBatch) {
    float scale[kBatch], shift[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int col = base + k * kBlock;
      scale[k] = col < n ? load_scale<T, kKind>(a, col) : 0.f;
      if constexpr (kKind == Kind::kLayer) shift[k] = col < n ? load_shift<T>(a, col) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int col = base + k * kBlock;
      if (col >= n) break;
      *p.at(0, col) = scale[k];
      if constexpr (kKind == Kind::kLayer) *p.at(1, col) = shift[k];
    }
  }
}

// Blocks per SM the register kernel is compiled for: RMSNorm without the residual takes 5
// blocks of 256 threads (48 registers, no spills), so a fifth row group is in flight per SM.
// H100, bf16, same build otherwise: rmsnorm 65536x8192 2902 GB/s at 53 registers (4 blocks per
// SM) -> 2993 at 48, 4096x8192 2607 -> 2683, 32768x1024 2565 -> 2608. bf16 LayerNorm (48
// registers without spills too) was slower at 5 blocks: 4096x8192 2358 -> 2296, 32768x1024
// 2424 -> 2327, 65536x8192 2736 -> 2724. The fused add (fp16, or an fp32 residual) and
// LayerNorm with fp32 parameters spill at 48.
template <class R, Kind kKind, int kBlock>
constexpr int kMinBlocksPerSm =
    kBlock == 256 && std::is_void_v<R> && kKind == Kind::kRms ? 5 : 1024 / kBlock;

// Whole row in registers (as stored: 16 bytes per vector for 16-bit inputs): kThreads threads
// per row, kVecs vectors of V elements each; aligned rows of a multiple of V elements.
// LayerNorm takes its three sums (x, x - pivot, (x - pivot)^2) in one reduction, so every row
// has a single barrier round trip. kVariant:
//   kRegisters: scale and shift staged once per block in shared memory (StagedParams);
//     LayerNorm's blocks form a persistent grid looping over row groups, RMSNorm's take one
//     row group each (launch_registers says why).
//   kRows: one row group per block (the grid covers the rows); weight and bias read from
//     global memory as stored (GlobalParams, their dtypes W and B; T for kRegisters, which
//     reads the runtime flags), no shared tables. With kCluster > 1, rows longer than a block
//     holds: a cluster of kCluster blocks per row, each holding a contiguous chunk of its
//     vectors; the block sums are added across the cluster (ClusterRowSum, bitwise the same
//     totals in every block), and each block normalizes and stores its chunk.
//   kPipelined: kRegisters whose rows arrive through a two-stage RowRing: the next row group's
//     copies are issued before this group's reduction, so HBM reads continue through its
//     barriers and stores (in kRegisters a block has no reads in flight then).
template <class T, class R, class W, class B, Kind kKind, NormVariant kVariant, int kThreads,
          int kVecs, int kCluster>
__global__ void __launch_bounds__(kBlockFor<kThreads>,
                                  kMinBlocksPerSm<R, kKind, kBlockFor<kThreads>>)
    forward_registers_kernel(ForwardArgs a) {
  // The pivot would race with the residual write-back of the row's first vector.
  static_assert(kKind == Kind::kRms || std::is_void_v<R>);
  static_assert(kVariant == NormVariant::kRegisters || kVariant == NormVariant::kRows ||
                kVariant == NormVariant::kPipelined);
  static_assert(kCluster == 1 || (kVariant == NormVariant::kRows && kThreads >= kForwardBlock),
                "a cluster splits one row per block, its parameters read as kRows reads them");
  constexpr bool kPipelined = kVariant == NormVariant::kPipelined;
  constexpr bool kStaged = kVariant != NormVariant::kRows;
  using X = Held<T, R>;
  using Ring = RowRing<T, R, kThreads, kVecs>;
  constexpr int V = detail::kVec16<T>;
  constexpr int kBlock = kBlockFor<kThreads>;
  constexpr int kRowsPerBlock = kBlock / kThreads;
  __shared__ float scratch[kThreads > 32 ? kBlock / 32 * kSums<kKind> : 1];
  __shared__ detail::ClusterRowSum<kCluster, kSums<kKind>> cluster_sums;  // kCluster > 1
  extern __shared__ float4 staged[];
  const int lane = threadIdx.x % kThreads;
  const int slot = threadIdx.x / kThreads;
  // Columns as int: the register kernels take rows of at most 8 x 4096 vectors. 32-bit bounds
  // checks are one compare each, 64-bit ones two.
  const int n = static_cast<int>(a.cols);
  // The block's columns of each row: all of them, or its rank's chunk of a cluster's row (a
  // whole number of vectors, as even as the vector count allows).
  const int rank = static_cast<int>(blockIdx.x % kCluster);
  const int chunk_cols = (n / V + kCluster - 1) / kCluster * V;
  const int first_col = rank * chunk_cols;
  const int block_cols = kCluster == 1 ? n : min(chunk_cols, n - first_col);
  const StagedParams<kKind, V> staged_params{reinterpret_cast<float*>(staged), n / V};
  // The ring follows the staged tables (a multiple of 16 bytes: n is a multiple of V >= 4).
  const Ring ring{reinterpret_cast<uint4*>(staged) + staged_param_bytes<kKind>(n) / sizeof(uint4),
                  static_cast<int>(n / V)};
  using Params = GlobalParams<T, W, B, kKind, V, kVecs>;  // kRows
  const bool params_present = Params::all_present(a);
  const std::int64_t first_group = static_cast<std::int64_t>(blockIdx.x / kCluster) * kRowsPerBlock;
  const std::int64_t group_stride = static_cast<std::int64_t>(gridDim.x / kCluster) * kRowsPerBlock;

  // kPipelined: starts the copies of the thread's row of the group at `base` into `stage`, one
  // commit group per call (empty past the last row, so every thread counts groups alike), and
  // returns the row's LayerNorm pivot, read now so that it is in a register when needed.
  const auto prefetch = [&](std::int64_t base, int stage) {
    const std::int64_t row = base + slot;
    float pivot = 0.f;
    if (row < a.rows) {
      ring.fetch(a, row, slot, lane, stage);
      if constexpr (kKind == Kind::kLayer) pivot = load_pivot<T, R>(a, row);
    }
    detail::cp_async_commit();
    return pivot;
  };
  float next_pivot = 0.f;
  // The first group's copies overlap the staging of the parameters.
  if constexpr (kPipelined) next_pivot = prefetch(first_group, 0);
  if constexpr (kStaged) {
    stage_params<T, kKind, kBlock, V>(a, staged_params);
    __syncthreads();
  }
  int cluster_rows = 0;
  if constexpr (kCluster > 1) cluster_sums.start();

  // Every thread of a block runs the same number of iterations: the reductions need them all.
  int stage = 0;
  for (std::int64_t base = first_group; base < a.rows; base += group_stride, stage ^= 1) {
    const std::int64_t row = base + slot;
    const bool valid = row < a.rows;
    float pivot = 0.f;
    if constexpr (kPipelined) {
      pivot = next_pivot;
      next_pivot = prefetch(base + group_stride, stage ^ 1);
      detail::cp_async_wait<1>();  // this group's copies (the thread's own) have landed
    } else if constexpr (kKind == Kind::kLayer) {
      pivot = valid ? load_pivot<T, R>(a, row) : 0.f;
    }
    Vec<X, V> held[kVecs];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int u = i * kThreads + lane;
      const int col = u * V;
      if (!valid || col >= block_cols) continue;
      if constexpr (kPipelined) {
        held[i] = ring.take(a, row, slot, stage, u);
      } else {
        held[i] = load_input_raw<T, R, V>(a, row, first_col + col);
      }
    }
    // Once the first row's loads are in flight, and before the parameters are prefetched into L1,
    // which this cluster-scope acquire invalidates.
    if constexpr (kCluster > 1) {
      if (base == first_group) cluster_sums.wait_started();
    }
    if constexpr (!kStaged) {
      if (valid) {
        if (params_present) {
          Params::template prefetch<true>(a, first_col, block_cols, lane, kThreads);
        } else {
          Params::template prefetch<false>(a, first_col, block_cols, lane, kThreads);
        }
      }
    }
    float sums[kSums<kKind>] = {};
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int col = (i * kThreads + lane) * V;
      if (!valid || col >= block_cols) continue;
      float v[V];
      detail::to_floats(held[i], v);
      accumulate<kKind, V>(v, pivot, sums);
    }
    row_sum<kThreads, kSums<kKind>>(sums, scratch);
    if constexpr (kCluster > 1) cluster_sums.reduce(sums, cluster_rows);
    const RowStats st = row_stats<kKind>(sums, n, a.eps);
    if (!valid) continue;
    T* y_row = static_cast<T*>(a.y) + row * a.y_stride + first_col;
    const auto normalize_row = [&](auto present) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int col = (i * kThreads + lane) * V;
        if (col >= block_cols) continue;
        float v[V], scale[V], shift[V] = {};
        detail::to_floats(held[i], v);
        if constexpr (kStaged) {
          staged_params.scale_shift(a, col, scale, shift);
        } else {
          Params::template scale_shift<decltype(present)::value>(a, first_col + col, scale,
                                                                  shift);
        }
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] = normalize<kKind>(v[j], pivot, st, scale[j], shift[j]);
        store_floats<T, V>(y_row + col, v);
      }
    };
    if (kStaged || params_present) {
      normalize_row(std::true_type{});
    } else {
      normalize_row(std::false_type{});
    }
    if (lane == 0 && rank == 0) {
      if (a.rstd) a.rstd[row] = st.rstd;
      if (a.mean) a.mean[row] = st.mean;
    }
  }
}

// Any row length and alignment: one block per row, pass 1 reduces, pass 2 re-reads (mostly
// from L2) and writes. V is the vector width when rows are aligned, else 1.
template <class T, class R, Kind kKind, int V>
__global__ void __launch_bounds__(kTwoPassThreads) forward_two_pass_kernel(ForwardArgs a) {
  __shared__ float scratch[kTwoPassThreads / 32 * kSums<kKind>];
  const std::int64_t n = a.cols;
  constexpr std::int64_t kStep = static_cast<std::int64_t>(kTwoPassThreads) * V;
  for (std::int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    float pivot = 0.f;
    if constexpr (kKind == Kind::kLayer) {
      pivot = load_pivot<T, R>(a, row);
      __syncthreads();  // before pass 1 rewrites the residual
    }
    float sums[kSums<kKind>] = {};
    for (std::int64_t col = threadIdx.x * V; col < n; col += kStep) {
      float v[V];
      load_input<T, R, V>(a, row, col, v);
      accumulate<kKind, V>(v, pivot, sums);
    }
    // The reduction's barriers also publish the residual to pass 2.
    row_sum<kTwoPassThreads, kSums<kKind>>(sums, scratch);
    const RowStats st = row_stats<kKind>(sums, n, a.eps);
    T* y_row = static_cast<T*>(a.y) + row * a.y_stride;
    for (std::int64_t col = threadIdx.x * V; col < n; col += kStep) {
      float v[V];
      if constexpr (std::is_void_v<R>) {
        load_floats<T, V>(static_cast<const T*>(a.x) + row * a.x_stride + col, v);
      } else {
        load_floats<R, V>(static_cast<const R*>(a.residual) + row * a.residual_stride + col, v);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float shift = kKind == Kind::kLayer ? load_shift<T>(a, col + j) : 0.f;
        v[j] = normalize<kKind>(v[j], pivot, st, load_scale<T, kKind>(a, col + j), shift);
      }
      store_floats<T, V>(y_row + col, v);
    }
    if (threadIdx.x == 0) {
      if (a.rstd) a.rstd[row] = st.rstd;
      if (a.mean) a.mean[row] = st.mean;
    }
  }
}

// kAuto's kernel for aligned rows one block holds (kPipelined, kRegisters or kRows); kAuto
// falls back to two passes where it cannot run. Measured on the H100 (bf16, dsv3 and quack
// shapes, all variants in one run; docs/perf-notes.md, session 4): from N = 6144 kRows is faster
// for every op (RMSNorm +3-5 %, the fused add +3-4 %, LayerNorm up to +36 % at M = 4096: it
// drops the staged tables and the persistent grid, whose streaming ceiling is ~2850 GB/s); at
// N = 4096 and below it is 10 % (N = 4096) to 4x (N = 256) slower: every small block re-reads
// the weights. Up to 256 vectors (bf16 N = 2048) kPipelined: its next row group's loads overlap
// this group's reduction, which short rows spend most of their time in (same run as kRegisters:
// +0-7 %, e.g. rmsnorm 32768x512 2452 vs 2309 GB/s, layernorm 2048 -0.3 %, within noise).
// The fused add keeps kPipelined up to 512 vectors (bf16 N = 4096), where with one row group
// per block its first group's loads overlap the staging (session 5, 32768x4096: 2923 vs 2893
// GB/s; plain RMSNorm 2899 vs 2911, so kRegisters there).
NormVariant auto_register_variant(std::int64_t cols, std::int64_t vecs, bool fused_add) {
  if (cols >= 6144) return NormVariant::kRows;
  return vecs <= (fused_add ? 512 : 256) ? NormVariant::kPipelined : NormVariant::kRegisters;
}

// Small rows in about one wave take kPipelined with one vector per thread: more threads per
// row, fewer unrolled steps per thread. At most kOneVectorMaxThreads vectors per row and
// kOneVectorMaxVecs in all: 512 blocks of 256 threads when a row's vectors are a power of two,
// up to twice that otherwise (the H100 holds 528 at 4 blocks per SM). H100, bf16, us (4
// vectors per thread, 90cffd9 / 1, aa601cd): layernorm 4096x32 2.84 / 2.62, 8192x32 2.93 /
// 2.76, 4096x64 3.00 / 2.79, 4096x128 3.32 / 3.08; rmsnorm 32768x32 3.00 / 2.83, 8192x128
// 3.09 / 2.96. At 32 vectors it lost (layernorm 4096x256 3.69 / 3.87; docs/perf-notes.md,
// session 9).
constexpr int kOneVectorMaxThreads = 16;
constexpr std::int64_t kOneVectorMaxVecs = 131072;

bool one_vector_per_thread(NormVariant chosen, std::int64_t rows, std::int64_t vecs) {
  return chosen == NormVariant::kPipelined && vecs <= kOneVectorMaxThreads &&
         rows * vecs <= kOneVectorMaxVecs;
}

// The register kernels' row split (with_register_config) for kVecsPerThread vectors per thread:
// one vector per thread only for the short rows above.
template <int kVecsPerThread, class Fn>
auto with_row_split(std::int64_t vecs, Fn&& fn) {
  static_assert(kVecsPerThread == 1 || kVecsPerThread == kForwardVecsPerThread);
  constexpr int kMaxThreads = kVecsPerThread == 1 ? kOneVectorMaxThreads : 1024;
  return with_register_config<kVecsPerThread, kMaxThreads>(vecs, std::forward<Fn>(fn));
}

// Dynamic shared memory of a staged register variant (kRegisters, kPipelined) for aligned
// rows of `cols` elements: the staged tables, and kPipelined's ring.
template <class T, class R, Kind kKind, NormVariant kVariant, int kVecsPerThread>
std::size_t forward_shared_bytes(std::int64_t cols) {
  std::size_t bytes = staged_param_bytes<kKind>(cols);
  if constexpr (kVariant == NormVariant::kPipelined) {
    const std::int64_t vecs = cols / detail::kVec16<T>;
    bytes += with_row_split<kVecsPerThread>(vecs, [&](auto threads, auto per_thread) {
      return RowRing<T, R, decltype(threads)::value, decltype(per_thread)::value>::bytes(vecs);
    });
  }
  return bytes;
}

// kRows takes rows longer than one block holds (kMaxRegisterVecs) over a cluster of the fewest
// blocks that hold them: 2, 4 or 8 (the portable cluster maximum), so bf16 N <= 262144 and fp32
// N <= 131072. fn(std::integral_constant<int, blocks per row>).
constexpr std::int64_t kBlockVecs = kMaxRegisterVecs<kForwardVecsPerThread>;
constexpr std::int64_t kMaxClusterVecs = 8 * kBlockVecs;

// Row groups each cluster takes in turn (the grid has a quarter as many clusters as row
// groups). One per cluster paid every cluster's launch, its cluster barrier and its first L1
// misses on the weights once per row; H100, bf16, same run, GB/s at 1 / 4 / 16 groups:
// rmsnorm 32768x65536 2768 / 2925 / 2850, 16384x131072 2585 / 2791 / 2742; layernorm
// 32768x65536 2589 / 2746 / 2726; the fused add 16384x131072 2621 / 2847 / 2828.
constexpr std::int64_t kClusterRowGroups = 4;

template <class Fn>
auto with_row_cluster(std::int64_t vecs, Fn&& fn) {
  using std::integral_constant;
  if (vecs <= kBlockVecs) return fn(integral_constant<int, 1>{});
  if (vecs <= 2 * kBlockVecs) return fn(integral_constant<int, 2>{});
  if (vecs <= 4 * kBlockVecs) return fn(integral_constant<int, 4>{});
  return fn(integral_constant<int, 8>{});
}

// Launches the register kernel for rows of `vecs` vectors, kCluster blocks per row (kRows
// only), kVecsPerThread vectors per thread (with_row_split). Returns false, launching nothing,
// where a cluster of that configuration cannot be resident on the device.
template <class T, class R, class W, class B, Kind kKind, NormVariant kVariant, int kCluster,
          int kVecsPerThread = kForwardVecsPerThread>
bool launch_registers(const ForwardArgs& a, std::int64_t vecs, cudaStream_t stream,
                      const char* op) {
  const std::int64_t block_vecs = (vecs + kCluster - 1) / kCluster;
  return with_row_split<kVecsPerThread>(block_vecs, [&](auto threads, auto per_thread) {
    constexpr int kThreads = decltype(threads)::value;
    constexpr int kVecs = decltype(per_thread)::value;
    constexpr int kBlock = kBlockFor<kThreads>;
    constexpr int kRowsPerBlock = kBlock / kThreads;
    const std::int64_t row_groups = (a.rows + kRowsPerBlock - 1) / kRowsPerBlock;
    if constexpr (kCluster > 1 && 2 * kThreads * kVecs <= kBlockVecs) {
      // kCluster is the fewest blocks that hold the row, so a block holds over half of
      // kBlockVecs: configurations for fewer vectors never serve a cluster and are not compiled.
      return false;
    } else if constexpr (kCluster > 1) {
      const auto kernel =
          forward_registers_kernel<T, R, W, B, kKind, kVariant, kThreads, kVecs, kCluster>;
      if (detail::max_active_clusters(kernel, kBlock, kCluster, 0, op) == 0) return false;
      detail::prefer_l1_at_full_occupancy(kernel, kBlock, 0, op);  // weight and bias from L1
      const std::int64_t clusters =
          std::min<std::int64_t>((row_groups + kClusterRowGroups - 1) / kClusterRowGroups,
                                 std::numeric_limits<int>::max() / kCluster);
      detail::launch_in_clusters(kernel, clusters * kCluster, kBlock, kCluster, 0, stream, op, a);
      return true;
    } else {
      const auto kernel = forward_registers_kernel<T, R, W, B, kKind, kVariant, kThreads, kVecs, 1>;
      std::size_t smem = 0;
      std::int64_t grid = std::min<std::int64_t>(row_groups, std::numeric_limits<int>::max());
      if constexpr (kVariant == NormVariant::kRows) {
        detail::prefer_l1_at_full_occupancy(kernel, kBlock, 0, op);  // weight and bias from L1
      } else {
        smem = forward_shared_bytes<T, R, kKind, kVariant, kVecsPerThread>(a.cols);
        if (smem + kMaxScratchBytes > kDefaultSharedBytes) {
          detail::check_cuda(cudaFuncSetAttribute(kernel,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  static_cast<int>(smem)),
                             op, "raising the shared-memory limit");
        }
        // LayerNorm: one resident wave, each block staging its tables (8 B per column) once and
        // looping over row groups. RMSNorm (4 B per column) streams faster with one row group per
        // block, the tables staged by every block (H100, bf16 32768x4096: 2911 vs 2793 GB/s;
        // LayerNorm 2087 vs 2612; docs/perf-notes.md, session 5).
        if constexpr (kKind == Kind::kLayer) {
          int per_sm = 0;
          detail::check_cuda(
              cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlock, smem), op,
              "occupancy query");
          grid = balanced_blocks_for(row_groups, std::max(per_sm, 1));
        }
      }
      kernel<<<static_cast<unsigned>(grid), kBlock, smem, stream>>>(a);
      return true;
    }
  });
}

// The rows variant with the parameters' dtypes as template arguments (an absent one as T), a
// cluster per row for rows longer than a block holds. False where that cluster cannot be
// resident (nothing launched).
template <class T, class R, Kind kKind>
bool launch_rows(const ForwardArgs& a, std::int64_t vecs, cudaStream_t stream, const char* op) {
  const auto with_dtype = [](bool f32, auto fn) {
    if (f32 && !std::is_same_v<T, float>) return fn(detail::TypeTag<float>{});
    return fn(detail::TypeTag<T>{});
  };
  return with_row_cluster(vecs, [&](auto cluster) {
    constexpr int kCluster = decltype(cluster)::value;
    return with_dtype(a.weight && a.weight_f32, [&](auto w) {
      using W = typename decltype(w)::type;
      if constexpr (kKind == Kind::kRms) {
        return launch_registers<T, R, W, W, kKind, NormVariant::kRows, kCluster>(a, vecs, stream,
                                                                                op);
      } else {
        return with_dtype(a.bias && a.bias_f32, [&](auto b) {
          using B = typename decltype(b)::type;
          return launch_registers<T, R, W, B, kKind, NormVariant::kRows, kCluster>(a, vecs,
                                                                                  stream, op);
        });
      }
    });
  });
}

template <class T, class R, Kind kKind>
void launch_forward(const ForwardArgs& a, NormVariant variant, cudaStream_t stream,
                    const char* op) {
  if (a.rows == 0) return;
  constexpr int V = detail::kVec16<T>;
  const std::int64_t vecs = (a.cols + V - 1) / V;
  bool aligned = a.cols % V == 0 && rows_vectorizable(a.x, a.x_stride, sizeof(T)) &&
                 rows_vectorizable(a.y, a.y_stride, sizeof(T));
  if constexpr (!std::is_void_v<R>) {
    aligned = aligned && rows_vectorizable(a.residual, a.residual_stride, sizeof(R));
  }
  // Choice per row (H100, ptxas for sm_90a: every register configuration <= 64 registers,
  // no spills, so 4 blocks of 256 threads per SM, 5 for RMSNorm (kMinBlocksPerSm), unless
  // shared memory says fewer):
  //   16-bit N <= 32 (fp32 N <= 16): 1 vector per thread, 1 ... 4 threads per row, 256 ... 64
  //     rows per block.
  //   16-bit N <= 1024 (fp32 N <= 512): 4 vectors per thread, 4 ... 32 threads per row, 64 ... 8
  //     rows per block; kPipelined with 16-bit N <= 128 and at most 131072 vectors in all: 1
  //     vector per thread, 4 ... 16 threads per row (one_vector_per_thread).
  //   16-bit N 2048 / 4096 / 8192: 64 / 128 / 256 threads per row, 4 vectors each; kRegisters
  //     stages tables of 4 B per column (RMSNorm) or 8 B (LayerNorm): LayerNorm N = 8192 takes
  //     64 KB, so 3 blocks per SM.
  //   16-bit N 16384 / 32768: 512 / 1024 threads per row (one row per block): RMSNorm 2 / 1
  //     blocks per SM (registers), kRegisters' LayerNorm N = 16384 1 block (128 KB of tables).
  //   kRows: the same threads per row, one row group per block, no tables (any N <= 4096
  //     vectors; 27-64 registers, no spills). Longer rows (16-bit N <= 262144, fp32 N <=
  //     131072), and kAuto's choice for them: a cluster of 2 / 4 / 8 blocks of 1024 threads
  //     per row, one block per SM.
  //   kPipelined (kAuto's choice up to 256 vectors, the fused add's up to 512): kRegisters'
  //     threads per row, 40-64 registers, no spills, plus two row groups in shared memory:
  //     16-bit RMSNorm N = 4096 48 KB per block (4 blocks per SM), N = 8192 64 KB (3),
  //     LayerNorm N = 8192 96 KB (2), N = 16384 128 / 192 KB (1 block of 512); the fused add's
  //     residual doubles the ring (fp32: triples it). No room for 16-bit N = 32768.
  //   kRegisters' LayerNorm 16-bit N > 29008 (tables over the 227 KB per block), rows beyond
  //   kRows' cluster or whose cluster cannot be resident, and unaligned rows: two passes.
  NormVariant chosen = variant == NormVariant::kAuto
                           ? auto_register_variant(a.cols, vecs, !std::is_void_v<R>)
                           : variant;
  if (variant == NormVariant::kAuto && vecs > kBlockVecs) chosen = NormVariant::kRows;
  const std::int64_t max_vecs = chosen == NormVariant::kRows ? kMaxClusterVecs : kBlockVecs;
  if (chosen != NormVariant::kTwoPass && !use_registers(variant, aligned, vecs, max_vecs)) {
    chosen = NormVariant::kTwoPass;
  }
  const bool one_vector = one_vector_per_thread(chosen, a.rows, vecs);
  if (chosen == NormVariant::kRegisters || chosen == NormVariant::kPipelined) {
    const bool pipelined = chosen == NormVariant::kPipelined;
    constexpr int kWide = kForwardVecsPerThread;
    const std::size_t needed =
        !pipelined ? forward_shared_bytes<T, R, kKind, NormVariant::kRegisters, kWide>(a.cols)
        : one_vector ? forward_shared_bytes<T, R, kKind, NormVariant::kPipelined, 1>(a.cols)
                     : forward_shared_bytes<T, R, kKind, NormVariant::kPipelined, kWide>(a.cols);
    const std::size_t shared_limit = detail::current_device_info().shared_memory_per_block_optin;
    if (needed + kMaxScratchBytes > shared_limit) {
      if (variant == chosen) {
        throw UnsupportedVariantError(
            std::string("trainscale norm: the ") + variant_name(chosen) + " variant stages " +
            (pipelined ? "the row's parameters and two row groups" : "the row's parameters") +
            " in shared memory, which has no room for " + std::to_string(a.cols) + " columns");
      }
      chosen = NormVariant::kTwoPass;
    }
  }
  if (chosen == NormVariant::kRows && !launch_rows<T, R, kKind>(a, vecs, stream, op)) {
    if (variant == chosen) {
      throw UnsupportedVariantError(
          "trainscale norm: the rows variant's thread-block cluster for " +
          std::to_string(a.cols) + " columns cannot be resident on this device");
    }
    chosen = NormVariant::kTwoPass;
  }
  if (chosen == NormVariant::kRegisters) {
    launch_registers<T, R, T, T, kKind, NormVariant::kRegisters, 1>(a, vecs, stream, op);
  } else if (chosen == NormVariant::kPipelined && one_vector) {
    launch_registers<T, R, T, T, kKind, NormVariant::kPipelined, 1, 1>(a, vecs, stream, op);
  } else if (chosen == NormVariant::kPipelined) {
    launch_registers<T, R, T, T, kKind, NormVariant::kPipelined, 1>(a, vecs, stream, op);
  } else if (chosen == NormVariant::kTwoPass) {
    if (aligned) {
      forward_two_pass_kernel<T, R, kKind, V>
          <<<static_cast<unsigned>(blocks_for(a.rows, 4)), kTwoPassThreads, 0, stream>>>(a);
    } else {
      forward_two_pass_kernel<T, R, kKind, 1>
          <<<static_cast<unsigned>(blocks_for(a.rows, 4)), kTwoPassThreads, 0, stream>>>(a);
    }
  }
  detail::check_launch(op);
}

ForwardArgs make_args(const char* op, const TensorView& x, const TensorView& weight,
                      const TensorView& bias, TensorView y, TensorView mean, TensorView rstd) {
  detail::OpChecker c(op);
  const auto xr = c.rows(x, "x");
  const auto yr = c.rows(y, "y");
  ForwardArgs a{};
  a.x = x.data;
  a.x_stride = xr.row_stride;
  a.weight = weight.defined() ? weight.data : nullptr;
  a.weight_f32 = weight.defined() && weight.dtype == DType::kFloat32;
  a.bias = bias.defined() ? bias.data : nullptr;
  a.bias_f32 = bias.defined() && bias.dtype == DType::kFloat32;
  a.y = y.data;
  a.y_stride = yr.row_stride;
  a.mean = mean.defined() ? mean.ptr<float>() : nullptr;
  a.rstd = rstd.defined() ? rstd.ptr<float>() : nullptr;
  a.rows = xr.rows;
  a.cols = xr.cols;
  return a;
}

}  // namespace

void rmsnorm_forward_cuda(const TensorView& x, const TensorView& weight, TensorView y,
                          TensorView rstd, const RMSNormOptions& options, cudaStream_t stream) {
  ForwardArgs a = make_args("rmsnorm_forward", x, weight, {}, y, {}, rstd);
  a.eps = static_cast<float>(options.eps);
  a.weight_offset = static_cast<float>(options.weight_offset);
  detail::dispatch_activation_dtype(x.dtype, "rmsnorm_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_forward<T, void, Kind::kRms>(a, options.variant, stream, "rmsnorm_forward");
  });
}

void fused_add_rmsnorm_forward_cuda(TensorView x, TensorView residual, const TensorView& weight,
                                    TensorView rstd, const RMSNormOptions& options,
                                    cudaStream_t stream) {
  const char* op = "fused_add_rmsnorm_forward";
  ForwardArgs a = make_args(op, x, weight, {}, x, {}, rstd);
  a.residual = residual.data;
  a.residual_stride = detail::OpChecker(op).rows(residual, "residual").row_stride;
  a.eps = static_cast<float>(options.eps);
  a.weight_offset = static_cast<float>(options.weight_offset);
  detail::dispatch_activation_dtype(x.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (residual.dtype == DType::kFloat32) {
      launch_forward<T, float, Kind::kRms>(a, options.variant, stream, op);
    } else {
      launch_forward<T, T, Kind::kRms>(a, options.variant, stream, op);
    }
  });
}

void layernorm_forward_cuda(const TensorView& x, const TensorView& weight, const TensorView& bias,
                            TensorView y, TensorView mean, TensorView rstd,
                            const LayerNormOptions& options, cudaStream_t stream) {
  ForwardArgs a = make_args("layernorm_forward", x, weight, bias, y, mean, rstd);
  a.eps = static_cast<float>(options.eps);
  detail::dispatch_activation_dtype(x.dtype, "layernorm_forward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_forward<T, void, Kind::kLayer>(a, options.variant, stream, "layernorm_forward");
  });
}

}  // namespace trainscale::ops::norm
