// The Hopper attention backward's roles (attention_bwd_sm90_kernel.cuh): its parameters, the
// producer warp (TMA loads of K, V, Q, dO and the row terms), the dQ writer warp (each query
// block's dQ partial reduce-added into the workspace, in key-block order when deterministic) and
// the consumer warp groups' loop over the query blocks (the five products and the score terms).
#pragma once

#include <climits>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "common/wgmma.cuh"
#include "ops/attention/attention_bwd_kernel.cuh"
#include "ops/attention/attention_bwd_sm90_traits.cuh"
#include "ops/attention/attention_mask.h"
#include "ops/attention/attention_softmax.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TS_ATTENTION_BWD_SM90_BODY 1
#else
#define TS_ATTENTION_BWD_SM90_BODY 0
#endif

namespace trainscale::ops::attention {

template <class Traits>
struct BackwardSm90Params {
  typename Traits::TmaQ tma_q, tma_dout;
  typename Traits::TmaK tma_k, tma_v;
  typename Traits::ShapeQKV shape_q;   // (Sq, D, Hq, B)
  typename Traits::ShapeQKV shape_kv;  // (Sk, D, Hkv, B)
  BshdTensor dk, dv;                   // written
  const float* lse_log2;               // [B, Hq, stats_len]: the workspace's (preprocess)
  const float* delta;                  // [B, Hq, stats_len]
  float* dq_accum;                     // [B, Hq, m_blocks, kDqFloats], zeroed
  int* dq_semaphore;                   // [B, Hq, m_blocks], zeroed; null: any order
  int batch, q_len, kv_len, q_heads, kv_heads, group, m_blocks;
  bool key_blocks_outermost = false;  // the CTA order (backward_cta)
  float scale_log2;  // scale * log2(e)
  float scale;
  float softcap;  // 0: off
  AttentionMask<int> mask;
};

// Named barriers (ids after CUTLASS's reserved ones).
enum class BackwardBarrier : uint32_t {
  kDsReady = 0,  // both consumer warp groups stored their dS^T rows
  kPReady = 1,   // kSplitHeadDim: both consumer warp groups stored their P^T rows
};

// The query blocks that see a key of key block n_block (AttentionMask::query_blocks).
using QueryBlocks = AttentionMask<int>::Blocks;
template <class Traits>
__device__ __forceinline__ QueryBlocks query_blocks(const BackwardSm90Params<Traits>& p, int n_block) {
  const int n0 = n_block * Traits::kBlockN;
  return p.mask.query_blocks(n0, min(n0 + Traits::kBlockN, p.kv_len), Traits::kBlockM);
}

template <class Traits>
struct BackwardSm90Producer {
  // Runs on the 32 lanes of the producer warp; lane 0 issues.
  template <class SharedStorage>
  __device__ static void run(const BackwardSm90Params<Traits>& p, SharedStorage& storage,
                             typename Traits::Pipeline& pipeline_q, typename Traits::Pipeline& pipeline_dout,
                             int batch, int kv_head, int n_block, QueryBlocks blocks) {
    using namespace cute;
    constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    if (threadIdx.x % 32 != 0) return;
    const int tiles = blocks.count * p.group;
    if (tiles == 0) return;
    prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_dout.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());

    Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutK{});
    Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutQ{});
    Tensor mK = p.tma_k.get_tma_tensor(p.shape_kv);
    Tensor mV = p.tma_v.get_tma_tensor(p.shape_kv);
    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q);
    Tensor mdO = p.tma_dout.get_tma_tensor(p.shape_q);

    auto tile_of = Shape<Int<kBlockN>, Int<kHeadDim>>{};
    Tensor gK = local_tile(mK(_, _, kv_head, batch), tile_of, make_coord(n_block, _0{}));
    Tensor gV = local_tile(mV(_, _, kv_head, batch), tile_of, make_coord(n_block, _0{}));
    auto [tKgK, tKsK] = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    auto& barrier_kv = reinterpret_cast<uint64_t&>(storage.barrier_kv);
    storage.barrier_kv.arrive_and_expect_tx(Traits::kTmaBytesKV);
    copy(p.tma_k.with(barrier_kv), tKgK, tKsK);
    copy(p.tma_v.with(barrier_kv), tVgV, tVsV);

    auto write = cutlass::make_producer_start_state<typename Traits::Pipeline>();
    for (int t = 0; t < tiles; ++t) {
      const int head = kv_head * p.group + t / blocks.count;
      const int m_block = blocks.first + t % blocks.count;
      const int64_t stats = (static_cast<int64_t>(batch) * p.q_heads + head) * p.m_blocks * kBlockM +
                            static_cast<int64_t>(m_block) * kBlockM;
      auto rows_of = Shape<Int<kBlockM>, Int<kHeadDim>>{};
      Tensor gQ = local_tile(mQ(_, _, head, batch), rows_of, make_coord(m_block, _0{}));
      Tensor gdO = local_tile(mdO(_, _, head, batch), rows_of, make_coord(m_block, _0{}));
      auto [tQgQ, tQsQ] = tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tOgO, tOsO] =
          tma_partition(p.tma_dout, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      const int stage = write.index();

      pipeline_q.producer_acquire(write);
      uint64_t* barrier = pipeline_q.producer_get_barrier(write);
      copy(p.tma_q.with(*barrier), tQgQ, tQsQ(_, stage));
      SM90_BULK_COPY_G2S::copy(p.lse_log2 + stats, barrier, storage.lse_log2[stage], Traits::kStatBytes);

      pipeline_dout.producer_acquire(write);
      barrier = pipeline_dout.producer_get_barrier(write);
      copy(p.tma_dout.with(*barrier), tOgO, tOsO(_, stage));
      SM90_BULK_COPY_G2S::copy(p.delta + stats, barrier, storage.delta[stage], Traits::kStatBytes);
      ++write;
    }
    // Leave only once the consumers have released every buffer.
    pipeline_q.producer_tail(write);
    pipeline_dout.producer_tail(write);
  }
};

