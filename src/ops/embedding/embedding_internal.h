// Between the embedding family's entry points (embedding.cc), its CPU reference
// (embedding_cpu.cc) and its CUDA kernels (embedding.cu). Arguments arrive validated.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/check.h"
#include "trainscale/embedding.h"

namespace trainscale::ops::embedding {

// The CPU paths check every id first (op names the entry point in the error).
void embedding_forward_cpu(const TensorView& weight, const TensorView& ids, TensorView out);
void embedding_backward_cpu(const TensorView& grad_output, const TensorView& ids, TensorView grad_weight,
                            std::int64_t padding_idx);

// embedding.cu
void embedding_forward_cuda(const TensorView& weight, const TensorView& ids, TensorView out, cudaStream_t stream);
std::size_t embedding_backward_workspace_bytes_cuda(std::int64_t num_ids);
void embedding_backward_cuda(const TensorView& grad_output, const TensorView& ids, TensorView grad_weight,
                             std::int64_t padding_idx, TensorView workspace, cudaStream_t stream);

}  // namespace trainscale::ops::embedding
