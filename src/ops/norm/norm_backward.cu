// Backward kernels. dx is fused with the row statistics; the weight (and bias) gradients are
// summed per block into fixed partial rows of the workspace, then reduced over blocks in a
// fixed order, so they are bitwise identical from run to run.
#include "core/check.h"
#include "ops/norm/norm_common.cuh"

namespace trainscale::ops::norm {
namespace {

using detail::load_floats;
using detail::load_param;
using detail::row_sum;
using detail::store_floats;

constexpr int kBackwardBlock = 512;

struct BackwardArgs {
  const void* dy;
  std::int64_t dy_stride;
  const void* x;  // the norm's input (fused add: the saved sum), dtype X
  std::int64_t x_stride;
  const void* d_residual;  // fused add: gradient of the residual output, dtype X, optional
  std::int64_t d_residual_stride;
  const void* weight;
  bool weight_f32;
  const float* mean;
  const float* rstd;
  void* dx;
  std::int64_t dx_stride;
  float* partial;  // [blocks, cols] weight-gradient partials, then [blocks, cols] for bias
  std::int64_t rows;
  std::int64_t cols;
  float weight_offset;
};

// dx for V elements given the row's reductions: sum(g) (LayerNorm) and sum(g * xhat).
template <Kind kKind, int V>
__device__ __forceinline__ void input_gradient(const float (&g)[V], const float (&xhat)[V],
                                               float rstd, float mean_g, float mean_gx,
                                               float (&dx)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    dx[j] = kKind == Kind::kLayer ? rstd * (g[j] - mean_g - xhat[j] * mean_gx)
                                  : rstd * (g[j] - xhat[j] * mean_gx);
  }
}

template <class X, int V>
__device__ __forceinline__ void add_residual_gradient(const BackwardArgs& a, std::int64_t row,
                                                      std::int64_t col, float (&dx)[V]) {
  if (a.d_residual == nullptr) return;
  float r[V];
  load_floats<X, V>(static_cast<const X*>(a.d_residual) + row * a.d_residual_stride + col, r);
#pragma unroll
  for (int j = 0; j < V; ++j) dx[j] += r[j];
}

template <class T, class X, Kind kKind, int kThreads, int kVecs>
__global__ void __launch_bounds__(kThreads > kBackwardBlock ? kThreads : kBackwardBlock)
    backward_registers_kernel(BackwardArgs a) {
  constexpr int V = detail::kVec16<T>;
  constexpr int kBlock = kThreads > kBackwardBlock ? kThreads : kBackwardBlock;
  constexpr int kRowsPerBlock = kBlock / kThreads;
  constexpr int kSums = kKind == Kind::kLayer ? 2 : 1;
  constexpr int kRowElems = kThreads * kVecs * V;
  __shared__ float scratch[kThreads > 32 ? kBlock / 32 * kSums : 1];
  __shared__ float combine[kRowsPerBlock > 1 ? kRowElems : 1];
  const int lane = threadIdx.x % kThreads;
  const int slot = threadIdx.x / kThreads;
  const std::int64_t n = a.cols;
  const bool want_dw = a.partial != nullptr;

  float scale[kVecs][V];
  float dw[kVecs][V];
  float db[kKind == Kind::kLayer ? kVecs : 1][V];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const std::int64_t col = (static_cast<std::int64_t>(i) * kThreads + lane) * V;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      scale[i][j] = col + j < n ? load_scale<T, kKind>(a, col + j) : 0.f;
      dw[i][j] = 0.f;
      if constexpr (kKind == Kind::kLayer) db[i][j] = 0.f;
    }
  }

  for (std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock; base < a.rows;
       base += static_cast<std::int64_t>(gridDim.x) * kRowsPerBlock) {
    const std::int64_t row = base + slot;
    const bool valid = row < a.rows;
    const float rstd = valid ? a.rstd[row] : 0.f;
    const float mean = kKind == Kind::kLayer && valid ? a.mean[row] : 0.f;
    float dy[kVecs][V], xhat[kVecs][V];
    float sums[kSums] = {};
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const std::int64_t col = (static_cast<std::int64_t>(i) * kThreads + lane) * V;
      if (valid && col < n) {
        load_floats<T, V>(static_cast<const T*>(a.dy) + row * a.dy_stride + col, dy[i]);
        load_floats<X, V>(static_cast<const X*>(a.x) + row * a.x_stride + col, xhat[i]);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) dy[i][j] = xhat[i][j] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < V; ++j) {
        xhat[i][j] = (xhat[i][j] - mean) * rstd;
        const float g = dy[i][j] * scale[i][j];
        sums[kSums - 1] += g * xhat[i][j];
        if constexpr (kKind == Kind::kLayer) sums[0] += g;
      }
    }
    row_sum<kThreads, kSums>(sums, scratch);
    const float inv_n = 1.f / static_cast<float>(n);
    const float mean_g = kKind == Kind::kLayer ? sums[0] * inv_n : 0.f;
    const float mean_gx = sums[kSums - 1] * inv_n;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const std::int64_t col = (static_cast<std::int64_t>(i) * kThreads + lane) * V;
      if (!valid || col >= n) continue;
      float g[V], dx[V];
