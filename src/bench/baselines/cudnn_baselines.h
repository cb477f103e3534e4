// What the case files need to know about the cuDNN baselines (cudnn_norm.h, cudnn_sdpa.h)
// before registering them.
#pragma once

namespace trainscale::bench {

// Whether this build has the cuDNN baselines (CMake found the cuDNN frontend headers).
bool cudnn_baselines_built();

}  // namespace trainscale::bench
