#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "ops/attention/attention_cuda.h"
#include "ops/attention/attention_heuristics.h"
#include "ops/attention/attention_internal.h"

namespace trainscale {

namespace {

// A [B, S, H, D] tensor with stride 1 in D.
void check_bshd(detail::OpChecker& c, const TensorView& t, const char* name) {
  c.present(t, name).ndim(t, name, 4).unit_last_stride(t, name);
}

// A [B, S, H, D] tensor with the dtype and shape of `ref`.
void check_bshd_like(detail::OpChecker& c, const TensorView& t, const char* name,
                     const TensorView& ref, const char* ref_name) {
  check_bshd(c, t, name);
  c.same_dtype(t, name, ref, ref_name).same_shape(t, name, ref, ref_name);
}

// q, k, v and the options, shared by forward and backward.
void check_qkv(detail::OpChecker& c, const TensorView& q, const TensorView& k, const TensorView& v,
               const AttentionOptions& options) {
  check_bshd(c, q, "q");
  c.dtype_in(q, "q", detail::kFloatDTypes);
  if (!(q.size(3) > 0)) c.fail("q", "a head dim D >= 1", "shape " + q.shape_str());
  check_bshd(c, k, "k");
  c.same_dtype(k, "k", q, "q")
      .dim_size(k, "k", 0, q.size(0), "the batch size of 'q'")
      .dim_size(k, "k", 3, q.size(3), "the head dim of 'q'");
  const std::int64_t q_heads = q.size(2), kv_heads = k.size(2);
  if (!(kv_heads > 0 && q_heads % kv_heads == 0))
    c.fail("k", "a head count that divides the " + std::to_string(q_heads) + " heads of 'q'",
           std::to_string(kv_heads) + " heads (shape " + k.shape_str() + ")");
  check_bshd_like(c, v, "v", k, "k");
  if (!std::isfinite(options.scale))
    c.fail("options.scale", "a finite value (0 for 1/sqrt(D))", std::to_string(options.scale));
  if (options.window_left < -1)
    c.fail("options.window_left", "-1 (unbounded) or a key count >= 0", std::to_string(options.window_left));
  if (options.window_right < -1 || (options.causal && options.window_right > 0))
    c.fail("options.window_right",
           options.causal ? "-1 or 0 with causal (causal is a right window of 0)"
                          : "-1 (unbounded) or a key count >= 0",
           std::to_string(options.window_right));
  if (!(options.softcap == 0.0 || (options.softcap > 0.0 && std::isfinite(options.softcap))))
    c.fail("options.softcap", "0 (off) or a finite value > 0", std::to_string(options.softcap));
}

// lse [B, Hq, Sq], contiguous; float32 (float64 too on the CPU, for fp64 gradient checks).
void check_lse(detail::OpChecker& c, const TensorView& lse, const char* name, const TensorView& q) {
  c.present(lse, name).dtype_in(lse, name, {DType::kFloat32, DType::kFloat64}).ndim(lse, name, 3);
  c.dim_size(lse, name, 0, q.size(0), "B of 'q'")
      .dim_size(lse, name, 1, q.size(2), "Hq of 'q'")
      .dim_size(lse, name, 2, q.size(1), "Sq of 'q'");
  c.contiguous(lse, name);
}

std::string strides_str(const TensorView& t) {
  std::string s = "[";
  for (int d = 0; d < t.ndim; ++d) s += (d ? ", " : "") + std::to_string(t.strides[d]);
  return s + "]";
}

// What the CUDA forward needs beyond the contract: a dtype and head dim it has a kernel for, and
// q, k, v as TMA reads them (16-byte aligned start, every stride of a dim longer than 1 a multiple
// of 16 bytes), and sizes that fit its 32-bit indices.
void check_cuda_forward(detail::OpChecker& c, const TensorView& q, const TensorView& k,
                        const TensorView& v) {
  c.dtype_in(q, "q", {DType::kBFloat16, DType::kFloat16});
  if (!ops::attention::forward_head_dim_supported(q.size(3)))
    c.fail("q", "a head dim D of 64, 128 or 256 (the CUDA kernel's)", "shape " + q.shape_str());
  const std::int64_t element = static_cast<std::int64_t>(dtype_size(q.dtype));
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{q, "q"}, {k, "k"}, {v, "v"}}) {
    if (reinterpret_cast<std::uintptr_t>(t.data) % 16 != 0)
      c.fail(name, "a 16-byte aligned start (TMA)",
             "address " + std::to_string(reinterpret_cast<std::uintptr_t>(t.data)) + " (" +
                 std::to_string(reinterpret_cast<std::uintptr_t>(t.data) % 16) + " past 16)");
    for (int d = 0; d < 3; ++d) {
      if (t.size(d) > 1 && (t.strides[d] * element) % 16 != 0)
        c.fail(name, "strides of 16-byte multiples in dims 0-2 (TMA)",
               "strides " + strides_str(t) + " in elements of " + std::to_string(element) + " bytes");
      if (t.size(d) > std::numeric_limits<std::int32_t>::max())
        c.fail(name, "dims below 2^31 (the CUDA kernel's indices)", "shape " + t.shape_str());
    }
  }
}