#pragma unroll
      for (int j = 0; j < V; ++j) g[j] = dy[i][j] * scale[i][j];
      input_gradient<kKind, V>(g, xhat[i], rstd, mean_g, mean_gx, dx);
      add_residual_gradient<X, V>(a, row, col, dx);
      store_floats<T, V>(static_cast<T*>(a.dx) + row * a.dx_stride + col, dx);
      if (want_dw) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          dw[i][j] += dy[i][j] * xhat[i][j];
          if constexpr (kKind == Kind::kLayer) db[i][j] += dy[i][j];
        }
      }
    }
  }
  if (!want_dw) return;

  // Combine the block's row slots in slot order, then write the block's partial row.
  auto write_partial = [&](float (&acc)[kVecs][V], float* out) {
    if constexpr (kRowsPerBlock == 1) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const std::int64_t col = (static_cast<std::int64_t>(i) * kThreads + lane) * V;
        if (col < n) store_floats<float, V>(out + col, acc[i]);
      }
    } else {
      for (int s = 0; s < kRowsPerBlock; ++s) {
        __syncthreads();
        if (slot == s) {
#pragma unroll
          for (int i = 0; i < kVecs; ++i) {
            const int col = (i * kThreads + lane) * V;
#pragma unroll
            for (int j = 0; j < V; ++j) {
              combine[col + j] = (s == 0 ? 0.f : combine[col + j]) + acc[i][j];
            }
          }
        }
      }
      __syncthreads();
      for (int col = threadIdx.x; col < n; col += kBlock) out[col] = combine[col];
    }
  };
  write_partial(dw, a.partial + blockIdx.x * n);
  if constexpr (kKind == Kind::kLayer) write_partial(db, a.partial + (gridDim.x + blockIdx.x) * n);
}

