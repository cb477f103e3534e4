// The attention backward kernels (sm_80+: mma.sync, ldmatrix, cp.async), in three launches:
//
//   preprocess  delta[b, h, i] = sum_d dout * out (fp32): the row term of the softmax Jacobian.
//   dK/dV       one CTA per (batch, kv head, key block): over the query heads of its GQA group
//               and the query blocks that see one of its keys, recompute the score tile and
//               accumulate dV += P^T dO and dK += dS^T Q in registers; write dK, dV once.
//   dQ          one CTA per (batch, query head, query block): over the key blocks its queries
//               see, recompute the score tile and accumulate dQ += dS K; write dQ once.
//
// Both gradient kernels recompute the tile with one building block (recompute_scores): S = Q K^T
// and dP = dO V^T from shared memory, then per element P = exp(c(S) - lse) and
// dS = P (dP - delta) c'(S), with c the scaled, optionally soft-capped score, into shared memory
// for the next products. Every output element is written by exactly one CTA, summed in one fixed
// order: deterministic by construction, no atomics, no zero-initialization of the outputs.
//
// A score the mask hides gives P = dS = 0. Only tiles that cross a mask edge or the end of a
// sequence test elements; interior tiles skip the test. NaN inputs propagate through the
// products (a NaN in one row of a tile also reaches, through 0 * NaN in the products, the
// gradients of keys in that tile its query does not see).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "common/async_copy.cuh"
#include "common/vec.cuh"
#include "ops/attention/attention_bwd_traits.cuh"
#include "ops/attention/attention_mask.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define TS_ATTENTION_BWD_BODY 1
#else
#define TS_ATTENTION_BWD_BODY 0
#endif

namespace trainscale::ops::attention {

// A [B, S, H, D] tensor: its data and the element strides of B, S and H (D contiguous).
struct BshdTensor {
  void* data;
  int64_t batch_stride, seq_stride, head_stride;

  // Element 0 of vector (b, s, h).
  template <class Element>
  __device__ __forceinline__ Element* row(int b, int s, int h) const {
    return static_cast<Element*>(data) + b * batch_stride + s * seq_stride + h * head_stride;
  }
};

struct BackwardParams {
  BshdTensor q, k, v, out, dout;  // read
  BshdTensor dq, dk, dv;          // written
  const float* lse;               // [B, Hq, Sq]
  float* delta;                   // [B, Hq, stats_len], the workspace
  float* lse_log2;                // [B, Hq, stats_len] or null: lse * log2(e) for the Hopper kernel
  float* dq_accum;                // [B, Hq, stats_len, D] or null: the Hopper kernel's dQ sums, zeroed here
  int stats_len;                  // Sq, or Sq padded to the Hopper kernel's query blocks
  int batch, q_len, kv_len, q_heads, kv_heads, group;
  float scale;
  float softcap;  // 0: off
  AttentionMask<int> mask;
};

// ---- preprocess -------------------------------------------------------------------------------

// One warp per row (b, h, i) of [B, Hq, stats_len]; each lane reads D / 32 elements of dout and
// out. Rows past Sq (padding) get delta = 0 and lse * log2(e) = +inf, and so does a query that
// sees no key (lse = -inf): P = 2^(s - inf) = 0 there without a test. Each warp also zeroes D
// floats of the dQ accumulator: the (b, h, query block) chunks of block_m x D floats lie in row
// order, so row r's share is floats [r D, (r + 1) D) whatever the order inside a chunk.
template <class Traits>
__global__ void __launch_bounds__(256) attention_backward_preprocess_kernel(const BackwardParams p) {
#if TS_ATTENTION_BWD_BODY
  using Native = typename Traits::Native;
  constexpr int kPerLane = Traits::kHeadDim / 32;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= static_cast<int64_t>(p.batch) * p.q_heads * p.stats_len) return;
  const int i = static_cast<int>(row % p.stats_len);
  const int h = static_cast<int>(row / p.stats_len % p.q_heads);
  const int b = static_cast<int>(row / p.stats_len / p.q_heads);
  if (p.dq_accum != nullptr) {
    static_assert(kPerLane % 2 == 0, "a lane zeroes whole float2 units");
    float* zero = p.dq_accum + row * Traits::kHeadDim + lane * kPerLane;
    CUTE_UNROLL
    for (int j = 0; j < kPerLane; j += 2) *reinterpret_cast<float2*>(zero + j) = make_float2(0.f, 0.f);
  }
  if (i >= p.q_len) {
    if (lane == 0) {
      p.delta[row] = 0.f;
      if (p.lse_log2 != nullptr) p.lse_log2[row] = INFINITY;
    }
    return;
  }
  const int64_t column = static_cast<int64_t>(lane) * kPerLane;
  float dout[kPerLane], out[kPerLane];
  detail::load_floats<Native, kPerLane>(p.dout.row<const Native>(b, i, h) + column, dout);
  detail::load_floats<Native, kPerLane>(p.out.row<const Native>(b, i, h) + column, out);
  float sum = 0.f;
  CUTE_UNROLL
  for (int j = 0; j < kPerLane; ++j) sum = fmaf(dout[j], out[j], sum);
  CUTE_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) {
    p.delta[row] = sum;
    if (p.lse_log2 != nullptr) {
      const float lse = p.lse[(static_cast<int64_t>(b) * p.q_heads + h) * p.q_len + i];
      p.lse_log2[row] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
    }
  }
