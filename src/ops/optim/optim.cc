#include <algorithm>
#include <cstdint>
#include <cmath>
#include <string>
#include <vector>

#include "ops/optim/optim_internal.h"

namespace trainscale {
namespace {

void check_finite(detail::OpChecker& c, double value, const char* name) {
  if (!(std::isfinite(value) && value >= 0)) c.fail(name, "a finite value >= 0", detail::format_number(value));
}

void check_count(detail::OpChecker& c, const char* name, std::size_t count, std::size_t expected) {
  if (count != expected)
    c.fail(name, "one per parameter: " + std::to_string(expected), std::to_string(count));
}

// A float32 scalar (one element) on the device of the tensors checked before it.
void check_scalar(detail::OpChecker& c, const TensorView& t, const char* name) {
  c.present(t, name).dtype_in(t, name, {DType::kFloat32});
  if (t.numel() != 1) c.fail(name, "one element", t.shape_str());
}

// The tensors an optimizer call reads and writes, by byte range: no updated tensor may share a
// byte with any other argument. Sorted by start, so a model's hundreds of tensors cost
// O(n log n), not a check per pair.
struct Extent {
  std::uintptr_t lo, hi;
  bool written;
  std::string name;
};

void check_disjoint(detail::OpChecker& c, std::vector<Extent> extents) {
  std::erase_if(extents, [](const Extent& e) { return e.lo == e.hi; });
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) { return a.lo < b.lo; });
  const Extent *reach_all = nullptr, *reach_written = nullptr;  // the previous extents reaching furthest
  for (const Extent& e : extents) {
    const Extent* hit = e.written ? reach_all : reach_written;
    if (hit != nullptr && e.lo < hit->hi)
      c.fail(e.name.c_str(), "no memory shared with '" + hit->name + "' (" + (e.written ? "updated" : "read") +
                                 " in place while the other is " + (hit->written ? "updated" : "read") + ")",
             "overlapping views");
    if (reach_all == nullptr || e.hi > reach_all->hi) reach_all = &e;
    if (e.written && (reach_written == nullptr || e.hi > reach_written->hi)) reach_written = &e;
  }
}

Extent extent(const TensorView& t, bool written, std::string name) {
  const auto [lo, hi] = detail::byte_extent(t);
  return {lo, hi, written, std::move(name)};
}

std::string item(const char* list, std::size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

}  // namespace

void adamw_step(std::span<const TensorView> params, std::span<const TensorView> grads,
                std::span<const TensorView> exp_avgs, std::span<const TensorView> exp_avg_sqs,
                const AdamWOptions& options, const TensorView& grad_scale, cudaStream_t stream) {
  detail::OpChecker c("adamw_step");
  check_count(c, "grads", grads.size(), params.size());
  check_count(c, "exp_avgs", exp_avgs.size(), params.size());
  check_count(c, "exp_avg_sqs", exp_avg_sqs.size(), params.size());
  check_finite(c, options.lr, "options.lr");
  check_finite(c, options.eps, "options.eps");
  check_finite(c, options.weight_decay, "options.weight_decay");
  for (auto [beta, name] : {std::pair{options.beta1, "options.beta1"}, std::pair{options.beta2, "options.beta2"}}) {
    if (!(beta >= 0 && beta < 1)) c.fail(name, "a value in [0, 1)", detail::format_number(beta));
  }
  if (!(options.step >= 1)) c.fail("options.step", "a step number >= 1", std::to_string(options.step));
  std::vector<Extent> extents;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::string p = item("params", i), g = item("grads", i), m = item("exp_avgs", i),
                      v = item("exp_avg_sqs", i);
    c.present(params[i], p.c_str()).dtype_in(params[i], p.c_str(), detail::kFloatDTypes).contiguous(params[i], p.c_str());
    c.matches(grads[i], g.c_str(), params[i], p.c_str()).contiguous(grads[i], g.c_str());
    c.present(exp_avgs[i], m.c_str())
        .float32_or_dtype_of(exp_avgs[i], m.c_str(), params[i], p.c_str())
        .same_shape(exp_avgs[i], m.c_str(), params[i], p.c_str())
        .contiguous(exp_avgs[i], m.c_str());
    c.matches(exp_avg_sqs[i], v.c_str(), exp_avgs[i], m.c_str()).contiguous(exp_avg_sqs[i], v.c_str());
    extents.push_back(extent(params[i], true, p));
    extents.push_back(extent(exp_avgs[i], true, m));
    extents.push_back(extent(exp_avg_sqs[i], true, v));
    extents.push_back(extent(grads[i], false, g));
  }
  if (grad_scale.defined()) {
    check_scalar(c, grad_scale, "grad_scale");
    extents.push_back(extent(grad_scale, false, "grad_scale"));
  }
  check_disjoint(c, std::move(extents));
  if (params.empty()) return;
  if (detail::ran_on_cuda(c, [&] {
        ops::optim::adamw_step_cuda(params, grads, exp_avgs, exp_avg_sqs, options, grad_scale, stream);
      })) {
    return;
  }
  ops::optim::adamw_step_cpu(params, grads, exp_avgs, exp_avg_sqs, options, grad_scale);
}

namespace {

void check_grads(detail::OpChecker& c, std::span<const TensorView> grads) {
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const std::string g = item("grads", i);
    c.present(grads[i], g.c_str()).dtype_in(grads[i], g.c_str(), detail::kFloatDTypes).contiguous(grads[i], g.c_str());
  }
}

}  // namespace

void grad_norm(std::span<const TensorView> grads, double max_norm, TensorView norm, TensorView clip_factor,
               TensorView workspace, cudaStream_t stream) {
  detail::OpChecker c("grad_norm");
  check_grads(c, grads);
  if (!(max_norm > 0)) c.fail("max_norm", "a value > 0 (+inf: no clipping)", detail::format_number(max_norm));
  check_scalar(c, norm, "norm");
  check_scalar(c, clip_factor, "clip_factor");
  c.optional(workspace, "workspace");
  std::vector<Extent> extents{extent(norm, true, "norm"), extent(clip_factor, true, "clip_factor")};
  if (workspace.defined()) extents.push_back(extent(workspace, true, "workspace"));
  for (std::size_t i = 0; i < grads.size(); ++i) extents.push_back(extent(grads[i], false, item("grads", i)));
  check_disjoint(c, std::move(extents));
  if (detail::ran_on_cuda(c, [&] {
        const std::size_t needed = ops::optim::grad_norm_workspace_bytes_cuda(grads);
        const std::size_t given = workspace.defined() ? workspace.numel() * workspace.element_size() : 0;
        if (needed > 0 && !(given >= needed && workspace.is_contiguous() && reinterpret_cast<std::uintptr_t>(workspace.data) % 8 == 0))
          c.fail("workspace",
                 "a contiguous, 8-byte aligned buffer of at least " + std::to_string(needed) +
                     " bytes (grad_norm_workspace_bytes)",
                 workspace.defined() ? workspace.describe() : std::string("none"));
        ops::optim::grad_norm_cuda(grads, max_norm, norm, clip_factor, workspace, stream);
      })) {
    return;
  }
  ops::optim::grad_norm_cpu(grads, max_norm, norm, clip_factor);
}

std::size_t grad_norm_workspace_bytes(std::span<const TensorView> grads) {
  detail::OpChecker c("grad_norm_workspace_bytes");
  check_grads(c, grads);
#if TRAINSCALE_HAVE_CUDA
  return ops::optim::grad_norm_workspace_bytes_cuda(grads);
#else
  return 0;
#endif
}

}  // namespace trainscale