// Any row length and alignment: pass 1 reduces, pass 2 re-reads and writes dx; each thread
// owns the same columns on every row, so it accumulates its block's partial row in place.
template <class T, class X, Kind kKind, int V>
__global__ void __launch_bounds__(kTwoPassThreads) backward_two_pass_kernel(BackwardArgs a) {
  constexpr int kSums = kKind == Kind::kLayer ? 2 : 1;
  __shared__ float scratch[kTwoPassThreads / 32 * kSums];
  const std::int64_t n = a.cols;
  constexpr std::int64_t kStep = static_cast<std::int64_t>(kTwoPassThreads) * V;
  float* dw_partial = a.partial ? a.partial + blockIdx.x * n : nullptr;
  float* db_partial = a.partial ? a.partial + (gridDim.x + blockIdx.x) * n : nullptr;
  if (dw_partial) {
    for (std::int64_t col = threadIdx.x * V; col < n; col += kStep) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        dw_partial[col + j] = 0.f;
        if constexpr (kKind == Kind::kLayer) db_partial[col + j] = 0.f;
      }
    }
  }
  for (std::int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const float rstd = a.rstd[row];
    const float mean = kKind == Kind::kLayer ? a.mean[row] : 0.f;
    const T* dy_row = static_cast<const T*>(a.dy) + row * a.dy_stride;
    const X* x_row = static_cast<const X*>(a.x) + row * a.x_stride;
    auto load = [&](std::int64_t col, float (&dy)[V], float (&xhat)[V], float (&g)[V]) {
      load_floats<T, V>(dy_row + col, dy);
      load_floats<X, V>(x_row + col, xhat);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        xhat[j] = (xhat[j] - mean) * rstd;
        g[j] = dy[j] * load_scale<T, kKind>(a, col + j);
      }
    };
    float sums[kSums] = {};
    for (std::int64_t col = threadIdx.x * V; col < n; col += kStep) {
      float dy[V], xhat[V], g[V];
      load(col, dy, xhat, g);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        sums[kSums - 1] += g[j] * xhat[j];
        if constexpr (kKind == Kind::kLayer) sums[0] += g[j];
      }
    }
    row_sum<kTwoPassThreads, kSums>(sums, scratch);
    const float inv_n = 1.f / static_cast<float>(n);
    const float mean_g = kKind == Kind::kLayer ? sums[0] * inv_n : 0.f;
    const float mean_gx = sums[kSums - 1] * inv_n;
    for (std::int64_t col = threadIdx.x * V; col < n; col += kStep) {
      float dy[V], xhat[V], g[V], dx[V];
      load(col, dy, xhat, g);
      input_gradient<kKind, V>(g, xhat, rstd, mean_g, mean_gx, dx);
      add_residual_gradient<X, V>(a, row, col, dx);
      store_floats<T, V>(static_cast<T*>(a.dx) + row * a.dx_stride + col, dx);
      if (dw_partial) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          dw_partial[col + j] += dy[j] * xhat[j];
          if constexpr (kKind == Kind::kLayer) db_partial[col + j] += dy[j];
        }
      }
    }
  }
}

// out[c] = sum over p of partial[p][c], p in order: 8 warps take interleaved partial rows
// for 32 columns, then one warp adds the 8 results in warp order.
template <class W>
__global__ void __launch_bounds__(256) reduce_partials_kernel(const float* partial,
                                                              std::int64_t blocks,
                                                              std::int64_t cols, W* out) {
  __shared__ float warp_sums[8][33];
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (col < cols) {
    for (std::int64_t p = threadIdx.y; p < blocks; p += 8) s += partial[p * cols + col];
  }
  warp_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) total += warp_sums[w][threadIdx.x];
    out[col] = detail::from_float<W>(total);
  }
}

template <class T>
void reduce_partials(const float* partial, std::int64_t blocks, std::int64_t cols,
                     const TensorView& out, cudaStream_t stream, const char* op) {
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32));
  const dim3 block(32, 8);
  if (out.dtype == DType::kFloat32) {
    reduce_partials_kernel<float><<<grid, block, 0, stream>>>(partial, blocks, cols, out.ptr<float>());
  } else {
    reduce_partials_kernel<T><<<grid, block, 0, stream>>>(partial, blocks, cols, out.ptr<T>());
  }
  detail::check_launch(op);
}

struct Plan {
  bool registers = false;
  bool vectorized = false;
  std::int64_t blocks = 0;
};

