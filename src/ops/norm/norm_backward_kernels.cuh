// Backward kernels. dx is fused with the row statistics; the weight (and bias) gradients are
// summed per block into fixed partial rows of the workspace, then reduced over blocks in a
// fixed order, so they are bitwise identical from run to run: by the register kernel itself
// after a grid-wide barrier where its launch is cooperative (one block per row group, the
// training shapes), else by a second launch of the same sums (reduce_partials_kernel). Launched by
// norm_backward_launch.cuh.
#pragma once

#include "common/async_copy.cuh"
#include "common/grid_reduce.cuh"
#include "ops/norm/norm_common.cuh"

namespace trainscale::ops::norm {
namespace {

// Register kernel blocks: 512 threads (one or several rows), two per SM (64 registers), so one
// block's loads overlap the other's reductions.
constexpr int kBackwardBlock = 512;
constexpr int kBackwardBlocksPerSm = 2;

struct BackwardArgs {
  const void* dy;
  std::int64_t dy_stride;
  const void* x;  // the norm's input (fused add: the saved sum), dtype X
  std::int64_t x_stride;
  const void* d_residual;  // fused add: gradient of the residual output, dtype X, optional
  std::int64_t d_residual_stride;
  const void* weight;
  bool weight_f32;
  const float* mean;
  const float* rstd;
  void* dx;
  std::int64_t dx_stride;
  float* partial;  // [blocks, cols] weight-gradient partials, then [blocks, cols] for bias
  // The register kernel reduces the partials itself (a cooperative launch, no cluster), else
  // reduce_partials_kernel does. dw and db: either may be null, fp32 or the activation dtype.
  bool reduce_in_kernel;
  void* dw;
  bool dw_f32;
  void* db;
  bool db_f32;
  std::int64_t rows;
  std::int64_t cols;
  float weight_offset;
};

// Adds V elements to the row's reductions: sums[kSums - 1] += g * xhat, and for LayerNorm
// sums[0] += g.
template <Kind kKind, int V, int kSums>
__device__ __forceinline__ void add_row_sums(const float (&g)[V], const float (&xhat)[V],
                                             float (&sums)[kSums]) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    sums[kSums - 1] += g[j] * xhat[j];
    if constexpr (kKind == Kind::kLayer) sums[0] += g[j];
  }
}

// dx for V elements given the row's reductions: sum(g) (LayerNorm) and sum(g * xhat).
template <Kind kKind, int V>
__device__ __forceinline__ void input_gradient(const float (&g)[V], const float (&xhat)[V],
                                               float rstd, float mean_g, float mean_gx,
                                               float (&dx)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    dx[j] = kKind == Kind::kLayer ? rstd * (g[j] - mean_g - xhat[j] * mean_gx)
                                  : rstd * (g[j] - xhat[j] * mean_gx);
  }
}

template <class X, int V>
__device__ __forceinline__ void add_residual_gradient(const BackwardArgs& a, std::int64_t row,
                                                      std::int64_t col, float (&dx)[V]) {
  if (a.d_residual == nullptr) return;
  float r[V];
  load_floats<X, V>(static_cast<const X*>(a.d_residual) + row * a.d_residual_stride + col, r);
#pragma unroll
  for (int j = 0; j < V; ++j) dx[j] += r[j];
}

// Column col of dw (array 0) or db (array 1), either absent, in fp32 or the activation dtype.
template <class T>
__device__ __forceinline__ void store_gradient(const BackwardArgs& a, int array, std::int64_t col,
                                               float total) {
  void* const out = array == 0 ? a.dw : a.db;
  if (out == nullptr) return;
  if (array == 0 ? a.dw_f32 : a.db_f32) {
    static_cast<float*>(out)[col] = total;
  } else {
    static_cast<T*>(out)[col] = detail::from_float<T>(total);
  }
}

