// The attention forward for head dim 256: bf16 and fp16, causal and not (attention_fwd_launch.cuh).
#include "ops/attention/attention_fwd_launch.cuh"

namespace trainscale::ops::attention {

void attention_forward_hdim256(const TensorView& q, const TensorView& k, const TensorView& v,
                              TensorView out, TensorView lse, const AttentionOptions& options,
                              cudaStream_t stream) {
  dispatch_forward<256>(q, k, v, out, lse, options, stream);
}

}  // namespace trainscale::ops::attention
