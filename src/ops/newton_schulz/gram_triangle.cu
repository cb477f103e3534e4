// The lower tile triangle of a symmetric product in one launch: a CUTLASS Hopper GEMM (TMA,
// wgmma, ping-pong warp specialization) whose persistent tile scheduler visits only the tiles
// (m, n) with n <= m of
//   out = alpha * rows @ rows^T + beta * addend,
// rows [p, K] row-major (X for X X^T; the symmetric A for A A = A A^T), for a batch of matrices
// (the GEMM's L mode). The diagonal tiles are computed whole; the caller mirrors the tiles above.
// Every tile sums K in one order whatever the batch (no split-K), so a matrix gets the bits of
// a call on it alone.
#include "ops/newton_schulz/newton_schulz_internal.h"

#if TRAINSCALE_HAVE_CUTLASS

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "common/cuda_check.h"

namespace trainscale::ops::newton_schulz {
// The tile scheduler's tag (TileSchedulerSelector below maps it to the scheduler).
struct LowerTriangleTiles {};
}  // namespace trainscale::ops::newton_schulz

namespace cutlass::gemm::kernel::detail {

// PersistentTileSchedulerSm90 over the lower triangle of a T x T tile grid (T even), folded into
// a T / 2 x (T + 1) rectangle per matrix (folded_triangle_tile). Consecutive work walks along a
// rectangle row, so a wave of CTAs shares a few row panels of `rows` and streams the others
// through L2.
class LowerTriangleTileScheduler : public StaticPersistentTileScheduler<LowerTriangleTileScheduler> {
  using Base = StaticPersistentTileScheduler<LowerTriangleTileScheduler>;

 public:
  using Base::Base;
  using Params = PersistentTileSchedulerSm90Params;
  using RasterOrder = typename Params::RasterOrder;
  using RasterOrderOptions = typename Params::RasterOrderOptions;
  using Arguments = typename Base::Arguments;
  static constexpr bool IsDynamicPersistent = false;
  using Pipeline = PipelineEmpty;
  using PipelineStorage = typename Pipeline::SharedStorage;
  using ThrottlePipeline = PipelineEmpty;
  using ThrottlePipelineStorage = typename ThrottlePipeline::SharedStorage;
  struct CLCResponse {};
  class SharedStorage {
   public:
    CUTLASS_DEVICE PipelineStorage pipeline() { return PipelineStorage{}; }
    CUTLASS_DEVICE ThrottlePipelineStorage throttle_pipeline() { return ThrottlePipelineStorage{}; }
    CUTLASS_DEVICE CLCResponse* data() { return nullptr; }
  };

  // The folded rectangle of every matrix, walked along N (its rows), no swizzle, clusters of one CTA.
  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape, ClusterShape,
                                        KernelHardwareInfo const& hw_info, Arguments const&, void* = nullptr,
                                        const uint32_t = 1, uint32_t = 1) {
    static_assert(cute::size<0>(TileShape{}) == cute::size<1>(TileShape{}) && cute::size(ClusterShape{}) == 1);
    const auto t = static_cast<uint32_t>(cute::ceil_div(cute::get<0>(problem_shape_mnkl), cute::size<0>(TileShape{})));
    Params params;
    params.initialize(dim3(t / 2, t + 1, static_cast<uint32_t>(cute::get<3>(problem_shape_mnkl))),
                      GemmCoord(1, 1, 1), hw_info, 1, RasterOrderOptions::AlongN);
    return params;
  }

  // blk: the linear index within a matrix, r * (T + 1) + c; divmod_cluster_blk_major divides by T + 1.
  static CUTLASS_DEVICE cute::tuple<int32_t, int32_t> get_work_idx_m_and_n(
      uint64_t blk, FastDivmodU64Pow2 const&, FastDivmodU64Pow2 const&, FastDivmodU64 const& divmod_row,
      int32_t, RasterOrder) {
    uint64_t r, c;
    divmod_row(r, c, blk);
    const auto tile = trainscale::ops::newton_schulz::folded_triangle_tile(
        static_cast<int64_t>(r), static_cast<int64_t>(c), static_cast<int64_t>(divmod_row.divisor) - 1);
    return {static_cast<int32_t>(tile.m), static_cast<int32_t>(tile.n)};
  }

