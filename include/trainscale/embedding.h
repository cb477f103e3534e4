// Token embedding: the gather of a table's rows and its gradient, the rows of the output
// gradient summed into a dense table gradient in a fixed order (the same bits every run).
#pragma once

#include <cstddef>
#include <cstdint>

#include "trainscale/tensor.h"

namespace trainscale {

// out[t, :] = weight[ids[t], :] for t in [0, T).
// weight: [V, H] float32 / float16 / bfloat16 (float64 on the CPU), rows contiguous (any row
// stride); ids: [T] int32 / int64, contiguous; out: [T, H] of weight's dtype, rows contiguous,
// disjoint from weight. An id outside [0, V): on the CPU an error naming it; on CUDA (not
// checked on the host) that row of out is NaN.
void embedding_forward(const TensorView& weight, const TensorView& ids, TensorView out, cudaStream_t stream = nullptr);

// grad_weight[v, :] = the sum of grad_output[t, :] over the t with ids[t] == v, for every v in
// [0, V) other than padding_idx (-1: none), whose row is zero like those no id names. Every row
// is written. Summed in increasing t in float32 on CUDA (float64 on the CPU) and rounded once.
// grad_output: [T, H] float32 / float16 / bfloat16 (float64 on the CPU), rows contiguous (any
// row stride); ids: [T] int32 / int64, contiguous, T < 2^31; grad_weight: [V, H] of
// grad_output's dtype, contiguous, disjoint from the inputs (V < 2^31 on CUDA); padding_idx: -1
// or in [0, V).
// An id outside [0, V): on the CPU an error naming it; on CUDA every element of grad_weight is
// NaN (the gradient has no row to go to; the error shows in the gradient norm).
// workspace: on CUDA at least embedding_backward_workspace_bytes(T) bytes, 16-byte aligned
// (the ids sorted with their positions); ignored on the CPU.
void embedding_backward(const TensorView& grad_output, const TensorView& ids, TensorView grad_weight,
                        std::int64_t padding_idx = -1, TensorView workspace = {}, cudaStream_t stream = nullptr);
std::size_t embedding_backward_workspace_bytes(std::int64_t num_ids);

}  // namespace trainscale
