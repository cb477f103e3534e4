// Compile-time description of the attention backward for one dtype and tile shape: the SM80
// mma.sync tiled MMA every product of the backward uses, the ldmatrix copy atoms, the swizzled
// shared-memory layouts (and the transposed views the products read) and the shared storage of
// the dK/dV and dQ kernels. Nothing here is Hopper-specific: the same code runs on sm_80+.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace trainscale::ops::attention {

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_>
struct BackwardTraits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  // The CUDA type of the same bits, for common/vec.cuh.
  using Native =
      std::conditional_t<std::is_same_v<Element, cutlass::bfloat16_t>, __nv_bfloat16, __half>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries of a score tile
  static constexpr int kBlockN = kBlockN_;  // keys of a score tile
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps;

  static_assert(sizeof(Element) == 2);
  static_assert(kWarps == 8, "the tiled MMA below lays out 8 warps");
  static_assert(kBlockM % 64 == 0 && kBlockN % 64 == 0 && kHeadDim % 64 == 0,
                "tiles of whole 64-element swizzle rows and of the 64 x 32 MMA step");

  // m16n8k16, fp32 accumulation.
  using MmaAtom = cute::MMA_Atom<std::conditional_t<std::is_same_v<Element, cutlass::bfloat16_t>,
                                                    cute::SM80_16x8x16_F32BF16BF16F32_TN,
                                                    cute::SM80_16x8x16_F32F16F16F32_TN>>;
  // Every product (S, dP: block_m x block_n; dV, dK: block_n x D; dQ: block_m x D) uses one
  // tiled MMA: 4 warps along the rows, 2 along the columns, each warp 16 x 16 per step so that
  // one ldmatrix.x4 fills its A and its B fragment of a k step.
  using TiledMma = decltype(cute::make_tiled_mma(MmaAtom{}, cute::Layout<cute::Shape<cute::_4, cute::_2, cute::_1>>{},
                                                 cute::Tile<cute::_64, cute::_32, cute::_16>{}));

  // ldmatrix of an operand stored with its k dim contiguous, and of one stored with its m / n dim
  // contiguous (the transposed views below).
  using LoadKMajor = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using LoadMNMajor = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;

  // Row-major tiles of 64-element (128-byte) rows, 16-byte chunks XOR-swizzled across 8 rows:
  // ldmatrix reads 8 rows of one chunk column (or, transposed, 8 chunks of one row) without bank
  // conflicts, and a 16-byte cp.async writes one chunk.
  using SmemAtom = decltype(cute::composition(
      cute::Swizzle<3, 3, 3>{}, cute::Layout<cute::Shape<cute::_8, cute::_64>, cute::Stride<cute::_64, cute::_1>>{}));
  template <int kRows, int kCols>
  using SmemTile = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kRows>, cute::Int<kCols>>{}));
  // The (cols, rows) view of a (rows, cols) tile: element (c, r) is element (r, c).
  template <class Layout, int kRows, int kCols>
  using Transposed = decltype(cute::composition(
      Layout{}, cute::make_layout(cute::Shape<cute::Int<kCols>, cute::Int<kRows>>{}, cute::GenRowMajor{})));

  using SmemLayoutQ = SmemTile<kBlockM, kHeadDim>;  // Q, dO, dQ staging
  using SmemLayoutK = SmemTile<kBlockN, kHeadDim>;  // K, V, dK / dV staging
  using SmemLayoutP = SmemTile<kBlockM, kBlockN>;   // P, dS
  using SmemLayoutQt = Transposed<SmemLayoutQ, kBlockM, kHeadDim>;  // (D, block_m)
  using SmemLayoutKt = Transposed<SmemLayoutK, kBlockN, kHeadDim>;  // (D, block_n)
  using SmemLayoutPt = Transposed<SmemLayoutP, kBlockM, kBlockN>;   // (block_n, block_m)

  static constexpr int kTileQ = cute::cosize_v<SmemLayoutQ>;
  static constexpr int kTileK = cute::cosize_v<SmemLayoutK>;
  static constexpr int kTileP = cute::cosize_v<SmemLayoutP>;

  // The dK/dV kernel keeps its key block's K and V and streams two stages of Q, dO and the row
  // statistics (lse, delta) of the query blocks.
  struct DkdvStorage {
    alignas(128) Element k[kTileK];
    alignas(128) Element v[kTileK];
    alignas(128) Element q[2][kTileQ];
    alignas(128) Element dout[2][kTileQ];
    alignas(128) Element p[kTileP];
    alignas(128) Element ds[kTileP];
    alignas(16) float lse[2][kBlockM];
    alignas(16) float delta[2][kBlockM];
  };
  // The dQ kernel keeps its query block's Q, dO and statistics and streams two stages of K, V.
  struct DqStorage {
    alignas(128) Element q[kTileQ];
    alignas(128) Element dout[kTileQ];
    alignas(128) Element k[2][kTileK];
    alignas(128) Element v[2][kTileK];
    alignas(128) Element ds[kTileP];
    alignas(16) float lse[kBlockM];
    alignas(16) float delta[kBlockM];
  };
  static constexpr int kDkdvSharedBytes = static_cast<int>(sizeof(DkdvStorage));
  static constexpr int kDqSharedBytes = static_cast<int>(sizeof(DqStorage));
  static_assert(kDkdvSharedBytes <= 227 * 1024 && kDqSharedBytes <= 227 * 1024,
                "exceeds the 227 KiB of shared memory per CTA");
};

}  // namespace trainscale::ops::attention