// The number of key blocks before n_block whose query range covers m_block: the partials of
// (head, m_block) the deterministic mode waits for (counted by the same rule that makes those
// CTAs visit it).
template <class Traits>
__device__ __forceinline__ int key_blocks_before(const BackwardSm90Params<Traits>& p, int n_block, int m_block) {
  int count = 0;
  for (int n = 0; n < n_block; ++n) {
    const QueryBlocks blocks = query_blocks(p, n);
    count += m_block >= blocks.first && m_block < blocks.first + blocks.count;
  }
  return count;
}

__device__ __forceinline__ void bulk_reduce_add(float* global, const float* smem, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               :
               : "l"(global), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))), "r"(bytes)
               : "memory");
}

template <class Traits>
struct BackwardSm90DqWriter {
  // Runs on the 32 lanes of the dQ warp; lane 0 waits for each staged partial, reduce-adds it
  // (the whole query block: both warp groups' halves, contiguous in the staging buffer and in
  // the workspace) and frees the buffer once the reduce has read it.
  template <class SharedStorage>
  __device__ static void run(const BackwardSm90Params<Traits>& p, SharedStorage& storage,
                             typename Traits::PipelineDq& pipeline_dq, int batch, int kv_head, int n_block,
                             QueryBlocks blocks) {
    if (threadIdx.x % 32 != 0) return;
    typename Traits::PipelineDq::PipelineState read;
    int head = kv_head * p.group, m_block = blocks.first;
    for (int t = 0; t < blocks.count * p.group; ++t) {
      const int64_t chunk = (static_cast<int64_t>(batch) * p.q_heads + head) * p.m_blocks + m_block;
      int* semaphore = p.dq_semaphore != nullptr ? p.dq_semaphore + chunk : nullptr;
      if (semaphore != nullptr) {
        const int expected = key_blocks_before(p, n_block, m_block);
        int seen;
        do {
          asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(semaphore) : "memory");
        } while (seen < expected);
      }
      pipeline_dq.consumer_wait(read);
      bulk_reduce_add(p.dq_accum + chunk * Traits::kDqFloats, storage.dq.buffer[read.index()],
                      Traits::kDqFloats * sizeof(float));
      cute::tma_store_arrive();
      if (semaphore != nullptr) {
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // the sums are in global memory
        __threadfence();
        atomicAdd(semaphore, 1);
      } else {
        cute::tma_store_wait<0>();  // the staging buffer is read
      }
      pipeline_dq.consumer_release(read);
      ++read;
      if (++m_block == blocks.first + blocks.count) m_block = blocks.first, ++head;
    }
  }
};

