// FP8 (e4m3) quantization at every granularity, optionally with the transposed copy (q_t and
// its scales from the same read of x); bit-exact against the reference. Config M x N.
#include "bench/cases/case_util.h"
#include "trainscale/fp8.h"

namespace trainscale::bench::cases {
namespace {

Shape scales_shape(Fp8Granularity granularity, std::int64_t m, std::int64_t n) {
  switch (granularity) {
    case Fp8Granularity::kTensor: return {1};
    case Fp8Granularity::kRow: return {m};
    case Fp8Granularity::kTile1x128: return {m, (n + 127) / 128};
    case Fp8Granularity::kBlock128x128: return {(m + 127) / 128, (n + 127) / 128};
  }
  return {};
}

Case fp8_quantize_case(const char* op, std::span<const std::int64_t> shape, DType dtype, Fp8Granularity granularity,
                       bool transposed) {
  Case c = begin_case(op, "fp8", shape, dtype, 2, "MxN");
  const std::int64_t m = c.shape[0], n = c.shape[1];
  c.tensors = {input("x", dtype, {m, n}), output("q", DType::kFloat8E4M3, {m, n}),
               output("scales", DType::kFloat32, scales_shape(granularity, m, n))};
  if (transposed) {
    c.tensors.push_back(output("q_t", DType::kFloat8E4M3, {n, m}));
    c.tensors.push_back(output("scales_t", DType::kFloat32, scales_shape(granularity, n, m)));
  }
  // The contract is float32 arithmetic on x as stored: the reference sees the same dtypes and
  // must agree bit for bit.
  for (TensorSpec& t : c.tensors) {
    t.reference_dtype = t.dtype;
    t.tolerance = 0.0;
  }
  c.spec("x").lo = -100.0;
  c.spec("x").hi = 100.0;
  c.bytes = traffic(c.tensors);
  c.flops = 3.0 * static_cast<double>(m * n);  // |x|, max, divide
  // A tensor-wide amax or a transposed copy couples rows: the gate compares every row.
  c.rows_independent = !transposed && granularity != Fp8Granularity::kTensor &&
                       granularity != Fp8Granularity::kBlock128x128;
  Fp8QuantizeOptions options;
  options.granularity = granularity;
  const auto [x, q, scales] = c.ids("x", "q", "scales");
  if (transposed) {
    const auto [q_t, scales_t] = c.ids("q_t", "scales_t");
    c.entry = [=](CaseTensors t, cudaStream_t s) {
      fp8_quantize(t[x], t[q], t[scales], t[q_t], t[scales_t], options, s);
    };
  } else {
    c.entry = [=](CaseTensors t, cudaStream_t s) { fp8_quantize(t[x], t[q], t[scales], {}, {}, options, s); };
  }
  c.reference = on_cpu(c.entry);
  return c;
}

struct Fp8Op {
  const char* name;
  Fp8Granularity granularity;
  bool transposed;
};
constexpr Fp8Op kFp8Ops[] = {
    {"fp8_quantize_tensor", Fp8Granularity::kTensor, false},
    {"fp8_quantize_row", Fp8Granularity::kRow, false},
    {"fp8_quantize_1x128", Fp8Granularity::kTile1x128, false},
    {"fp8_quantize_128x128", Fp8Granularity::kBlock128x128, false},
    {"fp8_quantize_1x128_t", Fp8Granularity::kTile1x128, true},
    {"fp8_quantize_128x128_t", Fp8Granularity::kBlock128x128, true},
};

const Registrar kRegister([](Registry& r) {
  const auto bf16 = std::vector<DType>{DType::kBFloat16};
  for (const Fp8Op& op : kFp8Ops) {
    r.add_op({op.name, "fp8", "M x N", [op](std::span<const std::int64_t> s, DType d) {
                return fp8_quantize_case(op.name, s, d, op.granularity, op.transposed);
              }});
    r.add_configs("smoke", op.name, {{64, 512}}, {DType::kFloat32, DType::kBFloat16});
    r.add_configs("dsv3", op.name, dsv3_row_shapes(), bf16);  // 65536 x 8192: issue 5's target
    r.add_configs("llama", op.name, {{kLlamaTokens, kLlamaHidden}, {kLlamaTokens, kLlamaFfn}}, bf16);
  }
});

}  // namespace
}  // namespace trainscale::bench::cases
