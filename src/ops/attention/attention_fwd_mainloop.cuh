// Mainloop of the attention forward, both roles of the warp-specialized CTA.
//
// Producer (one warp of the producer warp group, one elected lane issuing): per tile, the Q tile
// through TMA onto its own transaction barrier, then the tile's K and V blocks, last block first,
// into the `kStages`-deep K and V pipelines (PipelineTmaAsync: a full barrier the TMA completes and
// an empty barrier the consumers release). Q is reloaded only after the consumers signal
// (named barrier kQueryEmpty) that the previous tile's last QK^T GEMM is done. With each Q goes
// the index of the CTA's tile after it (SharedStorage::next_tile, attention_tile_scheduler.cuh).
//
// Consumers (block_m / 64 warp groups, 64 query rows each), per key block:
//   S = Q K^T (wgmma, both from shared memory) -> release K -> softcap -> mask -> online softmax
//   (P in registers, the sums rescaled) -> O += P V (wgmma with P from registers) -> release V,
// with the P V product of one block in flight while the softmax of the next runs (the consumer
// loop in attention_fwd_kernel.cuh).
// A query block visits only the key blocks its mask lets it see (attention_mask.h), from the last
// to the first, so the blocks that need a mask (the tail past Sk and, causal, those crossing the
// diagonal) come first.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/wgmma.cuh"
#include "ops/attention/attention_fwd_traits.cuh"
#include "ops/attention/attention_mask.h"
#include "ops/attention/attention_softmax.cuh"
#include "ops/attention/attention_tile_scheduler.cuh"

namespace trainscale::ops::attention {

// Named barriers of the forward kernel (ids after CUTLASS's reserved ones).
enum class ForwardBarrier : uint32_t {
  kQueryEmpty = 0,  // consumers -> producer: the Q tile may be overwritten
};

template <class Traits>
struct ForwardParams {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::ShapeQKV shape_q;   // (Sq, D, Hq, B)
  typename Traits::ShapeQKV shape_kv;  // (Sk, D, Hkv, B)
  void* out;                           // [B, Sq, Hq, D], D contiguous
  int64_t out_stride_b, out_stride_s, out_stride_h;
  int out_vector;  // adjacent output elements one store may write: 8 (16 bytes), 2 or 1, as the output's alignment allows
  float* lse;              // [B, Hq, Sq] or null
  int q_len, kv_len, q_heads, group;
  float scale_log2;      // |scale| * log2(e)
  float abs_scale;       // |scale|
  bool negate_scores;    // scale < 0
  // Softcap in the units of the unscaled (sign-adjusted) scores s: s <- cap * tanh(s / cap) with
  // cap = softcap / |scale|, so that |scale| s becomes softcap * tanh(|scale| s / softcap). 0: off.
  float softcap_unscaled;
  AttentionMask<int> mask;  // read when Traits::kMasked
  TileScheduler scheduler;
};

// The key blocks (of block_n) a query block sees: [first, last).
struct KeyBlocks {
  int first, last;
};
template <class Traits>
__device__ __forceinline__ KeyBlocks key_blocks(const ForwardParams<Traits>& p, int m_block) {
  int begin = 0, end = p.kv_len;
  if constexpr (Traits::kMasked) {
    const int first_row = m_block * Traits::kBlockM;
    begin = p.mask.key_begin(first_row);
    end = p.mask.key_end(min(first_row + Traits::kBlockM, p.q_len) - 1);
  }
  if (end <= begin) return {0, 0};  // no query of the block sees a key
  return {begin / Traits::kBlockN, (end + Traits::kBlockN - 1) / Traits::kBlockN};
}

template <class Traits>
struct ForwardProducer {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;

  // Runs on all 32 lanes of the producer warp; lane 0 issues.
  template <class SharedStorage>
  __device__ static void run(const ForwardParams<Traits>& p, SharedStorage& storage,
                             typename Traits::PipelineKV& pipeline_k,
                             typename Traits::PipelineKV& pipeline_v) {
    using namespace cute;
    const bool leader = threadIdx.x % 32 == 0;
    if (leader) {
      prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    }
    Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutV{});
    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q);
    Tensor mK = p.tma_k.get_tma_tensor(p.shape_kv);
    Tensor mV = p.tma_v.get_tma_tensor(p.shape_kv);

