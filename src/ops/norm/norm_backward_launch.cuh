// Launch of the backward kernels (norm_backward_kernels.cuh): the register kernel where the row
// fits (norm_plan.h's use_registers, and enough resident row groups), cooperative where it can
// reduce its own partial rows, else the two-pass kernel and a reduction of the partials.
// Included by one translation unit per op.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "common/carveout.h"
#include "common/cluster_launch.h"
#include "core/check.h"
#include "ops/norm/norm_backward_kernels.cuh"

namespace trainscale::ops::norm {
namespace {

// Partial rows: row groups of the register kernel (blocks, or clusters), or two-pass blocks.
struct Plan {
  bool registers = false;
  bool vectorized = false;
  std::int64_t groups = 0;
};

// The register kernel of a row length and how it is launched.
struct RegisterKernel {
  void (*kernel)(BackwardArgs);
  int cluster;
  std::size_t smem;
  int rows_per_group;
  bool weight_from_l1;  // not staged in shared memory
};

template <class T, class X, Kind kKind>
RegisterKernel register_kernel(std::int64_t cols) {
  constexpr int V = detail::kVec16<T>;
  return with_backward_config((cols + V - 1) / V, [](auto threads, auto per_thread, auto cluster) {
    constexpr int kThreads = decltype(threads)::value;
    constexpr int kVecs = decltype(per_thread)::value;
    constexpr int kCluster = decltype(cluster)::value;
    using Smem = RegisterSmem<T, X, kKind, kThreads, kVecs>;
    return RegisterKernel{backward_registers_kernel<T, X, kKind, kThreads, kVecs, kCluster>,
                          kCluster, Smem::kBytes, kBackwardBlock / kThreads,
                          !Smem::kStagedScale};
  });
}

// Row groups resident at once on the current device (0: the configuration does not fit it).
std::int64_t query_resident_groups(const RegisterKernel& k, const char* op) {
  const auto& info = detail::current_device_info();
  if (k.smem > info.shared_memory_per_block_optin) return 0;
  detail::check_cuda(cudaFuncSetAttribute(k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(k.smem)),
                     op, "cudaFuncSetAttribute");
  // One block's shared memory and the rest L1, where the weight stays for every row when the
  // kernel does not stage it (a 32-64 KB weight chunk).
  if (k.weight_from_l1) detail::prefer_l1_carveout(k.kernel, 1, k.smem, op);
  if (k.cluster > 1) {
    return std::min<std::int64_t>(
        detail::max_active_clusters(k.kernel, kBackwardBlock, k.cluster, k.smem, op),
        static_cast<std::int64_t>(info.sm_count) * kMaxBlocksPerSm / k.cluster);
  }
  int count = 0;
  detail::check_cuda(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, k.kernel, kBackwardBlock, k.smem), op,
      "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return static_cast<std::int64_t>(info.sm_count) * std::min(count, kMaxBlocksPerSm);
}

// query_resident_groups once per (device, kernel): the attribute and occupancy calls cost
// microseconds of host time per launch otherwise.
std::int64_t resident_groups(const RegisterKernel& k, const char* op) {
  static std::mutex mutex;
  static std::map<std::pair<int, void (*)(BackwardArgs)>, std::int64_t> cache;
  int device = 0;
  detail::check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, k.kernel);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  const std::int64_t groups = query_resident_groups(k, op);
  cache.emplace(key, groups);
  return groups;
}

template <class T, class X, Kind kKind>
Plan plan_backward(const BackwardArgs& a, NormVariant variant, const char* op) {
  if (variant == NormVariant::kRows || variant == NormVariant::kPipelined ||
      variant == NormVariant::kRing) {
    variant = NormVariant::kAuto;  // forward-only variants
  }
  constexpr int V = detail::kVec16<T>;
  const std::int64_t vecs = (a.cols + V - 1) / V;
  const bool aligned = a.cols % V == 0 && rows_vectorizable(a.dy, a.dy_stride, sizeof(T)) &&
                       rows_vectorizable(a.dx, a.dx_stride, sizeof(T)) &&
                       rows_vectorizable(a.x, a.x_stride, sizeof(X)) &&
                       rows_vectorizable(a.d_residual, a.d_residual_stride, sizeof(X));
  const RegisterKernel k = register_kernel<T, X, kKind>(a.cols);
  // A kernel that reads the weight from L1 reads it as 16-byte vectors too.
  const bool weight_aligned = !k.weight_from_l1 || rows_vectorizable(a.weight, 0, sizeof(T));
  Plan plan;
  plan.vectorized = aligned;
  plan.registers =
      use_registers(variant, aligned && weight_aligned, vecs, kMaxBackwardRegisterVecs);
  if (plan.registers) {
    const std::int64_t resident = resident_groups(k, op);
    // Auto leaves rows to two passes over every SM when the clusters cover less than a quarter
    // of the SMs (16-block clusters on a GPU of small GPCs, or a MIG slice): an SM streams about
    // 1/128 of an H100's bandwidth, so a quarter of the SMs only matches the two-pass kernel
    // over all of them.
    const std::int64_t min_blocks =
        variant == NormVariant::kAuto ? detail::current_device_info().sm_count / 4 : 1;
    if (resident == 0 || resident * k.cluster < min_blocks) {
      if (variant == NormVariant::kRegisters) {
        throw UnsupportedVariantError(std::string("trainscale ") + op +
                    ": the register variant does not fit this device for " +
                    std::to_string(a.cols) + " columns");
      }
      plan.registers = false;
    } else {
      plan.groups = std::min(resident, (a.rows + k.rows_per_group - 1) / k.rows_per_group);
    }
  }
  if (!plan.registers) plan.groups = blocks_for(a.rows, kMaxBlocksPerSm);
  return plan;
}

template <class T, class X, Kind kKind>
void launch_backward(BackwardArgs a, const TensorView& dw, const TensorView& db,
                     const TensorView& workspace, NormVariant variant, cudaStream_t stream,
                     const char* op) {
  if (a.rows == 0) {
    // An empty batch still defines the gradients: zero.
    for (const TensorView* g : {&dw, &db}) {
      if (g->defined() && g->numel() > 0) {
        detail::check_cuda(cudaMemsetAsync(g->data, 0, g->numel() * g->element_size(), stream),
                           op, "cudaMemsetAsync");
      }
    }
    return;
  }
  const Plan plan = plan_backward<T, X, kKind>(a, variant, op);
  if (dw.defined() || db.defined()) {
    const std::size_t need = static_cast<std::size_t>(plan.groups) * a.cols * sizeof(float) *
                             (kKind == Kind::kLayer ? 2 : 1);
    const std::size_t have = workspace.defined() ? workspace.numel() * workspace.element_size() : 0;
    if (have < need) {
      detail::throw_arg_error(op, "workspace",
                              "at least " + std::to_string(need) +
                                  " bytes (norm_backward_workspace_bytes)",
                              std::to_string(have) + " bytes");
    }
    if (!detail::is_aligned(workspace.data, 16)) {
      detail::throw_arg_error(op, "workspace", "a 16-byte aligned pointer", "an unaligned one");
    }
    a.partial = static_cast<float*>(workspace.data);
    a.dw = dw.defined() ? dw.data : nullptr;
    a.dw_f32 = dw.defined() && dw.dtype == DType::kFloat32;
    a.db = db.defined() ? db.data : nullptr;
    a.db_f32 = db.defined() && db.dtype == DType::kFloat32;
  }
  constexpr int V = detail::kVec16<T>;
  bool reduced = false;
  if (plan.registers) {
    const RegisterKernel k = register_kernel<T, X, kKind>(a.cols);
    // One block per row group and every block resident (plan.groups <= resident_groups): the
    // kernel reduces its partial rows itself after a grid barrier, saving the reduction's
    // launches (7-9 % of LayerNorm's backward at 4096-8192 rows). Clusters keep the second
    // kernel.
    if (a.partial != nullptr && k.cluster == 1 && detail::cooperative_launch_supported(op)) {
      BackwardArgs fused = a;
      fused.reduce_in_kernel = true;
      reduced = detail::launch_cooperative(k.kernel, plan.groups, kBackwardBlock, k.smem, stream,
                                           op, fused);
    }
    if (!reduced) {
      detail::launch_in_clusters(k.kernel, plan.groups * k.cluster, kBackwardBlock, k.cluster,
                                 k.smem, stream, op, a);
    }
  } else {
    const auto grid = static_cast<unsigned>(plan.groups);
    if (plan.vectorized) {
      backward_two_pass_kernel<T, X, kKind, V><<<grid, kTwoPassThreads, 0, stream>>>(a);
    } else {
      backward_two_pass_kernel<T, X, kKind, 1><<<grid, kTwoPassThreads, 0, stream>>>(a);
    }
  }
  detail::check_launch(op);
  if (reduced || a.partial == nullptr) return;
  // The bias's partial rows follow the weight's (array 1), whether or not dw is asked for.
  const int arrays = db.defined() ? 2 : 1;
  const std::int64_t tiles =
      (a.cols + detail::kGridReduceTile - 1) / detail::kGridReduceTile * arrays;
  reduce_partials_kernel<T><<<static_cast<unsigned>(tiles), kReduceBlock, 0, stream>>>(
      a, static_cast<int>(plan.groups), arrays);
  detail::check_launch(op);
}

BackwardArgs make_args(const TensorView& dy, const TensorView& x,
                       const TensorView& weight, const TensorView& mean, const TensorView& rstd,
                       TensorView dx) {
  const auto dyr = detail::row_layout(dy);
  BackwardArgs a{};
  a.dy = dy.data;
  a.dy_stride = dyr.row_stride;
  a.x = x.data;
  a.x_stride = detail::row_layout(x).row_stride;
  a.weight = weight.defined() ? weight.data : nullptr;
  a.weight_f32 = weight.defined() && weight.dtype == DType::kFloat32;
  a.mean = mean.defined() ? mean.ptr<const float>() : nullptr;
  a.rstd = rstd.ptr<const float>();
  a.dx = dx.data;
  a.dx_stride = detail::row_layout(dx).row_stride;
  a.rows = dyr.rows;
  a.cols = dyr.cols;
  return a;
}

}  // namespace
}  // namespace trainscale::ops::norm
