// Between the Newton-Schulz family's entry points (newton_schulz.cc), its CPU reference
// (newton_schulz_cpu.cc) and its CUDA kernels (newton_schulz.cu). Arguments arrive validated.
#pragma once

#include "core/check.h"
#include "trainscale/newton_schulz.h"

namespace trainscale::ops::newton_schulz {

void newton_schulz_cpu(const TensorView& g, TensorView out, const NewtonSchulzOptions& options);
void muon_step_cpu(TensorView param, const TensorView& grad, TensorView momentum_buffer,
                   const MuonOptions& options);

}  // namespace trainscale::ops::newton_schulz