// Register kernel configuration for rows of `vecs` 16-byte vectors: kThreads threads per row
// (a power of two, at most 512 so that two blocks share an SM and one block's loads overlap the
// other's reductions), 2 vectors per thread, and rows longer than one block covers split over a
// thread-block cluster of kCluster blocks (each owns an equal share of the row's vectors). The
// longest rows take 4 vectors per thread: their shared memory (128-224 KB) allows one block per
// SM anyway, so they may use 128 registers, and the block prefetches its next row (RowStage)
// since no other block's loads overlap its reductions. Beyond 8 blocks (bf16 N > 131072) the
// cluster takes 16, a size Hopper allows as non-portable: a cluster of one block per SM then
// needs 16 free SMs of one GPC.
// fn(threads, vecs per thread, cluster), each a std::integral_constant<int, ...>.
template <class Fn>
auto with_backward_config(std::int64_t vecs, Fn&& fn) {
  using std::integral_constant;
  using Two = integral_constant<int, 2>;
  using Four = integral_constant<int, 4>;
  using One = integral_constant<int, 1>;
  if (vecs <= 32) return fn(integral_constant<int, 32>{}, One{}, One{});
  if (vecs <= 64) return fn(integral_constant<int, 32>{}, Two{}, One{});
  if (vecs <= 128) return fn(integral_constant<int, 64>{}, Two{}, One{});
  if (vecs <= 256) return fn(integral_constant<int, 128>{}, Two{}, One{});
  if (vecs <= 512) return fn(integral_constant<int, 256>{}, Two{}, One{});
  using Wide = integral_constant<int, 512>;
  if (vecs <= 1024) return fn(Wide{}, Two{}, One{});
  if (vecs <= 2048) return fn(Wide{}, Two{}, integral_constant<int, 2>{});
  if (vecs <= 4096) return fn(Wide{}, Two{}, integral_constant<int, 4>{});
  if (vecs <= 8192) return fn(Wide{}, Two{}, integral_constant<int, 8>{});
  if (vecs <= 16384) return fn(Wide{}, Four{}, integral_constant<int, 8>{});
  return fn(Wide{}, Four{}, integral_constant<int, 16>{});
}
// Longest row (16-byte vectors) of the register kernel: 16 blocks of 512 threads x 4 vectors;
// bf16 N <= 262144, fp32 N <= 131072.
constexpr std::int64_t kMaxBackwardRegisterVecs = 16 * 512 * 4;
// Upper bound of resident blocks per SM of every backward kernel (2048 threads / 512): the
// grid, hence the workspace, never has more than sm_count * this many partial rows.
constexpr int kMaxBlocksPerSm = 2048 / kBackwardBlock;
// Dynamic shared memory a block may opt into on Hopper (sm_90: 227 KB) less 1 KB for the
// kernel's static reduction scratch and cluster exchange; the host checks the device's limit.
constexpr std::size_t kSharedBytesPerBlock = 227 * 1024 - 1024;

// Per-column fp32 arrays in shared memory (the scale, and the dw/db sums of each row slot).
// Float quad q of vector i of thread `lane` sits at ((i * kQuads + q) * kThreads + lane) * 4,
// so a warp's 16-byte accesses are contiguous (no bank conflicts).
template <int kThreads, int V>
__device__ __forceinline__ int quad_index(int i, int lane, int q) {
  return ((i * (V / 4) + q) * kThreads + lane) * 4;
}
// The same position for chunk column c.
template <int kThreads, int V>
__device__ __forceinline__ int column_index(int c) {
  const int vec = c / V;
  return quad_index<kThreads, V>(vec / kThreads, vec % kThreads, (c % V) / 4) + c % 4;
}

