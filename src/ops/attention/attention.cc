#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "ops/attention/attention_internal.h"

namespace trainscale {

namespace {

constexpr auto kFloatTypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};

// An output written by several threads must not map two of its elements to one address:
// sorted by stride, every dim must step past everything the smaller dims reach.
void require_distinct_elements(detail::OpChecker& c, const TensorView& t, const char* name) {
  if (t.numel() == 0) return;
  std::vector<std::pair<std::int64_t, std::int64_t>> stride_size;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] > 1) stride_size.emplace_back(t.strides[d], t.shape[d]);
  }
  std::sort(stride_size.begin(), stride_size.end());
  std::int64_t reach = 1;  // one past the largest offset the smaller dims reach
  for (auto [stride, size] : stride_size) {
    if (!(stride >= reach))
      c.fail(name, "strides under which no two elements share memory",
             "strides " + t.strides_str() + " for shape " + t.shape_str());
    reach += stride * (size - 1);
  }
}

// A [B, S, H, D] tensor with stride 1 in D.
void check_bshd(detail::OpChecker& c, const TensorView& t, const char* name) {
  c.present(t, name).ndim(t, name, 4).unit_last_stride(t, name);
}

// A tensor (input or output) with the dtype and shape of `ref`.
void check_like(detail::OpChecker& c, const TensorView& t, const char* name, const TensorView& ref,
                const char* ref_name) {
  check_bshd(c, t, name);
  c.same_dtype(t, name, ref, ref_name).same_shape(t, name, ref, ref_name);
}

void check_output_like(detail::OpChecker& c, const TensorView& t, const char* name,
                       const TensorView& ref, const char* ref_name) {
  check_like(c, t, name, ref, ref_name);
  require_distinct_elements(c, t, name);
}

// q, k, v and the options, shared by forward and backward.
void check_qkv(detail::OpChecker& c, const TensorView& q, const TensorView& k, const TensorView& v,
               const AttentionOptions& options) {
  check_bshd(c, q, "q");
  c.dtype_in(q, "q", kFloatTypes);
  if (!(q.size(3) > 0)) c.fail("q", "a head dim D >= 1", "shape " + q.shape_str());
  check_bshd(c, k, "k");
  c.same_dtype(k, "k", q, "q")
      .dim_size(k, "k", 0, q.size(0), "the batch size of 'q'")
      .dim_size(k, "k", 3, q.size(3), "the head dim of 'q'");
  const std::int64_t q_heads = q.size(2), kv_heads = k.size(2);
  if (!(kv_heads > 0 && q_heads % kv_heads == 0))
    c.fail("k", "a head count that divides the " + std::to_string(q_heads) + " heads of 'q'",
           std::to_string(kv_heads) + " heads (shape " + k.shape_str() + ")");
  check_like(c, v, "v", k, "k");
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
  check_output_like(c, out, "out", q, "q");
  if (lse.defined()) check_lse(c, lse, "lse", q);
  for (auto [t, name] : {std::pair{out, "out"}, std::pair{lse, "lse"}}) {
    c.no_overlap(t, name, q, "q").no_overlap(t, name, k, "k").no_overlap(t, name, v, "v");
  }
  c.no_overlap(lse, "lse", out, "out");
  if (c.on_cuda()) detail::throw_no_cuda_kernel(c.op());
  ops::attention::attention_forward_cpu(q, k, v, out, lse, options);
}

void attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, const TensorView& lse,
                        TensorView dq, TensorView dk, TensorView dv,
                        const AttentionOptions& options, cudaStream_t /*stream*/) {
  detail::OpChecker c("attention_backward");
  check_qkv(c, q, k, v, options);
  check_like(c, out, "out", q, "q");
  check_like(c, dout, "dout", q, "q");
  check_lse(c, lse, "lse", q);
  check_output_like(c, dq, "dq", q, "q");
  check_output_like(c, dk, "dk", k, "k");
  check_output_like(c, dv, "dv", v, "v");
  const std::pair<const TensorView&, const char*> inputs[] = {
      {dout, "dout"}, {q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {lse, "lse"}};
  for (auto [grad, grad_name] : {std::pair{dq, "dq"}, std::pair{dk, "dk"}, std::pair{dv, "dv"}}) {
    for (const auto& [input, input_name] : inputs) c.no_overlap(grad, grad_name, input, input_name);
  }
  c.no_overlap(dq, "dq", dk, "dk").no_overlap(dq, "dq", dv, "dv").no_overlap(dk, "dk", dv, "dv");
  if (c.on_cuda()) detail::throw_no_cuda_kernel(c.op());
  ops::attention::attention_backward_cpu(dout, q, k, v, out, lse, dq, dk, dv, options);
}

}  // namespace trainscale