    auto write = cutlass::make_producer_start_state<typename Traits::PipelineKV>();
    bool first_tile = true;
    for (int64_t t = p.scheduler.first(); p.scheduler.valid(t);) {
      const AttentionTile tile = p.scheduler.tile(t);
      const KeyBlocks blocks = key_blocks(p, tile.m_block);
      const int kv_head = tile.head / p.group;
      // The CTA's tile after this one, decided now (a dynamic claim's latency hides behind the
      // consumers' work) and handed to them with this tile's Q.
      int64_t next = leader ? p.scheduler.claim_next(t) : 0;
      next = __shfl_sync(0xffffffffu, next, 0);

      Tensor gQ = local_tile(mQ(_, _, tile.head, tile.batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                             make_coord(tile.m_block, _0{}));  // (M, D)
      Tensor gK = local_tile(mK(_, _, kv_head, tile.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                             make_coord(_, _0{}));  // (N, D, n)
      Tensor gV = local_tile(mV(_, _, kv_head, tile.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                             make_coord(_, _0{}));
      auto [tQgQ, tQsQ] = tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                        group_modes<0, 2>(gQ));
      auto [tKgK, tKsK] = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                        group_modes<0, 2>(gK));  // (TMA, n), (TMA, stage)
      auto [tVgV, tVsV] = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                        group_modes<0, 2>(gV));

      auto load_k = [&](int n_block) {
        pipeline_k.producer_acquire(write);
        copy(p.tma_k.with(*pipeline_k.producer_get_barrier(write)), tKgK(_, n_block),
             tKsK(_, write.index()));
      };
      auto load_v = [&](int n_block) {
        pipeline_v.producer_acquire(write);
        copy(p.tma_v.with(*pipeline_v.producer_get_barrier(write)), tVgV(_, n_block),
             tVsV(_, write.index()));
      };

      // The first K block goes out before waiting for the Q buffer, so the previous tile's tail
      // hides its latency.
      if (blocks.last > blocks.first && leader) load_k(blocks.last - 1);
      __syncwarp();  // the barrier below is warp-aligned
      if (!first_tile) {
        cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads + 32,
                                          static_cast<uint32_t>(ForwardBarrier::kQueryEmpty));
      }
      first_tile = false;
      if (leader) {
        // The consumers read it once this arrival (release) completes the Q barrier's phase; the
        // previous value was read before they released the Q buffer (kQueryEmpty above).
        *reinterpret_cast<volatile int64_t*>(&storage.next_tile) = next;
        asm volatile("" ::: "memory");
        storage.barrier_q.arrive_and_expect_tx(Traits::kTmaBytesQ);
        copy(p.tma_q.with(reinterpret_cast<uint64_t&>(storage.barrier_q)), tQgQ, tQsQ);
      }
      if (leader && blocks.last > blocks.first) {
        load_v(blocks.last - 1);
        ++write;
        for (int n_block = blocks.last - 2; n_block >= blocks.first; --n_block) {
          load_k(n_block);
          load_v(n_block);
          ++write;
        }
      }
      __syncwarp();
      t = next;
    }
    // Leave only once the consumers have released every buffer.
    if (leader) {
      pipeline_k.producer_tail(write);
      pipeline_v.producer_tail(write);
    }
  }
};

template <class Traits>
struct ForwardConsumer {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;

  // Scores of keys a row does not see -> -inf: keys past Sk and, masked, keys outside the row's
  // [key_begin, key_end) (attention_mask.h).
  template <class TensorS, class TensorC>
  __device__ __forceinline__ static void mask(const ForwardParams<Traits>& p, TensorS& s,
                                              const TensorC& coords, int m_block, int n_block) {
    using namespace cute;
    const int row0 = m_block * kBlockM, col0 = n_block * kBlockN;
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      int begin = 0, end = p.kv_len;
      if constexpr (Traits::kMasked) {
        const int row = row0 + get<0>(coords(r, 0));
        begin = p.mask.key_begin(row);
        end = p.mask.key_end(row);
      }
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        const int col = col0 + get<1>(coords(r, c));
        if (col < begin || col >= end) s(r, c) = -INFINITY;
      }
    }
  }

  // Whether key block n_block of query block m_block holds a masked score. The mask's key range
  // moves right with the row, so the block's first row bounds the end and its last row the start.
  __device__ __forceinline__ static bool needs_mask(const ForwardParams<Traits>& p, int m_block,
                                                    int n_block) {
    const int begin = n_block * kBlockN, end = begin + kBlockN;  // the block's keys
    if (end > p.kv_len) return true;
    if constexpr (Traits::kMasked) {
      const int first_row = m_block * kBlockM;
      return p.mask.key_end(first_row) < end || p.mask.key_begin(first_row + kBlockM - 1) > begin;
    }
    return false;
  }

  // The softcap on the unscaled scores (ForwardParams::softcap_unscaled), before the mask.
  template <class TensorS>
  __device__ __forceinline__ static void softcap(const ForwardParams<Traits>& p, TensorS& s) {
    const float cap = p.softcap_unscaled, inv_cap = 1.f / cap;
    CUTE_UNROLL
    for (int i = 0; i < cute::size(s); ++i) s(i) = cap * fast_tanh(s(i) * inv_cap);
  }
};

}  // namespace trainscale::ops::attention
