#include <cmath>
#include <string>

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
}

// lse [B, Hq, Sq], contiguous; float32 (float64 too on the CPU, for fp64 gradient checks).
void check_lse(detail::OpChecker& c, const TensorView& lse, const char* name, const TensorView& q) {
  c.present(lse, name).dtype_in(lse, name, {DType::kFloat32, DType::kFloat64}).ndim(lse, name, 3);
  c.dim_size(lse, name, 0, q.size(0), "B of 'q'")
      .dim_size(lse, name, 1, q.size(2), "Hq of 'q'")
      .dim_size(lse, name, 2, q.size(1), "Sq of 'q'");
  c.contiguous(lse, name);
}

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       TensorView out, TensorView lse, const AttentionOptions& options,
                       cudaStream_t /*stream*/) {
  detail::OpChecker c("attention_forward");
  check_qkv(c, q, k, v, options);
  check_bshd_like(c, out, "out", q, "q");
  c.distinct_elements(out, "out");
  if (lse.defined()) check_lse(c, lse, "lse", q);
  c.outputs_disjoint({{out, "out"}, {lse, "lse"}}, {{q, "q"}, {k, "k"}, {v, "v"}});
  if (c.on_cuda()) detail::throw_no_cuda_kernel(c.op());
  ops::attention::attention_forward_cpu(q, k, v, out, lse, options);
}

void attention_backward(const AttentionBackwardArgs& args, const AttentionOptions& options,
                        cudaStream_t /*stream*/) {
  const auto& [dout, q, k, v, out, lse, dq, dk, dv] = args;
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
  c.outputs_disjoint({{dv, "dv"}, {dk, "dk"}, {dq, "dq"}},
                     {{dout, "dout"}, {q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {lse, "lse"}});
  if (c.on_cuda()) detail::throw_no_cuda_kernel(c.op());
  ops::attention::attention_backward_cpu(dout, q, k, v, out, lse, dq, dk, dv, options);
}

}  // namespace trainscale