template <class T, class X>
Plan plan_backward(const BackwardArgs& a, NormVariant variant) {
  constexpr int V = detail::kVec16<T>;
  const std::int64_t vecs = (a.cols + V - 1) / V;
  const bool aligned = a.cols % V == 0 && rows_vectorizable(a.dy, a.dy_stride, sizeof(T)) &&
                       rows_vectorizable(a.dx, a.dx_stride, sizeof(T)) &&
                       rows_vectorizable(a.x, a.x_stride, sizeof(X)) &&
                       rows_vectorizable(a.d_residual, a.d_residual_stride, sizeof(X));
  Plan plan;
  plan.vectorized = aligned;
  plan.registers =
      use_registers(variant, aligned, vecs, kMaxRegisterVecs<kBackwardVecsPerThread>);
  if (plan.registers) {
    with_register_config<kBackwardVecsPerThread>(vecs, [&](auto threads, auto) {
      constexpr int kThreads = decltype(threads)::value;
      constexpr int kBlock = kThreads > kBackwardBlock ? kThreads : kBackwardBlock;
      constexpr int kRowsPerBlock = kBlock / kThreads;
      plan.blocks = blocks_for((a.rows + kRowsPerBlock - 1) / kRowsPerBlock, 2048 / kBlock);
    });
  } else {
    plan.blocks = blocks_for(a.rows, 2048 / kTwoPassThreads);
  }
  return plan;
}

template <class T, class X, Kind kKind>
void launch_backward(BackwardArgs a, const TensorView& dw, const TensorView& db,
                     const TensorView& workspace, NormVariant variant, cudaStream_t stream,
                     const char* op) {
  if (a.rows == 0) {
    // An empty batch still defines the gradients: zero.
    for (const TensorView* g : {&dw, &db}) {
      if (g->defined() && g->numel() > 0) {
        detail::check_cuda(cudaMemsetAsync(g->data, 0, g->numel() * g->element_size(), stream),
                           op, "cudaMemsetAsync");
      }
    }
    return;
  }
  const Plan plan = plan_backward<T, X>(a, variant);
  if (dw.defined() || db.defined()) {
    const std::size_t need = static_cast<std::size_t>(plan.blocks) * a.cols * sizeof(float) *
                             (kKind == Kind::kLayer ? 2 : 1);
    const std::size_t have = workspace.defined() ? workspace.numel() * workspace.element_size() : 0;
    if (have < need) {
      detail::throw_arg_error(op, "workspace",
                              "at least " + std::to_string(need) +
                                  " bytes (norm_backward_workspace_bytes)",
                              std::to_string(have) + " bytes");
    }
    if (!detail::is_aligned(workspace.data, 16)) {
      detail::throw_arg_error(op, "workspace", "a 16-byte aligned pointer", "an unaligned one");
    }
    a.partial = static_cast<float*>(workspace.data);
  }
  constexpr int V = detail::kVec16<T>;
  const auto grid = static_cast<unsigned>(plan.blocks);
  if (plan.registers) {
    with_register_config<kBackwardVecsPerThread>((a.cols + V - 1) / V, [&](auto threads, auto per_thread) {
      constexpr int kThreads = decltype(threads)::value;
      constexpr int kBlock = kThreads > kBackwardBlock ? kThreads : kBackwardBlock;
      backward_registers_kernel<T, X, kKind, kThreads, decltype(per_thread)::value>
          <<<grid, kBlock, 0, stream>>>(a);
    });
  } else if (plan.vectorized) {
    backward_two_pass_kernel<T, X, kKind, V><<<grid, kTwoPassThreads, 0, stream>>>(a);
  } else {
    backward_two_pass_kernel<T, X, kKind, 1><<<grid, kTwoPassThreads, 0, stream>>>(a);
  }
  detail::check_launch(op);
  if (dw.defined()) reduce_partials<T>(a.partial, plan.blocks, a.cols, dw, stream, op);
  if (db.defined()) {
    reduce_partials<T>(a.partial + plan.blocks * a.cols, plan.blocks, a.cols, db, stream, op);
  }
}

