// Norm family: RMSNorm forward / backward, fused residual-add + RMSNorm forward / backward,
// LayerNorm forward / backward. M rows of N; weight and bias (and dw, db) in the activation
// dtype, or, for the ops named <op>_fp32_weight (the training suite), in fp32 as mixed-precision
// training keeps them.
// Opt-in implementations force a kernel variant (NormVariant): trainscale-registers,
// trainscale-two-pass, and for the forward ops trainscale-rows, trainscale-pipelined and
// trainscale-ring.
#include "bench/baselines/cudnn_norm.h"
#include "bench/cases/case_util.h"
#include "bench/gate.h"
#include "trainscale/norm.h"

namespace trainscale::bench::cases {
namespace {

// Saved statistics fed to the backward passes: any positive rstd is valid input, since the
// backward uses them as saved rather than recomputing.
TensorSpec saved_rstd(std::int64_t m) {
  TensorSpec t = input("rstd", DType::kFloat32, {m});
  t.lo = 0.5;
  t.hi = 2.0;
  return t;
}

TensorSpec workspace_for(std::int64_t m, std::int64_t n, DType dtype) {
  return scratch("workspace", cuda_workspace_bytes([&] {
                   return norm_backward_workspace_bytes(m, n, dtype, Device::cuda());
                 }));
}

double elements(const Case& c) { return static_cast<double>(numel(c.shape)); }

RMSNormOptions rms(NormVariant variant) {
  RMSNormOptions o;
  o.variant = variant;
  return o;
}

LayerNormOptions layer(NormVariant variant) {
  LayerNormOptions o;
  o.variant = variant;
  return o;
}

// Our entry point of each op on a case's tensors, with the kernel variant it forces (kAuto for
// the case itself). The backward passes take the case's workspace, except in the reference
// (`workspace` false), whose CPU path has no use for one; the forward passes have none.
Entry rmsnorm_forward_entry(const Case& c, NormVariant v, bool /*workspace: none*/) {
  const auto [x, weight, y, rstd] = c.ids("x", "weight", "y", "rstd");
  return [=, o = rms(v)](CaseTensors t, cudaStream_t s) { rmsnorm_forward(t[x], t[weight], t[y], t[rstd], o, s); };
}
Entry rmsnorm_backward_entry(const Case& c, NormVariant v, bool workspace) {
  const auto [dy, x, weight, rstd, dx, dw, ws] = c.ids("dy", "x", "weight", "rstd", "dx", "dw", "workspace");
  return [=, o = rms(v)](CaseTensors t, cudaStream_t s) {
    rmsnorm_backward(t[dy], t[x], t[weight], t[rstd], t[dx], t[dw], workspace ? t[ws] : TensorView{}, o, s);
  };
}
Entry fused_add_rmsnorm_forward_entry(const Case& c, NormVariant v, bool /*workspace: none*/) {
  const auto [x, residual, weight, rstd] = c.ids("x", "residual", "weight", "rstd");
  return [=, o = rms(v)](CaseTensors t, cudaStream_t s) {
    fused_add_rmsnorm_forward(t[x], t[residual], t[weight], t[rstd], o, s);
  };
}
Entry fused_add_rmsnorm_backward_entry(const Case& c, NormVariant v, bool workspace) {
  const auto [dy, d_residual, residual, weight, rstd, dx, dw, ws] =
      c.ids("dy", "d_residual", "residual", "weight", "rstd", "dx", "dw", "workspace");
  return [=, o = rms(v)](CaseTensors t, cudaStream_t s) {
    fused_add_rmsnorm_backward(t[dy], t[d_residual], t[residual], t[weight], t[rstd], t[dx], t[dw],
                               workspace ? t[ws] : TensorView{}, o, s);
  };
}
Entry layernorm_forward_entry(const Case& c, NormVariant v, bool /*workspace: none*/) {
  const auto [x, weight, bias, y, mean, rstd] = c.ids("x", "weight", "bias", "y", "mean", "rstd");
  return [=, o = layer(v)](CaseTensors t, cudaStream_t s) {
    layernorm_forward(t[x], t[weight], t[bias], t[y], t[mean], t[rstd], o, s);
  };
}
Entry layernorm_backward_entry(const Case& c, NormVariant v, bool workspace) {
  const auto [dy, x, weight, mean, rstd, dx, dw, db, ws] =
      c.ids("dy", "x", "weight", "mean", "rstd", "dx", "dw", "db", "workspace");
  return [=, o = layer(v)](CaseTensors t, cudaStream_t s) {
    layernorm_backward({.dy = t[dy], .x = t[x], .weight = t[weight], .mean = t[mean], .rstd = t[rstd],
                        .dx = t[dx], .dw = t[dw], .db = t[db], .workspace = workspace ? t[ws] : TensorView{}},
                       o, s);
  };
}

Case rmsnorm_forward_case(std::span<const std::int64_t> shape, DType dtype, DType param, const char* op) {
  Case c = begin_case(op, "norm", shape, dtype, 2, "MxN");
  const std::int64_t m = c.shape[0], n = c.shape[1];
  c.tensors = {input("x", dtype, {m, n}), input("weight", param, {n}, false), output("y", dtype, {m, n}),
               output("rstd", DType::kFloat32, {m})};
  c.bytes = traffic(c.tensors);
  c.flops = 4.0 * elements(c);  // square, accumulate, two scalings
  c.rows_independent = true;
  c.entry = rmsnorm_forward_entry(c, NormVariant::kAuto, true);
  c.reference = on_cpu(c.entry);
  return c;
}

Case rmsnorm_backward_case(std::span<const std::int64_t> shape, DType dtype, DType param, const char* op) {
  Case c = begin_case(op, "norm", shape, dtype, 2, "MxN");
  const std::int64_t m = c.shape[0], n = c.shape[1];
  c.tensors = {input("dy", dtype, {m, n}),  input("x", dtype, {m, n}),     input("weight", param, {n}, false),
               saved_rstd(m),               output("dx", dtype, {m, n}),   output("dw", param, {n}, false),
               workspace_for(m, n, dtype)};
  c.bytes = traffic(c.tensors);
  c.flops = 8.0 * elements(c);
  c.entry = rmsnorm_backward_entry(c, NormVariant::kAuto, true);
  c.reference = on_cpu(rmsnorm_backward_entry(c, NormVariant::kAuto, false));
  return c;
}

Case fused_add_rmsnorm_case(std::span<const std::int64_t> shape, DType dtype, DType param, const char* op) {
  Case c = begin_case(op, "norm", shape, dtype, 2, "MxN");
  const std::int64_t m = c.shape[0], n = c.shape[1];
  c.tensors = {in_out("x", dtype, {m, n}), in_out("residual", dtype, {m, n}), input("weight", param, {n}, false),
               output("rstd", DType::kFloat32, {m})};
  // rstd comes from the residual rounded to `dtype`; the fp64 reference keeps the exact sum.
  c.spec("rstd").tolerance = default_tolerance(dtype);
  c.bytes = traffic(c.tensors);
  c.flops = 5.0 * elements(c);
  c.rows_independent = true;
  c.entry = fused_add_rmsnorm_forward_entry(c, NormVariant::kAuto, true);
  c.reference = on_cpu(c.entry);
  return c;
}

// The gradient reaches the residual stream twice: through the norm (dy) and straight from the
// next layer (d_residual); dx carries their sum back to both inputs of the add.
Case fused_add_rmsnorm_backward_case(std::span<const std::int64_t> shape, DType dtype, DType param, const char* op) {
  Case c = begin_case(op, "norm", shape, dtype, 2, "MxN");
  const std::int64_t m = c.shape[0], n = c.shape[1];
  c.tensors = {input("dy", dtype, {m, n}),       input("d_residual", dtype, {m, n}), input("residual", dtype, {m, n}),
               input("weight", param, {n}, false), saved_rstd(m),                     output("dx", dtype, {m, n}),
               output("dw", param, {n}, false),  workspace_for(m, n, dtype)};
  c.bytes = traffic(c.tensors);
  c.flops = 9.0 * elements(c);  // rmsnorm_backward's 8 and the add
  c.entry = fused_add_rmsnorm_backward_entry(c, NormVariant::kAuto, true);
  c.reference = on_cpu(fused_add_rmsnorm_backward_entry(c, NormVariant::kAuto, false));
  return c;
}

Case layernorm_forward_case(std::span<const std::int64_t> shape, DType dtype, DType param, const char* op) {
  Case c = begin_case(op, "norm", shape, dtype, 2, "MxN");
  const std::int64_t m = c.shape[0], n = c.shape[1];
  c.tensors = {input("x", dtype, {m, n}),  input("weight", param, {n}, false), input("bias", param, {n}, false),
               output("y", dtype, {m, n}), output("mean", DType::kFloat32, {m}), output("rstd", DType::kFloat32, {m})};
  c.bytes = traffic(c.tensors);
  c.flops = 7.0 * elements(c);
  c.rows_independent = true;
  c.entry = layernorm_forward_entry(c, NormVariant::kAuto, true);
  c.reference = on_cpu(c.entry);
  return c;
}

Case layernorm_backward_case(std::span<const std::int64_t> shape, DType dtype, DType param, const char* op) {
  Case c = begin_case(op, "norm", shape, dtype, 2, "MxN");
  const std::int64_t m = c.shape[0], n = c.shape[1];
  c.tensors = {input("dy", dtype, {m, n}),        input("x", dtype, {m, n}),        input("weight", param, {n}, false),
               input("mean", DType::kFloat32, {m}), saved_rstd(m),                  output("dx", dtype, {m, n}),
               output("dw", param, {n}, false),   output("db", param, {n}, false), workspace_for(m, n, dtype)};
  c.bytes = traffic(c.tensors);
  c.flops = 10.0 * elements(c);
  c.entry = layernorm_backward_entry(c, NormVariant::kAuto, true);
  c.reference = on_cpu(layernorm_backward_entry(c, NormVariant::kAuto, false));
  return c;
}

// The case of one op, its weight (and bias) in the activation dtype or in fp32.
using NormCase = Case (*)(std::span<const std::int64_t> shape, DType dtype, DType param, const char* op);

struct NormOp {
  const char* name;
  NormCase make;
  Entry (*entry)(const Case&, NormVariant, bool workspace);
  bool forward;
};

const NormOp kOps[] = {
    {"rmsnorm_forward", rmsnorm_forward_case, rmsnorm_forward_entry, true},
    {"rmsnorm_backward", rmsnorm_backward_case, rmsnorm_backward_entry, false},
    {"fused_add_rmsnorm_forward", fused_add_rmsnorm_case, fused_add_rmsnorm_forward_entry, true},
    {"fused_add_rmsnorm_backward", fused_add_rmsnorm_backward_case, fused_add_rmsnorm_backward_entry, false},
    {"layernorm_forward", layernorm_forward_case, layernorm_forward_entry, true},
    {"layernorm_backward", layernorm_backward_case, layernorm_backward_entry, false},
};

// The op with fp32 weight and bias (and dw, db): "<op>_fp32_weight".
std::string fp32_weight_op(const char* op) { return std::string(op) + "_fp32_weight"; }

struct ForcedVariant {
  NormVariant variant;
  const char* impl;
  bool forward_only;
};

const ForcedVariant kForcedVariants[] = {
    {NormVariant::kRegisters, "trainscale-registers", false},
    {NormVariant::kTwoPass, "trainscale-two-pass", false},
    {NormVariant::kRows, "trainscale-rows", true},
    {NormVariant::kPipelined, "trainscale-pipelined", true},
    {NormVariant::kRing, "trainscale-ring", true},
};

const Registrar kRegister([](Registry& r) {
  for (const NormOp& op : kOps) {
    for (const bool fp32_weight : {false, true}) {
      const std::string name = fp32_weight ? fp32_weight_op(op.name) : op.name;
      r.add_op({name, "norm", "M x N", [make = op.make, fp32_weight, name](std::span<const std::int64_t> shape,
                                                                          DType dtype) {
                  return make(shape, dtype, fp32_weight ? DType::kFloat32 : dtype, name.c_str());
                }});
      // A variant that cannot run a shape throws UnsupportedVariantError: the row is UNSUPPORTED.
      for (const ForcedVariant& forced : kForcedVariants) {
        if (forced.forward_only && !op.forward) continue;
        r.add_opt_in(name, forced.impl, [entry = op.entry, variant = forced.variant](const Case& c) {
          Implementation impl;
          impl.run = entry(c, variant, true);
          return std::optional<Implementation>(std::move(impl));
        });
      }
    }
  }
  const auto bf16 = std::vector<DType>{DType::kBFloat16};
  for (const char* op : {"rmsnorm_forward", "rmsnorm_backward", "fused_add_rmsnorm_forward", "fused_add_rmsnorm_backward", "layernorm_forward",
                         "layernorm_backward"}) {
    r.add_configs("smoke", op, {{64, 512}}, {DType::kFloat32, DType::kBFloat16});
    r.add_configs("smoke", fp32_weight_op(op), {{64, 512}}, {DType::kBFloat16});
    r.add_configs("quack", op, quack_shapes(), bf16);
    r.add_configs("quack-m", op, quack_m_shapes(), bf16);
    r.add_configs("dsv3", op, dsv3_row_shapes(), bf16);
    r.add_configs("llama", op, {{kLlamaTokens, kLlamaHidden}}, bf16);
  }
  for (const char* op : {"rmsnorm_forward", "layernorm_forward"}) r.add_configs("sweep", op, sweep_row_shapes(), bf16);
  // Training shapes (issue 25): every op, bf16 and fp16, weights in the activation dtype and in
  // fp32. 16 shapes x 6 ops x 2 weight dtypes x 2 dtypes = 384 configs; with cuDNN on the 8
  // ops it has (4 ops x 2 weight dtypes) 640 rows.
  const auto half = std::vector<DType>{DType::kBFloat16, DType::kFloat16};
  for (const NormOp& op : kOps) {
    r.add_configs("training", op.name, training_row_shapes(), half);
    r.add_configs("training", fp32_weight_op(op.name), training_row_shapes(), half);
  }

  // cuDNN baselines (same tensors and eps as our entry points; the cases use weight offset 0).
  // cuDNN has no fused residual-add + RMSNorm, so fused_add_rmsnorm_forward / _backward have no baseline.
  if (cudnn_baselines_built()) {
    const double rms_eps = RMSNormOptions{}.eps, rms_offset = RMSNormOptions{}.weight_offset;
    const double ln_eps = LayerNormOptions{}.eps;
    for (const bool fp32_weight : {false, true}) {
      const auto name = [&](const char* op) { return fp32_weight ? fp32_weight_op(op) : std::string(op); };
      r.add_baseline(name("rmsnorm_forward"), "cudnn", [=](const Case& c) {
        return cudnn_norm_baseline(CudnnNormOp::kRmsNormForward, c, rms_eps, rms_offset);
      });
      r.add_baseline(name("rmsnorm_backward"), "cudnn", [=](const Case& c) {
        return cudnn_norm_baseline(CudnnNormOp::kRmsNormBackward, c, rms_eps, rms_offset);
      });
      r.add_baseline(name("layernorm_forward"), "cudnn", [=](const Case& c) {
        return cudnn_norm_baseline(CudnnNormOp::kLayerNormForward, c, ln_eps);
      });
      r.add_baseline(name("layernorm_backward"), "cudnn", [=](const Case& c) {
        return cudnn_norm_baseline(CudnnNormOp::kLayerNormBackward, c, ln_eps);
      });
    }
  }
});

}  // namespace
}  // namespace trainscale::bench::cases
