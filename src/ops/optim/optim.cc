#include <cstdint>
#include <string>
#include <vector>

#include "ops/optim/optim_internal.h"

namespace trainscale {
namespace {

void check_count(detail::OpChecker& c, const char* name, std::size_t count, std::size_t expected) {
  if (count != expected)
    c.fail(name, "one per parameter: " + std::to_string(expected), std::to_string(count));
}

// A float32 scalar (one element) on the device of the tensors checked before it.
void check_scalar(detail::OpChecker& c, const TensorView& t, const char* name) {
  c.present(t, name).dtype_in(t, name, {DType::kFloat32});
  if (t.numel() != 1) c.fail(name, "one element", t.shape_str());
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
  c.finite(options.lr, "options.lr", true)
      .finite(options.eps, "options.eps", true)
      .finite(options.weight_decay, "options.weight_decay", true);
  for (auto [beta, name] : {std::pair{options.beta1, "options.beta1"}, std::pair{options.beta2, "options.beta2"}}) {
    if (!(beta >= 0 && beta < 1)) c.fail(name, "a value in [0, 1)", detail::format_number(beta));
  }
  if (!(options.step >= 1)) c.fail("options.step", "a step number >= 1", std::to_string(options.step));
  std::vector<std::string> names;  // params, grads, exp_avgs, exp_avg_sqs: stable storage for the checker
  names.reserve(4 * params.size());
  std::vector<detail::Arg> written, read;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::string &p = names.emplace_back(item("params", i)), &g = names.emplace_back(item("grads", i)),
                      &m = names.emplace_back(item("exp_avgs", i)), &v = names.emplace_back(item("exp_avg_sqs", i));
    c.present(params[i], p.c_str()).dtype_in(params[i], p.c_str(), detail::kFloatDTypes).contiguous(params[i], p.c_str());
    c.matches(grads[i], g.c_str(), params[i], p.c_str()).contiguous(grads[i], g.c_str());
    c.present(exp_avgs[i], m.c_str())
        .float32_or_dtype_of(exp_avgs[i], m.c_str(), params[i], p.c_str())
        .same_shape(exp_avgs[i], m.c_str(), params[i], p.c_str())
        .contiguous(exp_avgs[i], m.c_str());
    c.matches(exp_avg_sqs[i], v.c_str(), exp_avgs[i], m.c_str()).contiguous(exp_avg_sqs[i], v.c_str());
    written.push_back({params[i], p.c_str()});
    written.push_back({exp_avgs[i], m.c_str()});
    written.push_back({exp_avg_sqs[i], v.c_str()});
    read.push_back({grads[i], g.c_str()});
  }
  if (grad_scale.defined()) {
    check_scalar(c, grad_scale, "grad_scale");
    read.push_back({grad_scale, "grad_scale"});
  }
  c.updates_disjoint(written, read);
  if (params.empty()) return;
  if (detail::ran_on_cuda(c, [&] {
        ops::optim::adamw_step_cuda(params, grads, exp_avgs, exp_avg_sqs, options, grad_scale, stream);
      })) {
    return;
  }
  ops::optim::adamw_step_cpu(params, grads, exp_avgs, exp_avg_sqs, options, grad_scale);
}

namespace {

// Each tensor of a list present, of a float dtype and contiguous; returns their names
// ("list[i]", storage for the checker's later messages).
std::vector<std::string> check_float_list(detail::OpChecker& c, const char* list, std::span<const TensorView> ts) {
  std::vector<std::string> names;
  names.reserve(ts.size());
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const char* name = names.emplace_back(item(list, i)).c_str();
    c.present(ts[i], name).dtype_in(ts[i], name, detail::kFloatDTypes).contiguous(ts[i], name);
  }
  return names;
}

std::vector<detail::Arg> args(std::span<const TensorView> ts, const std::vector<std::string>& names) {
  std::vector<detail::Arg> out;
  out.reserve(ts.size());
  for (std::size_t i = 0; i < ts.size(); ++i) out.push_back({ts[i], names[i].c_str()});
  return out;
}

}  // namespace

void grad_norm(std::span<const TensorView> grads, double max_norm, TensorView norm, TensorView clip_factor,
               TensorView workspace, cudaStream_t stream) {
  detail::OpChecker c("grad_norm");
  const std::vector<std::string> names = check_float_list(c, "grads", grads);
  if (!(max_norm > 0)) c.fail("max_norm", "a value > 0 (+inf: no clipping)", detail::format_number(max_norm));
  check_scalar(c, norm, "norm");
  check_scalar(c, clip_factor, "clip_factor");
  c.optional(workspace, "workspace");
  const detail::Arg written[] = {{norm, "norm"}, {clip_factor, "clip_factor"}, {workspace, "workspace"}};
  c.updates_disjoint(written, args(grads, names));
  if (detail::ran_on_cuda(c, [&] {
        c.workspace(workspace, ops::optim::grad_norm_workspace_bytes_cuda(grads), 8, "grad_norm_workspace_bytes");
        ops::optim::grad_norm_cuda(grads, max_norm, norm, clip_factor, workspace, stream);
      })) {
    return;
  }
  ops::optim::grad_norm_cpu(grads, max_norm, norm, clip_factor);
}

std::size_t grad_norm_workspace_bytes(std::span<const TensorView> grads) {
  detail::OpChecker c("grad_norm_workspace_bytes");
  check_float_list(c, "grads", grads);
#if TRAINSCALE_HAVE_CUDA
  return ops::optim::grad_norm_workspace_bytes_cuda(grads);
#else
  return 0;
#endif
}

void scale_by_device_factor(std::span<const TensorView> tensors, const TensorView& factor, cudaStream_t stream) {
  detail::OpChecker c("scale_by_device_factor");
  const std::vector<std::string> names = check_float_list(c, "tensors", tensors);
  check_scalar(c, factor, "factor");
  const detail::Arg read[] = {{factor, "factor"}};
  c.updates_disjoint(args(tensors, names), read);
  if (detail::ran_on_cuda(c, [&] { ops::optim::scale_by_device_factor_cuda(tensors, factor, stream); })) return;
  ops::optim::scale_by_device_factor_cpu(tensors, factor);
}

}  // namespace trainscale