#else
  (void)p;
#endif
}

// ---- building blocks --------------------------------------------------------------------------

// Rows [0, valid_rows) of the [rows, cols] tile `smem` from `global` (row `row_stride` elements
// apart, columns contiguous, 16-byte aligned) with 16-byte cp.async; the rows past valid_rows
// are zero-filled. The caller commits.
template <int kThreads, class SmemTensor, class Element>
__device__ __forceinline__ void load_rows_async(SmemTensor smem, const Element* global,
                                                int64_t row_stride, int valid_rows, int thread) {
  constexpr int kRows = decltype(cute::size<0>(smem))::value;
  constexpr int kChunksPerRow = decltype(cute::size<1>(smem))::value / 8;
  static_assert(kRows * kChunksPerRow % kThreads == 0);
  CUTE_UNROLL
  for (int i = 0; i < kRows * kChunksPerRow / kThreads; ++i) {
    const int chunk = i * kThreads + thread;
    const int row = chunk / kChunksPerRow, col = chunk % kChunksPerRow * 8;
    const bool valid = row < valid_rows;
    detail::cp_async_16_zfill(&smem(row, col), valid ? global + row * row_stride + col : global, valid);
  }
}

// lse and delta of queries [0, valid_rows) of a block (both already offset to its first query);
// zeros past valid_rows (those rows are masked). The caller commits.
template <int kBlockM>
__device__ __forceinline__ void load_row_statistics_async(float* smem_lse, float* smem_delta,
                                                          const float* lse, const float* delta,
                                                          int valid_rows, int thread) {
  if (thread < 2 * kBlockM) {
    const int row = thread % kBlockM;
    const bool valid = row < valid_rows;
    const float* src = thread < kBlockM ? lse : delta;
    float* dst = thread < kBlockM ? smem_lse : smem_delta;
    detail::cp_async_4_zfill(dst + row, valid ? src + row : src, valid);
  }
}

