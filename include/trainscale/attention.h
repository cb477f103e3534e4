// Scaled dot-product attention: O = softmax(mask(softcap(Q K^T * scale))) V, with grouped-query
// heads, a bottom-right aligned causal mask and sliding window, and packed variable-length
// sequences (attention_varlen_*).
#pragma once

#include <cstddef>
#include <cstdint>

#include "trainscale/tensor.h"

namespace trainscale {

// How the CUDA forward's persistent grid (a CTA per SM) takes its tiles (a tile: one block of
// queries of one head). kStatic: CTA c takes tiles c, c + grid, c + 2 grid, ... kDynamic: after
// its first tile each CTA claims the next free one (a counter in device memory), so a CTA whose
// tiles cost less, as a causal mask's short query blocks do, takes more of them. kAuto: the
// library's choice for the shape (dynamic for masked attention at head dim 128 and 256, and at
// head dim 64 from 8192 queries; static otherwise).
enum class AttentionSchedule { kAuto, kStatic, kDynamic };

struct AttentionOptions {
  bool causal = false;
  double scale = 0.0;  // 0 -> 1/sqrt(D); otherwise any finite value
  // Sliding window (local attention): query i also sees only keys j with
  // i + (Sk - Sq) - window_left <= j <= i + (Sk - Sq) + window_right; -1 leaves a side unbounded.
  // Causal is window_right = 0 (with causal, window_right must be -1 or 0).
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  // Logit softcap: scores s = scale * q.k become softcap * tanh(s / softcap); 0 = off, else > 0.
  double softcap = 0.0;
  // Backward only: the same bits every run. The Hopper kernel then adds the dQ partials of the
  // key blocks in a fixed order instead of as they arrive (at D 64 / 128; at D 256 the sm_80+
  // kernels run instead); every other path is deterministic either way.
  bool deterministic = false;
  // Forward only, CUDA only (the CPU reference and the backward ignore it).
  AttentionSchedule schedule = AttentionSchedule::kAuto;
};

// q [B, Sq, Hq, D]; k and v [B, Sk, Hkv, D] with Hq % Hkv == 0 (query head h reads kv head
// h / (Hq / Hkv)). float32 / float16 / bfloat16 (float64 on the CPU), one dtype for all; any
// non-negative strides with stride 1 in the last dim.
// out [B, Sq, Hq, D] in q's dtype (any such strides, elements must not alias).
// lse [B, Hq, Sq] contiguous, float32 (float64 accepted on the CPU): log-sum-exp of each
// query's scaled, masked scores; optional (TensorView{}).
// Causal: query i sees key j iff j <= i + (Sk - Sq); the window bounds j further. A query that
// sees no key (Sq > Sk causal, a window past the keys, or Sk == 0) gets out = 0 and lse = -inf,
// as in FlashAttention. The CUDA path (sm_90a) takes bf16 / fp16 with D in {64, 128, 256} and
// q, k, v as TMA reads them (16-byte aligned, strides of 16-byte multiples).
void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       TensorView out, TensorView lse, const AttentionOptions& options = {},
                       cudaStream_t stream = nullptr);

// The tensors of attention_backward, named at the call so that none can be swapped:
//   attention_backward({.dout = dout, .q = q, .k = k, .v = v, .out = out, .lse = lse,
//                       .dq = dq, .dk = dk, .dv = dv}, options, stream);
// dout and out like the forward's out, lse as the forward wrote it (both required: the
// backward recomputes P = exp(S - lse) and D_i = rowsum(dout * out) as a kernel does).
// dq like q; dk, dv like k, v (all three required, written in full).
// workspace: the CUDA path's scratch (the fp32 row terms D_i and, on Hopper, dQ's fp32
// accumulator), at least attention_backward_workspace_bytes(q) bytes, contiguous and 256-byte
// aligned, disjoint from every other argument, contents ignored; required on CUDA, ignored on
// the CPU and may be absent there.
// On a Hopper GPU (sm_90a build), dQ is summed over key blocks in fp32 as the blocks finish, so
// its last bits may differ between runs unless options.deterministic; dK and dV are always summed
// in one order. Elsewhere (sm_80+, and D 256 when deterministic) every output element is written
// by one thread block in one fixed order. The CUDA path takes bf16 / fp16 with D in {64, 128, 256},
// and every [B, S, H, D] tensor 16-byte aligned with strides of 16-byte multiples (dims of size 1
// excepted); it needs compute capability 8.0+.
struct AttentionBackwardArgs {
  TensorView dout;
  TensorView q;
  TensorView k;
  TensorView v;
  TensorView out;
  TensorView lse;
  TensorView dq;
  TensorView dk;
  TensorView dv;
  TensorView workspace;
};
void attention_backward(const AttentionBackwardArgs& args, const AttentionOptions& options = {},
                        cudaStream_t stream = nullptr);
// Bytes of workspace attention_backward's CUDA path needs for q's shape (only the shape is
// read): fp32 [B, Hq, Sq'] row terms, fp32 [B, Hq, Sq', D] for dQ and one counter per query
// block of each head, Sq' being Sq rounded up to the Hopper kernel's query block (128 rows at
// D 64, 64 at D 128 and 256).
std::size_t attention_backward_workspace_bytes(const TensorView& q);

// Variable-length (packed) sequences, FlashAttention's varlen layout: q [Tq, Hq, D] and k / v
// [Tk, Hkv, D] hold B sequences back to back. Sequence b has queries
// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and keys [cu_seqlens_k[b], cu_seqlens_k[b + 1]), and is
// attended as attention_forward attends one batch entry (causal and window aligned bottom-right
// within the sequence; an empty sequence is allowed). cu_seqlens_* are int32 [B + 1] on q's
// device, non-decreasing from 0 to Tq / Tk, no sequence longer than max_seqlen_* (all checked).
// On CUDA the batched kernels run once per sequence after the offsets are read back to the host:
// a synchronization of `stream` per call, and stream-ordered allocations (cudaMallocAsync) for
// lse rows and the backward's workspace, so the backward takes no workspace argument.
struct AttentionSequences {
  TensorView cu_seqlens_q;
  TensorView cu_seqlens_k;
  std::int64_t max_seqlen_q = 0;
  std::int64_t max_seqlen_k = 0;
};

// out [Tq, Hq, D] like q (any strides with stride 1 in D); lse [Hq, Tq] contiguous float32
// (float64 accepted on the CPU), optional.
void attention_varlen_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                              const AttentionSequences& sequences, TensorView out, TensorView lse,
                              const AttentionOptions& options = {}, cudaStream_t stream = nullptr);
// The backward of attention_varlen_forward: the tensors of AttentionBackwardArgs in the packed
// layout (dout, out, dq like q; dk, dv like k, v; lse [Hq, Tq] as the forward wrote it); the
// workspace is not used.
void attention_varlen_backward(const AttentionBackwardArgs& args, const AttentionSequences& sequences,
                               const AttentionOptions& options = {}, cudaStream_t stream = nullptr);

}  // namespace trainscale
