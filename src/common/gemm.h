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
// [cols] of out's dtype, added to every row (in the product's epilogue). addend: the matrix
// beta scales (out's dtype and layout, disjoint from out); nullptr: out itself.
struct GemmResult {
  void* data = nullptr;
  DType dtype = DType::kBFloat16;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t ld = 0;
  const void* row_bias = nullptr;
  const void* addend = nullptr;
};

// alpha and beta: host floats, or device floats (read when the product runs) with on_device.
struct GemmScalars {
  const float* alpha = nullptr;
  const float* beta = nullptr;
  bool on_device = false;
};

// `count` products of one shape; product i reads a, b and the addend at data + i * stride_a,
// stride_b, stride_out elements and writes out at data + i * stride_out. batch_invariant: each
// product's bits do not depend on count: the algorithm is chosen for one product with no
// split-K reduction and used for every count (one strided-batched call when cuBLASLt accepts
// it for the batch, else one call per product).
struct GemmBatch {
  std::int64_t count = 1;
  std::int64_t stride_a = 0, stride_b = 0, stride_out = 0;
  bool batch_invariant = false;
};

// out = alpha * a @ b + beta * addend (+ row_bias), on `stream`, for each product of `batch`. a: [M, K], b: [K, N], out: [M, N]; a and b of
// one dtype (float32, float16, bfloat16), out of theirs or float32. workspace: cuBLASLt's
// scratch (16-byte aligned; 32 MiB lets it choose any algorithm). The algorithm for a shape is
// chosen once per process (cuBLASLt's heuristic) and reused: the same bits every run.
void gemm(const char* op, const GemmOperand& a, const GemmOperand& b, const GemmResult& out,
          const GemmScalars& scalars, void* workspace, std::size_t workspace_bytes,
          cudaStream_t stream, const GemmBatch& batch = {});

}  // namespace trainscale::detail
