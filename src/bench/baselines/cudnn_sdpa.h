// cuDNN scaled dot-product attention (forward with its log-sum-exp, backward from it) as the
// vendor baseline for the attention cases, through the cuDNN frontend's graph API: the fused
// flash-attention engines that PyTorch's cuDNN backend calls.
//
// Built and loaded like the norm baselines (cudnn_norm.h): only when CMake found the frontend
// headers, libcudnn.so.9 dlopen()ed at run time; where it cannot be loaded, or cuDNN has no
// engine for a case, the row is UNSUPPORTED with the reason.
#pragma once

#include <optional>

#include "bench/baselines/cudnn_baselines.h"
#include "bench/registry.h"
#include "trainscale/attention.h"

namespace trainscale::bench {

enum class CudnnSdpaOp {
  kForward,   // q, k, v -> out, lse
  kBackward,  // dout, q, k, v, out, lse -> dq, dk, dv
};

// The baseline for an attention case whose tensors are laid out as in cases/attention_cases.cc
// (q, out, dout, dq [B, Sq, Hq, D], k, v, dk, dv [B, Sk, Hkv, D], lse [B, Hq, Sq] float32, all
// contiguous), with the case's options; nothing when this build has no cuDNN. Never throws:
// what cuDNN cannot do (float32, a head dim it lacks, a causal mask with Sq > Sk, ...) gives an
// implementation that reports itself Unsupported with the reason. The graph is built here (once
// per case and options, then cached) and its workspace allocated here and declared as
// workspace_bytes, so only the execution is timed.
std::optional<Implementation> cudnn_sdpa_baseline(CudnnSdpaOp op, const Case& c, const AttentionOptions& options);

}  // namespace trainscale::bench