// Volatile shared-memory accesses: neither the compiler nor ptxas may hoist them out of the row
// loop or keep their values in registers across rows, which is the point — the weight and the
// gradient sums live in shared memory so that the row data fits in few registers.
__device__ __forceinline__ float4 load_shared_quad(const float* p) {
  const auto addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  float4 v;
  asm volatile("ld.volatile.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ void store_shared_quad(float* p, float4 v) {
  const auto addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("st.volatile.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(v.x),
               "f"(v.y), "f"(v.z), "f"(v.w));
}

template <int kThreads, int V>
__device__ __forceinline__ void load_shared_floats(const float* base, int i, int lane,
                                                   float (&out)[V]) {
#pragma unroll
  for (int q = 0; q < V / 4; ++q) {
    const float4 v = load_shared_quad(base + quad_index<kThreads, V>(i, lane, q));
    out[4 * q] = v.x;
    out[4 * q + 1] = v.y;
    out[4 * q + 2] = v.z;
    out[4 * q + 3] = v.w;
  }
}

// acc[column] += v[j] for the V columns of vector i of this thread.
template <int kThreads, int V>
__device__ __forceinline__ void accumulate_shared(float* acc, int i, int lane,
                                                  const float (&v)[V]) {
#pragma unroll
  for (int q = 0; q < V / 4; ++q) {
    float* p = acc + quad_index<kThreads, V>(i, lane, q);
    float4 sum = load_shared_quad(p);
    sum.x += v[4 * q];
    sum.y += v[4 * q + 1];
    sum.z += v[4 * q + 2];
    sum.w += v[4 * q + 3];
    store_shared_quad(p, sum);
  }
}

// One block's next row in shared memory, for the configurations of one block per SM: the
// copies (cp.async) of row r + 1 are in flight during row r's reductions and stores. A thread
// copies and later reads only its own vectors, so its cp.async.wait_group is all the ordering
// needed, and it refills the stage only after its values from it were consumed (the row sums).
// Layout: 16-byte chunks by [chunk][vector], chunk 0 dy and chunks 1.. x (two for fp32 x beside
// 16-bit dy), so a warp's 16-byte shared accesses are consecutive.
template <class T, class X, int kThreads, int kVecs>
struct RowStage {
  static constexpr int V = detail::kVec16<T>;
  static constexpr int kXChunks = static_cast<int>(sizeof(detail::Vec<X, V>) / 16);
  static constexpr int kVectors = kThreads * kVecs;
  static constexpr std::size_t kBytes =
      static_cast<std::size_t>(1 + kXChunks) * kVectors * sizeof(uint4);
  uint4* base;

  __device__ __forceinline__ uint4* chunk(int c, int u) const { return base + c * kVectors + u; }

  // Starts the copies of the thread's vectors (u < own_vecs) of `row`, from column first_col.
  __device__ __forceinline__ void fetch(const BackwardArgs& a, std::int64_t row,
                                        std::int64_t first_col, int own_vecs, int lane) const {
    const auto* dy = reinterpret_cast<const uint4*>(static_cast<const T*>(a.dy) +
                                                    row * a.dy_stride + first_col);
    const auto* x = reinterpret_cast<const uint4*>(static_cast<const X*>(a.x) + row * a.x_stride +
                                                   first_col);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int u = i * kThreads + lane;
      if (u >= own_vecs) continue;
      detail::cp_async_16(chunk(0, u), dy + u);
#pragma unroll
      for (int c = 0; c < kXChunks; ++c) detail::cp_async_16(chunk(1 + c, u), x + u * kXChunks + c);
    }
  }

  __device__ __forceinline__ void take(int u, detail::Vec<T, V>& dy, detail::Vec<X, V>& x) const {
    const uint4 dy_raw = *chunk(0, u);
    memcpy(&dy, &dy_raw, sizeof(dy));
    uint4 x_raw[kXChunks];
#pragma unroll
    for (int c = 0; c < kXChunks; ++c) x_raw[c] = *chunk(1 + c, u);
    memcpy(&x, x_raw, sizeof(x));
  }
};

// Dynamic shared memory of the register kernel, in this order: the RowStage (one block per SM),
// the scale, and the dw (and db) sums of each row slot; fp32 arrays of the block's columns. The
// scale is read from global memory (L1) instead where it does not fit beside the stage (16-bit
// LayerNorm at 4 vectors per thread: 64 KB stage + 3 x 64 KB arrays).
template <class T, class X, Kind kKind, int kThreads, int kVecs>
struct RegisterSmem {
  static constexpr bool kPrefetch = kVecs > 2;
  static constexpr int kChunk = kThreads * kVecs * detail::kVec16<T>;  // columns of one block
  static constexpr std::size_t kArrayBytes = kChunk * sizeof(float);
  static constexpr std::size_t kStageBytes =
      kPrefetch ? RowStage<T, X, kThreads, kVecs>::kBytes : 0;
  static constexpr int kSumArrays = kBackwardBlock / kThreads * (kKind == Kind::kLayer ? 2 : 1);
  static constexpr bool kStagedScale =
      kStageBytes + (1 + kSumArrays) * kArrayBytes <= kSharedBytesPerBlock;
  static constexpr std::size_t kBytes =
      kStageBytes + ((kStagedScale ? 1 : 0) + kSumArrays) * kArrayBytes;
  static_assert(kBytes <= kSharedBytesPerBlock);
};

// Scale of the V columns at col from global memory: every row of a block reads the same
// columns, so after the first row they come from L1.
template <class T, Kind kKind, int V>
__device__ __forceinline__ void load_scale_vector(const BackwardArgs& a, std::int64_t col,
                                                  float (&scale)[V]) {
  if (a.weight == nullptr) {
#pragma unroll
    for (int j = 0; j < V; ++j) scale[j] = 1.f;
  } else if (a.weight_f32) {
    load_floats<float, V, false>(static_cast<const float*>(a.weight) + col, scale);
  } else {
    load_floats<T, V, false>(static_cast<const T*>(a.weight) + col, scale);
  }
  if constexpr (kKind == Kind::kRms) {
#pragma unroll
    for (int j = 0; j < V; ++j) scale[j] += a.weight_offset;
  }
}

