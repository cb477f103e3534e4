#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/attention/attention_cuda.h"
#include "ops/attention/attention_heuristics.h"
#include "ops/attention/attention_internal.h"

namespace trainscale {

namespace {

// Dims of a tensor of heads: [B, S, H, D], or packed sequences [T, H, D].
constexpr int kBatched = 4, kPacked = 3;

// A tensor of heads with stride 1 in D.
void check_heads(detail::OpChecker& c, const TensorView& t, const char* name, int dims = kBatched) {
  c.present(t, name).ndim(t, name, dims).unit_last_stride(t, name);
}

// A tensor of heads with the dtype and shape of `ref`.
void check_heads_like(detail::OpChecker& c, const TensorView& t, const char* name,
                      const TensorView& ref, const char* ref_name, int dims = kBatched) {
  check_heads(c, t, name, dims);
  c.same_dtype(t, name, ref, ref_name).same_shape(t, name, ref, ref_name);
}

// q, k, v and the options, shared by forward and backward.
void check_qkv(detail::OpChecker& c, const TensorView& q, const TensorView& k, const TensorView& v,
               const AttentionOptions& options) {
  check_heads(c, q, "q");
  c.dtype_in(q, "q", detail::kFloatDTypes);
  if (!(q.size(3) > 0)) c.fail("q", "a head dim D >= 1", "shape " + q.shape_str());
  check_heads(c, k, "k");
  c.same_dtype(k, "k", q, "q")
      .dim_size(k, "k", 0, q.size(0), "the batch size of 'q'")
      .dim_size(k, "k", 3, q.size(3), "the head dim of 'q'");
  const std::int64_t q_heads = q.size(2), kv_heads = k.size(2);
  if (!(kv_heads > 0 && q_heads % kv_heads == 0))
    c.fail("k", "a head count that divides the " + std::to_string(q_heads) + " heads of 'q'",
           std::to_string(kv_heads) + " heads (shape " + k.shape_str() + ")");
  check_heads_like(c, v, "v", k, "k");
  if (!std::isfinite(options.scale))
    c.fail("options.scale", "a finite value (0 for 1/sqrt(D))", std::to_string(options.scale));
  if (options.window_left < -1)
    c.fail("options.window_left", "-1 (unbounded) or a key count >= 0", std::to_string(options.window_left));
  if (options.window_right < -1 || (options.causal && options.window_right > 0))
    c.fail("options.window_right",
           options.causal ? "-1 or 0 with causal (causal is a right window of 0)"
                          : "-1 (unbounded) or a key count >= 0",
           std::to_string(options.window_right));
  if (!(options.softcap == 0.0 || (options.softcap > 0.0 && std::isfinite(options.softcap))))
    c.fail("options.softcap", "0 (off) or a finite value > 0", std::to_string(options.softcap));
}

// lse [B, Hq, Sq], contiguous; float32 (float64 too on the CPU, for fp64 gradient checks).
void check_lse(detail::OpChecker& c, const TensorView& lse, const char* name, const TensorView& q) {
  c.present(lse, name).dtype_in(lse, name, {DType::kFloat32, DType::kFloat64}).ndim(lse, name, 3);
  c.dim_size(lse, name, 0, q.size(0), "B of 'q'")
      .dim_size(lse, name, 1, q.size(2), "Hq of 'q'")
      .dim_size(lse, name, 2, q.size(1), "Sq of 'q'");
  c.contiguous(lse, name);
}

std::string strides_str(const TensorView& t) {
  std::string s = "[";
  for (int d = 0; d < t.ndim; ++d) s += (d ? ", " : "") + std::to_string(t.strides[d]);
  return s + "]";
}

// [B, S, H, D] tensors as a kernel's 16-byte accesses (`how`: TMA, cp.async) reach them: a
// 16-byte aligned start and every stride of a dim longer than 1 a multiple of 16 bytes.
void check_16_byte_access(detail::OpChecker& c, std::initializer_list<detail::Arg> tensors, const char* how) {
  for (const auto& [t, name] : tensors) {
    const std::int64_t element = static_cast<std::int64_t>(t.element_size());
    if (reinterpret_cast<std::uintptr_t>(t.data) % 16 != 0)
      c.fail(name, std::string("a 16-byte aligned start (") + how + ")",
             "address " + std::to_string(reinterpret_cast<std::uintptr_t>(t.data)) + " (" +
                 std::to_string(reinterpret_cast<std::uintptr_t>(t.data) % 16) + " past 16)");
    for (int d = 0; d < 3; ++d) {
      if (t.size(d) > 1 && (t.strides[d] * element) % 16 != 0)
        c.fail(name, std::string("strides of 16-byte multiples in dims 0-2 (") + how + ")",
               "strides " + strides_str(t) + " in elements of " + std::to_string(element) + " bytes");
    }
  }
}

// CUDA tensors need a build with CUDA and the CUTLASS headers (the attention kernels' CuTe).
void require_attention_kernels(const detail::OpChecker& c) {
#if !TRAINSCALE_HAVE_CUDA
  detail::throw_no_cuda_build(c.op());
#elif !TRAINSCALE_HAVE_CUTLASS
  detail::throw_op_error(c.op(),
                         "CUDA tensors given, but this build has no attention kernel: it was "
                         "configured without the CUTLASS headers (pip install nvidia-cutlass, or "
                         "-DTRAINSCALE_CUTLASS_INCLUDE=<dir>), so only the CPU reference exists");
#else
  (void)c;
#endif
}

// The kernels' mask (attention_mask.h) sums positions in 32 bits.
void check_mask_indices(detail::OpChecker& c, const TensorView& q, const TensorView& k) {
  if (q.size(1) + k.size(1) > std::numeric_limits<std::int32_t>::max())
    c.fail("k", "Sq + Sk below 2^31 (the CUDA kernel's indices)",
           "Sq = " + std::to_string(q.size(1)) + ", Sk = " + std::to_string(k.size(1)));
}

// What the CUDA forward needs beyond the contract: a dtype and head dim it has a kernel for, and
// q, k, v as TMA reads them, and sizes that fit its 32-bit indices.
void check_cuda_forward(detail::OpChecker& c, const TensorView& q, const TensorView& k,
                        const TensorView& v) {
  c.dtype_in(q, "q", {DType::kBFloat16, DType::kFloat16});
  if (!ops::attention::forward_head_dim_supported(q.size(3)))
    c.fail("q", "a head dim D of 64, 128 or 256 (the CUDA kernel's)", "shape " + q.shape_str());
  check_16_byte_access(c, {{q, "q"}, {k, "k"}, {v, "v"}}, "TMA");
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{q, "q"}, {k, "k"}, {v, "v"}}) {
    for (int d = 0; d < 3; ++d) {
      if (t.size(d) > std::numeric_limits<std::int32_t>::max())
        c.fail(name, "dims below 2^31 (the CUDA kernel's indices)", "shape " + t.shape_str());
    }
  }
  check_mask_indices(c, q, k);
}

