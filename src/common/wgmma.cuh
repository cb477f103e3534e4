// Warp-group GEMM on Hopper's wgmma through CuTe's SM90 GMMA atoms (needs the CUTLASS headers):
// one call issues every k-block of a tile as one asynchronous batch. Operands come from
// `thr_mma.partition_fragment_A/B` (shared-memory descriptors, or registers for A) and the
// accumulator from `partition_fragment_C`.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

namespace trainscale::detail {

// C (+)= A B over all k-blocks. kZeroInit: C = A B (C's old values are ignored). kWait: the number
// of wgmma batches left in flight on return (-1: do not wait; the caller waits with
// cute::warpgroup_wait<N>() before it reads C).
template <bool kZeroInit, int kWait = 0, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, const TensorA& a, const TensorB& b,
                                               TensorC& c) {
  using namespace cute;
  // A from registers (RS) or shared-memory descriptors (SS).
  constexpr bool kARegisters =
      !is_same_v<typename std::decay_t<TensorA>::iterator, GMMA::DescriptorIterator>;
  if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TensorA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(c);
  if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TensorA&>(a));
}

}  // namespace trainscale::detail