// acc += A B^T for A (m, k) and B (n, k) in shared memory, through the thread's fragments of the
// tiled MMA; each operand is read with ldmatrix as its copy atom says (k- or mn-contiguous).
// The next k step's fragments are loaded while the current one multiplies.
template <class CopyAtomA, class CopyAtomB, class TiledMma, class Acc, class TensorA, class TensorB>
__device__ __forceinline__ void gemm_smem(const TiledMma& mma, Acc& acc, const TensorA& smem_a,
                                          const TensorB& smem_b, int thread) {
  using namespace cute;
  auto thr_mma = mma.get_thread_slice(thread);
  Tensor frag_a = thr_mma.partition_fragment_A(smem_a);  // (MMA, MMA_M, MMA_K)
  Tensor frag_b = thr_mma.partition_fragment_B(smem_b);  // (MMA, MMA_N, MMA_K)
  auto copy_a = make_tiled_copy_A(CopyAtomA{}, mma);
  auto copy_b = make_tiled_copy_B(CopyAtomB{}, mma);
  auto thr_copy_a = copy_a.get_thread_slice(thread);
  auto thr_copy_b = copy_b.get_thread_slice(thread);
  Tensor src_a = thr_copy_a.partition_S(smem_a);
  Tensor dst_a = thr_copy_a.retile_D(frag_a);
  Tensor src_b = thr_copy_b.partition_S(smem_b);
  Tensor dst_b = thr_copy_b.retile_D(frag_b);
  constexpr int kSteps = decltype(size<2>(frag_a))::value;
  copy(copy_a, src_a(_, _, 0), dst_a(_, _, 0));
  copy(copy_b, src_b(_, _, 0), dst_b(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < kSteps; ++k) {
    if (k + 1 < kSteps) {
      copy(copy_a, src_a(_, _, k + 1), dst_a(_, _, k + 1));
      copy(copy_b, src_b(_, _, k + 1), dst_b(_, _, k + 1));
    }
    cute::gemm(mma, frag_a(_, _, k), frag_b(_, _, k), acc);
  }
}

// Whether every score of the tile (queries [m0, m0 + kBlockM), keys [n0, n0 + kBlockN)) exists
// and is seen: query_begin / key_end are monotone, so the corners decide.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ bool tile_is_interior(const BackwardParams& p, int m0, int n0) {
  return m0 + kBlockM <= p.q_len && n0 + kBlockN <= p.kv_len &&
         p.mask.key_begin(m0 + kBlockM - 1) <= n0 && p.mask.key_end(m0) >= n0 + kBlockN;
}

// The shared recompute of both gradient kernels, for queries [m0, m0 + kBlockM) and keys
// [n0, n0 + kBlockN) of one head, all operands in shared memory: S = Q K^T and dP = dO V^T in
// fp32, then per element
//   c = scale S, or softcap tanh(scale S / softcap);  P = exp(c - lse)  (0 where lse = -inf)
//   dS = P (dP - delta) dc/d(scale S)                 (the factor scale is left to the caller)
// written to smem_ds (and P to smem_p when kStoreP) in the input dtype. Hidden scores and rows
// past the end give P = dS = 0. The caller synchronizes before reading them.
template <class Traits, bool kStoreP, class TensorQ, class TensorK, class TensorP>
__device__ __forceinline__ void recompute_scores(const BackwardParams& p, const TensorQ& smem_q,
                                                 const TensorK& smem_k, const TensorQ& smem_dout,
                                                 const TensorK& smem_v, const float* smem_lse,
                                                 const float* smem_delta, TensorP smem_p,
                                                 TensorP smem_ds, int m0, int n0, int thread) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr float kLog2e = 1.4426950408889634f;
  typename Traits::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(thread);
  Tensor scores = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor dprobs = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
  clear(scores);
  clear(dprobs);
  using LoadK = typename Traits::LoadKMajor;
  gemm_smem<LoadK, LoadK>(mma, scores, smem_q, smem_k, thread);
  gemm_smem<LoadK, LoadK>(mma, dprobs, smem_dout, smem_v, thread);

  Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor out_p = thr_mma.partition_C(smem_p);
  Tensor out_ds = thr_mma.partition_C(smem_ds);
  const bool softcapped = p.softcap > 0.f;
  auto finish = [&](auto masked) {
    CUTE_UNROLL
    for (int e = 0; e < size(scores); ++e) {
      const int row = get<0>(coords(e)), col = get<1>(coords(e));
      float prob = 0.f, dscore = 0.f;
      if (!decltype(masked)::value || (m0 + row < p.q_len && p.mask.sees(m0 + row, n0 + col))) {
        float logit = scores(e) * p.scale, slope = 1.f;
        if (softcapped) {
          const float t = tanhf(logit / p.softcap);
          logit = p.softcap * t;
          slope = 1.f - t * t;
        }
        const float row_lse = smem_lse[row];
        prob = row_lse == -INFINITY ? 0.f : exp2f((logit - row_lse) * kLog2e);
        dscore = prob * (dprobs(e) - smem_delta[row]) * slope;
      }
      if constexpr (kStoreP) out_p(e) = static_cast<Element>(prob);
      out_ds(e) = static_cast<Element>(dscore);
    }
  };
  if (tile_is_interior<kBlockM, kBlockN>(p, m0, n0)) {
    finish(cute::false_type{});
  } else {
    finish(cute::true_type{});
  }
}

