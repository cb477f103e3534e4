// RoPE: q and k rotated in one call (NeoX pairing, angles from theta, out of place).
// Config B x S x Hq x Hk x D.
#include "bench/cases/case_util.h"
#include "trainscale/rope.h"

namespace trainscale::bench::cases {
namespace {

constexpr const char* kDoc = "BxSxHqxHkxD";

Case rope_case(const char* op, std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case(op, "rope", shape, dtype, 5, kDoc);
  const std::int64_t b = c.shape[0], s = c.shape[1], hq = c.shape[2], hk = c.shape[3], d = c.shape[4];
  // Batches are independent (positions run 0..S-1 in each), so dim 0 can be sampled.
  c.tensors = {input("q", dtype, {b, s, hq, d}), input("k", dtype, {b, s, hk, d}), output("q_out", dtype, {b, s, hq, d}),
               output("k_out", dtype, {b, s, hk, d})};
  c.bytes = traffic(c.tensors);
  c.flops = 3.0 * static_cast<double>(b * s * (hq + hk) * d);  // two multiplies and an add per element
  c.rows_independent = true;
  return c;
}

Case rope_forward_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = rope_case("rope_forward", shape, dtype);
  const auto [q, k, q_out, k_out] = c.ids("q", "k", "q_out", "k_out");
  c.entry = [=](CaseTensors t, cudaStream_t s) { rope_forward(t[q], t[k], t[q_out], t[k_out], {}, {}, {}, {}, s); };
  c.reference = on_cpu(c.entry);
  return c;
}

Case rope_backward_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = rope_case("rope_backward", shape, dtype);
  // The gradients take the forward's places: dq_out and dk_out in q and k, dq and dk in the outputs.
  const auto [dq_out, dk_out, dq, dk] = c.ids("q", "k", "q_out", "k_out");
  c.entry = [=](CaseTensors t, cudaStream_t s) { rope_backward(t[dq_out], t[dk_out], t[dq], t[dk], {}, {}, {}, {}, s); };
  c.reference = on_cpu(c.entry);
  return c;
}

const Registrar kRegister([](Registry& r) {
  r.add_op({"rope_forward", "rope", kDoc, rope_forward_case});
  r.add_op({"rope_backward", "rope", kDoc, rope_backward_case});
  for (const char* op : {"rope_forward", "rope_backward"}) {
    r.add_configs("smoke", op, {{2, 16, 4, 2, 64}}, {DType::kFloat32, DType::kBFloat16});
    // Llama-3-8B at 8192 tokens, and the baseline shape of docs/perf/rope.md (4 x 4096 tokens).
    r.add_configs("llama", op,
                  {{1, kLlamaTokens, kLlamaHeads, kLlamaKvHeads, kLlamaHeadDim},
                   {4, 4096, kLlamaHeads, kLlamaKvHeads, kLlamaHeadDim}},
                  {DType::kBFloat16});
  }
});

}  // namespace
}  // namespace trainscale::bench::cases