// The consumer warp groups: every (query head, query block) of the CTA's tiles, per step the
// five products and the score terms above; dV and dK (unscaled) are summed into the accumulators
// given, cleared, and each step's dQ partial is staged for the dQ writer (or, with
// kSplitHeadDim, added to the workspace).
template <class Traits>
struct BackwardSm90Consumer {
  template <class SharedStorage, class Accumulator>
  __device__ static void run(const BackwardSm90Params<Traits>& p, SharedStorage& storage,
                             typename Traits::Pipeline& pipeline_q, typename Traits::Pipeline& pipeline_dout,
                             typename Traits::PipelineDq& pipeline_dq, int batch, int kv_head, int n_block,
                             QueryBlocks blocks, Accumulator& tdVrdV, Accumulator& tdKrdK) {
    using namespace cute;
    using Element = typename Traits::Element;
    using PipelineDq = typename Traits::PipelineDq;
    constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    constexpr int kConsumerThreads = Traits::kConsumerThreads;
    const int tiles = blocks.count * p.group;  // (query head, query block), heads outermost

    const int thread = threadIdx.x - 128;  // among the consumer threads
    const int consumer_group = thread / 128, group_thread = thread % 128;
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmaKV mma_kv;
    typename Traits::TiledMmaDQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(thread);
    auto thr_kv = mma_kv.get_thread_slice(thread);
    auto thr_dq = mma_dq.get_thread_slice(thread);

    Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKt{});
    Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutQt{});
    Tensor sDS = make_tensor(make_smem_ptr(storage.ds.data()), typename Traits::SmemLayoutDS{});
    Tensor sDSt = make_tensor(make_smem_ptr(storage.ds.data()), typename Traits::SmemLayoutDSt{});
    constexpr bool kSplit = Traits::kSplitHeadDim;
    // kSplitHeadDim: P^T's buffers, laid out as dS's.
    auto sPt = [&] {
      if constexpr (kSplit) return make_tensor(make_smem_ptr(storage.p.data()), typename Traits::SmemLayoutDSt{});
      else return 0;
    }();

    Tensor tSrK = thr_sdp.partition_fragment_A(sK);     // (MMA, MMA_M, MMA_K)
    Tensor tSrV = thr_sdp.partition_fragment_A(sV);
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);     // (MMA, MMA_N, MMA_K, stage)
    Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
    Tensor tKVrdOt = thr_kv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tKVrQt = thr_kv.partition_fragment_B(sQt);
    Tensor tQrdS = thr_dq.partition_fragment_A(sDS);    // (MMA, MMA_M, MMA_K, buffer)
    Tensor tQrKt = thr_dq.partition_fragment_B(sKt);    // (MMA, MMA_N, MMA_K)
    // dS^T's stores (stmatrix, addresses computed before the swizzle: cheap per-element offsets).
    auto ds_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto ds_copy_thread = ds_copy.get_thread_slice(thread);
    Tensor tDSsDSt = ds_copy_thread.partition_D(as_position_independent_swizzle_tensor(sDSt));  // (CPY, M, N, buffer)
    // kSplitHeadDim: P^T's stores, and dV's and dK's A operands from shared memory.
    auto [tPsPt, tKVsPt, tKVsDSt] = [&] {
      if constexpr (kSplit) {
        return cute::make_tuple(ds_copy_thread.partition_D(as_position_independent_swizzle_tensor(sPt)),
                                thr_kv.partition_fragment_A(sPt),  // (MMA, MMA_M, MMA_K, buffer)
                                thr_kv.partition_fragment_A(sDSt));
      } else {
        return cute::make_tuple(0, 0, 0);
      }
    }();

    // (key, query) within the tile of every score the thread holds, as (rows, cols).
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    Tensor s_coords = make_tensor(tScS.data(), accumulator_rowcol(tScS.layout()));
    constexpr int kRows = decltype(size<0>(s_coords))::value, kCols = decltype(size<1>(s_coords))::value;


    const int n0 = n_block * kBlockN;
    const bool softcapped = p.softcap > 0.f;
    // Every score of keys [n0, n0 + kBlockN) x queries [m0, m0 + kBlockM) exists and is seen
    // (queries past Sq need no test: their lse is +inf, so P = 0).
    auto tile_is_interior = [&](int m0) {
      return n0 + kBlockN <= p.kv_len && p.mask.key_begin(m0 + kBlockM - 1) <= n0 &&
             p.mask.key_end(m0) >= n0 + kBlockN;
    };

    // Each step's dQ partial goes, in register order, into this warp group's half of a staging
    // buffer as soon as its product completes (while the tensor cores run the step's dK); the dQ
    // writer reduce-adds the buffer once both warp groups have filled it, and frees it once read.
    // With kSplitHeadDim the threads add it, in the same order, into the workspace themselves.
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    auto hand_on_dq = [&](float* partial, auto store) {  // partial: this warp group's half
      static_assert(decltype(size(tdQrdQ))::value % 4 == 0);
      partial += consumer_group * Traits::kDqFloatsPerWarpGroup;
      CUTE_UNROLL
      for (int e = 0; e < size(tdQrdQ); e += 4) {
        store(reinterpret_cast<float4*>(partial + (e / 4 * 128 + group_thread) * 4),
              make_float4(tdQrdQ(e), tdQrdQ(e + 1), tdQrdQ(e + 2), tdQrdQ(e + 3)));
      }
    };
    auto write_dq = cutlass::make_producer_start_state<PipelineDq>();

    typename Traits::PipelineState read;
    if (tiles > 0) storage.barrier_kv.wait(0);
    for (int t = 0; t < tiles; ++t) {
      const int head = kv_head * p.group + t / blocks.count;
      const int m_block = blocks.first + t % blocks.count;
      const int m0 = m_block * kBlockM;
      const int stage = read.index(), buffer = t & 1;

      Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      Tensor s = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));
      Tensor dp = make_tensor(tSrdP.data(), accumulator_rowcol(tSrdP.layout()));
      pipeline_q.consumer_wait(read);
      detail::warpgroup_gemm</*kZeroInit=*/true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
      pipeline_dout.consumer_wait(read);
      detail::warpgroup_gemm</*kZeroInit=*/true, -1>(mma_sdp, tSrV, tSrdO(_, _, _, stage), tSrdP);

      const float* lse = storage.lse_log2[stage];
      const float* delta = storage.delta[stage];
      // P^T and dS^T in the input dtype: register operands of the dV and dK products, live until
      // those complete.
      Tensor p_regs = make_tensor<Element>(tSrS.layout());
      Tensor ds_regs = make_tensor<Element>(tSrdP.layout());
      Tensor p_rowcol = make_tensor(p_regs.data(), accumulator_rowcol(p_regs.layout()));
      // Whether score (r, c) is hidden: key j = n0 + row, query i = m0 + col is seen iff j < Sk and
      // the diagonal j - i lies in [offset - left, offset + right] (attention_mask.h; a side < 0 is
      // unbounded, and the mask's clamps to [0, Sk) only matter for j >= Sk). Row and column
      // offsets within the thread's fragment are compile-time, so a test is an add and compares.
      const int row0 = get<0>(s_coords(0, 0)), col0 = get<1>(s_coords(0, 0));
      const int diagonal0 = (n0 + row0) - (m0 + col0);
      const int diagonal_lo = p.mask.left < 0 ? INT_MIN / 2 : p.mask.offset() - p.mask.left;
      const int diagonal_hi = p.mask.right < 0 ? INT_MAX / 2 : p.mask.offset() + p.mask.right;
      const int rows_left = p.kv_len - n0 - row0;  // rows r with row offset below this exist
      auto hidden = [&](int r, int c) {
        const int dr = get<0>(s_coords(r, c)) - row0, dc = get<1>(s_coords(r, c)) - col0;
        const int diagonal = diagonal0 + dr - dc;
        return dr >= rows_left || diagonal < diagonal_lo || diagonal > diagonal_hi;
      };
      // P^T while dP^T is still being multiplied, and dV's product while dS^T is formed. With the
      // softcap, c = softcap tanh(scale S / softcap) and dS^T needs tanh's slope: the scores'
      // registers keep P^T times that slope for dS^T = (P^T slope) (dP^T - delta), P^T itself goes
      // to the dV product's operand. A hidden score gives P = dS = 0 (also where dP is NaN).
      auto probabilities = [&](auto masked, auto capped) {
        constexpr bool kMasked = decltype(masked)::value, kCapped = decltype(capped)::value;
        const float inv_cap = kCapped ? p.scale / p.softcap : 0.f;
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) {
          const float lse_c = lse[get<1>(s_coords(0, c))];
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) {
            float prob, slope = 1.f;
            if constexpr (kCapped) {
              constexpr float kLog2e = 1.4426950408889634f;
              const float th = tanhf(s(r, c) * inv_cap);
              prob = fast_exp2(fmaf(p.softcap * th, kLog2e, -lse_c));
              slope = 1.f - th * th;
            } else {
              prob = fast_exp2(fmaf(s(r, c), p.scale_log2, -lse_c));
            }
            if constexpr (kMasked) prob = hidden(r, c) ? 0.f : prob;
            if constexpr (kCapped) p_rowcol(r, c) = static_cast<Element>(prob);
            s(r, c) = kCapped ? prob * slope : prob;
          }
        }
      };
      auto score_gradients = [&](auto masked) {
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) {
          const float delta_c = delta[get<1>(s_coords(0, c))];
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) {
            const float dscore = s(r, c) * (dp(r, c) - delta_c);
            dp(r, c) = decltype(masked)::value && hidden(r, c) ? 0.f : dscore;
          }
        }
      };
      const bool interior = tile_is_interior(m0);
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      if (!softcapped) {
        if (interior) probabilities(cute::false_type{}, cute::false_type{});
        else probabilities(cute::true_type{}, cute::false_type{});
        p_regs = convert_fragment<Element>(tSrS);  // P^T = the scores' registers: one pack per pair
      } else {
        if (interior) probabilities(cute::false_type{}, cute::true_type{});
        else probabilities(cute::true_type{}, cute::true_type{});
      }
      if constexpr (kSplit) {
        copy(ds_copy, ds_copy_thread.retile_S(p_regs), tPsPt(_, _, _, buffer));
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(kConsumerThreads, static_cast<uint32_t>(BackwardBarrier::kPReady));
        detail::warpgroup_gemm</*kZeroInit=*/false, -1>(mma_kv, tKVsPt(_, _, _, buffer), tKVrdOt(_, _, _, stage),
                                                       tdVrdV);
      } else {
        detail::warpgroup_gemm</*kZeroInit=*/false, -1>(
            mma_kv, make_tensor(p_regs.data(), accumulator_as_a_operand(tSrS.layout())), tKVrdOt(_, _, _, stage),
            tdVrdV);
      }
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrdP);
      if (interior) score_gradients(cute::false_type{});
      else score_gradients(cute::true_type{});

      // dS^T: to registers for dK, to shared memory (as dS) for dQ (with kSplitHeadDim for dK as
      // well). Each 8 x 8 block of the accumulator is 8 keys x 8 adjacent queries, and a key's
      // queries are contiguous in dS's rows: stmatrix writes four such blocks per instruction.
      ds_regs = convert_fragment<Element>(tSrdP);
      copy(ds_copy, ds_copy_thread.retile_S(ds_regs), tDSsDSt(_, _, _, buffer));
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(kConsumerThreads, static_cast<uint32_t>(BackwardBarrier::kDsReady));

      // dQ before dK: the products complete in order, so dQ's partial is staged while dK runs.
      detail::warpgroup_gemm</*kZeroInit=*/true, -1>(mma_dq, tQrdS(_, _, _, buffer), tQrKt, tdQrdQ);
      if constexpr (kSplit) {
        detail::warpgroup_gemm</*kZeroInit=*/false, -1>(mma_kv, tKVsDSt(_, _, _, buffer), tKVrQt(_, _, _, stage),
                                                       tdKrdK);
      } else {
        detail::warpgroup_gemm</*kZeroInit=*/false, -1>(
            mma_kv, make_tensor(ds_regs.data(), accumulator_as_a_operand(tSrdP.layout())), tKVrQt(_, _, _, stage),
            tdKrdK);
      }
      warpgroup_wait<1>();
      warpgroup_fence_operand(tdQrdQ);
      if constexpr (kSplit) {
        const int64_t chunk = (static_cast<int64_t>(batch) * p.q_heads + head) * p.m_blocks + m_block;
        hand_on_dq(p.dq_accum + chunk * Traits::kDqFloats, [](float4* sum, float4 v) { atomicAdd(sum, v); });
      } else {
        pipeline_dq.producer_acquire(write_dq);
        hand_on_dq(storage.dq.buffer[write_dq.index()], [](float4* staged, float4 v) { *staged = v; });
        cutlass::arch::fence_view_async_shared();  // the staging stores, before the writer's bulk reduce
        pipeline_dq.producer_commit(write_dq);
        ++write_dq;
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(tdVrdV);
      warpgroup_fence_operand(tdKrdK);
      if constexpr (!kSplit) {
        warpgroup_fence_operand(p_regs);
        warpgroup_fence_operand(ds_regs);
      }
      pipeline_q.consumer_release(read);
      pipeline_dout.consumer_release(read);
      ++read;

    }
  }
};

}  // namespace trainscale::ops::attention
