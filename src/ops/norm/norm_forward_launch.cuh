// Launch of the forward row kernels (norm_forward_kernels.cuh) for a plan_forward choice
// (norm_plan.h): template arguments for the plan, grid and shared memory, and kRows' fallback
// where its cluster cannot be resident. Included by one translation unit per op.
#pragma once

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "common/carveout.h"
#include "common/cluster_launch.h"
#include "core/check.h"
#include "ops/norm/norm_forward_kernels.cuh"
#include "ops/norm/norm_forward_ring.cuh"
#include "ops/norm/norm_plan.h"

namespace trainscale::ops::norm {
namespace {

// fn(std::integral_constant<int, threads per row>, std::integral_constant<int, vecs per
// thread>) for forward_row_split(vecs, kVecsPerThread): kForwardVecsPerThread, or 1 for the
// short rows plan_forward gives one vector per thread.
template <int kVecsPerThread, int kThreads = 1, class Fn>
auto with_row_split_at(int threads, Fn&& fn) {
  constexpr int kMaxThreads = forward_row_split(std::numeric_limits<std::int64_t>::max(),
                                                kVecsPerThread).threads;
  using Threads = std::integral_constant<int, kThreads>;
  using Per = std::integral_constant<int, vecs_per_thread_at(kThreads, kVecsPerThread)>;
  if constexpr (kThreads == kMaxThreads) {
    return fn(Threads{}, Per{});
  } else {
    if (threads == kThreads) return fn(Threads{}, Per{});
    return with_row_split_at<kVecsPerThread, kThreads * 2>(threads, std::forward<Fn>(fn));
  }
}
template <int kVecsPerThread, class Fn>
auto with_row_split(std::int64_t vecs, Fn&& fn) {
  static_assert(kVecsPerThread == 1 || kVecsPerThread == kForwardVecsPerThread);
  return with_row_split_at<kVecsPerThread>(forward_row_split(vecs, kVecsPerThread).threads,
                                           std::forward<Fn>(fn));
}

// fn(std::integral_constant<int, blocks per row>) for rows_cluster_blocks(vecs).
template <class Fn>
auto with_row_cluster(std::int64_t vecs, Fn&& fn) {
  using std::integral_constant;
  switch (rows_cluster_blocks(vecs)) {
    case 1: return fn(integral_constant<int, 1>{});
    case 2: return fn(integral_constant<int, 2>{});
    case 4: return fn(integral_constant<int, 4>{});
  }
  return fn(integral_constant<int, 8>{});
}

template <class T, class R, Kind kKind>
ForwardProblem problem_of(const ForwardArgs& a) {
  constexpr int V = detail::kVec16<T>;
  bool aligned = a.cols % V == 0 && rows_vectorizable(a.x, a.x_stride, sizeof(T)) &&
                 rows_vectorizable(a.y, a.y_stride, sizeof(T));
  if constexpr (!std::is_void_v<R>) {
    aligned = aligned && rows_vectorizable(a.residual, a.residual_stride, sizeof(R)) &&
              rows_vectorizable(a.residual_out, a.residual_out_stride, sizeof(R));
  }
  return {.kind = kKind,
          .rows = a.rows,
          .cols = a.cols,
          .element_bytes = static_cast<int>(sizeof(T)),
          .residual_bytes = residual_bytes<R>(),
          .aligned = aligned,
          .bulk_copies = detail::current_device_info().major >= 9};
}

// Launches the register kernel for rows of `vecs` vectors, kCluster blocks per row (kRows
// only), kVecsPerThread vectors per thread (with_row_split). Returns false, launching nothing,
// where a cluster of that configuration cannot be resident on the device.
template <class T, class R, class W, class B, Kind kKind, NormVariant kVariant, int kCluster,
          int kVecsPerThread = kForwardVecsPerThread>
bool launch_registers(const ForwardArgs& a, std::int64_t vecs, cudaStream_t stream,
                      const char* op) {
  const std::int64_t block_vecs = (vecs + kCluster - 1) / kCluster;
  return with_row_split<kVecsPerThread>(block_vecs, [&](auto threads, auto per_thread) {
    constexpr int kThreads = decltype(threads)::value;
    constexpr int kVecs = decltype(per_thread)::value;
    constexpr int kBlock = kBlockFor<kVariant, kThreads>;
    constexpr int kRowsPerBlock = kBlock / kThreads;
    const std::int64_t row_groups = (a.rows + kRowsPerBlock - 1) / kRowsPerBlock;
    if constexpr (kCluster > 1 && 2 * kThreads * kVecs <= kBlockVecs) {
      // kCluster is the fewest blocks that hold the row, so a block holds over half of
      // kBlockVecs: configurations for fewer vectors never serve a cluster and are not compiled.
      return false;
    } else if constexpr (kCluster > 1) {
      const auto kernel =
          forward_registers_kernel<T, R, W, B, kKind, kVariant, kThreads, kVecs, kCluster>;
      if (detail::max_active_clusters(kernel, kBlock, kCluster, 0, op) == 0) return false;
      detail::prefer_l1_at_full_occupancy(kernel, kBlock, 0, op);  // weight and bias from L1
      const std::int64_t clusters = std::min<std::int64_t>(
          (row_groups + detail::kClusterRowGroups - 1) / detail::kClusterRowGroups,
          std::numeric_limits<int>::max() / kCluster);
      detail::launch_in_clusters(kernel, clusters * kCluster, kBlock, kCluster, 0, stream, op, a);
      return true;
    } else {
      const auto kernel = forward_registers_kernel<T, R, W, B, kKind, kVariant, kThreads, kVecs, 1>;
      std::size_t smem = 0;
      std::int64_t grid = std::min<std::int64_t>(row_groups, std::numeric_limits<int>::max());
      if constexpr (kVariant == NormVariant::kRows) {
        detail::prefer_l1_at_full_occupancy(kernel, kBlock, 0, op);  // weight and bias from L1
      } else {
        smem = forward_shared_bytes(problem_of<T, R, kKind>(a), kVariant, kVecsPerThread);
        if (smem + kMaxScratchBytes > kDefaultSharedBytes) {
          detail::check_cuda(cudaFuncSetAttribute(kernel,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  static_cast<int>(smem)),
                             op, "raising the shared-memory limit");
        }
        // LayerNorm: one resident wave, each block staging its tables (8 B per column) once and
        // looping over row groups. RMSNorm (4 B per column) streams faster with one row group per
        // block, the tables staged by every block; for LayerNorm that restaging costs more than
        // the looping wave loses (docs/perf/norm.md).
        if constexpr (persistent_grid(kKind, kVariant)) {
          int per_sm = 0;
          detail::check_cuda(
              cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlock, smem), op,
              "occupancy query");
          grid = balanced_blocks_for(row_groups, std::max(per_sm, 1));
        }
      }
      // A grid of one block per row group never loops: one ring stage serves it (ring_stages);
      // the kernel stays correct if it did, at one stage.
      ForwardArgs args = a;
      args.ring_stages = ring_stages(kKind);
      kernel<<<static_cast<unsigned>(grid), kBlock, smem, stream>>>(args);
      return true;
    }
  });
}

// fn(TypeTag<W>, TypeTag<B>): the parameters' dtypes as template arguments, an absent one as
// T (RMSNorm: B = W).
template <class T, Kind kKind, class Fn>
auto with_param_dtypes(const ForwardArgs& a, Fn&& fn) {
  const auto with_dtype = [](bool f32, auto inner) {
    if (f32 && !std::is_same_v<T, float>) return inner(detail::TypeTag<float>{});
    return inner(detail::TypeTag<T>{});
  };
  return with_dtype(a.weight && a.weight_f32, [&](auto w) {
    if constexpr (kKind == Kind::kRms) {
      return fn(w, w);
    } else {
      return with_dtype(a.bias && a.bias_f32, [&](auto b) { return fn(w, b); });
    }
  });
}

// The rows variant, a cluster per row for rows longer than a block holds. False where that
// cluster cannot be resident (nothing launched).
template <class T, class R, Kind kKind>
bool launch_rows(const ForwardArgs& a, std::int64_t vecs, cudaStream_t stream, const char* op) {
  return with_row_cluster(vecs, [&](auto cluster) {
    constexpr int kCluster = decltype(cluster)::value;
    return with_param_dtypes<T, kKind>(a, [&](auto w, auto b) {
      using W = typename decltype(w)::type;
      using B = typename decltype(b)::type;
      return launch_registers<T, R, W, B, kKind, NormVariant::kRows, kCluster>(a, vecs, stream, op);
    });
  });
}

// kRing (norm_forward_ring.cuh): a persistent grid of ring.blocks_per_sm blocks per SM, fewer
// where the device holds fewer, and no more blocks than rows (plan_forward checked the device's
// bulk copies).
template <class T, Kind kKind>
void launch_ring(const ForwardArgs& a, const RingPlan& ring, cudaStream_t stream, const char* op) {
  const auto& info = detail::current_device_info();
  const std::size_t smem = static_cast<std::size_t>(ring.stages) * a.cols * sizeof(T);
  const auto launch = [&](auto kernel) {
    const int per_sm = detail::max_resident_blocks(kernel, kRingThreads, smem, op) / info.sm_count;
    const std::int64_t per_sm_cap = std::clamp(per_sm, 1, ring.blocks_per_sm);
    const std::int64_t blocks = std::min<std::int64_t>(a.rows, info.sm_count * per_sm_cap);
    kernel<<<static_cast<unsigned>(blocks), kRingThreads, smem, stream>>>(a, ring.stages);
  };
  with_param_dtypes<T, kKind>(a, [&](auto w, auto b) {
    using W = typename decltype(w)::type;
    using B = typename decltype(b)::type;
    if (ring.vecs_per_thread == 2) {
      launch(forward_ring_kernel<T, W, B, kKind, 2>);
    } else {
      launch(forward_ring_kernel<T, W, B, kKind, 4>);
    }
  });
}

template <class T, class R, Kind kKind>
void launch_forward(const ForwardArgs& a, NormVariant variant, cudaStream_t stream,
                    const char* op) {
  if (a.rows == 0) return;
  constexpr int V = detail::kVec16<T>;
  const ForwardPlan plan = plan_forward(problem_of<T, R, kKind>(a), variant,
                                        detail::current_device_info().shared_memory_per_block_optin);
  const std::int64_t vecs = plan.vecs;
  NormVariant chosen = plan.variant;
  if (chosen == NormVariant::kRows && !launch_rows<T, R, kKind>(a, vecs, stream, op)) {
    if (variant == chosen) {
      throw UnsupportedVariantError(
          "trainscale norm: the rows variant's thread-block cluster for " +
          std::to_string(a.cols) + " columns cannot be resident on this device");
    }
    chosen = NormVariant::kTwoPass;
  }
  if (chosen == NormVariant::kRegisters) {
    launch_registers<T, R, T, T, kKind, NormVariant::kRegisters, 1>(a, vecs, stream, op);
  } else if (chosen == NormVariant::kPipelined && plan.vecs_per_thread == 1) {
    launch_registers<T, R, T, T, kKind, NormVariant::kPipelined, 1, 1>(a, vecs, stream, op);
  } else if (chosen == NormVariant::kPipelined) {
    launch_registers<T, R, T, T, kKind, NormVariant::kPipelined, 1>(a, vecs, stream, op);
  } else if (chosen == NormVariant::kRing) {
    if constexpr (std::is_void_v<R>) launch_ring<T, kKind>(a, plan.ring, stream, op);
  } else if (chosen == NormVariant::kTwoPass) {
    if (plan.vectorized) {
      forward_two_pass_kernel<T, R, kKind, V>
          <<<static_cast<unsigned>(blocks_for(a.rows, 4)), kTwoPassThreads, 0, stream>>>(a);
    } else {
      forward_two_pass_kernel<T, R, kKind, 1>
          <<<static_cast<unsigned>(blocks_for(a.rows, 4)), kTwoPassThreads, 0, stream>>>(a);
    }
  }
  detail::check_launch(op);
}

ForwardArgs make_args(const TensorView& x, const TensorView& weight,
                      const TensorView& bias, TensorView y, TensorView mean, TensorView rstd) {
  const auto xr = detail::row_layout(x);
  const auto yr = detail::row_layout(y);
  ForwardArgs a{};
  a.x = x.data;
  a.x_stride = xr.row_stride;
  a.weight = weight.defined() ? weight.data : nullptr;
  a.weight_f32 = weight.defined() && weight.dtype == DType::kFloat32;
  a.bias = bias.defined() ? bias.data : nullptr;
  a.bias_f32 = bias.defined() && bias.dtype == DType::kFloat32;
  a.y = y.data;
  a.y_stride = yr.row_stride;
  a.mean = mean.defined() ? mean.ptr<float>() : nullptr;
  a.rstd = rstd.defined() ? rstd.ptr<float>() : nullptr;
  a.rows = xr.rows;
  a.cols = xr.cols;
  return a;
}


}  // namespace
}  // namespace trainscale::ops::norm
