// Attention forward and backward. Config B x Hq x Hkv x S x D x causal (0 or 1); Sq = Sk = S.
#include <cmath>
#include <functional>
#include <optional>
#include <utility>

#include "bench/baselines/cudnn_sdpa.h"
#include "bench/cases/case_util.h"
#include "trainscale/attention.h"

namespace trainscale::bench::cases {
namespace {

constexpr const char* kDoc = "BxHqxHkvxSxDxcausal";

struct Dims {
  std::int64_t b, hq, hkv, s, d;
  bool causal;
};

Dims dims_of(const Case& c) {
  const auto& x = c.shape;
  if (x[5] != 0 && x[5] != 1) throw Unsupported("causal must be 0 or 1, got " + std::to_string(x[5]));
  if (x[1] % x[2] != 0) throw Unsupported("Hq must be a multiple of Hkv");
  return {x[0], x[1], x[2], x[3], x[4], x[5] == 1};
}

AttentionOptions options_of(const Dims& d) {
  AttentionOptions options;
  options.causal = d.causal;
  return options;
}

// 2 GEMMs of 2*S*S*D per head (QK^T and PV), half of them masked away when causal.
double forward_flops(const Dims& d) {
  return 4.0 * static_cast<double>(d.b * d.hq) * static_cast<double>(d.s) * static_cast<double>(d.s) *
         static_cast<double>(d.d) * (d.causal ? 0.5 : 1.0);
}

// Saved log-sum-exp around log(S) keeps the recomputed probabilities near normalized.
TensorSpec saved_lse(const Dims& d) {
  TensorSpec t = input("lse", DType::kFloat32, {d.b, d.hq, d.s});
  t.lo = std::log(static_cast<double>(d.s));
  t.hi = t.lo + 1.0;
  return t;
}

// Each kv head with its query heads is independent of the others: the gate of a long sequence
// checks a few such groups against the fp64 reference rather than every head.
void group_by_kv_head(Case& c, const Dims& d) {
  c.groups = d.hkv;
  for (TensorSpec& t : c.tensors) {
    if (t.role != Role::kScratch) t.group_dim = t.name == "lse" ? 1 : 2;
  }
}

// The CUDA kernels (src/ops/attention/attention_{fwd,bwd}_*.cu) take bf16/fp16 with head dims
// 64/128/256; other cases are UNSUPPORTED rows rather than failures.
void require_cuda_kernel(const TensorView& q, DType dtype, const Dims& d, const char* direction) {
  if (q.device.is_cuda() && (!(dtype == DType::kBFloat16 || dtype == DType::kFloat16) ||
                             !(d.d == 64 || d.d == 128 || d.d == 256))) {
    throw Unsupported(std::string("the CUDA attention ") + direction +
                      " takes bf16/fp16 with head dim 64, 128 or 256");
  }
}

// Our forward on a case's tensors with the case's options, the tile schedule as given.
std::function<void(CaseTensors, cudaStream_t)> forward_entry(const Case& c, AttentionSchedule schedule) {
  const Dims d = dims_of(c);
  AttentionOptions options = options_of(d);
  options.schedule = schedule;
  const auto [q, k, v, out, lse] = c.ids("q", "k", "v", "out", "lse");
  return [=, dtype = c.dtype](CaseTensors t, cudaStream_t s) {
    require_cuda_kernel(t[q], dtype, d, "forward");
    attention_forward(t[q], t[k], t[v], t[out], t[lse], options, s);
  };
}

Case attention_forward_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case("attention_forward", "attention", shape, dtype, 6, kDoc);
  const Dims d = dims_of(c);
  const AttentionOptions options = options_of(d);
  c.tensors = {input("q", dtype, {d.b, d.s, d.hq, d.d}), input("k", dtype, {d.b, d.s, d.hkv, d.d}),
               input("v", dtype, {d.b, d.s, d.hkv, d.d}), output("out", dtype, {d.b, d.s, d.hq, d.d}),
               output("lse", DType::kFloat32, {d.b, d.hq, d.s})};
  c.bytes = traffic(c.tensors);
  c.flops = forward_flops(d);
  c.bound = Bound::kCompute;
  group_by_kv_head(c, d);
  const auto [q, k, v, out, lse] = c.ids("q", "k", "v", "out", "lse");
  c.reference = on_cpu([=](CaseTensors t, cudaStream_t s) {
    attention_forward(t[q], t[k], t[v], t[out], t[lse], options, s);
  });
  c.entry = forward_entry(c, AttentionSchedule::kAuto);
  return c;
}

// Our backward on a case's tensors with the case's options, deterministic or not.
std::function<void(CaseTensors, cudaStream_t)> backward_entry(const Case& c, bool deterministic) {
  const Dims d = dims_of(c);
  AttentionOptions options = options_of(d);
  options.deterministic = deterministic;
  const auto [dout, q, k, v, out, lse, dq, dk, dv, workspace] =
      c.ids("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "workspace");
  return [=, dtype = c.dtype](CaseTensors t, cudaStream_t s) {
    require_cuda_kernel(t[q], dtype, d, "backward");
    attention_backward({.dout = t[dout], .q = t[q], .k = t[k], .v = t[v], .out = t[out], .lse = t[lse],
                        .dq = t[dq], .dk = t[dk], .dv = t[dv], .workspace = t[workspace]},
                       options, s);
  };
}

Case attention_backward_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case("attention_backward", "attention", shape, dtype, 6, kDoc);
  const Dims d = dims_of(c);
  const Shape q_shape = {d.b, d.s, d.hq, d.d}, kv_shape = {d.b, d.s, d.hkv, d.d};
  c.tensors = {input("dout", dtype, q_shape), input("q", dtype, q_shape),    input("k", dtype, kv_shape),
               input("v", dtype, kv_shape),   input("out", dtype, q_shape),  saved_lse(d),
               output("dq", dtype, q_shape),  output("dk", dtype, kv_shape), output("dv", dtype, kv_shape),
               scratch("workspace", cuda_workspace_bytes([&] {
                         return attention_backward_workspace_bytes(TensorView(nullptr, dtype, {d.b, d.s, d.hq, d.d}));
                       }))};
  c.bytes = traffic(c.tensors);
  c.flops = 2.5 * forward_flops(d);  // 5 GEMMs to the forward's 2
  c.bound = Bound::kCompute;
  group_by_kv_head(c, d);
  c.entry = backward_entry(c, /*deterministic=*/false);
  c.reference = on_cpu(c.entry);
  return c;
}

std::vector<Shape> attention_suite() {
  std::vector<Shape> shapes;
  for (const auto& [b, h, s, d] : {std::array<std::int64_t, 4>{1, 1, 128, 64}, {8, 4, 128, 64}, {32, 8, 128, 64},
                                   {32, 8, 256, 64}}) {
    shapes.push_back({b, h, h, s, d, 0});
  }
  // 16k tokens x hidden 2048.
  for (std::int64_t d : {64, 128}) {
    for (std::int64_t s = 512; s <= 16384; s *= 2) {
      for (std::int64_t causal : {0, 1}) shapes.push_back({16384 / s, 2048 / d, 2048 / d, s, d, causal});
    }
  }
  // Head dim 256 on the same 16k tokens x hidden 2048.
  for (std::int64_t s : {4096, 8192, 16384}) {
    for (std::int64_t causal : {0, 1}) shapes.push_back({16384 / s, 8, 8, s, 256, causal});
  }
  // Grouped-query attention at a Llama shape (32 query heads on 8 kv heads, D 128, 16k tokens),
  // next to the same shape without GQA.
  for (std::int64_t kv_heads : {8, 32}) {
    for (std::int64_t causal : {0, 1}) shapes.push_back({2, 32, kv_heads, 8192, 128, causal});
  }
  return shapes;
}

const Registrar kRegister([](Registry& r) {
  r.add_op({"attention_forward", "attention", kDoc, attention_forward_case});
  r.add_op({"attention_backward", "attention", kDoc, attention_backward_case});
  const auto bf16 = std::vector<DType>{DType::kBFloat16};
  for (const char* op : {"attention_forward", "attention_backward"}) {
    r.add_configs("smoke", op, {{1, 4, 2, 64, 32, 1}}, {DType::kFloat32, DType::kBFloat16});
    r.add_configs("attention", op, attention_suite(), bf16);
    r.add_configs("llama", op, {{1, kLlamaHeads, kLlamaKvHeads, kLlamaTokens, kLlamaHeadDim, 1}}, bf16);
  }
  // The forward's tile schedule forced (AttentionSchedule).
  for (const auto& [impl, schedule] : {std::pair{"trainscale-static", AttentionSchedule::kStatic},
                                       std::pair{"trainscale-dynamic", AttentionSchedule::kDynamic}}) {
    r.add_opt_in("attention_forward", impl, [schedule](const Case& c) {
      Implementation forced;
      forced.run = forward_entry(c, schedule);
      return std::optional<Implementation>(std::move(forced));
    });
  }
  // The backward's deterministic mode (AttentionOptions::deterministic).
  r.add_opt_in("attention_backward", "trainscale-deterministic", [](const Case& c) {
    Implementation forced;
    forced.run = backward_entry(c, /*deterministic=*/true);
    return std::optional<Implementation>(std::move(forced));
  });
  // A shape the CUDA forward runs (head dim 64, a sequence off its tiles), so smoke reaches it.
  r.add_configs("smoke", "attention_forward", {{1, 4, 2, 100, 64, 1}}, bf16);

  // cuDNN SDPA (same tensors, causal flag and default scale as the cases; lse is its stats).
  if (cudnn_baselines_built()) {
    r.add_baseline("attention_forward", "cudnn", [](const Case& c) {
      return cudnn_sdpa_baseline(CudnnSdpaOp::kForward, c, options_of(dims_of(c)));
    });
    r.add_baseline("attention_backward", "cudnn", [](const Case& c) {
      return cudnn_sdpa_baseline(CudnnSdpaOp::kBackward, c, options_of(dims_of(c)));
    });
  }
});

}  // namespace
}  // namespace trainscale::bench::cases
