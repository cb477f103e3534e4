// The computation fused_linear_cross_entropy_forward replaces, as the `unfused` baseline of its
// case: logits = hidden @ weight^T materialized whole ([T, V] in the activation dtype),
// cross_entropy_forward with the logits' gradient written over them, then
// grad_hidden = G @ weight and grad_weight = G^T @ hidden. The GEMMs are cuBLASLt through the
// library's detail::gemm (float32 accumulation), the cross-entropy our kernel.
#pragma once

#if TRAINSCALE_HAVE_CUDA
#include <optional>

#include "bench/registry.h"

namespace trainscale::bench {

// The logits and cuBLASLt's workspace are allocated on the first call (the gate's, never timed)
// and kept, so the row reports them as memory beyond inputs and outputs; logits that do not fit
// in device memory make the row UNSUPPORTED.
std::optional<Implementation> unfused_linear_cross_entropy_baseline(const Case& c);

}  // namespace trainscale::bench
#endif
