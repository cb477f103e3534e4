// Newton-Schulz on the GPU: the Frobenius norm (per-block partial sums, then one block adding
// them in a fixed order), X = G / (||G|| + eps) in the orientation whose Gram matrix is the
// smaller (a tiled transpose when R > C), then per step three cuBLASLt products
// (common/gemm.h, float32 accumulation; X, A and B stored in the input's dtype, as Muon
// implementations keep them):
//   A = X X^T;   B = c A A + b A (over a copy of A);   X' = B X + a X (over a copy of X).
// Every launch and product has a fixed shape and order: the same bits every run.
#include <algorithm>
#include <array>
#include <string>

#include "common/cuda_check.h"
#include "common/dtype.cuh"
#include "common/gemm.h"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "ops/newton_schulz/newton_schulz_internal.h"

namespace trainscale::ops::newton_schulz {
namespace {

constexpr const char* kOp = "newton_schulz";
constexpr int kNormBlocks = 264;  // fixed: the partial sums, and so the norm, do not depend on the device
constexpr int kThreads = 256;
constexpr std::size_t kAlign = 256;
constexpr std::size_t kGemmWorkspaceBytes = std::size_t{32} << 20;

// Sum of squares of a block's share of the elements (a fixed grid-stride assignment).
template <class T>
__global__ void __launch_bounds__(kThreads) sum_squares_kernel(const T* g, std::int64_t rows, std::int64_t cols,
                                                                std::int64_t ld, float* partial) {
  __shared__ float scratch[kThreads / 32];
  float s[1] = {0.f};
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{kThreads} + threadIdx.x; i < n; i += std::int64_t{kNormBlocks} * kThreads) {
    const float v = detail::to_float(g[(i / cols) * ld + i % cols]);
    s[0] = fmaf(v, v, s[0]);
  }
  detail::row_reduce<kThreads, detail::SumOp>(s, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

// scale = 1 / (sqrt(sum of the partials, in order, in double) + eps).
__global__ void inverse_norm_kernel(const float* partial, double eps, float* scale) {
  double sum = 0;
  for (int b = 0; b < kNormBlocks; ++b) sum += partial[b];
  *scale = static_cast<float>(1.0 / (sqrt(sum) + eps));
}

// dst = src * scale (scale optional: 1), src [rows, cols] with row stride src_ld; dst is its
// transpose [cols, rows] (row stride dst_ld) when `transpose`, else the same shape. Tiles of
// 32 x 32 through shared memory keep both sides' accesses along rows.
template <class T>
__global__ void copy_scaled_kernel(const T* src, std::int64_t src_ld, std::int64_t rows, std::int64_t cols,
                                   T* dst, std::int64_t dst_ld, bool transpose, const float* scale) {
  __shared__ float tile[32][33];
  const float s = scale != nullptr ? *scale : 1.f;
  const std::int64_t r0 = std::int64_t{blockIdx.y} * 32, c0 = std::int64_t{blockIdx.x} * 32;
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const std::int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = detail::to_float(src[r * src_ld + c]) * s;
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    if (transpose) {
      const std::int64_t c = c0 + i, r = r0 + threadIdx.x;  // dst row c, column r
      if (r < rows && c < cols) dst[c * dst_ld + r] = detail::from_float<T>(tile[threadIdx.x][i]);
    } else {
      const std::int64_t r = r0 + i, c = c0 + threadIdx.x;
      if (r < rows && c < cols) dst[r * dst_ld + c] = detail::from_float<T>(tile[i][threadIdx.x]);
    }
  }
}

template <class T>
void copy_scaled(const void* src, std::int64_t src_ld, std::int64_t rows, std::int64_t cols, void* dst,
                 std::int64_t dst_ld, bool transpose, const float* scale, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>((rows + 31) / 32));
  copy_scaled_kernel<T><<<grid, dim3(32, 8), 0, stream>>>(static_cast<const T*>(src), src_ld, rows, cols,
                                                          static_cast<T*>(dst), dst_ld, transpose, scale);
  detail::check_launch(kOp);
}

std::size_t round_up(std::size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Workspace layout: cuBLASLt's scratch, X and its next value [p, q], A and B [p, p], the
// norm's partial sums and scale.
struct Layout {
  std::size_t gemm = 0, x = 0, x_next = 0, a = 0, b = 0, partial = 0, scale = 0, bytes = 0;
};
Layout layout_for(std::int64_t rows, std::int64_t cols, DType dtype) {
  const auto p = static_cast<std::size_t>(std::min(rows, cols)), q = static_cast<std::size_t>(std::max(rows, cols));
  const std::size_t e = dtype_size(dtype);
  Layout l;
  std::size_t at = 0;
  const auto take = [&](std::size_t bytes) { const std::size_t o = at; at = round_up(at + bytes); return o; };
  l.gemm = take(kGemmWorkspaceBytes);
  l.x = take(p * q * e);
  l.x_next = take(p * q * e);
  l.a = take(p * p * e);
  l.b = take(p * p * e);
  l.partial = take(kNormBlocks * sizeof(float));
  l.scale = take(sizeof(float));
  l.bytes = at;
  return l;
}

}  // namespace

std::size_t newton_schulz_workspace_bytes_cuda(std::int64_t rows, std::int64_t cols, DType dtype) {
  return layout_for(rows, cols, dtype).bytes;
}

void newton_schulz_cuda(const TensorView& g, TensorView out, const NewtonSchulzOptions& options,
                        const TensorView& workspace, cudaStream_t stream) {
  const detail::Rows rg = detail::row_layout(g), ro = detail::row_layout(out);
  const std::int64_t rows = rg.rows, cols = rg.cols;
  const Layout l = layout_for(rows, cols, g.dtype);
  const std::size_t have = workspace.defined() ? static_cast<std::size_t>(workspace.numel()) * workspace.element_size() : 0;
  if (have < l.bytes) {
    detail::throw_arg_error(kOp, "workspace", "at least " + std::to_string(l.bytes) + " bytes (newton_schulz_workspace_bytes)",
                            std::to_string(have) + " bytes");
  }
  if (!workspace.is_contiguous() || !detail::is_aligned(workspace.data, kAlign))
    detail::throw_arg_error(kOp, "workspace", "a contiguous, 256-byte aligned view", workspace.describe());
  if (rows == 0 || cols == 0) return;
  const bool transpose = rows > cols;
  const std::int64_t p = std::min(rows, cols), q = std::max(rows, cols);
  char* base = static_cast<char*>(workspace.data);
  void* x = base + l.x;
  void* x_next = base + l.x_next;
  void* a = base + l.a;
  void* b = base + l.b;
  auto* partial = reinterpret_cast<float*>(base + l.partial);
  auto* scale = reinterpret_cast<float*>(base + l.scale);
  const std::size_t elem = g.element_size();
  detail::dispatch_activation_dtype(g.dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    sum_squares_kernel<T><<<kNormBlocks, kThreads, 0, stream>>>(g.ptr<const T>(), rows, cols, rg.row_stride, partial);
    detail::check_launch(kOp);
    inverse_norm_kernel<<<1, 1, 0, stream>>>(partial, options.eps, scale);
    detail::check_launch(kOp);
    copy_scaled<T>(g.data, rg.row_stride, rows, cols, x, q, transpose, scale, stream);
  });
  const DType dt = g.dtype;
  void* gemm_ws = base + l.gemm;
  for (int step = 0; step < options.steps; ++step) {
    const auto [ca, cb, cc] = options.per_step.empty() ? std::array{options.a, options.b, options.c}
                                                       : options.per_step[static_cast<std::size_t>(step)];
    const float one = 1.f, zero = 0.f, fa = static_cast<float>(ca), fb = static_cast<float>(cb), fc = static_cast<float>(cc);
    const detail::GemmOperand xm{x, dt, p, q, q}, xt{x, dt, q, p, q, true}, am{a, dt, p, p, p}, bm{b, dt, p, p, p};
    detail::gemm(kOp, xm, xt, {a, dt, p, p, p}, {&one, &zero}, gemm_ws, kGemmWorkspaceBytes, stream);  // A = X X^T
    detail::check_cuda(cudaMemcpyAsync(b, a, static_cast<std::size_t>(p * p) * elem, cudaMemcpyDeviceToDevice, stream),
                       kOp, "cudaMemcpyAsync");
    detail::gemm(kOp, am, am, {b, dt, p, p, p}, {&fc, &fb}, gemm_ws, kGemmWorkspaceBytes, stream);  // B = c A A + b A
    detail::check_cuda(cudaMemcpyAsync(x_next, x, static_cast<std::size_t>(p * q) * elem, cudaMemcpyDeviceToDevice, stream),
                       kOp, "cudaMemcpyAsync");
    detail::gemm(kOp, bm, xm, {x_next, dt, p, q, q}, {&one, &fa}, gemm_ws, kGemmWorkspaceBytes, stream);  // X' = B X + a X
    std::swap(x, x_next);
  }
  detail::dispatch_activation_dtype(dt, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    copy_scaled<T>(x, q, p, q, out.data, ro.row_stride, transpose, nullptr, stream);
  });
}

}  // namespace trainscale::ops::newton_schulz
