// Newton-Schulz orthogonalization (5 quintic steps, Muon's coefficients) of one matrix (config
// R x C) or of a batch of matrices of one shape (newton_schulz_batched, N x R x C, with the
// baseline "per-matrix": one call per matrix), and the Muon step over N parameters of one shape
// (muon_step, N x R x C, one list call).
#include <algorithm>
#include <cstddef>
#include <functional>
#include <optional>
#include <vector>

#include "bench/cases/case_util.h"
#include "ops/newton_schulz/newton_schulz_internal.h"
#include "trainscale/newton_schulz.h"

namespace trainscale::bench::cases {
namespace {

// The CUDA paths' workspaces (a build without CUDA needs none). The queries read the shape and
// dtype, never the data, but their argument checks want a non-null pointer.
std::int64_t workspace_bytes(std::int64_t count, std::int64_t rows, std::int64_t cols, DType dtype) {
  static std::byte placeholder;
  return static_cast<std::int64_t>(
      newton_schulz_workspace_bytes(TensorView(&placeholder, dtype, {count, rows, cols})));
}
std::int64_t muon_workspace_bytes(std::int64_t count, std::int64_t rows, std::int64_t cols, DType dtype) {
  static std::byte placeholder;
  return static_cast<std::int64_t>(muon_step_workspace_bytes(TensorView(&placeholder, dtype, {rows, cols}), count));
}

// FLOPs that `steps` steps on an R x C matrix must do: with r = min(R, C), n = max(R, C), per step
// one triangle of the symmetric X X^T (r^2 n) and A A (r^3), and B X (2 r^2 n). The dense
// products do 4 r^2 n + 2 r^3, so % of the GEMM roofline stays below 100 for any split of the
// symmetric products (docs/perf/newton_schulz.md). The gate's FLOP budget reads the same count
// (the fp64 reference runs the dense products, 1.5x it at R = C).
double ns_flops(std::int64_t rows, std::int64_t cols) {
  const auto r = static_cast<double>(std::min(rows, cols)), n = static_cast<double>(std::max(rows, cols));
  return NewtonSchulzOptions{}.steps * (3.0 * r * r * n + r * r * r);
}

// X is stored in the input's dtype between the five steps, so its rounding compounds: the fp64
// reference is 1.1-1.5 % away in bf16 and 0.14-0.17 % in fp16 (tests/newton_schulz_cuda_test.cc).
std::optional<double> ns_tolerance(DType dtype) {
  if (dtype == DType::kBFloat16) return 3e-2;
  if (dtype == DType::kFloat16) return 5e-3;
  return std::nullopt;
}

// Matrix n of a batch [N, R, C] as a [R, C] view.
TensorView matrix(const TensorView& t, std::int64_t n) {
  return TensorView(static_cast<char*>(t.data) + n * t.stride(0) * static_cast<std::int64_t>(t.element_size()),
                    t.dtype, {t.size(1), t.size(2)}, {t.stride(1), 1}, t.device);
}

Case newton_schulz_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case("newton_schulz", "newton_schulz", shape, dtype, 2, "RxC");
  const std::int64_t rows = c.shape[0], cols = c.shape[1];
  // Rows coupled: a large case is gated on the problem of its first rows (Case::flops_of_rows).
  c.tensors = {input("g", dtype, {rows, cols}), output("out", dtype, {rows, cols}),
               scratch("workspace", workspace_bytes(1, rows, cols, dtype))};
  c.spec("out").tolerance = ns_tolerance(dtype);
  c.bytes = traffic(c.tensors);
  c.flops_of_rows = [cols](std::int64_t rows_) { return ns_flops(rows_, cols); };
  c.flops = c.flops_of_rows(rows);
  c.bound = Bound::kCompute;
  const auto [g, out, workspace] = c.ids("g", "out", "workspace");
  c.entry = [=](CaseTensors t, cudaStream_t s) { newton_schulz(t[g], t[out], {}, t[workspace], s); };
  c.reference = on_cpu(c.entry);
  return c;
}

// The matrices are independent: the gate checks a run of whole ones (groups along dim 0).
Case newton_schulz_batched_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case("newton_schulz_batched", "newton_schulz", shape, dtype, 3, "NxRxC");
  const std::int64_t count = c.shape[0], rows = c.shape[1], cols = c.shape[2];
  c.tensors = {input("g", dtype, {count, rows, cols}, false), output("out", dtype, {count, rows, cols}, false),
               scratch("workspace", workspace_bytes(count, rows, cols, dtype))};
  c.spec("g").group_dim = 0;
  c.spec("out").group_dim = 0;
  c.spec("out").tolerance = ns_tolerance(dtype);
  c.groups = count;
  c.bytes = traffic(c.tensors);
  c.flops = static_cast<double>(count) * ns_flops(rows, cols);
  c.flops_of_rows = [cols](std::int64_t rows_) { return ns_flops(rows_, cols); };  // one matrix
  c.bound = Bound::kCompute;
  const auto [g, out, workspace] = c.ids("g", "out", "workspace");
  c.entry = [=](CaseTensors t, cudaStream_t s) { newton_schulz(t[g], t[out], {}, t[workspace], s); };
  c.reference = on_cpu(c.entry);
  return c;
}

