// Fused linear cross-entropy: tokens in chunks (fused_linear_plan.h), per chunk
//   logits = hidden_c @ weight^T (+ bias)           cuBLASLt, into the workspace
//   loss, lse and the logits' gradient in place      cross_entropy_held.cu's one-pass kernel
//   grad_hidden_c = alpha G @ weight                 cuBLASLt, written once (full V per chunk)
//   grad_weight (+)= alpha G^T @ hidden_c            cuBLASLt, float32 buffer or in place
//   grad_bias (+)= alpha G^T @ 1                     cuBLASLt
// alpha (kMean's 1 / rows not ignored, times a reduced upstream gradient) lives on the device,
// so nothing waits on the host. A per-token upstream gradient (kNone) scales G's rows instead,
// through cross_entropy_backward from the saved lse.
#include <string>

#include "common/cuda_check.h"
#include "common/dtype.cuh"
#include "common/gemm.h"
#include "common/vec.cuh"
#include "ops/loss/fused_linear_plan.h"
#include "ops/loss/loss_cuda.h"

namespace trainscale::ops::loss {
namespace {

constexpr const char* kOp = "fused_linear_cross_entropy_forward";

// The GEMMs' device scalars.
struct Scalars {
  std::int64_t valid_rows;
  float alpha;  // every gradient's scale
  float zero;
  float one;
};

__global__ void set_scalars_kernel(Scalars* s, const float* grad_loss, bool mean) {
  float alpha = grad_loss != nullptr ? *grad_loss : 1.f;
  // All rows ignored: every gradient row is 0, and stays 0 (not 0 * inf) as the reference.
  if (mean) alpha = s->valid_rows > 0 ? alpha / static_cast<float>(s->valid_rows) : 0.f;
  s->alpha = alpha;
  s->zero = 0.f;
  s->one = 1.f;
}

template <class T>
__global__ void fill_kernel(T* p, std::int64_t n, float v) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    p[i] = detail::from_float<T>(v);
  }
}

// out[r, c] = acc[r, c] (float32 [rows, cols], contiguous, cols a multiple of 4) rounded to T,
// four at a time.
template <class T>
__global__ void round_rows_kernel(const float* acc, T* out, std::int64_t rows, std::int64_t cols,
                                  std::int64_t out_ld) {
  const std::int64_t quads = cols / 4, total = rows * quads;
  for (std::int64_t q = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; q < total;
       q += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = q / quads, c = (q - r * quads) * 4;
    const float4 v = *reinterpret_cast<const float4*>(acc + r * cols + c);
    T* o = out + r * out_ld + c;
    o[0] = detail::from_float<T>(v.x);
    o[1] = detail::from_float<T>(v.y);
    o[2] = detail::from_float<T>(v.z);
    o[3] = detail::from_float<T>(v.w);
  }
}

template <class T>
__global__ void round_tail_kernel(const float* acc, T* out, std::int64_t rows, std::int64_t cols,
                                  std::int64_t out_ld, std::int64_t first_col) {
  const std::int64_t width = cols - first_col, total = rows * width;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < total;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = i / width, c = first_col + i % width;
    out[r * out_ld + c] = detail::from_float<T>(acc[r * cols + c]);
  }
}

constexpr int kThreads = 256;

unsigned grid_for(std::int64_t items) {
  return static_cast<unsigned>(std::min<std::int64_t>(detail::grid_for_tiles(items, kThreads), 65536));
}

// acc [rows, cols] float32 (contiguous, 16-byte aligned) rounded into out (row stride out_ld).
// Rows of a multiple of 4 go four at a time, others one element at a time.
void round_into(const float* acc, const TensorView& out, std::int64_t rows, std::int64_t cols,
                std::int64_t out_ld, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  detail::dispatch_activation_dtype(out.dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = out.ptr<T>();
    // Whole rows of float4 only when every row starts 16-byte aligned.
    const std::int64_t quad_cols = cols % 4 == 0 ? cols : 0;
    if (quad_cols > 0) {
      round_rows_kernel<T><<<grid_for(rows * cols / 4), kThreads, 0, stream>>>(acc, o, rows, cols, out_ld);
      detail::check_launch(kOp);
    }
    if (quad_cols < cols) {
      round_tail_kernel<T><<<grid_for(rows * (cols - quad_cols)), kThreads, 0, stream>>>(
          acc, o, rows, cols, out_ld, quad_cols);
      detail::check_launch(kOp);
    }
  });
}

