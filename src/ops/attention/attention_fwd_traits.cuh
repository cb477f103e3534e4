// Compile-time description of one attention forward variant: element type, tile shapes, the
// warp-group split, the two tiled wgmma's, the swizzled shared-memory layouts of Q, K and V, the
// K/V pipelines and the shared storage. Everything the mainloop, epilogue and kernel agree on.
#pragma once

#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#error "define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED before any CuTe header (attention_fwd_launch.cuh does)"
#endif

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "ops/attention/attention_heuristics.h"

namespace trainscale::ops::attention {

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kMasked_,
          bool kOverlap_>
struct ForwardTraits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  using Accum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kMasked = kMasked_;    // causal or a sliding window
  static constexpr bool kOverlap = kOverlap_;  // ForwardPlan::overlap

  static constexpr int kConsumerWarpGroups = kBlockM / 64;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpGroups;
  static constexpr int kThreads = kConsumerThreads + 128;  // + the producer warp group
  // Registers after setmaxnreg: the producer gives its share to the consumers. The pool is what
  // the CTA was launched with (__launch_bounds__(kThreads, 1): 64K / kThreads per thread, in
  // multiples of 8, i.e. 168 for 384 threads, not 170); asking setmaxnreg for more than the pool
  // holds blocks forever, so the sum must fit it exactly.
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegisters = kConsumerWarpGroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegisters = kConsumerWarpGroups == 2 ? 240 : 160;
  static_assert(kProducerRegisters + kConsumerWarpGroups * kConsumerRegisters <=
                kLaunchRegisters * (kConsumerWarpGroups + 1));

  static_assert(kBlockM % 64 == 0 && kConsumerWarpGroups >= 1 && kConsumerWarpGroups <= 3);
  static_assert(kHeadDim % 64 == 0, "128-byte swizzle rows");
  static_assert(kBlockN % 16 == 0, "the PV GEMM takes keys 16 at a time");
  static_assert(sizeof(Element) == 2);

  // S = Q K^T: (M, N, K) = (block_m, block_n, D); O += P V: (block_m, D, block_n).
  using TileShapeQK = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using TileShapePV = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>;
  // The consumer warp groups split the M dim, 64 rows each.
  using AtomLayout = cute::Layout<cute::Shape<cute::Int<kConsumerWarpGroups>, cute::_1, cute::_1>>;
  // Q and K from shared memory, both K-major (D contiguous).
  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, Accum,
                                 cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>>(),
      AtomLayout{}));
  // P from registers (the softmax output, never stored), V from shared memory; V is stored as
  // it lies in memory (D contiguous), which is MN-major for this GEMM (N = D).
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, Accum,
                                 cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      AtomLayout{}));

  // One wgmma atom spans the whole tile in N (a narrower atom would be a silent slowdown).
  static_assert(decltype(cute::size<1>(typename TiledMmaQK::AtomShape_MNK{}))::value == kBlockN);
  static_assert(decltype(cute::size<1>(typename TiledMmaPV::AtomShape_MNK{}))::value == kHeadDim);

  // 128-byte swizzled tiles (8 rows x 64 elements per atom), the layouts TMA writes and wgmma
  // reads without bank conflicts.
  using SmemAtomK = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(SmemAtomK{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemAtomK{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  // V^T (D, block_n, stage) as the PV GEMM reads it: MN-major atoms (64 contiguous D x 8 keys),
  // keys tiled first; V (block_n, D, stage), what TMA writes, is the same memory transposed.
  using SmemAtomVt = cute::GMMA::Layout_MN_SW128_Atom<Element>;
  using SmemLayoutVt = decltype(cute::tile_to_shape(
      SmemAtomVt{}, cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{},
      cute::Step<cute::_2, cute::_1, cute::_3>{}));
  using SmemLayoutV = decltype(cute::composition(
      SmemLayoutVt{},
      cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{},
                        cute::Stride<cute::Int<kHeadDim>, cute::_1, cute::Int<kHeadDim * kBlockN>>{})));

  // Global Q/K/V as (S, D, H, B) with D contiguous: the TMA descriptors' view of a BSHD tensor.
  using ShapeQKV = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using TmaQ = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), ShapeQKV{},
                        StrideQKV{}),
      SmemLayoutQ{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}, cute::_1{}));
  using TmaK = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), ShapeQKV{},
                        StrideQKV{}),
      cute::take<0, 2>(SmemLayoutK{}), cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{},
      cute::_1{}));
  using TmaV = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), ShapeQKV{},
                        StrideQKV{}),
      cute::take<0, 2>(SmemLayoutV{}), cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{},
      cute::_1{}));

  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);

  // K and V flow through separate pipelines so the QK^T GEMM of a block starts as soon as its K
  // lands, while V is still in flight.
  using PipelineKV = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename PipelineKV::PipelineState;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>> v;
    alignas(16) typename PipelineKV::SharedStorage pipeline_k;
    alignas(16) typename PipelineKV::SharedStorage pipeline_v;
    alignas(8) cutlass::arch::ClusterTransactionBarrier barrier_q;  // Q landed (one per tile)
    std::int64_t next_tile;  // the CTA's tile after the one whose Q landed (TileScheduler)
  };
  static constexpr int kSharedBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSharedBytes <= 227 * 1024, "exceeds the 227 KiB of shared memory per CTA");
};

// The traits of a plan.
template <class Element, int kHeadDim, bool kMasked>
using PlanTraits = ForwardTraits<Element, kHeadDim, forward_plan(kHeadDim, kMasked).block_m,
                                 forward_plan(kHeadDim, kMasked).block_n,
                                 forward_plan(kHeadDim, kMasked).stages, kMasked,
                                 forward_plan(kHeadDim, kMasked).overlap>;

}  // namespace trainscale::ops::attention
