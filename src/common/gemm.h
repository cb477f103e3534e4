// Matrix products on tensor cores through cuBLASLt, in the row-major terms the kernels use.
// Every product accumulates in float32 (CUBLAS_COMPUTE_32F: no TF32 for float32 operands).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "trainscale/tensor.h"

namespace trainscale::detail {

// A row-major operand of logical shape [rows, cols]: element (r, c) at data[r * ld + c], or,
// with transposed, the transpose of the row-major [cols, rows] matrix at data (element (r, c)
// at data[c * ld + r]).
struct GemmOperand {
  const void* data = nullptr;
  DType dtype = DType::kBFloat16;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t ld = 0;
  bool transposed = false;
};

// A row-major result [rows, cols], element (r, c) at data[r * ld + c]. row_bias: optional
// [cols] of out's dtype, added to every row (in the product's epilogue).
struct GemmResult {
  void* data = nullptr;
  DType dtype = DType::kBFloat16;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t ld = 0;
  const void* row_bias = nullptr;
};

// alpha and beta: host floats, or device floats (read when the product runs) with on_device.
struct GemmScalars {
  const float* alpha = nullptr;
  const float* beta = nullptr;
  bool on_device = false;
};

// out = alpha * a @ b + beta * out (+ row_bias), on `stream`. a: [M, K], b: [K, N], out: [M, N]; a and b of
// one dtype (float32, float16, bfloat16), out of theirs or float32. workspace: cuBLASLt's
// scratch (16-byte aligned; 32 MiB lets it choose any algorithm). The algorithm for a shape is
// chosen once per process (cuBLASLt's heuristic) and reused: the same bits every run.
void gemm(const char* op, const GemmOperand& a, const GemmOperand& b, const GemmResult& out,
          const GemmScalars& scalars, void* workspace, std::size_t workspace_bytes,
          cudaStream_t stream);

}  // namespace trainscale::detail
