// cuDNN RMSNorm / LayerNorm (forward in training mode, backward) as vendor baselines for the
// norm cases, through the cuDNN frontend's graph API.
//
// Built only when CMake found the frontend headers (TRAINSCALE_HAVE_CUDNN_FRONTEND); libcudnn
// is loaded at run time (dlopen of libcudnn.so.9, first from $TRAINSCALE_CUDNN_LIB_DIR), so the
// binary does not depend on it: where it cannot be loaded, or cuDNN has no engine for a case,
// the row is UNSUPPORTED with the reason.
#pragma once

#include <optional>

#include "bench/baselines/cudnn_baselines.h"
#include "bench/registry.h"

namespace trainscale::bench {

enum class CudnnNormOp {
  kRmsNormForward,     // x, weight -> y, rstd
  kRmsNormBackward,    // dy, x, weight, rstd -> dx, dw
  kLayerNormForward,   // x, weight, bias -> y, mean, rstd
  kLayerNormBackward,  // dy, x, weight, mean, rstd -> dx, dw, db
};

// The baseline for a norm case whose tensors are laid out as in cases/norm_cases.cc, with the
// case's eps (and RMSNorm weight offset, which must be 0); nothing when this build has no cuDNN
// or cuDNN takes no such dtype. Never throws: a graph cuDNN cannot build, or a libcudnn that
// cannot be loaded, gives an implementation that reports itself Unsupported when run. The graph
// is built here (once per op, shape, dtype and eps, then cached), and its workspace allocated
// here and declared as workspace_bytes, so nothing but the execution is timed.
std::optional<Implementation> cudnn_norm_baseline(CudnnNormOp op, const Case& c, double eps,
                                                  double weight_offset = 0.0);

}  // namespace trainscale::bench
