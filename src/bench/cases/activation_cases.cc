// Activations: GELU (erf and tanh), SiLU, SwiGLU and GeGLU (separate a / b, and packed: the two
// halves of one [M, 2F] tensor), forward and backward; M rows of N (F for the gated ones).
#include "bench/cases/case_util.h"
#include "trainscale/activation.h"

namespace trainscale::bench::cases {
namespace {

using Unary = void (*)(const TensorView&, TensorView, cudaStream_t);
using UnaryBackward = void (*)(const TensorView&, const TensorView&, TensorView, cudaStream_t);
using Gated = void (*)(const TensorView&, const TensorView&, TensorView, cudaStream_t);
using GatedBackward = void (*)(const TensorView&, const TensorView&, const TensorView&, TensorView, TensorView,
                               cudaStream_t);

void gelu_erf_forward(const TensorView& x, TensorView y, cudaStream_t s) {
  gelu_forward(x, y, GeluApproximation::kNone, s);
}
void gelu_erf_backward(const TensorView& dy, const TensorView& x, TensorView dx, cudaStream_t s) {
  gelu_backward(dy, x, dx, GeluApproximation::kNone, s);
}
void gelu_tanh_forward(const TensorView& x, TensorView y, cudaStream_t s) {
  gelu_forward(x, y, GeluApproximation::kTanh, s);
}
void gelu_tanh_backward(const TensorView& dy, const TensorView& x, TensorView dx, cudaStream_t s) {
  gelu_backward(dy, x, dx, GeluApproximation::kTanh, s);
}
void geglu_erf_forward(const TensorView& a, const TensorView& b, TensorView y, cudaStream_t s) {
  geglu_forward(a, b, y, GeluApproximation::kNone, s);
}
void geglu_erf_backward(const TensorView& dy, const TensorView& a, const TensorView& b, TensorView da,
                        TensorView db, cudaStream_t s) {
  geglu_backward(dy, a, b, da, db, GeluApproximation::kNone, s);
}

// Element-wise ops: every row independent; FLOPs are nominal (memory-bound).
Case elementwise(const char* op, std::span<const std::int64_t> shape, DType dtype, std::vector<TensorSpec> tensors,
                 double flops_per_element) {
  Case c = begin_case(op, "activation", shape, dtype, 2, "MxN");
  c.tensors = std::move(tensors);
  c.bytes = traffic(c.tensors);
  c.flops = flops_per_element * static_cast<double>(numel(c.shape));
  c.rows_independent = true;
  return c;
}

CaseFactory unary_forward(const char* op, Unary fn) {
  return [=](std::span<const std::int64_t> shape, DType dtype) {
    const Shape mn(shape.begin(), shape.end());
    Case c = elementwise(op, shape, dtype, {input("x", dtype, mn), output("y", dtype, mn)}, 8.0);
    const auto [x, y] = c.ids("x", "y");
    c.entry = [=](CaseTensors t, cudaStream_t s) { fn(t[x], t[y], s); };
    c.reference = on_cpu(c.entry);
    return c;
  };
}

CaseFactory unary_backward(const char* op, UnaryBackward fn) {
  return [=](std::span<const std::int64_t> shape, DType dtype) {
    const Shape mn(shape.begin(), shape.end());
    Case c = elementwise(op, shape, dtype, {input("dy", dtype, mn), input("x", dtype, mn), output("dx", dtype, mn)},
                         12.0);
    const auto [dy, x, dx] = c.ids("dy", "x", "dx");
    c.entry = [=](CaseTensors t, cudaStream_t s) { fn(t[dy], t[x], t[dx], s); };
    c.reference = on_cpu(c.entry);
    return c;
  };
}

using PackedForward = void (*)(const TensorView&, TensorView, cudaStream_t);
using PackedBackward = void (*)(const TensorView&, const TensorView&, TensorView, cudaStream_t);

CaseFactory packed_forward(const char* op, PackedForward fn) {
  return [=](std::span<const std::int64_t> shape, DType dtype) {
    const Shape mf(shape.begin(), shape.end());
    const Shape m2f{mf[0], 2 * mf[1]};
    Case c = elementwise(op, shape, dtype, {input("ab", dtype, m2f), output("y", dtype, mf)}, 9.0);
    const auto [ab, y] = c.ids("ab", "y");
    c.entry = [=](CaseTensors t, cudaStream_t s) { fn(t[ab], t[y], s); };
    c.reference = on_cpu(c.entry);
    return c;
  };
}

CaseFactory packed_backward(const char* op, PackedBackward fn) {
  return [=](std::span<const std::int64_t> shape, DType dtype) {
    const Shape mf(shape.begin(), shape.end());
    const Shape m2f{mf[0], 2 * mf[1]};
    Case c = elementwise(op, shape, dtype, {input("dy", dtype, mf), input("ab", dtype, m2f), output("dab", dtype, m2f)},
                         14.0);
    const auto [dy, ab, dab] = c.ids("dy", "ab", "dab");
    c.entry = [=](CaseTensors t, cudaStream_t s) { fn(t[dy], t[ab], t[dab], s); };
    c.reference = on_cpu(c.entry);
    return c;
  };
}

CaseFactory gated_forward(const char* op, Gated fn) {
  return [=](std::span<const std::int64_t> shape, DType dtype) {
    const Shape mf(shape.begin(), shape.end());
    Case c = elementwise(op, shape, dtype, {input("a", dtype, mf), input("b", dtype, mf), output("y", dtype, mf)}, 9.0);
    const auto [a, b, y] = c.ids("a", "b", "y");
    c.entry = [=](CaseTensors t, cudaStream_t s) { fn(t[a], t[b], t[y], s); };
    c.reference = on_cpu(c.entry);
    return c;
  };
}

CaseFactory gated_backward(const char* op, GatedBackward fn) {
  return [=](std::span<const std::int64_t> shape, DType dtype) {
    const Shape mf(shape.begin(), shape.end());
    Case c = elementwise(op, shape, dtype,
                         {input("dy", dtype, mf), input("a", dtype, mf), input("b", dtype, mf), output("da", dtype, mf),
                          output("db", dtype, mf)},
                         14.0);
    const auto [dy, a, b, da, db] = c.ids("dy", "a", "b", "da", "db");
    c.entry = [=](CaseTensors t, cudaStream_t s) { fn(t[dy], t[a], t[b], t[da], t[db], s); };
    c.reference = on_cpu(c.entry);
    return c;
  };
}

const Registrar kRegister([](Registry& r) {
  r.add_op({"gelu_forward", "activation", "M x N", unary_forward("gelu_forward", gelu_erf_forward)});
  r.add_op({"gelu_backward", "activation", "M x N", unary_backward("gelu_backward", gelu_erf_backward)});
  r.add_op({"gelu_forward_tanh", "activation", "M x N", unary_forward("gelu_forward_tanh", gelu_tanh_forward)});
  r.add_op({"gelu_backward_tanh", "activation", "M x N", unary_backward("gelu_backward_tanh", gelu_tanh_backward)});
  r.add_op({"silu_forward", "activation", "M x N", unary_forward("silu_forward", silu_forward)});
  r.add_op({"silu_backward", "activation", "M x N", unary_backward("silu_backward", silu_backward)});
  r.add_op({"swiglu_forward", "activation", "M x F", gated_forward("swiglu_forward", swiglu_forward)});
  r.add_op({"swiglu_backward", "activation", "M x F", gated_backward("swiglu_backward", swiglu_backward)});
  r.add_op({"geglu_forward", "activation", "M x F", gated_forward("geglu_forward", geglu_erf_forward)});
  r.add_op({"geglu_backward", "activation", "M x F", gated_backward("geglu_backward", geglu_erf_backward)});
  r.add_op({"swiglu_forward_packed", "activation", "M x F", packed_forward("swiglu_forward_packed", swiglu_forward_packed)});
  r.add_op({"swiglu_backward_packed", "activation", "M x F", packed_backward("swiglu_backward_packed", swiglu_backward_packed)});
  const auto bf16 = std::vector<DType>{DType::kBFloat16};
  for (const char* op : {"gelu_forward", "gelu_backward", "gelu_forward_tanh", "gelu_backward_tanh", "silu_forward", "silu_backward", "swiglu_forward",
                         "swiglu_backward", "swiglu_forward_packed", "swiglu_backward_packed", "geglu_forward", "geglu_backward"}) {
    r.add_configs("smoke", op, {{64, 512}}, {DType::kFloat32, DType::kBFloat16});
  }
  // Llama-3-8B MLP at 8192 tokens, and 16384 x 14336 (docs/perf/activation.md).
  for (const char* op : {"swiglu_forward", "swiglu_backward", "swiglu_forward_packed", "swiglu_backward_packed"}) {
    r.add_configs("llama", op, {{kLlamaTokens, kLlamaFfn}, {2 * kLlamaTokens, kLlamaFfn}}, bf16);
  }
  // Issue 5's gelu-tanh target shape (a GPT-style MLP's 4h activation).
  for (const char* op : {"gelu_forward_tanh", "gelu_backward_tanh"}) r.add_configs("llama", op, {{16384, 4096}}, bf16);
  for (const char* op : {"gelu_forward", "silu_forward"}) r.add_configs("sweep", op, sweep_row_shapes(), bf16);
});

}  // namespace
}  // namespace trainscale::bench::cases
