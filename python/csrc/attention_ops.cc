// Scaled dot-product attention as torch.ops.trainscale ops: python/trainscale/attention.py
// wraps them, the entry points are in include/trainscale/attention.h. Outputs are allocated
// here; shapes, dtypes and strides are validated by the C++ layer.
#include <tuple>

#include "binding.h"
#include "trainscale/attention.h"

namespace trainscale::binding {
namespace {

// The backward is deterministic when PyTorch is asked for deterministic algorithms
// (torch.use_deterministic_algorithms).
ts::AttentionOptions attention_options(bool causal, double scale, int64_t window_left,
                                       int64_t window_right, double softcap) {
  return {.causal = causal, .scale = scale, .window_left = window_left, .window_right = window_right,
          .softcap = softcap, .deterministic = at::globalContext().deterministicAlgorithms()};
}

// (out, lse): out [B, Sq, Hq, D] contiguous in q's dtype, lse [B, Hq, Sq] float32 (float64 for
// float64 q). A q that is not 4-D gets placeholders, and attention_forward names the argument.
std::tuple<Tensor, Tensor> attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             bool causal, double scale, int64_t window_left,
                                             int64_t window_right, double softcap) {
  const char* op = "attention_forward";
  Ctx ctx(q, op, "q");
  Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  const auto stats = q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  Tensor lse = q.dim() == 4 ? at::empty({q.size(0), q.size(2), q.size(1)}, stats) : at::empty({0}, stats);
  guarded([&] {
    ts::attention_forward(view(q, op, "q"), view(k, op, "k"), view(v, op, "v"), view(out, op, "out"),
                          view(lse, op, "lse"),
                          attention_options(causal, scale, window_left, window_right, softcap), ctx.stream);
  });
  return {out, lse};
}

// (dq, dk, dv), contiguous, like q, k and v: allocated here, then run(args, stream) with the
// tensors of the backward named.
template <class Run>
std::tuple<Tensor, Tensor, Tensor> run_backward(const char* op, const Tensor& dout, const Tensor& q,
                                                const Tensor& k, const Tensor& v, const Tensor& out,
                                                const Tensor& lse, Run run) {
  Ctx ctx(q, op, "q");
  Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor dk = at::empty_like(k, at::MemoryFormat::Contiguous);
  Tensor dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  Tensor workspace;
  guarded([&] {
    // The CPU reference needs no workspace; on CUDA the caching allocator owns it (256-byte
    // aligned). A q that is not 4-D gets none, and the op names the argument.
    if (q.is_cuda() && q.dim() == 4) {
      const ts::TensorView shape_of_q(nullptr, ts::DType::kFloat32, {q.size(0), q.size(1), q.size(2), q.size(3)});
      const auto bytes = static_cast<int64_t>(ts::attention_backward_workspace_bytes(shape_of_q));
      workspace = at::empty({bytes}, q.options().dtype(at::kByte));
    }
    run(ts::AttentionBackwardArgs{.dout = view(dout, op, "dout"),
                                  .q = view(q, op, "q"),
                                  .k = view(k, op, "k"),
                                  .v = view(v, op, "v"),
                                  .out = view(out, op, "out"),
                                  .lse = view(lse, op, "lse"),
                                  .dq = view(dq, op, "dq"),
                                  .dk = view(dk, op, "dk"),
                                  .dv = view(dv, op, "dv"),
                                  .workspace = workspace.defined() ? workspace_view(workspace, op, "workspace")
                                                                   : ts::TensorView{}},
        ctx.stream);
  });
  return {dq, dk, dv};
}

std::tuple<Tensor, Tensor, Tensor> attention_backward(const Tensor& dout, const Tensor& q,
                                                      const Tensor& k, const Tensor& v,
                                                      const Tensor& out, const Tensor& lse,
                                                      bool causal, double scale,
                                                      int64_t window_left, int64_t window_right,
                                                      double softcap) {
  return run_backward("attention_backward", dout, q, k, v, out, lse,
                      [&](const ts::AttentionBackwardArgs& args, cudaStream_t stream) {
                        ts::attention_backward(
                            args, attention_options(causal, scale, window_left, window_right, softcap), stream);
                      });
}

ts::AttentionSequences attention_sequences(const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                           int64_t max_seqlen_q, int64_t max_seqlen_k, const char* op) {
  return {.cu_seqlens_q = view(cu_seqlens_q, op, "cu_seqlens_q"),
          .cu_seqlens_k = view(cu_seqlens_k, op, "cu_seqlens_k"),
          .max_seqlen_q = max_seqlen_q,
          .max_seqlen_k = max_seqlen_k};
}

// (out, lse) of packed sequences: out [Tq, Hq, D] contiguous in q's dtype, lse [Hq, Tq].
std::tuple<Tensor, Tensor> attention_varlen_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                    const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                    int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                                    double scale, int64_t window_left, int64_t window_right,
                                                    double softcap) {
  const char* op = "attention_varlen_forward";
  Ctx ctx(q, op, "q");
  Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  const auto stats = q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  Tensor lse = q.dim() == 3 ? at::empty({q.size(1), q.size(0)}, stats) : at::empty({0}, stats);
  guarded([&] {
    ts::attention_varlen_forward(view(q, op, "q"), view(k, op, "k"), view(v, op, "v"),
                                 attention_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, op),
                                 view(out, op, "out"), view(lse, op, "lse"),
                                 attention_options(causal, scale, window_left, window_right, softcap), ctx.stream);
  });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_varlen_backward(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
    const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    bool causal, double scale, int64_t window_left, int64_t window_right, double softcap) {
  const char* op = "attention_varlen_backward";
  return run_backward(op, dout, q, k, v, out, lse, [&](const ts::AttentionBackwardArgs& args, cudaStream_t stream) {
    ts::attention_varlen_backward(args,
                                  attention_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, op),
                                  attention_options(causal, scale, window_left, window_right, softcap), stream);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trainscale, m) {
  def_op(m,
         "attention_varlen_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
         "int max_seqlen_q, int max_seqlen_k, bool causal, float scale, int window_left=-1, "
         "int window_right=-1, float softcap=0.0) -> (Tensor, Tensor)",
         &attention_varlen_forward);
  def_op(m,
         "attention_varlen_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
         "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal, "
         "float scale, int window_left=-1, int window_right=-1, float softcap=0.0) -> "
         "(Tensor, Tensor, Tensor)",
         &attention_varlen_backward);
  def_op(m,
         "attention_forward(Tensor q, Tensor k, Tensor v, bool causal, float scale, "
         "int window_left=-1, int window_right=-1, float softcap=0.0) -> (Tensor, Tensor)",
         &attention_forward);
  def_op(m,
         "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
         "bool causal, float scale, int window_left=-1, int window_right=-1, float softcap=0.0) -> "
         "(Tensor, Tensor, Tensor)",
         &attention_backward);
}

}  // namespace trainscale::binding
