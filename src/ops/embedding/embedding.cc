#include <cstdint>
#include <string>

#include "ops/embedding/embedding_internal.h"

namespace trainscale {
namespace {

constexpr auto kIdTypes = {DType::kInt32, DType::kInt64};

void check_ids(detail::OpChecker& c, const TensorView& ids, std::int64_t tokens, const char* tokens_of) {
  c.present(ids, "ids").dtype_in(ids, "ids", kIdTypes).ndim(ids, "ids", 1).contiguous(ids, "ids");
  if (ids.size(0) != tokens)
    c.fail("ids", "one id per row of " + std::string(tokens_of) + ": " + std::to_string(tokens),
           std::to_string(ids.size(0)));
}

}  // namespace

void embedding_forward(const TensorView& weight, const TensorView& ids, TensorView out, cudaStream_t stream) {
  detail::OpChecker c("embedding_forward");
  const detail::Rows w = c.matrix(weight, "weight");
  const detail::Rows o = c.matrix(out, "out");
  c.same_dtype(out, "out", weight, "weight").dim_size(out, "out", 1, w.cols, "the weight's row length H");
  check_ids(c, ids, o.rows, "out");
  c.outputs_disjoint({{out, "out"}}, {{weight, "weight"}, {ids, "ids"}});
  if (o.rows == 0 || o.cols == 0) return;
  if (detail::ran_on_cuda(c, [&] { ops::embedding::embedding_forward_cuda(weight, ids, out, stream); })) return;
  ops::embedding::embedding_forward_cpu(weight, ids, out);
}

void embedding_backward(const TensorView& grad_output, const TensorView& ids, TensorView grad_weight,
                        std::int64_t padding_idx, TensorView workspace, cudaStream_t stream) {
  detail::OpChecker c("embedding_backward");
  const detail::Rows g = c.matrix(grad_output, "grad_output");
  c.present(grad_weight, "grad_weight")
      .same_dtype(grad_weight, "grad_weight", grad_output, "grad_output")
      .ndim(grad_weight, "grad_weight", 2)
      .dim_size(grad_weight, "grad_weight", 1, g.cols, "grad_output's row length H")
      .contiguous(grad_weight, "grad_weight");
  check_ids(c, ids, g.rows, "grad_output");
  if (g.rows >= (std::int64_t{1} << 31))
    c.fail("ids", "fewer than 2^31 ids", std::to_string(g.rows));
  const std::int64_t rows = grad_weight.size(0);
  if (!(padding_idx == -1 || (padding_idx >= 0 && padding_idx < rows)))
    c.fail("padding_idx", "-1 (none) or a row in [0, " + std::to_string(rows) + ")", std::to_string(padding_idx));
  c.optional(workspace, "workspace");
  c.outputs_disjoint({{grad_weight, "grad_weight"}, {workspace, "workspace"}},
                     {{grad_output, "grad_output"}, {ids, "ids"}});
  if (rows == 0 || g.cols == 0) return;
  if (detail::ran_on_cuda(c, [&] {
        if (rows >= (std::int64_t{1} << 31))
          c.fail("grad_weight", "fewer than 2^31 rows (the CUDA path's 32-bit sort keys)", grad_weight.shape_str());
        c.workspace(workspace, ops::embedding::embedding_backward_workspace_bytes_cuda(g.rows), 16,
                    "embedding_backward_workspace_bytes");
        ops::embedding::embedding_backward_cuda(grad_output, ids, grad_weight, padding_idx, workspace, stream);
      })) {
    return;
  }
  ops::embedding::embedding_backward_cpu(grad_output, ids, grad_weight, padding_idx);
}

std::size_t embedding_backward_workspace_bytes(std::int64_t num_ids) {
  detail::OpChecker c("embedding_backward_workspace_bytes");
  if (num_ids < 0 || num_ids >= (std::int64_t{1} << 31))
    c.fail("num_ids", "a count in [0, 2^31)", std::to_string(num_ids));
#if TRAINSCALE_HAVE_CUDA
  return ops::embedding::embedding_backward_workspace_bytes_cuda(num_ids);
#else
  return 0;
#endif
}

}  // namespace trainscale
