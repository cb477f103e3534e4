// MSE (loss family): forward and backward with the mean reduction, rows of N elements.
#include "bench/cases/case_util.h"
#include "trainscale/loss.h"

namespace trainscale::bench::cases {
namespace {

Case mse_forward_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case("mse_forward", "loss", shape, dtype, 2, "MxN");
  const Shape& mn = c.shape;
  c.tensors = {input("a", dtype, mn), input("b", dtype, mn),
               output("out", DType::kFloat32, {}, /*row_wise=*/false)};
  c.spec("out").reference_dtype = DType::kFloat64;
  c.bytes = traffic(c.tensors);
  c.flops = 3.0 * static_cast<double>(numel(mn));  // subtract, square, accumulate
  c.bound = Bound::kMemory;
  const auto [a, b, out] = c.ids("a", "b", "out");
  c.entry = [=](CaseTensors t, cudaStream_t stream) { mse_forward(t[a], t[b], t[out], Reduction::kMean, stream); };
  c.reference = on_cpu(c.entry);
  return c;
}

Case mse_backward_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case("mse_backward", "loss", shape, dtype, 2, "MxN");
  const Shape& mn = c.shape;
  c.tensors = {input("grad_out", DType::kFloat32, {}, /*row_wise=*/false), input("a", dtype, mn),
               input("b", dtype, mn), output("grad_a", dtype, mn), output("grad_b", dtype, mn)};
  c.spec("grad_out").reference_dtype = DType::kFloat64;
  c.bytes = traffic(c.tensors);
  c.flops = 4.0 * static_cast<double>(numel(mn));  // subtract, two scalings, negate
  c.bound = Bound::kMemory;
  const auto [grad_out, a, b, grad_a, grad_b] = c.ids("grad_out", "a", "b", "grad_a", "grad_b");
  c.entry = [=](CaseTensors t, cudaStream_t stream) {
    mse_backward(t[grad_out], t[a], t[b], t[grad_a], t[grad_b], Reduction::kMean, stream);
  };
  c.reference = on_cpu(c.entry);
  c.rows_independent = true;  // grad_out is one scalar every row sees whole
  return c;
}

const Registrar kRegister([](Registry& r) {
  r.add_op({"mse_forward", "loss", "M x N (mean over all elements)", mse_forward_case});
  r.add_op({"mse_backward", "loss", "M x N (mean reduction)", mse_backward_case});
  for (const char* op : {"mse_forward", "mse_backward"}) {
    r.add_configs("smoke", op, {{64, 256}}, {DType::kFloat32, DType::kBFloat16});
    r.add_configs("quack", op, quack_shapes(), {DType::kBFloat16});
  }
});

}  // namespace
}  // namespace trainscale::bench::cases
