#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "core/host_dtype.h"
#include "ops/rope/rope_internal.h"

#include "ops/rope/rope_cuda.h"

namespace trainscale {

const char* rope_style_name(RopeStyle style) {
  switch (style) {
    case RopeStyle::kNeox: return "neox";
    case RopeStyle::kGptJ: return "gptj";
  }
  return "unknown";
}

namespace {

// Forward and backward take the same arguments under different names.
struct ArgNames {
  const char* q;
  const char* k;
  const char* q_out;
  const char* k_out;
};
constexpr ArgNames kForwardNames{"q", "k", "q_out", "k_out"};
constexpr ArgNames kBackwardNames{"dq_out", "dk_out", "dq", "dk"};

// q_out and k_out may be head ranges of one fused QKV buffer, interleaved with q and k.
constexpr auto kHeads = detail::Disjoint::kElements;

std::int64_t check_options(detail::OpChecker& c, const RopeOptions& options,
                           std::int64_t head_dim) {
  if (!(options.style == RopeStyle::kNeox || options.style == RopeStyle::kGptJ))
    c.fail("options.style", "RopeStyle::kNeox or kGptJ",
           "value " + std::to_string(static_cast<int>(options.style)));
  if (!(std::isfinite(options.theta) && options.theta > 0))
    c.fail("options.theta", "a finite value > 0", std::to_string(options.theta));
  const std::int64_t rotary_dim = options.rotary_dim == -1 ? head_dim : options.rotary_dim;
  if (!(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0))
    c.fail("options.rotary_dim",
           "an even number in [0, " + std::to_string(head_dim) + "], or -1 for an even head dim",
           options.rotary_dim == -1 ? "-1 with the odd head dim " + std::to_string(head_dim)
                                    : std::to_string(options.rotary_dim));
  return rotary_dim;
}

// q and k (or their gradients) and the outputs written from them.
void check_heads(detail::OpChecker& c, const ArgNames& n, const TensorView& q, const TensorView& k,
                 const TensorView& q_out, const TensorView& k_out) {
  c.matches(q_out, n.q_out, q, n.q).unit_last_stride(q_out, n.q_out);
  if (!(k_out.defined() == k.defined()))
    c.fail(k.defined() ? n.k_out : n.k,
           std::string("'") + n.k + "' and '" + n.k_out + "' both given or both absent",
           k.defined() ? "no '" + std::string(n.k_out) + "'" : "no '" + std::string(n.k) + "'");
  if (k.defined()) {
    c.present(k, n.k).same_dtype(k, n.k, q, n.q).ndim(k, n.k, 4);
    const std::string of_q = std::string(" of '") + n.q + "'";
    c.dim_size(k, n.k, 0, q.size(0), ("the batch size" + of_q).c_str());
    c.dim_size(k, n.k, 1, q.size(1), ("the sequence length" + of_q).c_str());
    c.dim_size(k, n.k, 3, q.size(3), ("the head dim" + of_q).c_str()).unit_last_stride(k, n.k);
    c.matches(k_out, n.k_out, k, n.k).unit_last_stride(k_out, n.k_out);
  }
  // Each pair is read before it is written, so an output may be exactly its input's view.
  c.disjoint_or_in_place(q_out, n.q_out, q, n.q, kHeads);
  c.disjoint_or_in_place(k_out, n.k_out, k, n.k, kHeads);
  c.no_overlap(q_out, n.q_out, k, n.k, kHeads);
  c.no_overlap(k_out, n.k_out, q, n.q, kHeads);
  c.no_overlap(q_out, n.q_out, k_out, n.k_out, kHeads);
}

// Returns P, the number of positions the tables hold (-1 without tables).
std::int64_t check_tables(detail::OpChecker& c, const TensorView& cos, const TensorView& sin,
                          const TensorView& q, const char* q_name, std::int64_t rotary_dim) {
  if (!(cos.defined() == sin.defined()))
    c.fail(cos.defined() ? "sin" : "cos", "'cos' and 'sin' both given or both absent", "none");
  if (!cos.defined()) return -1;
  c.present(cos, "cos").dtype_in(cos, "cos", {DType::kFloat32, q.dtype}).ndim(cos, "cos", 2);
  c.dim_size(cos, "cos", 1, rotary_dim / 2, "rotary_dim / 2").unit_last_stride(cos, "cos");
  c.matches(sin, "sin", cos, "cos").unit_last_stride(sin, "sin");
  const std::int64_t positions = cos.size(0), seq = q.size(1);
  if (!(seq <= positions))
    c.fail(
        "cos",
        "at least " + std::to_string(seq) + " positions (the sequence length of '" + q_name + "')",
        std::to_string(positions) + " rows");
  return positions;
}

void check_offsets(detail::OpChecker& c, const TensorView& offsets, const TensorView& q,
                   const char* q_name, std::int64_t table_positions) {
  if (!offsets.defined()) return;
  c.present(offsets, "position_offsets")
      .dtype_in(offsets, "position_offsets", {DType::kInt32, DType::kInt64});
  c.ndim(offsets, "position_offsets", 1);
  c.dim_size(offsets, "position_offsets", 0, q.size(0),
             (std::string("the batch size of '") + q_name + "'").c_str());
  if (c.on_cuda() || q.size(1) == 0) return;  // the device's values are not read here
  for (std::int64_t b = 0; b < offsets.size(0); ++b) {
    const std::int64_t first =
        detail::load_index(offsets.dtype, offsets.data, b * offsets.stride(0));
    const std::int64_t last = first + q.size(1) - 1;
    const bool in_range = first >= 0 && (table_positions < 0 || last < table_positions);
    if (!in_range)
      c.fail("position_offsets",
             table_positions < 0 ? std::string("offsets >= 0")
                                 : "offsets with offset + " + std::to_string(q.size(1)) + " <= " +
                                       std::to_string(table_positions) + " (the rows of 'cos')",
             "offset " + std::to_string(first) + " for batch " + std::to_string(b));
  }
}

void rope(const char* op, const ArgNames& n, ops::rope::Direction direction, const TensorView& q,
          const TensorView& k, TensorView q_out, TensorView k_out, const TensorView& cos,
          const TensorView& sin, const TensorView& offsets, const RopeOptions& options,
          cudaStream_t stream) {
  detail::OpChecker c(op);
  c.present(q, n.q).dtype_in(q, n.q, detail::kFloatDTypes).ndim(q, n.q, 4).unit_last_stride(q, n.q);
  const std::int64_t rotary_dim = check_options(c, options, q.size(3));
  check_heads(c, n, q, k, q_out, k_out);
  const std::int64_t table_positions = check_tables(c, cos, sin, q, n.q, rotary_dim);
  check_offsets(c, offsets, q, n.q, table_positions);
  for (auto [out, out_name] : {std::pair{q_out, n.q_out}, std::pair{k_out, n.k_out}}) {
    c.no_overlap(out, out_name, cos, "cos", kHeads);
    c.no_overlap(out, out_name, sin, "sin", kHeads);
    c.no_overlap(out, out_name, offsets, "position_offsets", kHeads);
  }
  if (detail::ran_on_cuda(c, [&] {
      ops::rope::rope_cuda(direction, q, k, q_out, k_out, cos, sin, offsets, rotary_dim, options,
                           stream);
      })) {
    return;
  }
  ops::rope::rope_cpu(direction, q, k, q_out, k_out, cos, sin, offsets, rotary_dim, options);
}

}  // namespace

void rope_forward(const TensorView& q, const TensorView& k, TensorView q_out, TensorView k_out,
                  const TensorView& cos, const TensorView& sin, const TensorView& position_offsets,
                  const RopeOptions& options, cudaStream_t stream) {
  rope("rope_forward", kForwardNames, ops::rope::Direction::kForward, q, k, q_out, k_out, cos, sin,
       position_offsets, options, stream);
}

void rope_backward(const TensorView& dq_out, const TensorView& dk_out, TensorView dq, TensorView dk,
                   const TensorView& cos, const TensorView& sin, const TensorView& position_offsets,
                   const RopeOptions& options, cudaStream_t stream) {
  rope("rope_backward", kBackwardNames, ops::rope::Direction::kBackward, dq_out, dk_out, dq, dk,
       cos, sin, position_offsets, options, stream);
}

}  // namespace trainscale
