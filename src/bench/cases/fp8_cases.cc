// FP8 (e4m3) quantization with per-row and 1x128-tile scales; bit-exact against the reference.
// Config M x N.
#include "bench/cases/case_util.h"
#include "trainscale/fp8.h"

namespace trainscale::bench::cases {
namespace {

Case fp8_quantize_case(const char* op, std::span<const std::int64_t> shape, DType dtype, Fp8Granularity granularity) {
  Case c = begin_case(op, "fp8", shape, dtype, 2, "MxN");
  const std::int64_t m = c.shape[0], n = c.shape[1];
  const Shape scales_shape = granularity == Fp8Granularity::kRow ? Shape{m} : Shape{m, (n + 127) / 128};
  c.tensors = {input("x", dtype, {m, n}), output("q", DType::kFloat8E4M3, {m, n}),
               output("scales", DType::kFloat32, scales_shape)};
  // The contract is float32 arithmetic on x as stored: the reference sees the same dtypes and
  // must agree bit for bit.
  for (TensorSpec& t : c.tensors) {
    t.reference_dtype = t.dtype;
    t.tolerance = 0.0;
  }
  c.tensors[0].lo = -100.0;
  c.tensors[0].hi = 100.0;
  c.bytes = traffic(c.tensors);
  c.flops = 3.0 * static_cast<double>(m * n);  // |x|, max, divide
  c.rows_independent = true;
  Fp8QuantizeOptions options;
  options.granularity = granularity;
  c.entry = [options](Views t, cudaStream_t s) { fp8_quantize(t[0], t[1], t[2], {}, {}, options, s); };
  c.reference = [options](Views t) { fp8_quantize(t[0], t[1], t[2], {}, {}, options); };
  return c;
}

const Registrar kRegister([](Registry& r) {
  r.add_op({"fp8_quant_row", "fp8", "M x N", [](std::span<const std::int64_t> s, DType d) {
              return fp8_quantize_case("fp8_quant_row", s, d, Fp8Granularity::kRow);
            }});
  r.add_op({"fp8_quant_1x128", "fp8", "M x N", [](std::span<const std::int64_t> s, DType d) {
              return fp8_quantize_case("fp8_quant_1x128", s, d, Fp8Granularity::kTile1x128);
            }});
  const auto bf16 = std::vector<DType>{DType::kBFloat16};
  for (const char* op : {"fp8_quant_row", "fp8_quant_1x128"}) {
    r.add_configs("smoke", op, {{64, 512}}, {DType::kFloat32, DType::kBFloat16});
    r.add_configs("dsv3", op, dsv3_row_shapes(), bf16);
    r.add_configs("llama", op, {{kLlamaTokens, kLlamaHidden}, {kLlamaTokens, kLlamaFfn}}, bf16);
  }
});

}  // namespace
}  // namespace trainscale::bench::cases
