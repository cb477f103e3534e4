// The Hopper attention backward for head dim 256: bf16 and fp16 (attention_bwd_sm90_launch.cuh).
#include "ops/attention/attention_bwd_sm90_launch.cuh"

namespace trainscale::ops::attention {

void attention_backward_sm90_hdim256(const AttentionBackwardArgs& args, const AttentionOptions& options,
                                     cudaStream_t stream) {
  dispatch_backward_sm90<256>(args, options, stream);
}

}  // namespace trainscale::ops::attention
