// The attention backward for head dim 64: the Hopper kernel where it runs, else the sm_80+
// kernels for bf16 and fp16 (attention_bwd_launch.cuh).
#include "ops/attention/attention_bwd_launch.cuh"

namespace trainscale::ops::attention {

void attention_backward_hdim64(const AttentionBackwardArgs& args, const AttentionOptions& options,
                               cudaStream_t stream) {
  if (use_hopper_backward(64)) {
    attention_backward_sm90_hdim64(args, options, stream);
    return;
  }
  dispatch_backward<64>(args, options, stream);
}

}  // namespace trainscale::ops::attention
