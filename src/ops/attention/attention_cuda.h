// CUDA launchers of the attention family, defined in attention_fwd_hdim{64,128,256}.cu and
// attention_bwd_hdim{64,128,256}.cu and attention_bwd_sm90_hdim{64,128,256}.cu (built when the CUTLASS headers are found:
// TRAINSCALE_HAVE_CUTLASS). Arguments arrive validated by attention.cc, including the CUDA
// kernels' own requirements (check_cuda_forward / check_cuda_backward there): bf16 or fp16, a
// supported head dim, 16-byte aligned tensors and strides, and for the backward a workspace of
// attention_backward_workspace_bytes.
#pragma once

#include <string>

#include "common/cuda_check.h"
#include "core/check.h"
#include "trainscale/attention.h"

namespace trainscale::ops::attention {

// The current GPU runs `kernel`: its compute capability is `needs` (major exactly `major`, or at
// least `major` when `or_newer`) and this build holds an image of the kernel for it.
inline void require_device_for(const char* op, const void* kernel, int major, bool or_newer, const char* needs) {
  const detail::DeviceInfo& info = detail::current_device_info();
  if (or_newer ? info.major < major : info.major != major) {
    detail::throw_op_error(op, std::string("the CUDA attention kernel needs ") + needs + "; device " +
                                   std::to_string(info.device) + " has compute capability " +
                                   std::to_string(info.major) + "." + std::to_string(info.minor) +
                                   " (pass CPU tensors for the reference)");
  }
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    detail::throw_op_error(op, "no kernel image for this GPU in this build (TRAINSCALE_CUDA_ARCHS must "
                               "include its architecture)");
  }
}

void attention_forward_hdim64(const TensorView& q, const TensorView& k, const TensorView& v,
                              TensorView out, TensorView lse, const AttentionOptions& options,
                              cudaStream_t stream);
void attention_forward_hdim128(const TensorView& q, const TensorView& k, const TensorView& v,
                               TensorView out, TensorView lse, const AttentionOptions& options,
                               cudaStream_t stream);
void attention_forward_hdim256(const TensorView& q, const TensorView& k, const TensorView& v,
                               TensorView out, TensorView lse, const AttentionOptions& options,
                               cudaStream_t stream);

void attention_backward_hdim64(const AttentionBackwardArgs& args, const AttentionOptions& options,
                               cudaStream_t stream);
void attention_backward_hdim128(const AttentionBackwardArgs& args, const AttentionOptions& options,
                                cudaStream_t stream);
void attention_backward_hdim256(const AttentionBackwardArgs& args, const AttentionOptions& options,
                                cudaStream_t stream);
// The Hopper backward (attention_bwd_sm90_hdim*.cu), which attention_backward_hdim* call on a
// Hopper GPU.
void attention_backward_sm90_hdim64(const AttentionBackwardArgs& args, const AttentionOptions& options,
                                    cudaStream_t stream);
void attention_backward_sm90_hdim128(const AttentionBackwardArgs& args, const AttentionOptions& options,
                                     cudaStream_t stream);
void attention_backward_sm90_hdim256(const AttentionBackwardArgs& args, const AttentionOptions& options,
                                     cudaStream_t stream);

}  // namespace trainscale::ops::attention
