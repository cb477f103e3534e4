// The Hopper attention backward's outputs (attention_bwd_sm90_kernel.cuh): dK and dV from the
// consumers' registers at the end of the CTA, and the postprocess kernel that turns the dQ
// workspace into dQ.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "common/wgmma.cuh"
#include "ops/attention/attention_bwd_sm90_mainloop.cuh"

namespace trainscale::ops::attention {

// dK (times the scale) and dV of the CTA's keys, from the consumers' registers in 16-byte stores
// (detail::store_accumulator_row; dk and dv have 16-byte aligned starts and strides:
// check_cuda_backward).
template <class Traits>
struct BackwardSm90Epilogue {
  template <class Accumulator>
  __device__ static void store_dk_dv(const BackwardSm90Params<Traits>& p, const Accumulator& tdVrdV,
                                     const Accumulator& tdKrdK, int batch, int kv_head, int n_block) {
    using namespace cute;
    using Element = typename Traits::Element;
    constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    typename Traits::TiledMmaKV mma_kv;
    auto thr_kv = mma_kv.get_thread_slice(threadIdx.x - 128);  // among the consumer threads
    const int n0 = n_block * kBlockN;
    Tensor tKVcKV = thr_kv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    Tensor kv_coords = make_tensor(tKVcKV.data(), accumulator_rowcol(tKVcKV.layout()));
    Tensor dv = make_tensor(tdVrdV.data(), accumulator_rowcol(tdVrdV.layout()));
    Tensor dk = make_tensor(tdKrdK.data(), accumulator_rowcol(tdKrdK.layout()));
    CUTE_UNROLL
    for (int r = 0; r < size<0>(dv); ++r) {
      const int key = n0 + get<0>(kv_coords(r, 0));
      const bool inside = key < p.kv_len;  // rows past Sk still take part in the shuffles
      auto column_of = [&](int c) { return get<1>(kv_coords(r, c)); };
      detail::store_accumulator_row(p.dv.template row<Element>(batch, inside ? key : 0, kv_head), dv, r, column_of,
                                    1.f, inside);
      detail::store_accumulator_row(p.dk.template row<Element>(batch, inside ? key : 0, kv_head), dk, r, column_of,
                                    p.scale, inside);
    }
  }
};

// dQ = scale * the workspace's sum, one CTA per (batch, query head, query block); thread i reads
// the floats consumer thread i staged (its register order), puts them where the dQ product put
// them in a shared tile, and the CTA writes the tile's rows in 16-byte units (dq's start and
// strides are 16-byte multiples: check_cuda_backward): pairs stored straight from the register
// order wrote each 32-byte sector in two halves.
template <class Traits>
__global__ void __launch_bounds__(Traits::kConsumerThreads)
    attention_backward_sm90_dq_kernel(const __grid_constant__ BackwardSm90Params<Traits> p, BshdTensor dq_out) {
#if TS_ATTENTION_BWD_SM90_BODY
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  constexpr int kPitch = kHeadDim + 8;  // a row's 16-byte units start in rotating bank groups
  __shared__ alignas(16) Element tile[kBlockM * kPitch];
  const int64_t chunk = blockIdx.x;
  const int m_block = static_cast<int>(chunk % p.m_blocks);
  const int head = static_cast<int>(chunk / p.m_blocks % p.q_heads);
  const int batch = static_cast<int>(chunk / p.m_blocks / p.q_heads);
  const int thread = threadIdx.x, consumer_group = thread / 128, group_thread = thread % 128;

  typename Traits::TiledMmaDQ mma_dq;
  Tensor coords = mma_dq.get_thread_slice(thread).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  const float4* source = reinterpret_cast<const float4*>(p.dq_accum + chunk * Traits::kDqFloats +
                                                        consumer_group * Traits::kDqFloatsPerWarpGroup);
  // Every load issued before the first store (the stores could alias the workspace as far as the
  // compiler knows, so interleaved they would wait on each load in turn); read once, streamed.
  constexpr int kUnits = decltype(size(coords))::value / 4;
  float4 sums[kUnits];
  CUTE_UNROLL
  for (int u = 0; u < kUnits; ++u) sums[u] = __ldcs(source + u * 128 + group_thread);
  CUTE_UNROLL
  for (int u = 0; u < kUnits; ++u) {
    const float values[4] = {sums[u].x, sums[u].y, sums[u].z, sums[u].w};
    CUTE_UNROLL
    for (int pair_start = 0; pair_start < 4; pair_start += 2) {
      const auto coord = coords(4 * u + pair_start);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(tile + get<0>(coord) * kPitch + get<1>(coord)) =
          detail::round_pair<Element>(values[pair_start] * p.scale, values[pair_start + 1] * p.scale);
    }
  }
  __syncthreads();
  constexpr int kUnitsPerRow = kHeadDim * static_cast<int>(sizeof(Element)) / 16;
  CUTE_UNROLL
  for (int unit = thread; unit < kBlockM * kUnitsPerRow; unit += Traits::kConsumerThreads) {
    const int r = unit / kUnitsPerRow, part = unit % kUnitsPerRow;
    const int row = m_block * kBlockM + r;
    if (row >= p.q_len) continue;
    *reinterpret_cast<uint4*>(dq_out.row<Element>(batch, row, head) + part * 8) =
        *reinterpret_cast<const uint4*>(tile + r * kPitch + part * 8);
  }
#else
  (void)p;
  (void)dq_out;
#endif
}

}  // namespace trainscale::ops::attention
