// Compile-time description of the Hopper (sm_90a) attention backward for one dtype and head dim:
// the three tiled wgmma's, the swizzled shared-memory tiles with the transposed views the products
// read, the TMA loads, the Q and dO pipelines and the shared storage.
//
// A CTA owns block_n keys of one kv head (kBlockN / 64 consumer warp groups, 64 keys each) and
// walks block_m queries at a time. Per query block:
//   S^T = K Q^T, dP^T = V dO^T   (keys x queries; A and B from shared memory)
//   dV += P^T dO, dK += dS^T Q   (keys x D; P^T and dS^T from registers, dO^T / Q^T MN-major)
//   dQ  = dS K                   (queries x D; dS from shared memory, the warp groups split D)
// Working in S^T keeps P^T and dS^T in the layout the dV / dK products take as register operands.
#pragma once

#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#error "define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED before any CuTe header (attention_bwd_launch.cuh does)"
#endif

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

namespace trainscale::ops::attention {

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct BackwardSm90Traits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per step
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr int kStages = kStages_;  // Q / dO buffers in flight

  static constexpr int kConsumerWarpGroups = kBlockN / 64;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpGroups;
  static constexpr int kThreads = kConsumerThreads + 128;  // + the producer warp group
  // As in the forward (attention_fwd_traits.cuh): the producer hands its registers to the
  // consumers; the sum must fit the launch's pool exactly.
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(kConsumerWarpGroups == 2, "the register split above is for two consumer warp groups");
  static_assert(kProducerRegisters + kConsumerWarpGroups * kConsumerRegisters <=
                kLaunchRegisters * (kConsumerWarpGroups + 1));
  static_assert(kHeadDim % 64 == 0 && kBlockM == 64, "128-byte swizzle rows; one MN-major atom of queries");
  static_assert(sizeof(Element) == 2);

  using Keys = cute::Layout<cute::Shape<cute::Int<kConsumerWarpGroups>, cute::_1, cute::_1>>;
  using Columns = cute::Layout<cute::Shape<cute::_1, cute::Int<kConsumerWarpGroups>, cute::_1>>;
  // S^T and dP^T: (keys, queries, D), K-major operands.
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kBlockM>, cute::Int<kHeadDim>>>(),
      Keys{}));
  // dV and dK: (keys, D, queries), A (P^T, dS^T) from registers, B (dO^T, Q^T) MN-major.
  using TiledMmaKV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockM>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      Keys{}));
  // dQ: (queries, D, keys); dS stored queries-contiguous (MN-major), K^T MN-major; each warp
  // group takes D / kConsumerWarpGroups columns.
  static constexpr int kDqColumns = kHeadDim / kConsumerWarpGroups;
  using TiledMmaDQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kDqColumns>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
      Columns{}));
  static_assert(decltype(cute::size<1>(typename TiledMmaSdP::AtomShape_MNK{}))::value == kBlockM);
  static_assert(decltype(cute::size<1>(typename TiledMmaKV::AtomShape_MNK{}))::value == kHeadDim);
  static_assert(decltype(cute::size<1>(typename TiledMmaDQ::AtomShape_MNK{}))::value == kDqColumns);

  using SmemAtomK = cute::GMMA::Layout_K_SW128_Atom<Element>;
  // Q and dO: (queries, D, stage), D contiguous as TMA writes them; (D, queries, stage) views.
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtomK{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>, cute::Int<kStages>>{},
                                       cute::Stride<cute::Int<kBlockM>, cute::_1, cute::Int<kBlockM * kHeadDim>>{})));
  // K and V: (keys, D); K^T: (D, keys).
  using SmemLayoutK =
      decltype(cute::tile_to_shape(SmemAtomK{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutK{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                       cute::Stride<cute::Int<kBlockN>, cute::_1>{})));
  // dS: (queries, keys, stage), queries contiguous; dS^T (keys, queries, stage) is how the
  // consumers write it.
  using SmemLayoutDS = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::_2>{}));
  using SmemLayoutDSt = decltype(cute::composition(
      SmemLayoutDS{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>, cute::_2>{},
                                        cute::Stride<cute::Int<kBlockM>, cute::_1, cute::Int<kBlockM * kBlockN>>{})));

  // Global tensors as (S, D, H, B) with D contiguous (attention_fwd_traits.cuh).
  using ShapeQKV = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)),
                                                ShapeQKV{}, StrideQKV{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                            cute::take<0, 2>(SmemLayoutQ{}),
                                            cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}, cute::_1{}));
  using TmaK = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{},
                                            cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}, cute::_1{}));

  // Per query block: its rows of Q or dO and of the matching row statistic (lse or delta).
  static constexpr uint32_t kStatBytes = kBlockM * sizeof(float);
  static constexpr uint32_t kTmaBytesRows = kBlockM * kHeadDim * sizeof(Element) + kStatBytes;
  static constexpr uint32_t kTmaBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);
  // The dQ partial of one query block, fp32, in the order the consumer threads hold it.
  static constexpr int kDqFloats = kBlockM * kHeadDim;
  static constexpr int kDqFloatsPerWarpGroup = kDqFloats / kConsumerWarpGroups;

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  // The dQ partials' staging: the consumer threads fill a buffer, the dQ warp reduce-adds it.
  using PipelineDq = cutlass::PipelineAsync<2>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> dout;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutDS>> ds;
    alignas(128) float dq[2][kDqFloats];  // staging of the dQ partials, double-buffered
    alignas(16) float lse_log2[kStages][kBlockM];  // lse * log2(e); +inf: the query sees no key
    alignas(16) float delta[kStages][kBlockM];
    alignas(16) typename Pipeline::SharedStorage pipeline_q;
    alignas(16) typename Pipeline::SharedStorage pipeline_dout;
    alignas(16) typename PipelineDq::SharedStorage pipeline_dq;
    alignas(8) cutlass::arch::ClusterTransactionBarrier barrier_kv;  // K and V landed
  };
  static constexpr int kSharedBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSharedBytes <= 227 * 1024, "exceeds the 227 KiB of shared memory per CTA");
};

}  // namespace trainscale::ops::attention