// Rows [begin, begin + count) of a 1-D or 2-D view.
TensorView rows_of(const TensorView& t, std::int64_t begin, std::int64_t count) {
  if (!t.defined()) return t;
  TensorView v = t;
  v.data = static_cast<char*>(t.data) + begin * t.stride(0) * static_cast<std::int64_t>(t.element_size());
  v.shape[0] = count;
  return v;
}

detail::GemmOperand matrix_of(const TensorView& t, std::int64_t begin, std::int64_t rows) {
  return {static_cast<const char*>(t.data) + begin * t.stride(0) * static_cast<std::int64_t>(t.element_size()),
          t.dtype, rows, t.size(1), t.stride(0)};
}

void check_workspace(const TensorView& w, std::size_t need) {
  const std::size_t have = w.defined() ? static_cast<std::size_t>(w.numel()) * w.element_size() : 0;
  if (have < need) {
    detail::throw_arg_error(kOp, "workspace",
                            "at least " + std::to_string(need) +
                                " bytes (fused_linear_cross_entropy_workspace_bytes)",
                            std::to_string(have) + " bytes");
  }
  if (!w.is_contiguous()) detail::throw_arg_error(kOp, "workspace", "a contiguous view", "strides " + w.strides_str());
  if (!detail::is_aligned(w.data, 256)) detail::throw_arg_error(kOp, "workspace", "a 256-byte aligned pointer", "an unaligned one");
}

}  // namespace