#if TRAINSCALE_HAVE_CUDA
// Opt-in: the CUDA path with its symmetric products split into k x k blocks, or by the tile
// triangle (kGramTriangle, where it applies), whatever gram_blocks(p) picks (1: dense products),
// so one run compares the splits.
BaselineFactory with_gram_blocks(int k) {
  return [k](const Case& c) {
    const auto [g, out, workspace] = c.ids("g", "out", "workspace");
    Implementation impl;
    impl.run = [=](CaseTensors t, cudaStream_t s) {
      ops::newton_schulz::newton_schulz_cuda(t[g], t[out], {}, t[workspace], s, k);
    };
    return std::optional<Implementation>(std::move(impl));
  };
}
#endif

// One call per matrix, on the batch's workspace (one matrix needs a prefix of it).
std::optional<Implementation> per_matrix_baseline(const Case& c) {
  const auto [g, out, workspace] = c.ids("g", "out", "workspace");
  Implementation impl;
  impl.run = [=](CaseTensors t, cudaStream_t s) {
    for (std::int64_t n = 0; n < t[g].size(0); ++n) newton_schulz(matrix(t[g], n), matrix(t[out], n), {}, t[workspace], s);
  };
  return impl;
}

// The muon_step cases' options.
const MuonOptions kMuonOptions{.weight_decay = 0.1};

// muon_step with `options` on the N parameters [R, C] of a muon_step case, stacked in
// [N, R, C] tensors and passed as a list (the optimizer's call).
std::function<void(CaseTensors, cudaStream_t)> muon_step_stacked(const Case& c, const MuonOptions& options) {
  const auto [param, grad, buffer, workspace] = c.ids("param", "grad", "momentum_buffer", "workspace");
  return [=](CaseTensors t, cudaStream_t s) {
    std::vector<TensorView> p, g, b;
    for (std::int64_t n = 0; n < t[param].size(0); ++n) {
      p.push_back(matrix(t[param], n));
      g.push_back(matrix(t[grad], n));
      b.push_back(matrix(t[buffer], n));
    }
    muon_step(p, g, b, options, t[workspace], s);
  };
}

Case muon_step_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case("muon_step", "newton_schulz", shape, dtype, 3, "NxRxC");
  const std::int64_t count = c.shape[0], rows = c.shape[1], cols = c.shape[2];
  c.tensors = {in_out("param", dtype, {count, rows, cols}, false), input("grad", dtype, {count, rows, cols}, false),
               in_out("momentum_buffer", DType::kFloat32, {count, rows, cols}, false),
               scratch("workspace", muon_workspace_bytes(count, rows, cols, dtype))};
  for (const char* name : {"param", "grad", "momentum_buffer"}) c.spec(name).group_dim = 0;
  c.spec("momentum_buffer").reference_dtype = DType::kFloat32;
  c.groups = count;
  c.bytes = traffic(c.tensors);
  c.flops = static_cast<double>(count) * ns_flops(rows, cols);
  c.flops_of_rows = [cols](std::int64_t rows_) { return ns_flops(rows_, cols); };  // one parameter
  c.bound = Bound::kCompute;
  c.entry = muon_step_stacked(c, kMuonOptions);
  c.reference = on_cpu(c.entry);
  return c;
}

