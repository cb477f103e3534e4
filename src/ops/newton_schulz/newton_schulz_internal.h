// Between the Newton-Schulz family's entry points (newton_schulz.cc), its CPU reference
// (newton_schulz_cpu.cc) and its CUDA kernels (newton_schulz.cu). Arguments arrive validated.
#pragma once

#include "core/check.h"
#include "trainscale/newton_schulz.h"

namespace trainscale::ops::newton_schulz {

void newton_schulz_cpu(const TensorView& g, TensorView out, const NewtonSchulzOptions& options);
void muon_step_cpu(TensorView param, const TensorView& grad, TensorView momentum_buffer,
                   const MuonOptions& options);

// newton_schulz.cu: workspace of at least newton_schulz_workspace_bytes_cuda bytes (checked).
std::size_t newton_schulz_workspace_bytes_cuda(std::int64_t rows, std::int64_t cols, DType dtype);
void newton_schulz_cuda(const TensorView& g, TensorView out, const NewtonSchulzOptions& options,
                        const TensorView& workspace, cudaStream_t stream);

}  // namespace trainscale::ops::newton_schulz
