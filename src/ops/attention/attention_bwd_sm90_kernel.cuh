// The Hopper (sm_90a) attention backward: one warp-specialized CTA per (batch, kv head, key
// block) computes dK and dV of its keys in registers over the query heads of its GQA group and
// the query blocks that see its keys, and adds each query block's dQ partial into an fp32
// workspace (a bulk asynchronous reduce-add from shared memory); a postprocess kernel scales and
// converts dQ. The products and tiles: attention_bwd_sm90_traits.cuh; the roles:
// attention_bwd_sm90_mainloop.cuh; dK/dV and the postprocess: attention_bwd_sm90_epilogue.cuh.
//
//   producer (one warp)  K and V once; per step Q + lse and dO + delta through two TMA pipelines.
//   dQ writer (one warp): per query block, once the consumers staged its dQ partial, one bulk
//                         asynchronous reduce-add of it into the workspace.
//   consumers (2 warp groups, 64 keys each), per query block:
//     S^T, dP^T (wgmma) -> P^T = exp2(S^T scale log2e - lse log2e) -> dV += P^T dO (P^T from
//     registers) -> dS^T = P^T (dP^T - delta) -> dS^T to shared memory (stmatrix) ->
//     dQ = dS K, then dK += dS^T Q -> dQ's partial staged (double-buffered) while dK runs, and
//     handed to the dQ writer.
//   With kSplitHeadDim (D 256; attention_bwd_sm90_traits.cuh) the two warp groups take 32
//   queries each of S^T and dP^T and half the head dim of dV, dK and dQ: P^T goes to shared
//   memory too (both warp groups' halves before dV), and each thread adds its dQ partial to the
//   workspace by float4 atomics while dK runs; no dQ writer.
//
// dQ's partials arrive in any order by default. In the deterministic mode (not with
// kSplitHeadDim, whose launcher refuses it) each (query head, query block) has a counter in the
// workspace and the key blocks add their partials in key-block order: the dQ writer of key block
// n waits until every earlier key block that sees the query block has added its part (CTAs
// start in blockIdx order, and backward_cta numbers a head's earlier key blocks first, so the
// ones waited for are running or done).
//
// The scores' scale and softcap enter as in the sm_80 kernels (attention_bwd_kernel.cuh): dS
// leaves out the factor scale, which the epilogue (dK) and the postprocess (dQ) apply.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "ops/attention/attention_bwd_sm90_epilogue.cuh"
#include "ops/attention/attention_bwd_sm90_mainloop.cuh"

namespace trainscale::ops::attention {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    attention_backward_sm90_kernel(const __grid_constant__ BackwardSm90Params<Traits> p) {
#if TS_ATTENTION_BWD_SM90_BODY
  using namespace cute;
  using SharedStorage = typename Traits::SharedStorage;
  using Pipeline = typename Traits::Pipeline;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kConsumerThreads = Traits::kConsumerThreads;

  extern __shared__ __align__(1024) char smem[];
  SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem);
  const int warp_group = threadIdx.x / 128;

  const BackwardCta cta = backward_cta(blockIdx.x, (p.kv_len + kBlockN - 1) / kBlockN, p.kv_heads, p.batch,
                                       p.key_blocks_outermost);
  const int n_block = cta.n_block, kv_head = cta.kv_head, batch = cta.batch;
  const QueryBlocks blocks = query_blocks(p, n_block);

  if (threadIdx.x == 0) storage.barrier_kv.init(1);
  typename Pipeline::Params pipeline_params;
  pipeline_params.transaction_bytes = Traits::kTmaBytesRows;
  pipeline_params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipeline_params.is_leader = threadIdx.x == 0;
  pipeline_params.num_consumers = kConsumerThreads;
  Pipeline pipeline_q(storage.pipeline_q, pipeline_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_dout(storage.pipeline_dout, pipeline_params, Shape<_1, _1, _1>{});
  using PipelineDq = typename Traits::PipelineDq;
  typename PipelineDq::Params dq_params;
  dq_params.role = warp_group == 0 ? PipelineDq::ThreadCategory::Consumer : PipelineDq::ThreadCategory::Producer;
  dq_params.producer_arv_count = kConsumerThreads;  // every consumer thread stages part of a partial
  dq_params.consumer_arv_count = 1;                 // the dQ warp's lane 0
  PipelineDq pipeline_dq(storage.pipeline_dq, dq_params);
  __syncthreads();  // barriers initialized before any thread uses them

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (threadIdx.x / 32 == 0) {
      BackwardSm90Producer<Traits>::run(p, storage, pipeline_q, pipeline_dout, batch, kv_head, n_block, blocks);
    } else if (threadIdx.x / 32 == 1) {
      if constexpr (!Traits::kSplitHeadDim) {
        BackwardSm90DqWriter<Traits>::run(p, storage, pipeline_dq, batch, kv_head, n_block, blocks);
      }
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();

  typename Traits::TiledMmaKV mma_kv;
  Tensor tdVrdV = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tdKrdK = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(tdVrdV);
  clear(tdKrdK);
  BackwardSm90Consumer<Traits>::run(p, storage, pipeline_q, pipeline_dout, pipeline_dq, batch, kv_head, n_block,
                                    blocks, tdVrdV, tdKrdK);
  BackwardSm90Epilogue<Traits>::store_dk_dv(p, tdVrdV, tdKrdK, batch, kv_head, n_block);
#else
  (void)p;
#endif
}

}  // namespace trainscale::ops::attention
