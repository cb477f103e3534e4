// The lower panel triangle of a symmetric product in one launch: a CUTLASS grouped GEMM (TMA,
// wgmma, warp-specialized, Hopper) over panels of P rows, panel i of matrix n computing out rows
// [i P, i P + P) by columns [0, (i + 1) P) as
//   out = alpha * lhs_rows @ rhs_rows^T + beta * addend,
// lhs_rows and rhs_rows both row-major [p, K] (the rows of X for X X^T; of the symmetric A for
// A A). The group table (shapes, pointers, strides) is written on the device into the workspace
// by one small kernel, then CUTLASS's own workspace follows it. No split-K: each tile's sum runs
// in one order whatever the batch, so a matrix gets the bits of a call on it alone.
#include "ops/newton_schulz/newton_schulz_internal.h"

#if TRAINSCALE_HAVE_CUTLASS

#include <cuda_bf16.h>

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "common/cuda_check.h"

namespace trainscale::ops::newton_schulz {
namespace {

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using Element = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // lhs rows: [M, K], K-major
using LayoutB = cutlass::layout::ColumnMajor;  // rhs rows as B [K, N]: K-major
using LayoutC = cutlass::layout::RowMajor;
constexpr int kAlignment = 16 / sizeof(Element);
// P = 128: ping-pong 128 x 128 tiles (p = 4096: 528 tiles, four waves of 132 SMs); P = 256:
// cooperative 256 x 128 tiles (p = 8192: 1056 tiles, eight waves).
template <class TileShape, class MainloopSchedule, class EpilogueSchedule>
struct GramGemm {
  using ClusterShape = Shape<_1, _1, _1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutC*, kAlignment, Element,
      LayoutC*, kAlignment, EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment, Element, LayoutB*,
      kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};
using PingPong = GramGemm<Shape<_128, _128, _64>, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                          cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
using Cooperative = GramGemm<Shape<_256, _128, _64>, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                             cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
using StrideA = typename PingPong::Kernel::InternalStrideA;
using StrideB = typename PingPong::Kernel::InternalStrideB;
using StrideC = typename PingPong::Kernel::InternalStrideC;
using StrideD = typename PingPong::Kernel::InternalStrideD;
static_assert(std::is_same_v<StrideA, typename Cooperative::Kernel::InternalStrideA> &&
              std::is_same_v<StrideD, typename Cooperative::Kernel::InternalStrideD>);
using Shape3 = typename ProblemShape::UnderlyingProblemShape;

// The per-group arguments, laid out in the workspace.
struct Groups {
  Shape3* shape;
  const Element** a;
  const Element** b;
  const Element** c;
  Element** d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideC* stride_c;
  StrideD* stride_d;
};

struct PanelArgs {
  const Element* lhs;
  std::int64_t ld_lhs, lhs_stride;
  const Element* rhs;
  std::int64_t ld_rhs, rhs_stride;
  const Element* addend;  // null: out
  Element* out;
  std::int64_t out_stride;
  int p, k, panels, panel;
};

// Group g = n * panels + i: panel i of matrix n.
__global__ void fill_groups_kernel(PanelArgs a, Groups g, int count) {
  const int group = blockIdx.x * blockDim.x + threadIdx.x;
  if (group >= count * a.panels) return;
  const std::int64_t n = group / a.panels, i = group % a.panels;
  const std::int64_t row0 = i * a.panel, end = row0 + a.panel < a.p ? row0 + a.panel : a.p;
  const int m = static_cast<int>(end - row0);
  const int cols = static_cast<int>(end);
  g.shape[group] = Shape3{m, cols, a.k};
  g.a[group] = a.lhs + n * a.lhs_stride + row0 * a.ld_lhs;
  g.b[group] = a.rhs + n * a.rhs_stride;
  // Without an addend (beta 0) the C array is not passed, and C not read.
  const Element* addend = a.addend != nullptr ? a.addend : a.out;
  g.c[group] = addend + n * a.out_stride + row0 * a.p;
  g.d[group] = a.out + n * a.out_stride + row0 * a.p;
  g.stride_a[group] = StrideA{a.ld_lhs, Int<1>{}, Int<0>{}};
  g.stride_b[group] = StrideB{a.ld_rhs, Int<1>{}, Int<0>{}};
  g.stride_c[group] = StrideC{static_cast<std::int64_t>(a.p), Int<1>{}, Int<0>{}};
  g.stride_d[group] = StrideD{static_cast<std::int64_t>(a.p), Int<1>{}, Int<0>{}};
}

std::size_t align_up(std::size_t v) { return (v + 255) / 256 * 256; }

template <class G>
bool run_gemm(const char* op, int groups, Shape3* shapes, const Element** a, StrideA* sa, const Element** b,
              StrideB* sb, const Element** c, StrideC* sc, Element** d, StrideD* sd, float alpha, float beta,
              char* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  using Gemm = typename G::Gemm;
  const detail::DeviceInfo& device = detail::current_device_info();
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device.device;
  hw.sm_count = device.sm_count;
  typename Gemm::Arguments arguments;
  decltype(arguments.epilogue.thread) fusion;
  fusion.alpha = alpha;
  fusion.beta = beta;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, 0};
  fusion.dBeta = {_0{}, _0{}, 0};
  arguments = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                       {groups, shapes, nullptr},
                                       {a, sa, b, sb},
                                       {fusion, c, sc, d, sd},
                                       hw};
  if (Gemm::get_workspace_size(arguments) > workspace_bytes) return false;
  Gemm gemm;
  if (gemm.initialize(arguments, workspace, stream) != cutlass::Status::kSuccess) {
    detail::throw_op_error(op, "the grouped Gram product could not be initialized");
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    detail::throw_op_error(op, "the grouped Gram product failed to launch");
  }
  detail::check_launch(op);
  return true;
}

}  // namespace

