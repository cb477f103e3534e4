// The Hopper (sm_90a) attention forward kernel: a persistent, warp-specialized CTA of one producer
// warp group (TMA loads; registers given away with setmaxnreg) and block_m / 64 consumer warp
// groups (wgmma + online softmax; registers taken with setmaxnreg), tied together by the Q
// transaction barrier, the K and V pipelines and the kQueryEmpty named barrier
// (attention_fwd_mainloop.cuh). The body is compiled for sm_90a only; other targets get an empty
// kernel that the launcher never starts (it checks the device and the kernel's PTX version first).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "ops/attention/attention_fwd_epilogue.cuh"
#include "ops/attention/attention_fwd_mainloop.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TS_ATTENTION_SM90_BODY 1
#else
#define TS_ATTENTION_SM90_BODY 0
#endif

namespace trainscale::ops::attention {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    attention_forward_kernel(const __grid_constant__ ForwardParams<Traits> p) {
#if TS_ATTENTION_SM90_BODY
  using namespace cute;
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  using PipelineKV = typename Traits::PipelineKV;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;

  extern __shared__ __align__(1024) char smem[];
  SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem);
  const int warp_group = threadIdx.x / 128;

  if (threadIdx.x == 0) storage.barrier_q.init(1);
  typename PipelineKV::Params pipeline_params;
  pipeline_params.transaction_bytes = Traits::kTmaBytesKV;
  pipeline_params.role = warp_group == 0 ? PipelineKV::ThreadCategory::Producer
                                         : PipelineKV::ThreadCategory::Consumer;
  pipeline_params.is_leader = threadIdx.x == 0;
  pipeline_params.num_consumers = Traits::kConsumerThreads;
  PipelineKV pipeline_k(storage.pipeline_k, pipeline_params, Shape<_1, _1, _1>{});
  PipelineKV pipeline_v(storage.pipeline_v, pipeline_params, Shape<_1, _1, _1>{});
  __syncthreads();  // barriers initialized before any thread uses them

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (threadIdx.x / 32 == 0) ForwardProducer<Traits>::run(p, storage, pipeline_k, pipeline_v);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();

  const int thread = threadIdx.x - 128;  // among the consumer threads
  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(thread);
  auto thr_pv = mma_pv.get_thread_slice(thread);

  Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutVt{});
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K) descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)

  // (row, col) within the tile of every accumulator the thread holds, as (rows, cols).
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor s_coords = make_tensor(tScS.data(), accumulator_rowcol(tScS.layout()));
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor o_coords = make_tensor(tOcO.data(), accumulator_rowcol(tOcO.layout()));

  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor o = make_tensor(tOrO.data(), accumulator_rowcol(tOrO.layout()));
  constexpr int kRows = decltype(size<0>(o))::value;

  // K and V advance separately: with the overlap below, V of the previous key block is still
  // being read while K of the next one is.
  typename Traits::PipelineState read_k, read_v;
  uint32_t q_phase = 0;
  for (int64_t t = p.scheduler.first(); p.scheduler.valid(t);) {
    const AttentionTile tile = p.scheduler.tile(t);
    const KeyBlocks blocks = key_blocks(p, tile.m_block);
    clear(tOrO);
    OnlineSoftmax<kRows> softmax(p.scale_log2);
    storage.barrier_q.wait(q_phase);
    q_phase ^= 1;
    const int64_t next = p.scheduler.next_for_consumers(t, storage.next_tile);

    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor s = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));
    float rescale[kRows];
    // Scores of key block n_block -> probabilities (sign, softcap, mask, online softmax).
    auto scores_to_probabilities = [&](int n_block) {
      if (p.negate_scores) {
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) tSrS(i) = -tSrS(i);
      }
      if (p.softcap_unscaled > 0.f) ForwardConsumer<Traits>::softcap(p, tSrS);
      if (ForwardConsumer<Traits>::needs_mask(p, tile.m_block, n_block)) {
        ForwardConsumer<Traits>::mask(p, s, s_coords, tile.m_block, n_block);
      }
      softmax.update(s, rescale);
    };
    auto scores_of = [&](auto wait) {  // S = Q K^T of the next K stage; wait: batches left in flight
      pipeline_k.consumer_wait(read_k);
      detail::warpgroup_gemm</*kZeroInit=*/true, decltype(wait)::value>(mma_qk, tSrQ,
                                                                        tSrK(_, _, _, read_k.index()), tSrS);
    };
    auto accumulate_output = [&](auto& p_regs, auto wait) {  // O += P V of the next V stage
      Tensor tOrP = make_tensor(p_regs.data(), accumulator_as_a_operand(tSrS.layout()));
      pipeline_v.consumer_wait(read_v);
      detail::warpgroup_gemm</*kZeroInit=*/false, decltype(wait)::value>(mma_pv, tOrP,
                                                                         tOrV(_, _, _, read_v.index()), tOrO);
    };
    // Once the tile's last Q K^T product is done, the producer may load the next tile's Q: it
    // then lands while this tile's last softmax, P V product and epilogue run.
    const bool next_tile = p.scheduler.valid(next);
    auto release_q = [&] {
      if (next_tile) {
        cutlass::arch::NamedBarrier::arrive(Traits::kConsumerThreads + 32,
                                            static_cast<uint32_t>(ForwardBarrier::kQueryEmpty));
      }
    };
    auto release_k = [&](int n_block) {  // after the Q K^T product of key block n_block
      pipeline_k.consumer_release(read_k);
      ++read_k;
      if (n_block == blocks.first) release_q();
    };
    auto release_v = [&] { pipeline_v.consumer_release(read_v); ++read_v; };

    // Block n computes O = O * rescale_n + P_n V_n. With Traits::kOverlap, while the tensor
    // cores compute S of key block n and O += P V of block n + 1 (both issued before either is
    // waited on), the warp group waits only for S, runs the softmax of block n on it, then waits
    // for the P V product before rescaling O; without it, each product completes before the next
    // step. Either way the first block's softmax and the last block's P V run alone.
    if (blocks.last > blocks.first) {
      scores_of(cute::Int<0>{});
      release_k(blocks.last - 1);
      scores_to_probabilities(blocks.last - 1);  // O is still zero: no rescale
      auto p_regs = convert_fragment<Element>(tSrS);
      for (int n_block = blocks.last - 2; n_block >= blocks.first; --n_block) {
        if constexpr (Traits::kOverlap) {
          scores_of(cute::Int<-1>{});
          accumulate_output(p_regs, cute::Int<-1>{});
          warpgroup_wait<1>();  // S landed; P V may still run
          warpgroup_fence_operand(tSrS);
          release_k(n_block);
          scores_to_probabilities(n_block);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          release_v();
        } else {
          accumulate_output(p_regs, cute::Int<0>{});
          release_v();
          scores_of(cute::Int<0>{});
          release_k(n_block);
          scores_to_probabilities(n_block);
        }
        OnlineSoftmax<kRows>::rescale_output(o, rescale);
        p_regs = convert_fragment<Element>(tSrS);
      }
      accumulate_output(p_regs, cute::Int<0>{});
      release_v();
    }
    if (blocks.last == blocks.first) release_q();  // no key block: Q was never read
    float lse[kRows];
    softmax.finalize(o, p.abs_scale, lse);
    ForwardEpilogue<Traits>::store(p, tile, o, o_coords, lse);
    t = next;
  }
#else
  (void)p;
#endif
}

}  // namespace trainscale::ops::attention
