// The forward row kernels of the norm family: RMSNorm, fused add + RMSNorm (in place) and
// LayerNorm share one register kernel (variants kRegisters, kRows, kPipelined) and a two-pass
// kernel. Which one runs, and how it is launched, is norm_plan.h's and
// norm_forward_launch.cuh's business.
#pragma once

#include <type_traits>

#include "common/async_copy.cuh"
#include "ops/norm/norm_common.cuh"

namespace trainscale::ops::norm {
namespace {

using detail::Vec;

// Threads of a block of the register kernels: kThreads per row, several rows when short
// (block_threads in norm_plan.h).
template <NormVariant kVariant, int kThreads>
constexpr int kBlockFor = block_threads(kVariant, kThreads);

struct ForwardArgs {
  const void* x;
  std::int64_t x_stride;
  const void* residual;  // fused add: read
  std::int64_t residual_stride;
  void* residual_out;  // fused add: x + residual (the residual itself, in place)
  std::int64_t residual_out_stride;
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
  int ring_stages;  // kPipelined: 2 (persistent grid) or 1 (ForwardPlan::ring_stages)
};

template <class T>
__device__ __forceinline__ float load_shift(const ForwardArgs& a, std::int64_t col) {
  return a.bias ? load_param<T>(a.bias, a.bias_f32, col) : 0.f;
}

// What a row's input is kept as between its reduction and its output: x, or with the fused
// add the sum x + residual rounded to the residual's dtype.
template <class T, class R>
using Held = std::conditional_t<std::is_void_v<R>, T, R>;

// x + residual rounded to the residual's dtype, written to residual_out at (row, col).
template <class T, class R, int V>
__device__ __forceinline__ Vec<R, V> add_residual(const ForwardArgs& a, std::int64_t row,
                                                  std::int64_t col, const Vec<T, V>& x,
                                                  const Vec<R, V>& r) {
  Vec<R, V> sum;
#pragma unroll
  for (int j = 0; j < V; ++j) sum.v[j] = from_float<R>(to_float(x.v[j]) + to_float(r.v[j]));
  detail::store_raw(static_cast<R*>(a.residual_out) + row * a.residual_out_stride + col, sum);
  return sum;
}

// x (+ residual, rounded to the residual's dtype and written to residual_out) for V elements
// at col, in its storage type: bf16 rows then take half the registers of floats.
template <class T, class R, int V>
__device__ __forceinline__ Vec<Held<T, R>, V> load_input_raw(const ForwardArgs& a,
                                                             std::int64_t row, std::int64_t col) {
  const T* x_ptr = static_cast<const T*>(a.x) + row * a.x_stride + col;
  if constexpr (std::is_void_v<R>) {
    return detail::load_raw<T, V>(x_ptr);
  } else {
    const R* r_ptr = static_cast<const R*>(a.residual) + row * a.residual_stride + col;
    return add_residual<T, R, V>(a, row, col, detail::load_raw<T, V>(x_ptr),
                                 detail::load_raw<R, V>(r_ptr));
  }
}

// Bytes of a residual element (none without a residual).
template <class R>
constexpr int residual_bytes() {
  if constexpr (std::is_void_v<R>) {
    return 0;
  } else {
    return static_cast<int>(sizeof(R));
  }
}

// kPipelined's ring of one or two stages (ForwardArgs::ring_stages) in shared memory, each a
// block's row group, filled by cp.async while the previous group is reduced and written. A
// thread copies and later reads only its own vectors, so its cp.async.wait_group is all the
// ordering needed (no barrier), and a stage is refilled only after the thread's values from it
// were consumed. Layout: 16-byte chunks by [stage][row slot][chunk][vector], chunk 0 x and
// chunks 1.. the residual (fused add), so a warp's 16-byte shared accesses are consecutive.
template <class T, class R, int kThreads, int kVecs>
struct RowRing {
  static constexpr int V = detail::kVec16<T>;
  static constexpr int kRowsPerBlock = kBlockFor<NormVariant::kPipelined, kThreads> / kThreads;
  // Chunk 0 x, chunks 1.. the residual's vector (ring_bytes sizes the ring from the same count).
  static constexpr int kChunks = ring_chunks(sizeof(T), residual_bytes<R>());
  static constexpr int kResidualChunks = kChunks - 1;
  uint4* base;
  int vecs;  // per row

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
  // sum, written to residual_out.
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
      return add_residual<T, R, V>(a, row, static_cast<std::int64_t>(u) * V, x, r);
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

// One FMA per element for LayerNorm's x-hat. LayerNorm forward is not issue-bound: cutting its
// instructions per element did not make it faster (docs/perf/norm.md).
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
// per load, L1/L2-resident since every row reads them. They are read after the row's reduction,
// not held across it (the kernel is at its register cap, and held parameters spilled) and not
// prefetched into L1 before it: in one run with and without, the prefetches cost LayerNorm up to
// 10 % at 4096-8192 columns and gained nowhere more than 1 % (docs/perf/norm.md). kPresent: the
// caller checked that every parameter is given (the usual case), so no vector tests for null
// (two 64-bit compares each, which the compiler re-issued per vector).
template <class W, class B, Kind kKind, int V>
struct GlobalParams {
  static __device__ __forceinline__ bool all_present(const ForwardArgs& a) {
    return a.weight != nullptr && (kKind == Kind::kRms || a.bias != nullptr);
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
// blocks of 256 threads (48 registers, no spills), so a fifth row group is in flight per SM:
// RMSNorm's speed follows its blocks per SM. bf16 LayerNorm (48 registers without spills too)
// was slower at 5 blocks (docs/perf/norm.md). The fused add (fp16, or an fp32 residual) and
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
//   kPipelined: kRegisters whose rows arrive through a RowRing: the next row group's copies are
//     issued before this group's reduction, so HBM reads continue through its barriers and
//     stores (in kRegisters a block has no reads in flight then). With two stages (a persistent
//     grid) they start before this group's copies have landed; with one (a block per row group:
//     there is no next group, the ring overlaps the group's copies with the staging) once this
//     group's values are in registers and consumed.
// kRegisters issues its first row group's loads before staging the parameters, so they overlap
// the staging's L2 round trips and barrier (every block's, where blocks take one group each).
template <class T, class R, class W, class B, Kind kKind, NormVariant kVariant, int kThreads,
          int kVecs, int kCluster>
__global__ void __launch_bounds__(kBlockFor<kVariant, kThreads>,
                                  kMinBlocksPerSm<R, kKind, kBlockFor<kVariant, kThreads>>)
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
  constexpr int kBlock = kBlockFor<kVariant, kThreads>;
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
  const Ring ring{reinterpret_cast<uint4*>(staged) + staged_param_bytes(kKind, n) / sizeof(uint4),
                  static_cast<int>(n / V)};
  using Params = GlobalParams<W, B, kKind, V>;  // kRows
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
  const bool two_stages = a.ring_stages == 2;
  // The first group's copies overlap the staging of the parameters.
  if constexpr (kPipelined) next_pivot = prefetch(first_group, 0);
  // kRegisters: the thread's vectors of `row` into held (the fused add writes its sum back).
  Vec<X, V> held[kVecs];
  const auto load_held = [&](std::int64_t row, bool valid) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int col = (i * kThreads + lane) * V;
      if (!valid || col >= block_cols) continue;
      held[i] = load_input_raw<T, R, V>(a, row, first_col + col);
    }
  };
  // kRegisters: the first group's loads (and LayerNorm's pivot) overlap the staging too.
  constexpr bool kPreload = kVariant == NormVariant::kRegisters;
  if constexpr (kPreload) {
    const std::int64_t row = first_group + slot;
    load_held(row, row < a.rows);
    if constexpr (kKind == Kind::kLayer) next_pivot = row < a.rows ? load_pivot<T, R>(a, row) : 0.f;
  }
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
    const int ring_stage = two_stages ? stage : 0;
    if constexpr (kPipelined) {
      pivot = next_pivot;
      if (two_stages) {
        next_pivot = prefetch(base + group_stride, stage ^ 1);
        detail::cp_async_wait<1>();  // this group's copies (the thread's own) have landed
      } else {
        detail::cp_async_wait<0>();
      }
    } else if (kPreload && base == first_group) {
      pivot = next_pivot;  // held and the pivot were loaded before the staging
    } else if constexpr (kKind == Kind::kLayer) {
      pivot = valid ? load_pivot<T, R>(a, row) : 0.f;
    }
    if constexpr (kPipelined) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int u = i * kThreads + lane;
        if (!valid || u * V >= block_cols) continue;
        held[i] = ring.take(a, row, slot, ring_stage, u);
      }
    } else if (!kPreload || base != first_group) {
      load_held(row, valid);
    }
    // Once the first row's loads are in flight.
    if constexpr (kCluster > 1) {
      if (base == first_group) cluster_sums.wait_started();
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
    // One stage: the next group's copies refill it once this group's values, read from it,
    // were consumed by the sums above.
    if constexpr (kPipelined) {
      if (!two_stages) next_pivot = prefetch(base + group_stride, 0);
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
    // The reduction's barriers also publish the sum in residual_out to pass 2.
    row_sum<kTwoPassThreads, kSums<kKind>>(sums, scratch);
    const RowStats st = row_stats<kKind>(sums, n, a.eps);
    T* y_row = static_cast<T*>(a.y) + row * a.y_stride;
    for (std::int64_t col = threadIdx.x * V; col < n; col += kStep) {
      float v[V];
      if constexpr (std::is_void_v<R>) {
        load_floats<T, V>(static_cast<const T*>(a.x) + row * a.x_stride + col, v);
      } else {
        load_floats<R, V>(static_cast<const R*>(a.residual_out) + row * a.residual_out_stride + col, v);
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

}  // namespace
}  // namespace trainscale::ops::norm
