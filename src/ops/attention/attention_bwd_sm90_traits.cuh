// Compile-time description of the Hopper (sm_90a) attention backward for one dtype and head dim:
// the three tiled wgmma's, the swizzled shared-memory tiles with the transposed views the products
// read, the TMA loads, the Q and dO pipelines and the shared storage.
//
// A CTA owns block_n keys of one kv head and walks block_m queries at a time. Per query block:
//   S^T = K Q^T, dP^T = V dO^T   (keys x queries; A and B from shared memory)
//   dV += P^T dO, dK += dS^T Q   (keys x D; dO^T / Q^T MN-major)
//   dQ  = dS K                   (queries x D; dS from shared memory, the warp groups split D)
// Up to D = 128 the kBlockN / 64 consumer warp groups own 64 keys each: P^T and dS^T stay in the
// registers as the dV / dK products' A operands (working in S^T keeps them in that layout). Above
// (kSplitHeadDim), dK and dV of 64 keys x D no longer fit one warp group's registers: a CTA owns
// 64 keys, its two warp groups split the queries of S^T / dP^T and the head dim of dV, dK and dQ,
// P^T joins dS^T in shared memory as the A operand of both products, and dQ's partials are added
// to the workspace by atomics from the registers (a staging buffer does not fit beside two Q and
// dO stages).
#pragma once

#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#error "define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED before any CuTe header (attention_bwd_launch.cuh does)"
#endif

#include <type_traits>

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

  static constexpr bool kSplitHeadDim = kHeadDim > 128;
  static constexpr int kConsumerWarpGroups = kSplitHeadDim ? 2 : kBlockN / 64;
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
  static_assert(kHeadDim % 64 == 0 && (kBlockM == 64 || (!kSplitHeadDim && kBlockM == 64 * kConsumerWarpGroups)),
                "128-byte swizzle rows; 64 queries per step, or 64 per consumer warp group");
  static_assert(!kSplitHeadDim || kBlockN == 64, "split head dim: one block of 64 keys");
  static_assert(sizeof(Element) == 2);

  using Keys = cute::Layout<cute::Shape<cute::Int<kConsumerWarpGroups>, cute::_1, cute::_1>>;
  using Columns = cute::Layout<cute::Shape<cute::_1, cute::Int<kConsumerWarpGroups>, cute::_1>>;
  // The warp groups' split of S^T / dP^T and of dV / dK: keys, or (kSplitHeadDim) columns.
  using KeysOrColumns = std::conditional_t<kSplitHeadDim, Columns, Keys>;
  static constexpr int kSdPColumns = kSplitHeadDim ? kBlockM / kConsumerWarpGroups : kBlockM;
  static constexpr int kKvColumns = kSplitHeadDim ? kHeadDim / kConsumerWarpGroups : kHeadDim;
  // S^T and dP^T: (keys, queries, D), K-major operands.
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kSdPColumns>, cute::Int<kHeadDim>>>(),
      KeysOrColumns{}));
  // dV and dK: (keys, D, queries), A (P^T, dS^T) from registers or (kSplitHeadDim) from shared
  // memory (queries contiguous: K-major), B (dO^T, Q^T) MN-major.
  using KvAtom = std::conditional_t<
      kSplitHeadDim,
      decltype(cute::GMMA::ss_op_selector<Element, Element, float,
                                          cute::Shape<cute::_64, cute::Int<kKvColumns>, cute::Int<kBlockM>>,
                                          cute::GMMA::Major::K, cute::GMMA::Major::MN>()),
      decltype(cute::GMMA::rs_op_selector<Element, Element, float,
                                          cute::Shape<cute::_64, cute::Int<kKvColumns>, cute::Int<kBlockM>>,
                                          cute::GMMA::Major::K, cute::GMMA::Major::MN>())>;
  using TiledMmaKV = decltype(cute::make_tiled_mma(KvAtom{}, KeysOrColumns{}));
  // dQ: (queries, D, keys); dS stored queries-contiguous (MN-major), K^T MN-major. With 64
  // queries per step each warp group takes D / kConsumerWarpGroups columns; with 64 per warp
  // group, its own 64 queries and every column (a product kConsumerWarpGroups times wider).
  static constexpr bool kDqSplitsQueries = kBlockM == 64 * kConsumerWarpGroups;
  static constexpr int kDqColumns = kDqSplitsQueries ? kHeadDim : kHeadDim / kConsumerWarpGroups;
  using TiledMmaDQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kDqColumns>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
      std::conditional_t<kDqSplitsQueries, Keys, Columns>{}));
  static_assert(decltype(cute::size<1>(typename TiledMmaSdP::AtomShape_MNK{}))::value == kSdPColumns);
  static_assert(decltype(cute::size<1>(typename TiledMmaKV::AtomShape_MNK{}))::value == kKvColumns);
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
  // dS (and with kSplitHeadDim P): (queries, keys, buffer), queries contiguous; dS^T (keys,
  // queries, buffer) is how the consumers write it and (kSplitHeadDim) how dK reads it.
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
  // The dQ partial of one query block, fp32, in the order the consumer threads hold it (in the
  // staging buffer and in the workspace).
  static constexpr int kDqFloats = kBlockM * kHeadDim;
  static constexpr int kDqFloatsPerWarpGroup = kDqFloats / kConsumerWarpGroups;

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  // The dQ partials' staging: the consumer threads fill a buffer, the dQ warp reduce-adds it.
  using PipelineDq = cutlass::PipelineAsync<2>;

  struct Absent {};
  struct DqStaging {
    alignas(128) float buffer[2][kDqFloats];  // the dQ partials, double-buffered
  };
  using PBuffers = cute::array_aligned<Element, cute::cosize_v<SmemLayoutDS>, 1024>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> dout;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutDS>> ds;
    [[no_unique_address]] std::conditional_t<kSplitHeadDim, PBuffers, Absent> p;  // P^T, as dS
    [[no_unique_address]] std::conditional_t<kSplitHeadDim, Absent, DqStaging> dq;
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
