// Between the fp8 family's entry points (fp8.cc), its CPU reference (fp8_cpu.cc) and its CUDA
// kernels (fp8_quantize*.cu, fp8_dequantize.cu). Arguments arrive validated.
#pragma once

#include <cstdint>
#include <string>

#include "core/check.h"
#include "trainscale/fp8.h"

namespace trainscale::ops::fp8 {

inline constexpr std::int64_t kGroupEdge = 128;  // tile width, block height and width

inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Where each element's scale lives for an [rows, cols] matrix under one set of options:
// element (i, j) belongs to group (i / group_height, j / group_width), whose scale sits at
// offset(gi, gj) in the contiguous scales tensor of shape `shape`.
struct ScaleGrid {
  std::int64_t groups_down = 1;    // groups along the rows
  std::int64_t groups_across = 1;  // groups along a row
  std::int64_t group_height = 1;   // elements; never 0, so the division above is always defined
  std::int64_t group_width = 1;
  bool m_major = false;
  std::int64_t m_major_pitch = 0;  // align4(rows): the stride between a tile column's scales
  int ndim = 1;
  std::int64_t shape[2] = {1, 1};

  std::int64_t offset(std::int64_t gi, std::int64_t gj) const {
    return m_major ? gj * m_major_pitch + gi : gi * groups_across + gj;
  }
  std::int64_t storage_size() const { return ndim == 1 ? shape[0] : shape[0] * shape[1]; }
  std::string shape_str() const;
};

ScaleGrid scale_grid(const Fp8QuantizeOptions& options, std::int64_t rows, std::int64_t cols);

void fp8_quantize_cpu(const TensorView& x, TensorView q, TensorView scales, TensorView q_t,
                      TensorView scales_t, const Fp8QuantizeOptions& options);
void fp8_dequantize_cpu(const TensorView& q, const TensorView& scales, TensorView y,
                        const Fp8QuantizeOptions& options);

}  // namespace trainscale::ops::fp8