// What the CUDA backward needs beyond the contract: a dtype and head dim it has a kernel for;
// every [B, S, H, D] tensor as its 16-byte cp.async loads and stores reach it (16-byte aligned
// start, every stride of a dim longer than 1 a multiple of 16 bytes; no TMA, so no other layout
// rule); lse in float32; sequence lengths whose sum fits its 32-bit in-sequence indices; and the
// workspace.
// The tensors of heads only ([B, S, H, D] views; packed sequences check them as batches of one).
void check_cuda_backward_heads(detail::OpChecker& c, const AttentionBackwardArgs& args) {
  const TensorView& q = args.q;
  c.dtype_in(q, "q", {DType::kBFloat16, DType::kFloat16});
  if (!ops::attention::backward_head_dim_supported(q.size(3)))
    c.fail("q", "a head dim D of 64, 128 or 256 (the CUDA kernel's)", "shape " + q.shape_str());
  check_16_byte_access(c,
                       {{q, "q"}, {args.k, "k"}, {args.v, "v"}, {args.out, "out"}, {args.dout, "dout"},
                        {args.dq, "dq"}, {args.dk, "dk"}, {args.dv, "dv"}},
                       "16-byte loads and stores");
  check_mask_indices(c, q, args.k);
}
void check_cuda_backward(detail::OpChecker& c, const AttentionBackwardArgs& args) {
  check_cuda_backward_heads(c, args);
  c.dtype_in(args.lse, "lse", {DType::kFloat32});
  const TensorView& q = args.q;
  const std::size_t needed = attention_backward_workspace_bytes(q);
  const TensorView& w = args.workspace;
  const std::size_t given = w.defined() ? static_cast<std::size_t>(w.numel()) * w.element_size() : 0;
  if (given < needed)
    c.fail("workspace", "at least " + std::to_string(needed) + " bytes (attention_backward_workspace_bytes(q))",
           std::to_string(given) + " bytes");
  if (needed > 0 && (!w.is_contiguous() || reinterpret_cast<std::uintptr_t>(w.data) % 256 != 0))
    c.fail("workspace", "a contiguous, 256-byte aligned view", w.describe());
}