// dx with the row reductions and dw/db partial sums. The row's dy and x stay in registers as
// raw 16-byte vectors; the scale and the per-slot dw/db sums live in shared memory (fp32).
// Partial row g of the workspace belongs to row group g (a block, or a cluster whose blocks
// each write their share of the columns). Rows are aligned: N is a multiple of V.
template <class T, class X, Kind kKind, int kThreads, int kVecs, int kCluster>
__global__ void __launch_bounds__(kBackwardBlock, kVecs > 2 ? 1 : kBackwardBlocksPerSm)
    backward_registers_kernel(BackwardArgs a) {
  using Smem = RegisterSmem<T, X, kKind, kThreads, kVecs>;
  using Stage = RowStage<T, X, kThreads, kVecs>;
  constexpr int V = detail::kVec16<T>;
  static_assert(V % 4 == 0, "shared-memory arrays are accessed in float quads");
  static_assert(kThreads <= kBackwardBlock);
  constexpr int kBlock = kBackwardBlock;
  constexpr int kRowsPerBlock = kBlock / kThreads;
  static_assert(kCluster == 1 || kRowsPerBlock == 1, "a cluster shares one row");
  constexpr bool kPrefetch = Smem::kPrefetch;
  static_assert(!kPrefetch || kRowsPerBlock == 1, "the stage holds one row");
  constexpr int kSums = kKind == Kind::kLayer ? 2 : 1;
  constexpr int kChunk = Smem::kChunk;
  extern __shared__ float4 smem_quads[];
  const Stage stage{reinterpret_cast<uint4*>(smem_quads)};
  float* const scale_s = reinterpret_cast<float*>(smem_quads) + Smem::kStageBytes / sizeof(float);
  float* const dw_s = scale_s + (Smem::kStagedScale ? kChunk : 0);  // [kRowsPerBlock][kChunk]
  float* const db_s = dw_s + kRowsPerBlock * kChunk;                // LayerNorm only
  __shared__ float scratch[kThreads > 32 ? kBlock / 32 * kSums : 1];
  __shared__ detail::ClusterRowSum<kCluster, kSums> cluster_sums;  // kCluster > 1
  int cluster_rows = 0;
  const int lane = threadIdx.x % kThreads;
  const int slot = threadIdx.x / kThreads;
  const int rank = static_cast<int>(blockIdx.x % kCluster);
  const std::int64_t group = blockIdx.x / kCluster;
  const std::int64_t groups = gridDim.x / kCluster;
  const std::int64_t n = a.cols;
  // The row's vectors split evenly over the cluster's blocks (the last may own fewer).
  const std::int64_t row_vecs = n / V;
  const std::int64_t share = (row_vecs + kCluster - 1) / kCluster;
  const std::int64_t first_col = rank * share * V;
  const int own_vecs =
      static_cast<int>(std::max<std::int64_t>(0, std::min(share, row_vecs - rank * share)));
  const bool want_dw = a.partial != nullptr;

  // kPrefetch: rstd (and mean) of the row whose copies are in flight; the first row's copies
  // overlap the staging below.
  float next_rstd = 0.f, next_mean = 0.f;
  const auto prefetch = [&](std::int64_t row) {
    if (row < a.rows) {
      stage.fetch(a, row, first_col, own_vecs, lane);
      next_rstd = a.rstd[row];
      if constexpr (kKind == Kind::kLayer) next_mean = a.mean[row];
    }
    detail::cp_async_commit();
  };
  if constexpr (kCluster > 1) cluster_sums.start();
  if constexpr (kPrefetch) prefetch(group);

  if constexpr (Smem::kStagedScale) {
    for (int c = threadIdx.x; c < kChunk; c += kBlock) {
      scale_s[column_index<kThreads, V>(c)] =
          c < own_vecs * V ? load_scale<T, kKind>(a, first_col + c) : 0.f;
    }
  }
  if (want_dw) {
    const int sums = kRowsPerBlock * kChunk * kSums;
    for (int c = threadIdx.x * 4; c < sums; c += kBlock * 4) {
      store_shared_quad(dw_s + c, make_float4(0.f, 0.f, 0.f, 0.f));
    }
  }
  __syncthreads();
  if constexpr (kCluster > 1) cluster_sums.wait_started();
  float* const dw_slot = dw_s + slot * kChunk;
  float* const db_slot = db_s + slot * kChunk;

  for (std::int64_t base = group * kRowsPerBlock; base < a.rows; base += groups * kRowsPerBlock) {
    const std::int64_t row = base + slot;
    const bool valid = row < a.rows;
    float rstd = 0.f, mean = 0.f;
    if constexpr (kPrefetch) {
      rstd = next_rstd;
      mean = next_mean;
      detail::cp_async_wait<0>();  // this row's copies (the thread's own) have landed
    } else if (valid) {
      rstd = a.rstd[row];
      if constexpr (kKind == Kind::kLayer) mean = a.mean[row];
    }
    detail::Vec<T, V> dy_raw[kVecs];
    detail::Vec<X, V> x_raw[kVecs];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int u = i * kThreads + lane;
      const std::int64_t col = first_col + static_cast<std::int64_t>(u) * V;
      if (!valid || u >= own_vecs) {
        dy_raw[i] = {};
        x_raw[i] = {};
      } else if constexpr (kPrefetch) {
        stage.take(u, dy_raw[i], x_raw[i]);
      } else {
        dy_raw[i] = detail::load_raw<T, V>(static_cast<const T*>(a.dy) + row * a.dy_stride + col);
        x_raw[i] = detail::load_raw<X, V>(static_cast<const X*>(a.x) + row * a.x_stride + col);
      }
    }
    // Row data as floats: xhat and g = dy * scale (columns past the row: dy = 0, so g = 0).
    auto unpack = [&](int i, float (&dy)[V], float (&xhat)[V], float (&g)[V]) {
      float scale[V];
      if constexpr (Smem::kStagedScale) {
        load_shared_floats<kThreads, V>(scale_s, i, lane, scale);
      } else if (const int u = i * kThreads + lane; u < own_vecs) {
        load_scale_vector<T, kKind, V>(a, first_col + static_cast<std::int64_t>(u) * V, scale);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) scale[j] = 0.f;  // as staged past the block's columns
      }
      detail::to_floats(dy_raw[i], dy);
      detail::to_floats(x_raw[i], xhat);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        xhat[j] = (xhat[j] - mean) * rstd;
        g[j] = dy[j] * scale[j];
      }
    };
    float sums[kSums] = {};
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      float dy[V], xhat[V], g[V];
      unpack(i, dy, xhat, g);
      add_row_sums<kKind, V>(g, xhat, sums);
    }
    row_sum<kThreads, kSums>(sums, scratch);
    if constexpr (kPrefetch) prefetch(row + groups);
    if constexpr (kCluster > 1) cluster_sums.reduce(sums, cluster_rows);
    const float inv_n = 1.f / static_cast<float>(n);
    const float mean_g = kKind == Kind::kLayer ? sums[0] * inv_n : 0.f;
    const float mean_gx = sums[kSums - 1] * inv_n;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int u = i * kThreads + lane;
      if (!valid || u >= own_vecs) continue;
      const std::int64_t col = first_col + static_cast<std::int64_t>(u) * V;
      float dy[V], xhat[V], g[V], dx[V];
      unpack(i, dy, xhat, g);
      input_gradient<kKind, V>(g, xhat, rstd, mean_g, mean_gx, dx);
      add_residual_gradient<X, V>(a, row, col, dx);
      store_floats<T, V>(static_cast<T*>(a.dx) + row * a.dx_stride + col, dx);
      if (want_dw) {
        float dy_xhat[V];
#pragma unroll
        for (int j = 0; j < V; ++j) dy_xhat[j] = dy[j] * xhat[j];
        accumulate_shared<kThreads, V>(dw_slot, i, lane, dy_xhat);
        if constexpr (kKind == Kind::kLayer) accumulate_shared<kThreads, V>(db_slot, i, lane, dy);
      }
    }
  }
  if (!want_dw) return;

  // The block's row slots in slot order, then the group's partial row (this block's columns).
  __syncthreads();
  float* const dw_out = a.partial + group * n;
  float* const db_out = a.partial + (groups + group) * n;
  for (int c = threadIdx.x; c < own_vecs * V; c += kBlock) {
    const int at = column_index<kThreads, V>(c);
    float dw = 0.f, db = 0.f;
    for (int s = 0; s < kRowsPerBlock; ++s) {
      dw += dw_s[s * kChunk + at];
      if constexpr (kKind == Kind::kLayer) db += db_s[s * kChunk + at];
    }
    dw_out[first_col + c] = dw;
    if constexpr (kKind == Kind::kLayer) db_out[first_col + c] = db;
  }
  if constexpr (kCluster == 1) {
    if (!a.reduce_in_kernel) return;
    // Every block's partial rows are written: all blocks sum them by column tiles, in the shared
    // memory the dw/db sums used (no longer read after the barrier).
    using Scratch = detail::GridReduceScratch<kBlock>;
    static_assert(Smem::kBytes >= sizeof(Scratch));
    detail::grid_barrier();
    detail::reduce_partial_rows<kBlock>(
        a.partial, static_cast<int>(groups), n, kSums, *reinterpret_cast<Scratch*>(smem_quads),
        [&](int array, std::int64_t col, float total) { store_gradient<T>(a, array, col, total); });
  }
}