// Opt-in: the CUDA path with NewtonSchulzMethod::kGram (newton_schulz and muon_step cases).
std::optional<Implementation> gram_method(const Case& c) {
  Implementation impl;
  if (c.op == "muon_step") {
    MuonOptions options = kMuonOptions;
    options.newton_schulz.method = NewtonSchulzMethod::kGram;
    impl.run = muon_step_stacked(c, options);
  } else {
    const auto [g, out, workspace] = c.ids("g", "out", "workspace");
    impl.run = [=](CaseTensors t, cudaStream_t s) {
      newton_schulz(t[g], t[out], {.method = NewtonSchulzMethod::kGram}, t[workspace], s);
    };
  }
  return impl;
}

const Registrar kRegister([](Registry& r) {
  r.add_op({"newton_schulz", "newton_schulz", "R x C", newton_schulz_case});
  r.add_configs("smoke", "newton_schulz", {{64, 128}}, {DType::kFloat32, DType::kBFloat16});
  // Llama-3-8B weights: attention projections and the MLP; the largest square the issue targets.
  r.add_configs("llama", "newton_schulz", {{kLlamaHidden, kLlamaHidden}, {kLlamaHidden, kLlamaFfn}, {8192, 8192}},
                {DType::kBFloat16});
#if TRAINSCALE_HAVE_CUDA
  r.add_opt_in("newton_schulz", "trainscale-dense", with_gram_blocks(1));
  r.add_opt_in("newton_schulz", "trainscale-blocks-2", with_gram_blocks(2));
  r.add_opt_in("newton_schulz", "trainscale-blocks-4", with_gram_blocks(4));
  r.add_opt_in("newton_schulz", "trainscale-triangle", with_gram_blocks(ops::newton_schulz::kGramTriangle));
#endif
  r.add_opt_in("newton_schulz", "trainscale-gram", gram_method);
  r.add_op({"newton_schulz_batched", "newton_schulz", "N x R x C", newton_schulz_batched_case});
  r.add_baseline("newton_schulz_batched", "per-matrix", per_matrix_baseline);
  r.add_configs("smoke", "newton_schulz_batched", {{4, 64, 128}}, {DType::kBFloat16});
  // A model's layers of one shape: 32 matrices of 4096 x 4096. The "muon" suite's cases gate on
  // whole matrices (teraflops of fp64 on the host), so they stay out of the quick llama suite.
  r.add_configs("muon", "newton_schulz_batched", {{32, kLlamaHidden, kLlamaHidden}}, {DType::kBFloat16});
  r.add_op({"muon_step", "newton_schulz", "N x R x C", muon_step_case});
  r.add_configs("smoke", "muon_step", {{3, 96, 64}}, {DType::kBFloat16});
  // 4 Llama-3-8B decoder layers, per shape: q/o 4096 x 4096 (8), k/v 1024 x 4096 (8),
  // gate/up 14336 x 4096 (8), down 4096 x 14336 (4).
  r.add_configs("muon", "muon_step",
                {{8, kLlamaHidden, kLlamaHidden}, {8, kLlamaKvHeads * kLlamaHeadDim, kLlamaHidden},
                 {8, kLlamaFfn, kLlamaHidden}, {4, kLlamaHidden, kLlamaFfn}},
                {DType::kBFloat16});
  r.add_opt_in("muon_step", "trainscale-gram", gram_method);
});

}  // namespace
}  // namespace trainscale::bench::cases