bool gram_panels_bf16(const char* op, const void* lhs, std::int64_t ld_lhs, std::int64_t lhs_stride,
                      const void* rhs, std::int64_t ld_rhs, std::int64_t rhs_stride, std::int64_t p,
                      std::int64_t k, void* out, const void* addend, std::int64_t out_stride, float alpha,
                      float beta, std::int64_t count, std::int64_t panel, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream) {
  if (panel != 128 && panel != 256) return false;
  const std::int64_t panels = (p + panel - 1) / panel;
  const std::int64_t groups = count * panels;
  if (groups > (1 << 20) || p % kAlignment != 0 || k % kAlignment != 0 || ld_lhs % kAlignment != 0 ||
      ld_rhs % kAlignment != 0) {
    return false;
  }
  // The group arrays, then CUTLASS's own workspace.
  char* at = static_cast<char*>(workspace);
  const auto take = [&](std::size_t bytes) {
    char* here = at;
    at += align_up(bytes);
    return static_cast<void*>(here);
  };
  const auto n = static_cast<std::size_t>(groups);
  Groups g{static_cast<Shape3*>(take(n * sizeof(Shape3))),
           static_cast<const Element**>(take(n * sizeof(void*))),
           static_cast<const Element**>(take(n * sizeof(void*))),
           static_cast<const Element**>(take(n * sizeof(void*))),
           static_cast<Element**>(take(n * sizeof(void*))),
           static_cast<StrideA*>(take(n * sizeof(StrideA))),
           static_cast<StrideB*>(take(n * sizeof(StrideB))),
           static_cast<StrideC*>(take(n * sizeof(StrideC))),
           static_cast<StrideD*>(take(n * sizeof(StrideD)))};
  PanelArgs args{static_cast<const Element*>(lhs), ld_lhs, lhs_stride, static_cast<const Element*>(rhs), ld_rhs,
                 rhs_stride, static_cast<const Element*>(addend), static_cast<Element*>(out), out_stride,
                 static_cast<int>(p), static_cast<int>(k), static_cast<int>(panels), static_cast<int>(panel)};
  const std::size_t used = static_cast<std::size_t>(at - static_cast<char*>(workspace));
  if (used > workspace_bytes) return false;
  fill_groups_kernel<<<static_cast<unsigned>((groups + 127) / 128), 128, 0, stream>>>(args, g,
                                                                                     static_cast<int>(count));
  detail::check_launch(op);
  const auto run = [&](auto config) {
    return run_gemm<decltype(config)>(op, static_cast<int>(groups), g.shape, g.a, g.stride_a, g.b, g.stride_b,
                                      addend != nullptr ? g.c : nullptr, g.stride_c, g.d, g.stride_d, alpha, beta,
                                      at, workspace_bytes - used, stream);
  };
  return panel == 256 ? run(Cooperative{}) : run(PingPong{});
}

}  // namespace trainscale::ops::newton_schulz

#else

namespace trainscale::ops::newton_schulz {
bool gram_panels_bf16(const char*, const void*, std::int64_t, std::int64_t, const void*, std::int64_t,
                      std::int64_t, std::int64_t, std::int64_t, void*, const void*, std::int64_t, float, float,
                      std::int64_t, std::int64_t, void*, std::size_t, cudaStream_t) {
  return false;
}
}  // namespace trainscale::ops::newton_schulz

#endif