// What the CUDA backward needs beyond the contract: a dtype and head dim it has a kernel for;
// every [B, S, H, D] tensor as its 16-byte cp.async loads and stores reach it (16-byte aligned
// start, every stride of a dim longer than 1 a multiple of 16 bytes; no TMA, so no other layout
// rule); lse in float32; sequence lengths whose sum fits its 32-bit in-sequence indices; and the
// workspace.
void check_cuda_backward(detail::OpChecker& c, const AttentionBackwardArgs& args) {
  const TensorView& q = args.q;
  c.dtype_in(q, "q", {DType::kBFloat16, DType::kFloat16});
  if (!ops::attention::backward_head_dim_supported(q.size(3)))
    c.fail("q", "a head dim D of 64, 128 or 256 (the CUDA kernel's)", "shape " + q.shape_str());
  c.dtype_in(args.lse, "lse", {DType::kFloat32});
  const std::int64_t element = static_cast<std::int64_t>(dtype_size(q.dtype));
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{q, "q"}, {args.k, "k"}, {args.v, "v"},
                                {args.out, "out"}, {args.dout, "dout"}, {args.dq, "dq"}, {args.dk, "dk"},
                                {args.dv, "dv"}}) {
    if (reinterpret_cast<std::uintptr_t>(t.data) % 16 != 0)
      c.fail(name, "a 16-byte aligned start (16-byte loads and stores)",
             "address " + std::to_string(reinterpret_cast<std::uintptr_t>(t.data)) + " (" +
                 std::to_string(reinterpret_cast<std::uintptr_t>(t.data) % 16) + " past 16)");
    for (int d = 0; d < 3; ++d) {
      if (t.size(d) > 1 && (t.strides[d] * element) % 16 != 0)
        c.fail(name, "strides of 16-byte multiples in dims 0-2 (16-byte loads and stores)",
               "strides " + strides_str(t) + " in elements of " + std::to_string(element) + " bytes");
    }
  }
  if (q.size(1) + args.k.size(1) > std::numeric_limits<std::int32_t>::max())
    c.fail("k", "Sq + Sk below 2^31 (the CUDA kernel's indices)",
           "Sq = " + std::to_string(q.size(1)) + ", Sk = " + std::to_string(args.k.size(1)));
  const std::size_t needed = attention_backward_workspace_bytes(q);
  const TensorView& w = args.workspace;
  const std::size_t given = w.defined() ? static_cast<std::size_t>(w.numel()) * w.element_size() : 0;
  if (given < needed)
    c.fail("workspace", "at least " + std::to_string(needed) + " bytes (attention_backward_workspace_bytes(q))",
           std::to_string(given) + " bytes");
  if (needed > 0 && (!w.is_contiguous() || reinterpret_cast<std::uintptr_t>(w.data) % 256 != 0))
    c.fail("workspace", "a contiguous, 256-byte aligned view", w.describe());
}

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       TensorView out, TensorView lse, const AttentionOptions& options,
                       cudaStream_t stream) {
  detail::OpChecker c("attention_forward");
  check_qkv(c, q, k, v, options);
  check_bshd_like(c, out, "out", q, "q");
  c.distinct_elements(out, "out");
  if (lse.defined()) check_lse(c, lse, "lse", q);
  c.outputs_disjoint({{out, "out"}, {lse, "lse"}}, {{q, "q"}, {k, "k"}, {v, "v"}});
  if (c.on_cuda()) {
#if !TRAINSCALE_HAVE_CUDA
    detail::throw_no_cuda_build(c.op());
#elif !TRAINSCALE_HAVE_CUTLASS
    detail::throw_op_error(c.op(),
                           "CUDA tensors given, but this build has no attention kernel: it was "
                           "configured without the CUTLASS headers (pip install nvidia-cutlass, or "
                           "-DTRAINSCALE_CUTLASS_INCLUDE=<dir>), so only the CPU reference exists");
#endif
    check_cuda_forward(c, q, k, v);
    if (lse.defined()) c.dtype_in(lse, "lse", {DType::kFloat32});
  }
#if TRAINSCALE_HAVE_CUDA && TRAINSCALE_HAVE_CUTLASS
  if (detail::ran_on_cuda(c, [&] {
        switch (q.size(3)) {
          case 64: ops::attention::attention_forward_hdim64(q, k, v, out, lse, options, stream); break;
          case 128: ops::attention::attention_forward_hdim128(q, k, v, out, lse, options, stream); break;
          default: ops::attention::attention_forward_hdim256(q, k, v, out, lse, options, stream); break;
        }
      }))
    return;
#else
  (void)stream;
#endif
  ops::attention::attention_forward_cpu(q, k, v, out, lse, options);
}

