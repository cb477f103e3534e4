// Newton-Schulz orthogonalization (5 quintic steps, Muon's coefficients). Config R x C.
#include <algorithm>
#include <cstddef>

#include "bench/cases/case_util.h"
#include "trainscale/newton_schulz.h"

namespace trainscale::bench::cases {
namespace {

// The CUDA path's workspace (a build without CUDA needs none). The query reads the shape and
// dtype, never the data, but its argument check wants a non-null pointer.
std::int64_t workspace_bytes(std::int64_t rows, std::int64_t cols, DType dtype) {
  static std::byte placeholder;
  return static_cast<std::int64_t>(newton_schulz_workspace_bytes(TensorView(&placeholder, dtype, {rows, cols})));
}

Case newton_schulz_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case("newton_schulz", "newton_schulz", shape, dtype, 2, "RxC");
  const std::int64_t rows = c.shape[0], cols = c.shape[1];
  // Rows coupled: a large case is gated on the problem of its first rows (Case::flops_of_rows).
  c.tensors = {input("g", dtype, {rows, cols}), output("out", dtype, {rows, cols}),
               scratch("workspace", workspace_bytes(rows, cols, dtype))};
  // X is stored in the input's dtype between the five steps, so its rounding compounds: the
  // fp64 reference is 1.1-1.5 % away in bf16 and 0.14-0.17 % in fp16 (tests/newton_schulz_cuda_test.cc).
  if (dtype == DType::kBFloat16) c.tensors[1].tolerance = 3e-2;
  if (dtype == DType::kFloat16) c.tensors[1].tolerance = 5e-3;
  c.bytes = traffic(c.tensors);
  // Per step, with r = min(R, C), n = max(R, C): X X^T (2 r^2 n), A A (2 r^3), B X (2 r^2 n).
  c.flops_of_rows = [cols](std::int64_t rows_) {
    const auto r = static_cast<double>(std::min(rows_, cols)), n = static_cast<double>(std::max(rows_, cols));
    return NewtonSchulzOptions{}.steps * (4.0 * r * r * n + 2.0 * r * r * r);
  };
  c.flops = c.flops_of_rows(rows);
  c.bound = Bound::kCompute;
  const auto [g, out, workspace] = c.ids("g", "out", "workspace");
  c.entry = [=](CaseTensors t, cudaStream_t s) { newton_schulz(t[g], t[out], {}, t[workspace], s); };
  c.reference = on_cpu(c.entry);
  return c;
}

const Registrar kRegister([](Registry& r) {
  r.add_op({"newton_schulz", "newton_schulz", "R x C", newton_schulz_case});
  r.add_configs("smoke", "newton_schulz", {{64, 128}}, {DType::kFloat32, DType::kBFloat16});
  // Llama-3-8B weights: attention projections and the MLP.
  r.add_configs("llama", "newton_schulz", {{kLlamaHidden, kLlamaHidden}, {kLlamaHidden, kLlamaFfn}},
                {DType::kBFloat16});
});

}  // namespace
}  // namespace trainscale::bench::cases