#if TRAINSCALE_HAVE_CUDA && TRAINSCALE_HAVE_CUTLASS
// The CUDA kernels of q's head dim, for arguments that passed the checks.
void forward_kernels(const TensorView& q, const TensorView& k, const TensorView& v, TensorView out,
                     TensorView lse, const AttentionOptions& options, cudaStream_t stream) {
  switch (q.size(3)) {
    case 64: ops::attention::attention_forward_hdim64(q, k, v, out, lse, options, stream); break;
    case 128: ops::attention::attention_forward_hdim128(q, k, v, out, lse, options, stream); break;
    default: ops::attention::attention_forward_hdim256(q, k, v, out, lse, options, stream); break;
  }
}
void backward_kernels(const AttentionBackwardArgs& args, const AttentionOptions& options,
                      cudaStream_t stream) {
  switch (args.q.size(3)) {
    case 64: ops::attention::attention_backward_hdim64(args, options, stream); break;
    case 128: ops::attention::attention_backward_hdim128(args, options, stream); break;
    default: ops::attention::attention_backward_hdim256(args, options, stream); break;
  }
}
#endif

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       TensorView out, TensorView lse, const AttentionOptions& options,
                       cudaStream_t stream) {
  detail::OpChecker c("attention_forward");
  check_qkv(c, q, k, v, options);
  check_heads_like(c, out, "out", q, "q");
  c.distinct_elements(out, "out");
  if (lse.defined()) check_lse(c, lse, "lse", q);
  c.outputs_disjoint({{out, "out"}, {lse, "lse"}}, {{q, "q"}, {k, "k"}, {v, "v"}});
  if (c.on_cuda()) {
    require_attention_kernels(c);
    check_cuda_forward(c, q, k, v);
    if (lse.defined()) c.dtype_in(lse, "lse", {DType::kFloat32});
  }
#if TRAINSCALE_HAVE_CUDA && TRAINSCALE_HAVE_CUTLASS
  if (detail::ran_on_cuda(c, [&] { forward_kernels(q, k, v, out, lse, options, stream); })) return;
#else
  (void)stream;
#endif
  ops::attention::attention_forward_cpu(q, k, v, out, lse, options);
}