void attention_backward(const AttentionBackwardArgs& args, const AttentionOptions& options,
                        cudaStream_t stream) {
  const auto& [dout, q, k, v, out, lse, dq, dk, dv, workspace] = args;
  detail::OpChecker c("attention_backward");
  check_qkv(c, q, k, v, options);
  check_bshd_like(c, out, "out", q, "q");
  check_bshd_like(c, dout, "dout", q, "q");
  check_lse(c, lse, "lse", q);
  check_bshd_like(c, dq, "dq", q, "q");
  c.distinct_elements(dq, "dq");
  check_bshd_like(c, dk, "dk", k, "k");
  c.distinct_elements(dk, "dk");
  check_bshd_like(c, dv, "dv", v, "v");
  c.distinct_elements(dv, "dv");
  c.optional(workspace, "workspace");
  c.outputs_disjoint({{dv, "dv"}, {dk, "dk"}, {dq, "dq"}, {workspace, "workspace"}},
                     {{dout, "dout"}, {q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {lse, "lse"}});
  if (c.on_cuda()) {
#if !TRAINSCALE_HAVE_CUDA
    detail::throw_no_cuda_build(c.op());
#elif !TRAINSCALE_HAVE_CUTLASS
    detail::throw_op_error(c.op(),
                           "CUDA tensors given, but this build has no attention kernel: it was "
                           "configured without the CUTLASS headers (pip install nvidia-cutlass, or "
                           "-DTRAINSCALE_CUTLASS_INCLUDE=<dir>), so only the CPU reference exists");
#endif
    check_cuda_backward(c, args);
  }
#if TRAINSCALE_HAVE_CUDA && TRAINSCALE_HAVE_CUTLASS
  if (detail::ran_on_cuda(c, [&] {
        switch (q.size(3)) {
          case 64: ops::attention::attention_backward_hdim64(args, options, stream); break;
          case 128: ops::attention::attention_backward_hdim128(args, options, stream); break;
          default: ops::attention::attention_backward_hdim256(args, options, stream); break;
        }
      }))
    return;
#else
  (void)stream;
#endif
  ops::attention::attention_backward_cpu(dout, q, k, v, out, lse, dq, dk, dv, options);
}

std::size_t attention_backward_workspace_bytes(const TensorView& q) {
  detail::OpChecker c("attention_backward_workspace_bytes");
  c.ndim(q, "q", 4);  // the shape is all it reads
  constexpr std::size_t kAlign = 256;
  const std::size_t delta_bytes = static_cast<std::size_t>(q.size(0) * q.size(2) * q.size(1)) * sizeof(float);
  return (delta_bytes + kAlign - 1) / kAlign * kAlign;
}

}  // namespace trainscale