// The thread's part of a tiled-MMA accumulator tile, times `factor`, rounded into the shared
// tile of the same shape. The caller synchronizes before the tile is read.
template <class Traits, class Acc, class SmemTensor>
__device__ __forceinline__ void stage_accumulators(const Acc& acc, float factor, SmemTensor smem,
                                                   int thread) {
  using Element = typename Traits::Element;
  typename Traits::TiledMma mma;
  cute::Tensor part = mma.get_thread_slice(thread).partition_C(smem);
  CUTE_UNROLL
  for (int e = 0; e < cute::size(acc); ++e) part(e) = static_cast<Element>(acc(e) * factor);
}

// Rows [0, valid_rows) of the shared tile to `global` (rows `row_stride` elements apart, columns
// contiguous, 16-byte aligned), 16 bytes per store.
template <int kThreads, class SmemTensor, class Element>
__device__ __forceinline__ void store_rows(const SmemTensor& smem, Element* global, int64_t row_stride,
                                           int valid_rows, int thread) {
  constexpr int kRows = decltype(cute::size<0>(smem))::value;
  constexpr int kChunksPerRow = decltype(cute::size<1>(smem))::value / 8;
  static_assert(kRows * kChunksPerRow % kThreads == 0);
  CUTE_UNROLL
  for (int i = 0; i < kRows * kChunksPerRow / kThreads; ++i) {
    const int chunk = i * kThreads + thread;
    const int row = chunk / kChunksPerRow, col = chunk % kChunksPerRow * 8;
    if (row < valid_rows) {
      *reinterpret_cast<uint4*>(global + row * row_stride + col) =
          *reinterpret_cast<const uint4*>(&smem(row, col));
    }
  }
}

// ---- dK / dV ----------------------------------------------------------------------------------