BackwardArgs make_args(const char* op, const TensorView& dy, const TensorView& x,
                       const TensorView& weight, const TensorView& mean, const TensorView& rstd,
                       TensorView dx) {
  detail::OpChecker c(op);
  const auto dyr = c.rows(dy, "dy");
  BackwardArgs a{};
  a.dy = dy.data;
  a.dy_stride = dyr.row_stride;
  a.x = x.data;
  a.x_stride = c.rows(x, "x").row_stride;
  a.weight = weight.defined() ? weight.data : nullptr;
  a.weight_f32 = weight.defined() && weight.dtype == DType::kFloat32;
  a.mean = mean.defined() ? mean.ptr<const float>() : nullptr;
  a.rstd = rstd.ptr<const float>();
  a.dx = dx.data;
  a.dx_stride = c.rows(dx, "dx").row_stride;
  a.rows = dyr.rows;
  a.cols = dyr.cols;
  return a;
}

}  // namespace

std::size_t backward_workspace_bytes_cuda(std::int64_t rows, std::int64_t cols, DType dtype) {
  // The largest block count any plan can pick (register or two-pass, any alignment), for the
  // weight and the bias gradient.
  const auto vec = static_cast<std::int64_t>(16 / dtype_size(dtype));
  const std::int64_t vecs = (cols + vec - 1) / vec;
  std::int64_t row_groups = rows;
  with_register_config<kBackwardVecsPerThread>(vecs, [&](auto threads, auto) {
    constexpr int kThreads = decltype(threads)::value;
    constexpr int kRowsPerBlock = (kThreads > kBackwardBlock ? kThreads : kBackwardBlock) / kThreads;
    row_groups = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  });
  const std::int64_t blocks = std::max(blocks_for(row_groups, 2048 / kBackwardBlock),
                                       blocks_for(rows, 2048 / kTwoPassThreads));
  return static_cast<std::size_t>(std::max<std::int64_t>(blocks, 1)) * cols * sizeof(float) * 2;
}

void rmsnorm_backward_cuda(const TensorView& dy, const TensorView& x, const TensorView& weight,
                           const TensorView& rstd, TensorView dx, TensorView dw,
                           TensorView workspace, const RMSNormOptions& options,
                           cudaStream_t stream, NormVariant variant) {
  const char* op = "rmsnorm_backward";
  BackwardArgs a = make_args(op, dy, x, weight, {}, rstd, dx);
  a.weight_offset = static_cast<float>(options.weight_offset);
  detail::dispatch_activation_dtype(dy.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_backward<T, T, Kind::kRms>(a, dw, {}, workspace, variant, stream, op);
  });
}

void fused_add_rmsnorm_backward_cuda(const TensorView& dy, const TensorView& d_residual,
                                     const TensorView& residual, const TensorView& weight,
                                     const TensorView& rstd, TensorView dx, TensorView dw,
                                     TensorView workspace, const RMSNormOptions& options,
                                     cudaStream_t stream, NormVariant variant) {
  const char* op = "fused_add_rmsnorm_backward";
  BackwardArgs a = make_args(op, dy, residual, weight, {}, rstd, dx);
  a.weight_offset = static_cast<float>(options.weight_offset);
  if (d_residual.defined()) {
    a.d_residual = d_residual.data;
    a.d_residual_stride = detail::OpChecker(op).rows(d_residual, "d_residual").row_stride;
  }
  detail::dispatch_activation_dtype(dy.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (residual.dtype == DType::kFloat32) {
      launch_backward<T, float, Kind::kRms>(a, dw, {}, workspace, variant, stream, op);
    } else {
      launch_backward<T, T, Kind::kRms>(a, dw, {}, workspace, variant, stream, op);
    }
  });
}

void layernorm_backward_cuda(const TensorView& dy, const TensorView& x, const TensorView& weight,
                             const TensorView& mean, const TensorView& rstd, TensorView dx,
                             TensorView dw, TensorView db, TensorView workspace,
                             const LayerNormOptions& /*options*/, cudaStream_t stream,
                             NormVariant variant) {
  const char* op = "layernorm_backward";
  BackwardArgs a = make_args(op, dy, x, weight, mean, rstd, dx);
  detail::dispatch_activation_dtype(dy.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_backward<T, T, Kind::kLayer>(a, dw, db, workspace, variant, stream, op);
  });
}

}  // namespace trainscale::ops::norm
