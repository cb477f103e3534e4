// Newton-Schulz orthogonalization (5 quintic steps, Muon's coefficients). Config R x C.
#include <algorithm>

#include "bench/cases/case_util.h"
#include "trainscale/newton_schulz.h"

namespace trainscale::bench::cases {
namespace {

Case newton_schulz_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case("newton_schulz", "newton_schulz", shape, dtype, 2, "RxC");
  const std::int64_t rows = c.shape[0], cols = c.shape[1];
  c.tensors = {input("g", dtype, {rows, cols}, false), output("out", dtype, {rows, cols}, false)};
  c.bytes = traffic(c.tensors);
  // Per step, with r = min(R, C), n = max(R, C): X X^T (2 r^2 n), A A (2 r^3), B X (2 r^2 n).
  const auto r = static_cast<double>(std::min(rows, cols)), n = static_cast<double>(std::max(rows, cols));
  const NewtonSchulzOptions options;
  c.flops = options.steps * (4.0 * r * r * n + 2.0 * r * r * r);
  c.bound = Bound::kCompute;
  const auto [g, out] = c.ids("g", "out");
  c.entry = [=](CaseTensors t, cudaStream_t s) { newton_schulz(t[g], t[out], {}, {}, s); };
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