  template <class ProblemShape, class ElementAccumulator>
  static size_t get_workspace_size(Arguments const&, ProblemShape, KernelHardwareInfo const&, uint32_t,
                                   const uint32_t = 1, uint32_t = 1) {
    return 0;
  }

  template <class ProblemShape, class ElementAccumulator>
  static cutlass::Status initialize_workspace(Arguments const&, void*, cudaStream_t, ProblemShape,
                                              KernelHardwareInfo const&, uint32_t, const uint32_t = 1,
                                              uint32_t = 1, CudaHostAdapter* = nullptr) {
    return Status::kSuccess;
  }
};

template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<trainscale::ops::newton_schulz::LowerTriangleTiles, ArchTag, TileShape, ClusterShape,
                             Stages> {
  using Scheduler = LowerTriangleTileScheduler;
};

}  // namespace cutlass::gemm::kernel::detail

namespace trainscale::ops::newton_schulz {
namespace {

using namespace cute;
using Element = cutlass::bfloat16_t;
using TileShape = Shape<_128, _128, _64>;
using ClusterShape = Shape<_1, _1, _1>;
constexpr int kAlignment = 16 / sizeof(Element);
static_assert(kGramTriangleTile == 128);
using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, cutlass::layout::RowMajor, kAlignment,
    Element, cutlass::layout::RowMajor, kAlignment, cutlass::epilogue::TmaWarpSpecialized,
    cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
// rows as A [M, K] and as B [N, K], both K-major.
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlignment, Element,
    cutlass::layout::ColumnMajor, kAlignment, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, LowerTriangleTiles>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

}  // namespace

bool gram_triangle_applies(DType dtype, std::int64_t p, std::int64_t k) {
#if defined(TRAINSCALE_HAS_SM90A) && TRAINSCALE_HAS_SM90A
  if (!(dtype == DType::kBFloat16 && p > 0 && p % (2 * kGramTriangleTile) == 0 && p <= (std::int64_t{1} << 30) &&
        k > 0 && k % kAlignment == 0 && k <= (std::int64_t{1} << 30))) {
    return false;
  }
  const detail::DeviceInfo& device = detail::current_device_info();
  return device.major == 9 && device.minor == 0;
#else
  (void)dtype, (void)p, (void)k;
  return false;
#endif
}

void gram_triangle_bf16(const char* op, const void* rows, std::int64_t rows_stride, std::int64_t p, std::int64_t k,
                        void* out, const void* addend, std::int64_t out_stride, float alpha, float beta,
                        std::int64_t count, cudaStream_t stream) {
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;
  const int m = static_cast<int>(p);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = detail::current_device_info().device;
  hw.sm_count = detail::current_device_info().sm_count;
  typename Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, m, static_cast<int>(k), static_cast<int>(count)},
      {static_cast<const Element*>(rows), StrideA{k, Int<1>{}, rows_stride}, static_cast<const Element*>(rows),
       StrideB{k, Int<1>{}, rows_stride}},
      // Without an addend C is `out`, never read (beta 0).
      {{}, static_cast<const Element*>(addend != nullptr ? addend : out), StrideC{p, Int<1>{}, out_stride},
       static_cast<Element*>(out),
       StrideD{p, Int<1>{}, out_stride}},
      hw};
  arguments.epilogue.thread.alpha = alpha;
  arguments.epilogue.thread.beta = addend != nullptr ? beta : 0.f;
  Gemm gemm;
  if (Gemm::get_workspace_size(arguments) != 0 || gemm.can_implement(arguments) != cutlass::Status::kSuccess ||
      gemm.initialize(arguments, nullptr, stream) != cutlass::Status::kSuccess) {
    detail::throw_op_error(op, "the Gram product's tile triangle could not be set up for p " + std::to_string(p) +
                                   ", K " + std::to_string(k));
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    detail::throw_op_error(op, "the Gram product's tile triangle failed to launch");
  }
  detail::check_launch(op);
}

}  // namespace trainscale::ops::newton_schulz

#else

namespace trainscale::ops::newton_schulz {
bool gram_triangle_applies(DType, std::int64_t, std::int64_t) { return false; }
void gram_triangle_bf16(const char* op, const void*, std::int64_t, std::int64_t, std::int64_t, void*, const void*,
                        std::int64_t, float, float, std::int64_t, cudaStream_t) {
  detail::throw_op_error(op, "this build has no CUTLASS: the Gram product's tile triangle is not available");
}
}  // namespace trainscale::ops::newton_schulz

#endif
