// How fused_linear_cross_entropy_forward's CUDA path splits the tokens into chunks and lays
// out its workspace: a pure function of the arguments' shapes, dtypes and which outputs are
// given (tests/cross_entropy_test.cc checks it on the CPU).
#pragma once

#include <cstddef>
#include <cstdint>

#include "trainscale/loss.h"

namespace trainscale::ops::loss {

struct FusedLinearPlan {
  std::int64_t chunk_tokens = 0;  // tokens per chunk (the last may have fewer)
  std::int64_t chunks = 0;
  std::int64_t logits_ld = 0;     // row stride of the logits chunk: V rounded up to 16 bytes
  bool float_weight_acc = false;  // grad_weight summed in a float32 buffer, rounded at the end
  bool float_bias_acc = false;    // grad_bias likewise (always when it is asked)
  // Byte offsets into the workspace (meaningful where the piece is used) and the total.
  std::size_t gemm_workspace = 0;  // cuBLASLt's, kGemmWorkspaceBytes
  std::size_t logits = 0;          // [chunk_tokens, logits_ld] of hidden's dtype
  std::size_t row_losses = 0;      // [T] float32, for a reduced loss
  std::size_t row_lse = 0;         // [T] float32, when the lse is needed but not asked for
  std::size_t scalars = 0;         // the valid-row count and the GEMMs' alpha / beta
  std::size_t reduce_parts = 0;    // the row reductions' partials, for a reduced loss
  std::size_t weight_acc = 0;      // [V, H] float32
  std::size_t bias_acc = 0;        // [V] float32
  std::size_t ones = 0;            // [chunk_tokens] of hidden's dtype: grad_bias as a GEMM
  std::size_t bytes = 0;
};

inline constexpr std::size_t kGemmWorkspaceBytes = std::size_t{32} << 20;

// Tokens per chunk when the caller leaves it to us: as many as keep a chunk's logits within
// kFusedLinearChunkBytes, a multiple of 128 (a GEMM tile) unless all tokens fit, at least 128.
std::int64_t default_chunk_tokens(std::int64_t tokens, std::int64_t classes, std::size_t elem_bytes);

// Expects validated arguments (shapes read from hidden, weight and the outputs given). With
// chunk_tokens 0: default_chunk_tokens, except when grad_weight is summed in a float32 buffer:
// then chunks of as many logits bytes as that buffer (4 H / e tokens: fewer passes over it),
// or every token in one chunk when holding all logits takes no more memory than a chunk and
// the buffer (e.g. Llama-3 8B's head at T 8192).
FusedLinearPlan plan_fused_linear(const FusedLinearCrossEntropyArgs& args,
                                  const CrossEntropyOptions& options);

}  // namespace trainscale::ops::loss
