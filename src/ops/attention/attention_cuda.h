// CUDA launchers of the attention family, defined in attention_fwd_hdim{64,128,256}.cu and
// attention_bwd_hdim{64,128,256}.cu (built when the CUTLASS headers are found:
// TRAINSCALE_HAVE_CUTLASS). Arguments arrive validated by attention.cc, including the CUDA
// kernels' own requirements (check_cuda_forward / check_cuda_backward there): bf16 or fp16, a
// supported head dim, 16-byte aligned tensors and strides, and for the backward a workspace of
// attention_backward_workspace_bytes.
#pragma once

#include "trainscale/attention.h"

namespace trainscale::ops::attention {

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

}  // namespace trainscale::ops::attention