// Any row length and alignment: pass 1 reduces, pass 2 re-reads and writes dx; each thread
// owns the same columns on every row, so it accumulates its block's partial row in place.
template <class T, class X, Kind kKind, int V>
__global__ void __launch_bounds__(kTwoPassThreads) backward_two_pass_kernel(BackwardArgs a) {
  constexpr int kSums = kKind == Kind::kLayer ? 2 : 1;
  __shared__ float scratch[kTwoPassThreads / 32 * kSums];
  const std::int64_t n = a.cols;
  constexpr std::int64_t kStep = static_cast<std::int64_t>(kTwoPassThreads) * V;
  float* dw_partial = a.partial ? a.partial + blockIdx.x * n : nullptr;
  float* db_partial = a.partial ? a.partial + (gridDim.x + blockIdx.x) * n : nullptr;
  if (dw_partial) {
    for (std::int64_t col = threadIdx.x * V; col < n; col += kStep) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        dw_partial[col + j] = 0.f;
        if constexpr (kKind == Kind::kLayer) db_partial[col + j] = 0.f;
      }
    }
  }
  for (std::int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const float rstd = a.rstd[row];
    const float mean = kKind == Kind::kLayer ? a.mean[row] : 0.f;
    const T* dy_row = static_cast<const T*>(a.dy) + row * a.dy_stride;
    const X* x_row = static_cast<const X*>(a.x) + row * a.x_stride;
    auto load = [&](std::int64_t col, float (&dy)[V], float (&xhat)[V], float (&g)[V]) {
      load_floats<T, V>(dy_row + col, dy);
      load_floats<X, V>(x_row + col, xhat);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        xhat[j] = (xhat[j] - mean) * rstd;
        g[j] = dy[j] * load_scale<T, kKind>(a, col + j);
      }
    };
    float sums[kSums] = {};
    for (std::int64_t col = threadIdx.x * V; col < n; col += kStep) {
      float dy[V], xhat[V], g[V];
      load(col, dy, xhat, g);
      add_row_sums<kKind, V>(g, xhat, sums);
    }
    row_sum<kTwoPassThreads, kSums>(sums, scratch);
    const float inv_n = 1.f / static_cast<float>(n);
    const float mean_g = kKind == Kind::kLayer ? sums[0] * inv_n : 0.f;
    const float mean_gx = sums[kSums - 1] * inv_n;
    for (std::int64_t col = threadIdx.x * V; col < n; col += kStep) {
      float dy[V], xhat[V], g[V], dx[V];
      load(col, dy, xhat, g);
      input_gradient<kKind, V>(g, xhat, rstd, mean_g, mean_gx, dx);
      add_residual_gradient<X, V>(a, row, col, dx);
      store_floats<T, V>(static_cast<T*>(a.dx) + row * a.dx_stride + col, dx);
      if (dw_partial) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          dw_partial[col + j] += dy[j] * xhat[j];
          if constexpr (kKind == Kind::kLayer) db_partial[col + j] += dy[j];
        }
      }
    }
  }
}

// dw (and db) from the `parts` partial rows of a launch that did not reduce them itself
// (clusters, two passes): grid_reduce.cuh's column sums in a second launch, one 32-column tile
// per block.
inline constexpr int kReduceBlock = 256;
template <class T>
__global__ void __launch_bounds__(kReduceBlock) reduce_partials_kernel(BackwardArgs a, int parts,
                                                                       int arrays) {
  __shared__ detail::GridReduceScratch<kReduceBlock> scratch;
  detail::reduce_partial_rows<kReduceBlock>(
      a.partial, parts, a.cols, arrays, scratch,
      [&](int array, std::int64_t col, float total) { store_gradient<T>(a, array, col, total); });
}

}  // namespace
}  // namespace trainscale::ops::norm
