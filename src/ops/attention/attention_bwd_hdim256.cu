// The attention backward for head dim 256: the Hopper kernel where it runs (not in the
// deterministic mode), else the sm_80+ kernels for bf16 and fp16 (attention_bwd_launch.cuh).
#include "ops/attention/attention_bwd_launch.cuh"

namespace trainscale::ops::attention {

void attention_backward_hdim256(const AttentionBackwardArgs& args, const AttentionOptions& options,
                               cudaStream_t stream) {
  if (use_hopper_backward(256) && !options.deterministic) {
    attention_backward_sm90_hdim256(args, options, stream);
    return;
  }
  dispatch_backward<256>(args, options, stream);
}

}  // namespace trainscale::ops::attention