// blockIdx.x = key block + key blocks * (kv head + Hkv * batch): key block 0, which the most
// queries see under a causal mask, starts first.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    attention_backward_dkdv_kernel(const __grid_constant__ BackwardParams p) {
#if TS_ATTENTION_BWD_BODY
  using namespace cute;
  using Element = typename Traits::Element;
  using Storage = typename Traits::DkdvStorage;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads;
  extern __shared__ __align__(128) char smem[];
  Storage& storage = *reinterpret_cast<Storage*>(smem);
  const int thread = threadIdx.x;

  const int n_blocks = (p.kv_len + kBlockN - 1) / kBlockN;
  const int n_block = static_cast<int>(blockIdx.x % n_blocks);
  const int kv_head = static_cast<int>(blockIdx.x / n_blocks % p.kv_heads);
  const int batch = static_cast<int>(blockIdx.x / n_blocks / p.kv_heads);
  const int n0 = n_block * kBlockN;
  const int n_valid = min(kBlockN, p.kv_len - n0);

  // The queries that see a key of the block, in whole query blocks.
  const int q_begin = p.mask.query_begin(n0), q_end = p.mask.query_end(n0 + n_valid - 1);
  const int m_first = q_begin / kBlockM;
  const int m_count = q_end > q_begin ? (q_end + kBlockM - 1) / kBlockM - m_first : 0;
  const int tiles = m_count * p.group;  // (query head, query block), heads outermost

  Tensor smem_k = make_tensor(make_smem_ptr(storage.k), typename Traits::SmemLayoutK{});
  Tensor smem_v = make_tensor(make_smem_ptr(storage.v), typename Traits::SmemLayoutK{});
  Tensor smem_p = make_tensor(make_smem_ptr(storage.p), typename Traits::SmemLayoutP{});
  Tensor smem_ds = make_tensor(make_smem_ptr(storage.ds), typename Traits::SmemLayoutP{});
  Tensor smem_pt = make_tensor(make_smem_ptr(storage.p), typename Traits::SmemLayoutPt{});
  Tensor smem_dst = make_tensor(make_smem_ptr(storage.ds), typename Traits::SmemLayoutPt{});
  using LayoutQ = typename Traits::SmemLayoutQ;
  using LayoutQt = typename Traits::SmemLayoutQt;
  auto smem_q = [&](int stage) { return make_tensor(make_smem_ptr(storage.q[stage]), LayoutQ{}); };
  auto smem_dout = [&](int stage) { return make_tensor(make_smem_ptr(storage.dout[stage]), LayoutQ{}); };
  auto smem_qt = [&](int stage) { return make_tensor(make_smem_ptr(storage.q[stage]), LayoutQt{}); };
  auto smem_doutt = [&](int stage) { return make_tensor(make_smem_ptr(storage.dout[stage]), LayoutQt{}); };

  load_rows_async<kThreads>(smem_k, p.k.row<const Element>(batch, n0, kv_head), p.k.seq_stride, n_valid,
                            thread);
  load_rows_async<kThreads>(smem_v, p.v.row<const Element>(batch, n0, kv_head), p.v.seq_stride, n_valid,
                            thread);

  auto tile_head = [&](int t) { return kv_head * p.group + t / m_count; };
  auto tile_m0 = [&](int t) { return (m_first + t % m_count) * kBlockM; };
  auto load_queries = [&](int t, int stage) {
    const int head = tile_head(t), m0 = tile_m0(t);
    const int m_valid = min(kBlockM, p.q_len - m0);
    load_rows_async<kThreads>(smem_q(stage), p.q.row<const Element>(batch, m0, head), p.q.seq_stride, m_valid,
                              thread);
    load_rows_async<kThreads>(smem_dout(stage), p.dout.row<const Element>(batch, m0, head), p.dout.seq_stride,
                              m_valid, thread);
    const int64_t stats = (static_cast<int64_t>(batch) * p.q_heads + head) * p.q_len + m0;
    load_row_statistics_async<kBlockM>(storage.lse[stage], storage.delta[stage], p.lse + stats,
                                       p.delta + stats, m_valid, thread);
  };
  if (tiles > 0) load_queries(0, 0);
  detail::cp_async_commit();

  typename Traits::TiledMma mma;
  Tensor dk = partition_fragment_C(mma, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor dv = partition_fragment_C(mma, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(dk);
  clear(dv);
  for (int t = 0; t < tiles; ++t) {
    const int stage = t & 1;
    // Tile t landed for every thread; every thread is done with tile t - 1 (its stage, P, dS).
    detail::cp_async_wait<0>();
    __syncthreads();
    if (t + 1 < tiles) {
      load_queries(t + 1, stage ^ 1);
      detail::cp_async_commit();
    }
    recompute_scores<Traits, /*kStoreP=*/true>(p, smem_q(stage), smem_k, smem_dout(stage), smem_v,
                                               storage.lse[stage], storage.delta[stage], smem_p,
                                               smem_ds, tile_m0(t), n0, thread);
    __syncthreads();
    using LoadMN = typename Traits::LoadMNMajor;
    gemm_smem<LoadMN, LoadMN>(mma, dv, smem_pt, smem_doutt(stage), thread);
    gemm_smem<LoadMN, LoadMN>(mma, dk, smem_dst, smem_qt(stage), thread);
  }

  // K and V (and any copy still in flight) are done with: stage dK and dV in their place.
  detail::cp_async_wait<0>();
  __syncthreads();
  stage_accumulators<Traits>(dk, p.scale, smem_k, thread);
  stage_accumulators<Traits>(dv, 1.f, smem_v, thread);
  __syncthreads();
  store_rows<kThreads>(smem_k, p.dk.row<Element>(batch, n0, kv_head), p.dk.seq_stride, n_valid, thread);
  store_rows<kThreads>(smem_v, p.dv.row<Element>(batch, n0, kv_head), p.dv.seq_stride, n_valid, thread);
#else
  (void)p;
#endif
}

// ---- dQ ---------------------------------------------------------------------------------------

// blockIdx.x = (query blocks - 1 - query block) + query blocks * (query head + Hq * batch): the
// last query blocks, which see the most keys under a causal mask, start first.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    attention_backward_dq_kernel(const __grid_constant__ BackwardParams p) {
#if TS_ATTENTION_BWD_BODY
  using namespace cute;
  using Element = typename Traits::Element;
  using Storage = typename Traits::DqStorage;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads;
  extern __shared__ __align__(128) char smem[];
  Storage& storage = *reinterpret_cast<Storage*>(smem);
  const int thread = threadIdx.x;

  const int m_blocks = (p.q_len + kBlockM - 1) / kBlockM;
  const int m_block = m_blocks - 1 - static_cast<int>(blockIdx.x % m_blocks);
  const int head = static_cast<int>(blockIdx.x / m_blocks % p.q_heads);
  const int batch = static_cast<int>(blockIdx.x / m_blocks / p.q_heads);
  const int kv_head = head / p.group;
  const int m0 = m_block * kBlockM;
  const int m_valid = min(kBlockM, p.q_len - m0);

  // The keys a query of the block sees, in whole key blocks.
  const int k_begin = p.mask.key_begin(m0), k_end = p.mask.key_end(m0 + m_valid - 1);
  const int n_first = k_begin / kBlockN;
  const int n_count = k_end > k_begin ? (k_end + kBlockN - 1) / kBlockN - n_first : 0;

  Tensor smem_q = make_tensor(make_smem_ptr(storage.q), typename Traits::SmemLayoutQ{});
  Tensor smem_dout = make_tensor(make_smem_ptr(storage.dout), typename Traits::SmemLayoutQ{});
  Tensor smem_ds = make_tensor(make_smem_ptr(storage.ds), typename Traits::SmemLayoutP{});
  using LayoutK = typename Traits::SmemLayoutK;
  auto smem_k = [&](int stage) { return make_tensor(make_smem_ptr(storage.k[stage]), LayoutK{}); };
  auto smem_v = [&](int stage) { return make_tensor(make_smem_ptr(storage.v[stage]), LayoutK{}); };
  using LayoutKt = typename Traits::SmemLayoutKt;
  auto smem_kt = [&](int stage) { return make_tensor(make_smem_ptr(storage.k[stage]), LayoutKt{}); };

  load_rows_async<kThreads>(smem_q, p.q.row<const Element>(batch, m0, head), p.q.seq_stride, m_valid, thread);
  load_rows_async<kThreads>(smem_dout, p.dout.row<const Element>(batch, m0, head), p.dout.seq_stride, m_valid,
                            thread);
  const int64_t stats = (static_cast<int64_t>(batch) * p.q_heads + head) * p.q_len + m0;
  load_row_statistics_async<kBlockM>(storage.lse, storage.delta, p.lse + stats, p.delta + stats, m_valid,
                                     thread);

  auto load_keys = [&](int t, int stage) {
    const int n0 = (n_first + t) * kBlockN;
    const int n_valid = min(kBlockN, p.kv_len - n0);
    load_rows_async<kThreads>(smem_k(stage), p.k.row<const Element>(batch, n0, kv_head), p.k.seq_stride, n_valid,
                              thread);
    load_rows_async<kThreads>(smem_v(stage), p.v.row<const Element>(batch, n0, kv_head), p.v.seq_stride, n_valid,
                              thread);
  };
  if (n_count > 0) load_keys(0, 0);
  detail::cp_async_commit();

  typename Traits::TiledMma mma;
  Tensor dq = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(dq);
  for (int t = 0; t < n_count; ++t) {
    const int stage = t & 1;
    // Block t landed for every thread; every thread is done with block t - 1 (its stage, dS).
    detail::cp_async_wait<0>();
    __syncthreads();
    if (t + 1 < n_count) {
      load_keys(t + 1, stage ^ 1);
      detail::cp_async_commit();
    }
    recompute_scores<Traits, /*kStoreP=*/false>(p, smem_q, smem_k(stage), smem_dout, smem_v(stage),
                                                storage.lse, storage.delta, smem_ds, smem_ds,
                                                m0, (n_first + t) * kBlockN, thread);
    __syncthreads();
    gemm_smem<typename Traits::LoadKMajor, typename Traits::LoadMNMajor>(mma, dq, smem_ds, smem_kt(stage),
                                                                         thread);
  }

  // Q (and any copy still in flight) is done with: stage dQ in its place.
  detail::cp_async_wait<0>();
  __syncthreads();
  stage_accumulators<Traits>(dq, p.scale, smem_q, thread);
  __syncthreads();
  store_rows<kThreads>(smem_q, p.dq.row<Element>(batch, m0, head), p.dq.seq_stride, m_valid, thread);
#else
  (void)p;
#endif
}

}  // namespace trainscale::ops::attention