void attention_backward(const AttentionBackwardArgs& args, const AttentionOptions& options,
                        cudaStream_t stream) {
  const auto& [dout, q, k, v, out, lse, dq, dk, dv, workspace] = args;
  detail::OpChecker c("attention_backward");
  check_qkv(c, q, k, v, options);
  check_heads_like(c, out, "out", q, "q");
  check_heads_like(c, dout, "dout", q, "q");
  check_lse(c, lse, "lse", q);
  check_heads_like(c, dq, "dq", q, "q");
  c.distinct_elements(dq, "dq");
  check_heads_like(c, dk, "dk", k, "k");
  c.distinct_elements(dk, "dk");
  check_heads_like(c, dv, "dv", v, "v");
  c.distinct_elements(dv, "dv");
  c.optional(workspace, "workspace");
  c.outputs_disjoint({{dv, "dv"}, {dk, "dk"}, {dq, "dq"}, {workspace, "workspace"}},
                     {{dout, "dout"}, {q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {lse, "lse"}});
  if (c.on_cuda()) {
    require_attention_kernels(c);
    check_cuda_backward(c, args);
  }
#if TRAINSCALE_HAVE_CUDA && TRAINSCALE_HAVE_CUTLASS
  if (detail::ran_on_cuda(c, [&] { backward_kernels(args, options, stream); })) return;
#else
  (void)stream;
#endif
  ops::attention::attention_backward_cpu(dout, q, k, v, out, lse, dq, dk, dv, options);
}

namespace {

// --- variable-length (packed) sequences ---------------------------------------------------------

// A packed [T, H, D] tensor as the batch of one [1, T, H, D].
TensorView as_one_batch(const TensorView& t) {
  return TensorView(t.data, t.dtype, {1, t.size(0), t.size(1), t.size(2)},
                    {t.size(0) * t.strides[0], t.strides[0], t.strides[1], 1}, t.device);
}

// Packed q, k, v: 3 dims each, then every check of the batched layout on batch-of-one views.
void check_packed_qkv(detail::OpChecker& c, const TensorView& q, const TensorView& k,
                      const TensorView& v, const AttentionOptions& options) {
  check_heads(c, q, "q", kPacked);
  check_heads(c, k, "k", kPacked);
  check_heads(c, v, "v", kPacked);
  check_qkv(c, as_one_batch(q), as_one_batch(k), as_one_batch(v), options);
}

// lse [Hq, Tq], contiguous (float32 on CUDA).
void check_packed_lse(detail::OpChecker& c, const TensorView& lse, const TensorView& q) {
  c.present(lse, "lse").dtype_in(lse, "lse", {DType::kFloat32, DType::kFloat64}).ndim(lse, "lse", 2);
  c.dim_size(lse, "lse", 0, q.size(1), "Hq of 'q'").dim_size(lse, "lse", 1, q.size(0), "Tq of 'q'");
  c.contiguous(lse, "lse");
  if (c.on_cuda()) c.dtype_in(lse, "lse", {DType::kFloat32});
}

// cu_seqlens_q / _k: int32 [B + 1] each, one B. Returns B.
std::int64_t check_sequences(detail::OpChecker& c, const AttentionSequences& s) {
  c.present(s.cu_seqlens_q, "cu_seqlens_q").dtype_in(s.cu_seqlens_q, "cu_seqlens_q", {DType::kInt32});
  c.ndim(s.cu_seqlens_q, "cu_seqlens_q", 1).contiguous(s.cu_seqlens_q, "cu_seqlens_q");
  if (s.cu_seqlens_q.size(0) < 1)
    c.fail("cu_seqlens_q", "B + 1 >= 1 offsets", "shape " + s.cu_seqlens_q.shape_str());
  c.present(s.cu_seqlens_k, "cu_seqlens_k").dtype_in(s.cu_seqlens_k, "cu_seqlens_k", {DType::kInt32});
  c.ndim(s.cu_seqlens_k, "cu_seqlens_k", 1).contiguous(s.cu_seqlens_k, "cu_seqlens_k");
  c.dim_size(s.cu_seqlens_k, "cu_seqlens_k", 0, s.cu_seqlens_q.size(0), "the B + 1 of 'cu_seqlens_q'");
  for (const auto& [max, name] : {std::pair{s.max_seqlen_q, "max_seqlen_q"}, {s.max_seqlen_k, "max_seqlen_k"}})
    if (max < 0) c.fail(name, "a length >= 0", std::to_string(max));
  return s.cu_seqlens_q.size(0) - 1;
}

// The offsets as the host reads them (on CUDA, copies: a synchronization of `stream`), checked:
// from 0 to the token count, non-decreasing, no sequence longer than its max_seqlen.
struct Offsets {
  std::vector<std::int32_t> q, k;
};
Offsets read_offsets(detail::OpChecker& c, const AttentionSequences& s, std::int64_t q_tokens,
                     std::int64_t kv_tokens, [[maybe_unused]] cudaStream_t stream) {
  const auto n = static_cast<std::size_t>(s.cu_seqlens_q.size(0));
  Offsets out{std::vector<std::int32_t>(n), std::vector<std::int32_t>(n)};
  for (const auto& [from, to] : {std::pair{&s.cu_seqlens_q, &out.q}, {&s.cu_seqlens_k, &out.k}}) {
    if (c.on_cuda()) {
#if TRAINSCALE_HAVE_CUDA
      detail::check_cuda(cudaMemcpyAsync(to->data(), from->data, n * sizeof(std::int32_t),
                                         cudaMemcpyDeviceToHost, stream),
                         c.op(), "cudaMemcpyAsync (cu_seqlens)");
#endif
    } else {
      std::copy_n(from->ptr<const std::int32_t>(), n, to->begin());
    }
  }
#if TRAINSCALE_HAVE_CUDA
  if (c.on_cuda()) detail::check_cuda(cudaStreamSynchronize(stream), c.op(), "cudaStreamSynchronize (cu_seqlens)");
#endif
  for (const auto& [o, name, tokens, max, max_name] :
       {std::tuple{&out.q, "cu_seqlens_q", q_tokens, s.max_seqlen_q, "max_seqlen_q"},
        std::tuple{&out.k, "cu_seqlens_k", kv_tokens, s.max_seqlen_k, "max_seqlen_k"}}) {
    const std::vector<std::int32_t>& v = *o;
    if (v.front() != 0 || v.back() != tokens)
      c.fail(name, "offsets from 0 to the " + std::to_string(tokens) + " tokens",
             "from " + std::to_string(v.front()) + " to " + std::to_string(v.back()));
    for (std::size_t b = 0; b + 1 < v.size(); ++b) {
      if (v[b + 1] < v[b])
        c.fail(name, "non-decreasing offsets",
               std::to_string(v[b]) + " then " + std::to_string(v[b + 1]) + " at " + std::to_string(b));
      if (v[b + 1] - v[b] > max)
        c.fail(name, std::string("sequences no longer than ") + max_name + " = " + std::to_string(max),
               "sequence " + std::to_string(b) + " of " + std::to_string(v[b + 1] - v[b]));
    }
  }
  return out;
}

// Sequence b of a packed view as a batch of one [1, S, H, D] (or its lse [1, Hq, S], rows Tq apart).
TensorView sequence_of(const TensorView& t, std::int64_t begin, std::int64_t end) {
  if (!t.defined()) return t;
  char* base = static_cast<char*>(t.data) + begin * t.strides[0] * static_cast<std::int64_t>(t.element_size());
  return TensorView(base, t.dtype, {1, end - begin, t.size(1), t.size(2)},
                    {(end - begin) * t.strides[0], t.strides[0], t.strides[1], 1}, t.device);
}
TensorView lse_of(const TensorView& lse, std::int64_t begin, std::int64_t end) {
  if (!lse.defined()) return lse;
  char* base = static_cast<char*>(lse.data) + begin * static_cast<std::int64_t>(lse.element_size());
  return TensorView(base, lse.dtype, {1, lse.size(0), end - begin}, {lse.size(0) * lse.size(1), lse.size(1), 1},
                    lse.device);
}

// fn(query begin, query end, key begin, key end) for every sequence.
template <class Fn>
void for_each_sequence(const Offsets& o, Fn&& fn) {
  for (std::size_t b = 0; b + 1 < o.q.size(); ++b) fn(o.q[b], o.q[b + 1], o.k[b], o.k[b + 1]);
}

#if TRAINSCALE_HAVE_CUDA && TRAINSCALE_HAVE_CUTLASS
// Packed sequences on CUDA: the batched kernels once per sequence, on batch-of-one views. The
// kernels keep lse as [B, Hq, S] contiguous, so a sequence's lse rows (Tq apart in [Hq, Tq])
// pass through a contiguous [Hq, S] buffer; that buffer and the backward's workspace are
// allocated stream-ordered (cudaMallocAsync) for the longest sequence.
class StreamBuffer {
 public:
  StreamBuffer(std::size_t bytes, cudaStream_t stream, const char* op) : stream_(stream) {
    if (bytes > 0) detail::check_cuda(cudaMallocAsync(&data_, bytes, stream), op, "cudaMallocAsync");
  }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  ~StreamBuffer() {
    if (data_ != nullptr) (void)cudaFreeAsync(data_, stream_);
  }
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

// Copies `heads` rows of `len` floats, src_pitch floats apart in src, dst_pitch apart in dst: a
// sequence's lse rows between the packed [Hq, Tq] (at its first column) and a contiguous [Hq, S].
void copy_lse_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch, std::int64_t heads,
                   std::int64_t len, cudaStream_t stream, const char* op) {
  detail::check_cuda(cudaMemcpy2DAsync(dst, dst_pitch * sizeof(float), src, src_pitch * sizeof(float),
                                       static_cast<std::size_t>(len) * sizeof(float),
                                       static_cast<std::size_t>(heads), cudaMemcpyDeviceToDevice, stream),
                     op, "cudaMemcpy2DAsync (lse)");
}

std::int64_t longest(const std::vector<std::int32_t>& offsets) {
  std::int64_t out = 0;
  for (std::size_t b = 0; b + 1 < offsets.size(); ++b) out = std::max<std::int64_t>(out, offsets[b + 1] - offsets[b]);
  return out;
}

void varlen_forward_cuda(const detail::OpChecker& c, const TensorView& q, const TensorView& k,
                         const TensorView& v, const Offsets& o, TensorView out, TensorView lse,
                         const AttentionOptions& options, cudaStream_t stream) {
  const std::int64_t heads = q.size(1), tokens = q.size(0), max_len = longest(o.q);
  StreamBuffer staged(lse.defined() ? static_cast<std::size_t>(heads * max_len) * sizeof(float) : 0, stream,
                      c.op());
  for_each_sequence(o, [&](std::int64_t qb, std::int64_t qe, std::int64_t kb, std::int64_t ke) {
    if (qe == qb) return;
    TensorView seq_lse;
    if (lse.defined())
      seq_lse = TensorView(staged.data(), DType::kFloat32, {1, heads, qe - qb}, {heads * (qe - qb), qe - qb, 1},
                           lse.device);
    forward_kernels(sequence_of(q, qb, qe), sequence_of(k, kb, ke), sequence_of(v, kb, ke),
                    sequence_of(out, qb, qe), seq_lse, options, stream);
    if (lse.defined())
      copy_lse_rows(static_cast<float*>(lse.data) + qb, tokens, staged.data(), qe - qb, heads, qe - qb, stream,
                    c.op());
  });
}

void varlen_backward_cuda(const detail::OpChecker& c, const AttentionBackwardArgs& args, const Offsets& o,
                          const AttentionOptions& options, cudaStream_t stream) {
  const TensorView& q = args.q;
  const std::int64_t heads = q.size(1), tokens = q.size(0), max_len = longest(o.q);
  const std::size_t lse_bytes = static_cast<std::size_t>(heads * max_len) * sizeof(float);
  // The workspace after the lse rows, at 256 bytes.
  const std::size_t work_offset = (lse_bytes + 255) / 256 * 256;
  const std::size_t work_bytes = ops::attention::backward_workspace(1, heads, max_len, q.size(2)).bytes;
  StreamBuffer buffer(work_offset + (work_bytes + sizeof(float) - 1) / sizeof(float) * sizeof(float), stream,
                      c.op());
  char* base = static_cast<char*>(buffer.data());
  for_each_sequence(o, [&](std::int64_t qb, std::int64_t qe, std::int64_t kb, std::int64_t ke) {
    if (qe == qb && ke == kb) return;
    const std::int64_t len = qe - qb;
    const TensorView seq_lse(base, DType::kFloat32, {1, heads, len}, {heads * len, len, 1}, args.lse.device);
    if (len > 0)
      copy_lse_rows(base, len, static_cast<const float*>(args.lse.data) + qb, tokens, heads, len, stream, c.op());
    const std::size_t seq_work = ops::attention::backward_workspace(1, heads, len, q.size(2)).bytes;
    const TensorView work(base + work_offset, DType::kFloat32,
                          {static_cast<std::int64_t>((seq_work + sizeof(float) - 1) / sizeof(float))}, {1},
                          args.lse.device);
    backward_kernels({.dout = sequence_of(args.dout, qb, qe), .q = sequence_of(q, qb, qe),
                      .k = sequence_of(args.k, kb, ke), .v = sequence_of(args.v, kb, ke),
                      .out = sequence_of(args.out, qb, qe), .lse = seq_lse, .dq = sequence_of(args.dq, qb, qe),
                      .dk = sequence_of(args.dk, kb, ke), .dv = sequence_of(args.dv, kb, ke), .workspace = work},
                     options, stream);
  });
}
#endif

}  // namespace

void attention_varlen_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                              const AttentionSequences& sequences, TensorView out, TensorView lse,
                              const AttentionOptions& options, cudaStream_t stream) {
  detail::OpChecker c("attention_varlen_forward");
  check_packed_qkv(c, q, k, v, options);
  check_heads_like(c, out, "out", q, "q", kPacked);
  c.distinct_elements(out, "out");
  if (lse.defined()) check_packed_lse(c, lse, q);
  check_sequences(c, sequences);
  c.outputs_disjoint({{out, "out"}, {lse, "lse"}}, {{q, "q"}, {k, "k"}, {v, "v"}});
  if (c.on_cuda()) {
    // As batches of one, the kernels' layout rules: every sequence's view passes them too.
    require_attention_kernels(c);
    check_cuda_forward(c, as_one_batch(q), as_one_batch(k), as_one_batch(v));
  }
#if TRAINSCALE_HAVE_CUDA && TRAINSCALE_HAVE_CUTLASS
  if (detail::ran_on_cuda(c, [&] {
        const Offsets o = read_offsets(c, sequences, q.size(0), k.size(0), stream);
        varlen_forward_cuda(c, q, k, v, o, out, lse, options, stream);
      }))
    return;
#endif
  for_each_sequence(read_offsets(c, sequences, q.size(0), k.size(0), stream),
                    [&](std::int64_t qb, std::int64_t qe, std::int64_t kb, std::int64_t ke) {
                      ops::attention::attention_forward_cpu(sequence_of(q, qb, qe), sequence_of(k, kb, ke),
                                                            sequence_of(v, kb, ke), sequence_of(out, qb, qe),
                                                            lse_of(lse, qb, qe), options);
                    });
}

