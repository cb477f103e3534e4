// Cross-entropy over a vocabulary (mean reduction): loss and lse alone, and with the logits
// gradient written in the same pass. Config M x V. Opt-in implementations force the forward's
// kernel (CrossEntropyKernel): trainscale-held, trainscale-held-direct, and trainscale-streamed
// for the loss alone.
#include <functional>
#include <optional>
#include <string_view>
#include <utility>

#include "bench/cases/case_util.h"
#include "trainscale/loss.h"

namespace trainscale::bench::cases {
namespace {

std::function<void(CaseTensors, cudaStream_t)> forward_entry(const Case& c, CrossEntropyKernel kernel) {
  const auto [logits, targets, loss, lse] = c.ids("logits", "targets", "loss", "lse");
  const std::optional<TensorId> grad =
      c.op == "cross_entropy_forward_with_grad" ? std::optional(c.id("grad_logits")) : std::nullopt;
  return [=](CaseTensors t, cudaStream_t s) {
    cross_entropy_forward(t[logits], t[targets], t[loss], t[lse], grad ? t[*grad] : TensorView{}, {.kernel = kernel},
                          s);
  };
}

Case cross_entropy_case(const char* op, std::span<const std::int64_t> shape, DType dtype, bool with_grad) {
  Case c = begin_case(op, "loss", shape, dtype, 2, "MxV");
  const std::int64_t m = c.shape[0], v = c.shape[1];
  TensorSpec logits = input("logits", dtype, {m, v});
  logits.lo = -4.0;
  logits.hi = 4.0;
  TensorSpec targets = input("targets", DType::kInt64, {m});
  targets.lo = 0;
  targets.hi = static_cast<double>(v - 1);
  c.tensors = {logits, targets, output("loss", DType::kFloat32, {}, false), output("lse", DType::kFloat32, {m})};
  c.spec("loss").reference_dtype = DType::kFloat64;
  if (with_grad) c.tensors.push_back(output("grad_logits", dtype, {m, v}));
  c.bytes = traffic(c.tensors);
  c.flops = (with_grad ? 7.0 : 4.0) * static_cast<double>(m * v);  // max, exp, sum (+ softmax, gradient)
  c.entry = forward_entry(c, CrossEntropyKernel::kAuto);
  c.reference = on_cpu(c.entry);
  return c;
}

const Registrar kRegister([](Registry& r) {
  r.add_op({"cross_entropy_forward", "loss", "M x V",
            [](std::span<const std::int64_t> s, DType d) { return cross_entropy_case("cross_entropy_forward", s, d, false); }});
  r.add_op({"cross_entropy_forward_with_grad", "loss", "M x V (gradient in the same pass)",
            [](std::span<const std::int64_t> s, DType d) { return cross_entropy_case("cross_entropy_forward_with_grad", s, d, true); }});
  const std::pair<const char*, CrossEntropyKernel> forced[] = {
      {"trainscale-held", CrossEntropyKernel::kHeld},
      {"trainscale-streamed", CrossEntropyKernel::kStreamed},
      {"trainscale-held-direct", CrossEntropyKernel::kHeldDirect}};
  for (const auto& [impl, kernel] : forced) {
    for (const char* op : {"cross_entropy_forward", "cross_entropy_forward_with_grad"}) {
      if (kernel == CrossEntropyKernel::kStreamed && std::string_view(op) != "cross_entropy_forward") continue;
      r.add_opt_in(op, impl, [kernel](const Case& c) {
        Implementation forced_kernel;
        forced_kernel.run = forward_entry(c, kernel);
        return std::optional<Implementation>(std::move(forced_kernel));
      });
    }
  }
  const auto bf16 = std::vector<DType>{DType::kBFloat16};
  std::vector<Shape> dsv3;
  for (std::int64_t m : {4096, 16384, 65536}) {
    for (std::int64_t v : {3072, 6144, 8192, 12288}) dsv3.push_back({m, v});
  }
  for (const char* op : {"cross_entropy_forward", "cross_entropy_forward_with_grad"}) {
    r.add_configs("smoke", op, {{64, 1000}}, {DType::kFloat32, DType::kBFloat16});
    r.add_configs("quack", op, quack_shapes(), bf16);
    r.add_configs("dsv3", op, dsv3, bf16);
    r.add_configs("llama", op, {{kLlamaTokens, kLlamaVocab}}, bf16);
  }
});

}  // namespace
}  // namespace trainscale::bench::cases
