// Reference for the fp8 family. Unlike the other families it computes in float32, not fp64:
// the contract fixes every float32 operation so that kernels can match it bit for bit.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/host_dtype.h"
#include "core/parallel.h"
#include "ops/fp8/fp8_internal.h"

namespace trainscale::ops::fp8 {

namespace {

constexpr std::int64_t kRowGrain = 16;

// An [rows, cols] matrix in memory, element (i, j) at i * row_stride + j * col_stride, so one
// routine quantizes both x and (with the strides swapped) x^T.
struct Matrix {
  void* data;
  DType dtype;
  std::int64_t rows, cols, row_stride, col_stride;

  std::int64_t offset(std::int64_t i, std::int64_t j) const {
    return i * row_stride + j * col_stride;
  }
  // Exact: float32, float16, bfloat16 and fp8 values are all floats.
  float load(std::int64_t i, std::int64_t j) const {
    return static_cast<float>(detail::load_as_double(dtype, data, offset(i, j)));
  }
  Matrix transposed() const { return {data, dtype, cols, rows, col_stride, row_stride}; }
};

// A validated 2-D view; its last stride only matters when cols > 1, where it is 1.
Matrix matrix_of(const TensorView& t) {
  return {t.data, t.dtype, t.size(0), t.size(1), t.stride(0), 1};
}

float fp8_max(DType fp8) { return fp8 == DType::kFloat8E4M3 ? 448.0f : 57344.0f; }

// The contract's amax lets a NaN win whatever the order; std::max would depend on it.
float max_keeping_nan(float a, float b) { return (a > b || std::isnan(a)) ? a : b; }

float dequant_scale(float amax, float fmax, bool power_of_two) {
  const float ratio = amax / fmax;
  // amax == 0, or so small that the ratio underflows: a zero scale would give q = x / 0.
  if (ratio == 0.0f) return 1.0f;
  if (!power_of_two || !std::isfinite(ratio)) return ratio;
  int exponent;
  const float mantissa = std::frexp(ratio, &exponent);  // ratio = mantissa * 2^exponent, [0.5, 1)
  return mantissa == 0.5f ? ratio : std::ldexp(1.0f, exponent);
}

void quantize_matrix(const Matrix& x, const Matrix& q, float* scales, const ScaleGrid& grid,
                     bool power_of_two) {
  const std::int64_t across = grid.groups_across;
  // amax of each row's share of each group (in parallel over rows), then folded down the
  // group's rows.
  std::vector<float> row_amax(static_cast<std::size_t>(x.rows * across), 0.0f);
  detail::parallel_for(x.rows, kRowGrain, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      for (std::int64_t j = 0; j < x.cols; ++j) {
        float& amax = row_amax[i * across + j / grid.group_width];
        amax = max_keeping_nan(amax, std::fabs(x.load(i, j)));
      }
    }
  });
  if (grid.m_major) std::fill(scales, scales + grid.storage_size(), 0.0f);  // padding rows
  const float fmax = fp8_max(q.dtype);
  std::vector<float> group_scale(static_cast<std::size_t>(grid.groups_down * across));
  for (std::int64_t gi = 0; gi < grid.groups_down; ++gi) {
    const std::int64_t row_end = std::min(x.rows, (gi + 1) * grid.group_height);
    for (std::int64_t gj = 0; gj < across; ++gj) {
      float amax = 0.0f;
      for (std::int64_t i = gi * grid.group_height; i < row_end; ++i) {
        amax = max_keeping_nan(amax, row_amax[i * across + gj]);
      }
      const float scale = dequant_scale(amax, fmax, power_of_two);
      group_scale[gi * across + gj] = scale;
      scales[grid.offset(gi, gj)] = scale;
    }
  }
  detail::parallel_for(x.rows, kRowGrain, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      const float* row_scales = &group_scale[(i / grid.group_height) * across];
      for (std::int64_t j = 0; j < x.cols; ++j) {
        // One float32 division (not a multiply by 1/s), then the saturating fp8 cast.
        const float quotient = x.load(i, j) / row_scales[j / grid.group_width];
        detail::store_from_double(q.dtype, q.data, q.offset(i, j), quotient);
      }
    }
  });
}

}  // namespace

void fp8_quantize_cpu(const TensorView& x, TensorView q, TensorView scales, TensorView q_t,
                      TensorView scales_t, const Fp8QuantizeOptions& options) {
  const Matrix xm = matrix_of(x);
  quantize_matrix(xm, matrix_of(q), scales.ptr<float>(), scale_grid(options, xm.rows, xm.cols),
                  options.power_of_two_scales);
  if (q_t.defined()) {
    quantize_matrix(xm.transposed(), matrix_of(q_t), scales_t.ptr<float>(),
                    scale_grid(options, xm.cols, xm.rows), options.power_of_two_scales);
  }
}

void fp8_dequantize_cpu(const TensorView& q, const TensorView& scales, TensorView y,
                        const Fp8QuantizeOptions& options) {
  const Matrix qm = matrix_of(q), ym = matrix_of(y);
  const ScaleGrid grid = scale_grid(options, qm.rows, qm.cols);
  const float* scale = scales.ptr<const float>();
  detail::parallel_for(qm.rows, kRowGrain, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      for (std::int64_t j = 0; j < qm.cols; ++j) {
        // One float32 multiply, rounded once to y's dtype.
        const float value =
            qm.load(i, j) * scale[grid.offset(i / grid.group_height, j / grid.group_width)];
        detail::store_from_double(ym.dtype, ym.data, ym.offset(i, j), value);
      }
    }
  });
}

}  // namespace trainscale::ops::fp8
