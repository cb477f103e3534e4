// CUDA launchers of the attention family, defined in attention_fwd_hdim{64,128,256}.cu (built
// when the CUTLASS headers are found: TRAINSCALE_HAVE_CUTLASS). Arguments arrive validated by
// attention.cc, including the CUDA kernel's own requirements (check_cuda_forward there): bf16 or
// fp16, a head dim forward_head_dim_supported accepts, 16-byte aligned q/k/v and strides.
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

}  // namespace trainscale::ops::attention
