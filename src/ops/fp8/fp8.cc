#include <algorithm>
#include <initializer_list>
#include <string>

#include "ops/fp8/fp8_internal.h"

#include "ops/fp8/fp8_cuda.h"

namespace trainscale {

const char* fp8_granularity_name(Fp8Granularity granularity) {
  switch (granularity) {
    case Fp8Granularity::kTensor: return "tensor";
    case Fp8Granularity::kRow: return "row";
    case Fp8Granularity::kTile1x128: return "tile1x128";
    case Fp8Granularity::kBlock128x128: return "block128x128";
  }
  return "unknown";
}

namespace ops::fp8 {

std::string ScaleGrid::shape_str() const {
  std::string s = "[";
  s += std::to_string(shape[0]);
  if (ndim == 2) s += ", " + std::to_string(shape[1]);
  return s + "]";
}

ScaleGrid scale_grid(const Fp8QuantizeOptions& options, std::int64_t rows, std::int64_t cols) {
  ScaleGrid g;
  switch (options.granularity) {
    case Fp8Granularity::kTensor:
      g.group_height = std::max<std::int64_t>(rows, 1);
      g.group_width = std::max<std::int64_t>(cols, 1);
      g.shape[0] = 1;
      break;
    case Fp8Granularity::kRow:
      g.groups_down = rows;
      g.group_width = std::max<std::int64_t>(cols, 1);
      g.shape[0] = rows;
      break;
    case Fp8Granularity::kTile1x128:
      g.groups_down = rows;
      g.groups_across = ceil_div(cols, kGroupEdge);
      g.group_width = kGroupEdge;
      g.ndim = 2;
      g.m_major = options.scales_m_major;
      g.m_major_pitch = ceil_div(rows, 4) * 4;
      g.shape[0] = g.m_major ? g.groups_across : rows;
      g.shape[1] = g.m_major ? g.m_major_pitch : g.groups_across;
      break;
    case Fp8Granularity::kBlock128x128:
      g.groups_down = ceil_div(rows, kGroupEdge);
      g.groups_across = ceil_div(cols, kGroupEdge);
      g.group_height = g.group_width = kGroupEdge;
      g.ndim = 2;
      g.shape[0] = g.groups_down;
      g.shape[1] = g.groups_across;
      break;
  }
  return g;
}

}  // namespace ops::fp8

namespace {

constexpr auto kHighPrecisionTypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
constexpr auto kFp8Types = {DType::kFloat8E4M3, DType::kFloat8E5M2};

void check_options(detail::OpChecker& c, const Fp8QuantizeOptions& options) {
  const Fp8Granularity g = options.granularity;
  const bool known = g == Fp8Granularity::kTensor || g == Fp8Granularity::kRow ||
                     g == Fp8Granularity::kTile1x128 || g == Fp8Granularity::kBlock128x128;
  if (!known)
    c.fail("options.granularity", "one of tensor, row, tile1x128, block128x128",
           "value " + std::to_string(static_cast<int>(g)));
  if (!(!options.scales_m_major || g == Fp8Granularity::kTile1x128))
    c.fail("options.scales_m_major", "false unless granularity is tile1x128",
           std::string("true with granularity ") + fp8_granularity_name(g));
}

// The scales of an [rows, cols] matrix: contiguous float32 in the grid's shape.
void check_scales(detail::OpChecker& c, const TensorView& t, const char* name,
                  const Fp8QuantizeOptions& options, std::int64_t rows, std::int64_t cols) {
  const ops::fp8::ScaleGrid grid = ops::fp8::scale_grid(options, rows, cols);
  c.present(t, name).dtype_in(t, name, {DType::kFloat32});
  const bool shape_ok = t.ndim == grid.ndim && t.shape[0] == grid.shape[0] &&
                        (grid.ndim == 1 || t.shape[1] == grid.shape[1]);
  if (!shape_ok)
    c.fail(name,
           "shape " + grid.shape_str() + " (" + fp8_granularity_name(options.granularity) +
               (grid.m_major ? " m-major" : "") + " scales of a [" + std::to_string(rows) + ", " +
               std::to_string(cols) + "] matrix)",
           "shape " + t.shape_str());
  c.contiguous(t, name);
}

}  // namespace

void fp8_quantize(const TensorView& x, TensorView q, TensorView scales, TensorView q_t,
                  TensorView scales_t, const Fp8QuantizeOptions& options, cudaStream_t stream) {
  detail::OpChecker c("fp8_quantize");
  check_options(c, options);
  c.matrix(x, "x", kHighPrecisionTypes);
  const std::int64_t M = x.size(0), N = x.size(1);
  c.matrix(q, "q", kFp8Types);
  c.same_shape(q, "q", x, "x");
  check_scales(c, scales, "scales", options, M, N);
  if (q_t.defined() != scales_t.defined()) {
    detail::throw_arg_error(c.op(), q_t.defined() ? "scales_t" : "q_t",
                            "a tensor (q_t and scales_t come together)", "none");
  }
  if (q_t.defined()) {
    c.matrix(q_t, "q_t", kFp8Types);
    c.same_dtype(q_t, "q_t", q, "q");
    c.dim_size(q_t, "q_t", 0, N, "the columns of x").dim_size(q_t, "q_t", 1, M, "the rows of x");
    check_scales(c, scales_t, "scales_t", options, N, M);
  }
  c.outputs_disjoint({{q, "q"}, {scales, "scales"}, {q_t, "q_t"}, {scales_t, "scales_t"}},
                     {{x, "x"}});
  if (detail::ran_on_cuda(c, [&] {
      ops::fp8::fp8_quantize_cuda(x, q, scales, q_t, scales_t, options, stream);
      })) {
    return;
  }
  ops::fp8::fp8_quantize_cpu(x, q, scales, q_t, scales_t, options);
}

void fp8_dequantize(const TensorView& q, const TensorView& scales, TensorView y,
                    const Fp8QuantizeOptions& options, cudaStream_t stream) {
  detail::OpChecker c("fp8_dequantize");
  check_options(c, options);
  c.matrix(q, "q", kFp8Types);
  check_scales(c, scales, "scales", options, q.size(0), q.size(1));
  c.matrix(y, "y", kHighPrecisionTypes);
  c.same_shape(y, "y", q, "q");
  c.outputs_disjoint({{y, "y"}}, {{q, "q"}, {scales, "scales"}});
  if (detail::ran_on_cuda(c, [&] {
      ops::fp8::fp8_dequantize_cuda(q, scales, y, options, stream);
      })) {
    return;
  }
  ops::fp8::fp8_dequantize_cpu(q, scales, y, options);
}

}  // namespace trainscale
