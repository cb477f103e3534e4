// Softmax over the last dim: forward and backward, M rows of N.
#include "bench/cases/case_util.h"
#include "trainscale/softmax.h"
#if TRAINSCALE_HAVE_CUDA
#include "ops/softmax/softmax_cuda.h"
#endif

namespace trainscale::bench::cases {
namespace {

Case softmax_forward_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case("softmax_forward", "softmax", shape, dtype, 2, "MxN");
  const Shape& mn = c.shape;
  c.tensors = {input("x", dtype, mn), output("y", dtype, mn)};
  c.spec("x").lo = -8.0;
  c.spec("x").hi = 8.0;
  c.bytes = traffic(c.tensors);
  c.flops = 5.0 * static_cast<double>(numel(mn));  // max, subtract, exp, sum, scale
  c.rows_independent = true;
  const auto [x, y] = c.ids("x", "y");
  c.entry = [=](CaseTensors t, cudaStream_t s) { softmax_forward(t[x], t[y], s); };
  c.reference = on_cpu(c.entry);
  return c;
}

Case softmax_backward_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case("softmax_backward", "softmax", shape, dtype, 2, "MxN");
  const Shape& mn = c.shape;
  c.tensors = {input("dy", dtype, mn), input("y", dtype, mn), output("dx", dtype, mn)};
  c.spec("y").lo = 0.0;  // probabilities
  c.bytes = traffic(c.tensors);
  c.flops = 4.0 * static_cast<double>(numel(mn));
  c.rows_independent = true;
  const auto [dy, y, dx] = c.ids("dy", "y", "dx");
  c.entry = [=](CaseTensors t, cudaStream_t s) { softmax_backward(t[dy], t[y], t[dx], s); };
  c.reference = on_cpu(c.entry);
  return c;
}

#if TRAINSCALE_HAVE_CUDA
// Opt-ins with the CUDA kernels' feed forced (ops::softmax::SoftmaxFeed), to time the choice:
// trainscale-row-splits (never the direct feed), trainscale-direct (the direct feed wherever it
// takes the rows, clusters included; other rows are reported unsupported).
BaselineFactory forward_fed(ops::softmax::SoftmaxFeed feed) {
  return [feed](const Case& c) {
    const auto [x, y] = c.ids("x", "y");
    Implementation impl;
    impl.run = [=](CaseTensors t, cudaStream_t s) { ops::softmax::softmax_forward_cuda(t[x], t[y], s, feed); };
    return std::optional<Implementation>(std::move(impl));
  };
}

BaselineFactory backward_fed(ops::softmax::SoftmaxFeed feed) {
  return [feed](const Case& c) {
    const auto [dy, y, dx] = c.ids("dy", "y", "dx");
    Implementation impl;
    impl.run = [=](CaseTensors t, cudaStream_t s) {
      ops::softmax::softmax_backward_cuda(t[dy], t[y], t[dx], s, feed);
    };
    return std::optional<Implementation>(std::move(impl));
  };
}
#endif

const Registrar kRegister([](Registry& r) {
  r.add_op({"softmax_forward", "softmax", "M x N", softmax_forward_case});
  r.add_op({"softmax_backward", "softmax", "M x N", softmax_backward_case});
#if TRAINSCALE_HAVE_CUDA
  using ops::softmax::SoftmaxFeed;
  r.add_opt_in("softmax_forward", "trainscale-row-splits", forward_fed(SoftmaxFeed::kRowSplits));
  r.add_opt_in("softmax_backward", "trainscale-row-splits", backward_fed(SoftmaxFeed::kRowSplits));
  r.add_opt_in("softmax_forward", "trainscale-direct", forward_fed(SoftmaxFeed::kDirect));
  r.add_opt_in("softmax_backward", "trainscale-direct", backward_fed(SoftmaxFeed::kDirect));
#endif
  const auto bf16 = std::vector<DType>{DType::kBFloat16};
  for (const char* op : {"softmax_forward", "softmax_backward"}) {
    r.add_configs("smoke", op, {{64, 512}}, {DType::kFloat32, DType::kBFloat16});
    r.add_configs("quack", op, quack_shapes(), bf16);
    r.add_configs("dsv3", op, dsv3_row_shapes(), bf16);
  }
  r.add_configs("sweep", "softmax_forward", sweep_row_shapes(), bf16);
});

}  // namespace
}  // namespace trainscale::bench::cases