void attention_varlen_backward(const AttentionBackwardArgs& args, const AttentionSequences& sequences,
                               const AttentionOptions& options, cudaStream_t stream) {
  const auto& [dout, q, k, v, out, lse, dq, dk, dv, workspace] = args;
  detail::OpChecker c("attention_varlen_backward");
  check_packed_qkv(c, q, k, v, options);
  check_heads_like(c, out, "out", q, "q", kPacked);
  check_heads_like(c, dout, "dout", q, "q", kPacked);
  check_packed_lse(c, lse, q);
  check_heads_like(c, dq, "dq", q, "q", kPacked);
  c.distinct_elements(dq, "dq");
  check_heads_like(c, dk, "dk", k, "k", kPacked);
  c.distinct_elements(dk, "dk");
  check_heads_like(c, dv, "dv", v, "v", kPacked);
  c.distinct_elements(dv, "dv");
  c.optional(workspace, "workspace");  // unused: the CUDA path allocates its own (see above)
  check_sequences(c, sequences);
  c.outputs_disjoint({{dv, "dv"}, {dk, "dk"}, {dq, "dq"}, {workspace, "workspace"}},
                     {{dout, "dout"}, {q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {lse, "lse"}});
  if (c.on_cuda()) {
    require_attention_kernels(c);
    check_cuda_backward_heads(c, {.dout = as_one_batch(dout), .q = as_one_batch(q), .k = as_one_batch(k),
                                  .v = as_one_batch(v), .out = as_one_batch(out), .lse = {},
                                  .dq = as_one_batch(dq), .dk = as_one_batch(dk), .dv = as_one_batch(dv),
                                  .workspace = {}});
  }
#if TRAINSCALE_HAVE_CUDA && TRAINSCALE_HAVE_CUTLASS
  if (detail::ran_on_cuda(c, [&] {
        const Offsets o = read_offsets(c, sequences, q.size(0), k.size(0), stream);
        varlen_backward_cuda(c, args, o, options, stream);
      }))
    return;
#endif
  for_each_sequence(read_offsets(c, sequences, q.size(0), k.size(0), stream),
                    [&](std::int64_t qb, std::int64_t qe, std::int64_t kb, std::int64_t ke) {
                      ops::attention::attention_backward_cpu(
                          sequence_of(dout, qb, qe), sequence_of(q, qb, qe), sequence_of(k, kb, ke),
                          sequence_of(v, kb, ke), sequence_of(out, qb, qe), lse_of(lse, qb, qe),
                          sequence_of(dq, qb, qe), sequence_of(dk, kb, ke), sequence_of(dv, kb, ke), options);
                    });
}

std::size_t attention_backward_workspace_bytes(const TensorView& q) {
  detail::OpChecker c("attention_backward_workspace_bytes");
  c.ndim(q, "q", 4);  // the shape is all it reads
  return ops::attention::backward_workspace(q.size(0), q.size(2), q.size(1), q.size(3)).bytes;
}

}  // namespace trainscale