void fused_linear_cross_entropy_forward_cuda(const FusedLinearCrossEntropyArgs& a,
                                             const CrossEntropyOptions& options,
                                             cudaStream_t stream) {
  const FusedLinearPlan plan = plan_fused_linear(a, options);
  check_workspace(a.workspace, plan.bytes);
  // cuBLASLt's bias epilogue reads a contiguous vector.
  if (a.bias.defined() && a.bias.size(0) > 1 && a.bias.stride(0) != 1)
    detail::throw_arg_error(kOp, "bias", "a contiguous vector (stride 1)", "stride " + std::to_string(a.bias.stride(0)));
  const std::int64_t tokens = a.hidden.size(0), classes = a.weight.size(0), dim = a.weight.size(1);
  char* base = static_cast<char*>(a.workspace.data);
  auto* scalars = reinterpret_cast<Scalars*>(base + plan.scalars);
  auto* reduce_parts = reinterpret_cast<double*>(base + plan.reduce_parts);
  void* gemm_ws = base + plan.gemm_workspace;
  const bool reduced = options.reduction != Reduction::kNone;
  const bool per_token_upstream = !reduced && a.grad_loss.defined();
  const bool with_grad = a.grad_hidden.defined() || a.grad_weight.defined() || a.grad_bias.defined();
  const DType dtype = a.hidden.dtype;

  if (options.reduction == Reduction::kMean) {
    count_valid_rows_cuda(a.targets, options.ignore_index, &scalars->valid_rows, reduce_parts, stream, kOp);
  }
  set_scalars_kernel<<<1, 1, 0, stream>>>(scalars, reduced ? a.grad_loss.ptr<const float>() : nullptr,
                                          options.reduction == Reduction::kMean);
  detail::check_launch(kOp);
  const detail::GemmScalars plain{&scalars->one, &scalars->zero, true};
  const auto accumulate = [&](std::int64_t chunk, const float* alpha) {
    return detail::GemmScalars{alpha, chunk == 0 ? &scalars->zero : &scalars->one, true};
  };
  const float* grad_alpha = per_token_upstream ? &scalars->one : &scalars->alpha;

  CrossEntropyOptions per_row = options;
  per_row.reduction = Reduction::kNone;
  per_row.kernel = CrossEntropyKernel::kAuto;  // the row pass's own choice, whatever was asked
  auto* row_losses = reinterpret_cast<float*>(base + plan.row_losses);
  auto* row_lse = reinterpret_cast<float*>(base + plan.row_lse);
  void* logits = base + plan.logits;
  if (plan.float_bias_acc) {
    detail::dispatch_activation_dtype(dtype, kOp, [&](auto tag) {
      using T = typename decltype(tag)::type;
      fill_kernel<T><<<grid_for(plan.chunk_tokens), kThreads, 0, stream>>>(
          reinterpret_cast<T*>(base + plan.ones), plan.chunk_tokens, 1.f);
    });
    detail::check_launch(kOp);
  }
  // grad_weight's destination: the float32 buffer or grad_weight itself.
  const detail::GemmResult weight_out =
      plan.float_weight_acc
          ? detail::GemmResult{base + plan.weight_acc, DType::kFloat32, classes, dim, dim}
          : detail::GemmResult{a.grad_weight.data, a.grad_weight.dtype, classes, dim,
                               a.grad_weight.defined() ? a.grad_weight.stride(0) : 0};
  const detail::GemmResult bias_out{base + plan.bias_acc, DType::kFloat32, classes, 1, 1};

  for (std::int64_t chunk = 0; chunk < plan.chunks; ++chunk) {
    const std::int64_t begin = chunk * plan.chunk_tokens;
    const std::int64_t rows = std::min(plan.chunk_tokens, tokens - begin);
    const detail::GemmOperand hidden = matrix_of(a.hidden, begin, rows);
    const detail::GemmOperand weight = matrix_of(a.weight, 0, classes);
    detail::gemm(kOp, hidden, {weight.data, dtype, dim, classes, weight.ld, true},
                 {logits, dtype, rows, classes, plan.logits_ld, a.bias.defined() ? a.bias.data : nullptr},
                 plain, gemm_ws, kGemmWorkspaceBytes, stream);

    // The chunk's logits as a view, then its loss, lse and (over it) its gradient.
    TensorView chunk_logits(logits, dtype, {rows, classes}, {plan.logits_ld, 1}, a.hidden.device);
    const TensorView targets = rows_of(a.targets, begin, rows);
    const TensorView loss = reduced ? TensorView(row_losses + begin, DType::kFloat32, {rows}, a.hidden.device)
                                    : rows_of(a.loss, begin, rows);
    TensorView lse = rows_of(a.lse, begin, rows);
    if (!lse.defined() && per_token_upstream && with_grad)
      lse = TensorView(row_lse + begin, DType::kFloat32, {rows}, a.hidden.device);
    const bool grad_in_pass = with_grad && !per_token_upstream;
    cross_entropy_forward_cuda(chunk_logits, targets, loss, lse, grad_in_pass ? chunk_logits : TensorView{},
                               per_row, stream);
    if (!with_grad) continue;
    if (per_token_upstream) {
      cross_entropy_backward_cuda(rows_of(a.grad_loss, begin, rows), chunk_logits, targets, lse,
                                  chunk_logits, per_row, stream);
    }
    const detail::GemmOperand grad_rows{logits, dtype, rows, classes, plan.logits_ld};
    const detail::GemmOperand grad_cols{logits, dtype, classes, rows, plan.logits_ld, true};
    if (a.grad_hidden.defined()) {
      const detail::GemmOperand gh = matrix_of(a.grad_hidden, begin, rows);
      detail::gemm(kOp, grad_rows, weight, {const_cast<void*>(gh.data), dtype, rows, dim, gh.ld},
                   {grad_alpha, &scalars->zero, true}, gemm_ws, kGemmWorkspaceBytes, stream);
    }
    if (a.grad_weight.defined()) {
      detail::gemm(kOp, grad_cols, hidden, weight_out, accumulate(chunk, grad_alpha), gemm_ws,
                   kGemmWorkspaceBytes, stream);
    }
    if (a.grad_bias.defined()) {
      detail::gemm(kOp, grad_cols, {base + plan.ones, dtype, rows, 1, 1}, bias_out,
                   accumulate(chunk, grad_alpha), gemm_ws, kGemmWorkspaceBytes, stream);
    }
  }

  // No chunk (T = 0): the weight's and bias' gradients are 0.
  if (plan.chunks == 0) {
    if (a.grad_weight.defined()) {
      detail::check_cuda(cudaMemset2DAsync(a.grad_weight.data, a.grad_weight.stride(0) * a.grad_weight.element_size(), 0,
                                           dim * a.grad_weight.element_size(), classes, stream),
                         kOp, "cudaMemset2DAsync");
    }
    if (a.grad_bias.defined()) {
      detail::check_cuda(cudaMemsetAsync(base + plan.bias_acc, 0, classes * sizeof(float), stream), kOp,
                         "cudaMemsetAsync");
    }
  }
  if (plan.float_weight_acc) {
    round_into(reinterpret_cast<const float*>(base + plan.weight_acc), a.grad_weight, classes, dim,
               a.grad_weight.stride(0), stream);
  }
  if (plan.float_bias_acc) {
    round_into(reinterpret_cast<const float*>(base + plan.bias_acc), a.grad_bias, classes, 1,
               a.grad_bias.stride(0), stream);
  }
  if (reduced) {
    reduce_row_losses_cuda(row_losses, a.targets, options.ignore_index,
                           options.reduction == Reduction::kMean, a.loss.ptr<float>(), reduce_parts, stream, kOp);
  }
}

}  // namespace trainscale::ops::loss
