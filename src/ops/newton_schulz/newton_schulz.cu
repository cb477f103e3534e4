// Newton-Schulz and the Muon step on the GPU, for one matrix or a batch of matrices of one shape.
// Newton-Schulz: per matrix the Frobenius norm (per-block partial sums, then one thread adding
// them in a fixed order), X = G / (||G|| + eps) in the orientation whose Gram matrix is the
// smaller (a tiled transpose when R > C), then per step three strided-batched cuBLASLt products
// (common/gemm.h, float32 accumulation; X, A and B stored in the input's dtype, as Muon
// implementations keep them):
//   A = X X^T;   B = c A A + b A;   X' = B X + a X   (B and X' written beside A and X).
// The two symmetric products compute only their lower block triangle (or, asked for, their
// lower triangle of tiles: gram_triangle.cu) and mirror it (symmetric_product, gram_blocks in
// newton_schulz_internal.h).
// NewtonSchulzMethod::kGram runs the same iteration on [p, p] matrices (gram_steps).
// Muon adds one pass before (momentum and Nesterov: the new buffer and u, Newton-Schulz's
// input) and puts the parameter update (weight decay and the scaled orthogonal step) in the
// tiled pass that copies X back out.
// Every launch and product has a fixed shape and order, and the products' algorithm is chosen
// for one matrix whatever the batch: the same bits every run and for every batch size.
#include <algorithm>
#include <array>
#include <string>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/dtype.cuh"
#include "common/gemm.h"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "ops/newton_schulz/newton_schulz_internal.h"

namespace trainscale::ops::newton_schulz {
namespace {

constexpr int kNormBlocks = 264;  // fixed: the partial sums, and so the norm, do not depend on the device
constexpr int kThreads = 256;
constexpr std::size_t kAlign = 256;
constexpr std::size_t kGemmWorkspaceBytes = std::size_t{32} << 20;
constexpr int kMomentumBlocks = 132;  // per parameter; any count gives the same bits (elementwise)

// Matrices of a batch: matrix n's element (r, c) at data[n * stride + r * ld + c].
template <class T>
struct Strided {
  T* data;
  std::int64_t ld, stride;
  __device__ T* at(std::int64_t n, std::int64_t r, std::int64_t c) const { return data + n * stride + r * ld + c; }
};

// Sum of squares of a block's share of matrix blockIdx.y's elements (a fixed grid-stride
// assignment), into partial[blockIdx.y * kNormBlocks + blockIdx.x].
template <class T>
__global__ void __launch_bounds__(kThreads) sum_squares_kernel(Strided<const T> g, std::int64_t rows, std::int64_t cols,
                                                                float* partial) {
  __shared__ float scratch[kThreads / 32];
  float s[1] = {0.f};
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{kThreads} + threadIdx.x; i < n; i += std::int64_t{kNormBlocks} * kThreads) {
    const float v = detail::to_float(*g.at(blockIdx.y, i / cols, i % cols));
    s[0] = fmaf(v, v, s[0]);
  }
  detail::row_reduce<kThreads, detail::SumOp>(s, scratch);
  if (threadIdx.x == 0) partial[blockIdx.y * kNormBlocks + blockIdx.x] = s[0];
}

// scale[n] = 1 / (sqrt(sum of matrix n's partials, in order, in double) + eps).
__global__ void inverse_norm_kernel(const float* partial, std::int64_t count, double eps, float* scale) {
  const std::int64_t n = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (n >= count) return;
  double sum = 0;
  for (int b = 0; b < kNormBlocks; ++b) sum += partial[n * kNormBlocks + b];
  scale[n] = static_cast<float>(1.0 / (sqrt(sum) + eps));
}

// The stores of the tiled pass. (n, r, c): matrix, row and column of the destination.
template <class T>
struct StoreTo {
  Strided<T> dst;
  __device__ void operator()(std::int64_t n, std::int64_t r, std::int64_t c, float v) const {
    *dst.at(n, r, c) = detail::from_float<T>(v);
  }
};

// dst = v + diagonal * I.
template <class T>
struct StorePlusDiagonal {
  Strided<T> dst;
  float diagonal;
  __device__ void operator()(std::int64_t n, std::int64_t r, std::int64_t c, float v) const {
    *dst.at(n, r, c) = detail::from_float<T>(r == c ? v + diagonal : v);
  }
};

// param <- param * decay - step * v, on a table of parameters (one per matrix of the batch).
template <class T>
struct MuonUpdate {
  T* param[kMuonMaxBatch];
  std::int64_t ld[kMuonMaxBatch];
  float decay, step;
  __device__ void operator()(std::int64_t n, std::int64_t r, std::int64_t c, float v) const {
    T* p = param[n] + r * ld[n] + c;
    *p = detail::from_float<T>(fmaf(-step, v, detail::to_float(*p) * decay));
  }
};

// store(n, ., ., src * scale[n]) (scale optional: 1) for matrix blockIdx.z of src [rows, cols];
// the destination is its transpose [cols, rows] when `transpose`, else the same shape. Tiles of
// 32 x 32 through shared memory keep both sides' accesses along rows.
template <class T, class Store>
__global__ void copy_tiles_kernel(Strided<const T> src, std::int64_t rows, std::int64_t cols, bool transpose,
                                  const float* scale, const Store store) {
  __shared__ float tile[32][33];
  const std::int64_t n = blockIdx.z;
  const float s = scale != nullptr ? scale[n] : 1.f;
  const std::int64_t r0 = std::int64_t{blockIdx.y} * 32, c0 = std::int64_t{blockIdx.x} * 32;
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const std::int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = detail::to_float(*src.at(n, r, c)) * s;
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    if (transpose) {
      const std::int64_t c = c0 + i, r = r0 + threadIdx.x;  // destination row c, column r
      if (r < rows && c < cols) store(n, c, r, tile[threadIdx.x][i]);
    } else {
      const std::int64_t r = r0 + i, c = c0 + threadIdx.x;
      if (r < rows && c < cols) store(n, r, c, tile[i][threadIdx.x]);
    }
  }
}

// The upper block triangle of symmetric [p, p] matrices (ld p, `stride` elements apart; matrix
// blockIdx.z) from the lower one: element (r, c) with r / b < c / b takes (c, r), b the block
// rows. One 32 x 32 destination tile per CTA through shared memory; tiles with no element
// above the block diagonal return at once.
template <class T>
__global__ void mirror_upper_blocks_kernel(T* m, std::int64_t p, std::int64_t b, std::int64_t stride) {
  __shared__ T tile[32][33];
  const std::int64_t r0 = std::int64_t{blockIdx.y} * 32, c0 = std::int64_t{blockIdx.x} * 32;
  if (std::min(c0 + 31, p - 1) / b <= r0 / b) return;
  T* mat = m + blockIdx.z * stride;
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const std::int64_t r = c0 + i, c = r0 + threadIdx.x;  // the source tile, (c0.., r0..)
    if (r < p && c < p) tile[i][threadIdx.x] = mat[r * p + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const std::int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < p && c < p && r / b < c / b) mat[r * p + c] = tile[threadIdx.x][i];
  }
}

// The upper block triangle of out (blocks of b rows) from its lower, for each matrix.
template <class T>
void mirror_upper_blocks(const char* op, const detail::GemmResult& out, std::int64_t b,
                         const detail::GemmBatch& matrices, cudaStream_t stream) {
  const std::int64_t p = out.rows;
  const dim3 grid(static_cast<unsigned>((p + 31) / 32), static_cast<unsigned>((p + 31) / 32),
                  static_cast<unsigned>(matrices.count));
  mirror_upper_blocks_kernel<T><<<grid, dim3(32, 8), 0, stream>>>(static_cast<T*>(out.data), p, b,
                                                                   matrices.stride_out);
  detail::check_launch(op);
}

// `m` with its data `offset` elements on and the logical shape [rows, cols].
detail::GemmOperand block_of(detail::GemmOperand m, std::int64_t offset, std::int64_t rows, std::int64_t cols) {
  m.data = static_cast<const char*>(m.data) + offset * static_cast<std::int64_t>(dtype_size(m.dtype));
  m.rows = rows;
  m.cols = cols;
  return m;
}

// out = alpha lhs @ rhs + beta addend for `matrices` (batch strides as gemm takes them) of a
// symmetric [p, p] result (ld p): lhs [p, K] in row blocks of b = p / k rows lhs_step elements
// apart, rhs [K, p] in column blocks of b columns rhs_step apart. k == kGramTriangle (bf16,
// where gram_triangle_applies): the lower tile triangle in one launch from lhs's rows (rhs is
// lhs^T), then mirrored. k == 1: one dense product.
// Else only the lower block triangle's k (k + 1) / 2 blocks are computed, then mirrored. One
// matrix: a call per diagonal band of blocks, batched along the band; several: a call per
// block, batched over the matrices. Every block is a product of one shape whose algorithm is
// chosen for a single product (batch_invariant), so each matrix gets a single call's bits.
template <class T>
void symmetric_product(const char* op, int k, const detail::GemmOperand& lhs, std::int64_t lhs_step,
                       const detail::GemmOperand& rhs, std::int64_t rhs_step, const detail::GemmResult& out,
                       const detail::GemmScalars& scalars, void* gemm_ws, const detail::GemmBatch& matrices,
                       cudaStream_t stream) {
  if (k == kGramTriangle) {
    if constexpr (!std::is_same_v<T, __nv_bfloat16>) {
      detail::throw_op_error(op, "the Gram product's tile triangle takes bfloat16 matrices");
    } else {
      // Packed rows (ld == cols) and host scalars, as orthogonalize passes them.
      if (lhs.ld != lhs.cols || scalars.on_device) {
        detail::throw_op_error(op, "the Gram product's tile triangle takes packed rows and host scalars");
      }
      gram_triangle_bf16(op, lhs.data, matrices.stride_a, out.rows, lhs.cols, out.data, out.addend,
                         matrices.stride_out, *scalars.alpha, *scalars.beta, matrices.count, stream);
      mirror_upper_blocks<T>(op, out, kGramTriangleTile, matrices, stream);
    }
    return;
  }
  if (k == 1) {
    detail::gemm(op, lhs, rhs, out, scalars, gemm_ws, kGemmWorkspaceBytes, stream, matrices);
    return;
  }
  const std::int64_t p = out.rows, b = p / k, e = static_cast<std::int64_t>(dtype_size(out.dtype));
  const auto product = [&](std::int64_t r, std::int64_t c, const detail::GemmBatch& batch) {
    detail::GemmResult block = out;
    const std::int64_t at = (r * b * out.ld + c * b) * e;
    block.data = static_cast<char*>(out.data) + at;
    if (out.addend != nullptr) block.addend = static_cast<const char*>(out.addend) + at;
    block.rows = block.cols = b;
    detail::gemm(op, block_of(lhs, r * lhs_step, b, lhs.cols), block_of(rhs, c * rhs_step, rhs.rows, b), block,
                 scalars, gemm_ws, kGemmWorkspaceBytes, stream, batch);
  };
  for (std::int64_t d = 0; d < k; ++d) {  // band d: blocks (i + d, i)
    if (matrices.count == 1) {
      product(d, 0, {k - d, lhs_step, rhs_step, b * out.ld + b, true});
    } else {
      for (std::int64_t i = 0; i + d < k; ++i) product(i + d, i, matrices);
    }
  }
  mirror_upper_blocks<T>(op, out, b, matrices, stream);
}

template <class T, class Store>
void copy_tiles(const char* op, Strided<const T> src, std::int64_t count, std::int64_t rows, std::int64_t cols,
                bool transpose, const float* scale, const Store& store, cudaStream_t stream) {
  if (rows == 0 || cols == 0 || count == 0) return;
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>((rows + 31) / 32),
                  static_cast<unsigned>(count));
  copy_tiles_kernel<T, Store><<<grid, dim3(32, 8), 0, stream>>>(src, rows, cols, transpose, scale, store);
  detail::check_launch(op);
}

// The momentum pass over a table of parameters (matrix blockIdx.y): in float32,
//   buf' = momentum * buf + grad;  u = nesterov ? grad + momentum * buf' : buf',
// buf' stored in the buffer's dtype B, u in T, rows of `cols` at u + n * u_stride. V
// elements per thread and step (16-byte loads of T when V > 1).
template <class T, class B>
struct MomentumArgs {
  const T* grad[kMuonMaxBatch];
  std::int64_t grad_ld[kMuonMaxBatch];
  B* buf[kMuonMaxBatch];
  std::int64_t buf_ld[kMuonMaxBatch];
  T* u;
  std::int64_t u_stride, rows, cols;
  float momentum;
  bool nesterov;
};

template <class T, class B, int V>
__global__ void __launch_bounds__(kThreads) momentum_kernel(const MomentumArgs<T, B> a) {
  const std::int64_t n = blockIdx.y, units = a.cols / V, total = a.rows * units;
  const T* grad = a.grad[n];
  B* buf = a.buf[n];
  for (std::int64_t t = blockIdx.x * std::int64_t{kThreads} + threadIdx.x; t < total;
       t += std::int64_t{gridDim.x} * kThreads) {
    const std::int64_t i = t / units, j = (t - i * units) * V;
    float g[V], b[V], u[V];
    detail::load_floats<T, V>(grad + i * a.grad_ld[n] + j, g);
    detail::load_floats<B, V>(buf + i * a.buf_ld[n] + j, b);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      b[e] = fmaf(a.momentum, b[e], g[e]);
      u[e] = a.nesterov ? fmaf(a.momentum, b[e], g[e]) : b[e];
    }
    detail::store_floats<B, V>(buf + i * a.buf_ld[n] + j, b);
    detail::store_floats<T, V>(a.u + n * a.u_stride + i * a.cols + j, u);
  }
}

std::size_t round_up(std::size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Workspace layout for `count` matrices: cuBLASLt's scratch, X and its next value [p, q] per
// matrix, A and B [p, p] per matrix, the norms' partial sums and scales. Matrices of a batch
// are 256-byte aligned (x_stride, a_stride elements apart).
struct Layout {
  std::size_t gemm = 0, x = 0, x_next = 0, a = 0, b = 0, partial = 0, scale = 0, bytes = 0;
  std::int64_t x_stride = 0, a_stride = 0;
};
Layout layout_for(std::int64_t count, std::int64_t rows, std::int64_t cols, DType dtype) {
  const auto p = static_cast<std::size_t>(std::min(rows, cols)), q = static_cast<std::size_t>(std::max(rows, cols));
  const std::size_t e = dtype_size(dtype), n = static_cast<std::size_t>(count);
  Layout l;
  l.x_stride = static_cast<std::int64_t>(round_up(p * q * e) / e);
  l.a_stride = static_cast<std::int64_t>(round_up(p * p * e) / e);
  std::size_t at = 0;
  const auto take = [&](std::size_t bytes) { const std::size_t o = at; at = round_up(at + bytes); return o; };
  l.gemm = take(kGemmWorkspaceBytes);
  l.x = take(n * static_cast<std::size_t>(l.x_stride) * e);
  l.x_next = take(n * static_cast<std::size_t>(l.x_stride) * e);
  l.a = take(n * static_cast<std::size_t>(l.a_stride) * e);
  l.b = take(n * static_cast<std::size_t>(l.a_stride) * e);
  l.partial = take(n * kNormBlocks * sizeof(float));
  l.scale = take(n * sizeof(float));
  l.bytes = at;
  return l;
}

void check_workspace(const char* op, const TensorView& workspace, std::size_t bytes, const char* bytes_fn) {
  const std::size_t have = workspace.defined() ? static_cast<std::size_t>(workspace.numel()) * workspace.element_size() : 0;
  if (have < bytes) {
    detail::throw_arg_error(op, "workspace", "at least " + std::to_string(bytes) + " bytes (" + bytes_fn + ")",
                            std::to_string(have) + " bytes");
  }
  if (!workspace.is_contiguous() || !detail::is_aligned(workspace.data, kAlign))
    detail::throw_arg_error(op, "workspace", "a contiguous, 256-byte aligned view", workspace.describe());
}

// Step `step`'s coefficients (a, b, c).
std::array<float, 3> coefficients(const NewtonSchulzOptions& options, int step) {
  const auto [a, b, c] = options.per_step.empty() ? std::array{options.a, options.b, options.c}
                                                  : options.per_step[static_cast<std::size_t>(step)];
  return {static_cast<float>(a), static_cast<float>(b), static_cast<float>(c)};
}

// Whether kGram's [p, p] iterates fit: R, T and Z in the slot of X's next value (unused while
// they live), Q and its next value in A's and B's.
bool gram_iterates_fit(const Layout& l, std::int64_t p, std::int64_t q) {
  return q >= 3 * p && 3 * l.a_stride <= l.x_stride;
}

// Gram Newton-Schulz (NewtonSchulzMethod::kGram) from the normalized X [p, q] in the workspace's
// x. Each step's X is Q X_0 for a polynomial Q of R = X_0 X_0^T, and with P = a I + T,
// T = c R R + b R the step's polynomial of its own Gram matrix R:
//   Q' = P Q = T Q + a Q,   R' = P R P = T Z + a Z  with  Z = T R + a R,
// all polynomials in X_0 X_0^T, so every product is symmetric and computes its lower block
// triangle only (symmetric_product; the tile triangle, which takes rhs = lhs^T, only for
// X X^T and R R). A phase's first step has Q = I, so Q' = P. A phase ends after its second step
// (the restart: X = Q X formed and its Gram matrix computed afresh, which bounds the drift of
// the [p, p] iterates from X's true Gram matrix under rounding) and after the last. Returns
// the region holding the result, as orthogonalize.
template <class T>
void* gram_steps(const char* op, DType dt, const Layout& l, char* base, std::int64_t count, std::int64_t p,
                 std::int64_t q, const NewtonSchulzOptions& options, int k, cudaStream_t stream) {
  constexpr int kRestartAfter = 2;
  const int k_general = k == kGramTriangle ? gram_blocks(p) : k;
  const std::int64_t block = k == kGramTriangle ? p : p / k, block_general = p / k_general;
  const std::int64_t e = static_cast<std::int64_t>(dtype_size(dt)), xs = l.x_stride, as = l.a_stride;
  void* x = base + l.x;
  void* x_next = base + l.x_next;
  void* q_now = base + l.a;
  void* q_next = base + l.b;
  void* gemm_ws = base + l.gemm;
  const float one = 1.f, zero = 0.f;
  const detail::GemmBatch in_slots{count, xs, xs, xs, true};  // R, T, Z (and X) products
  for (int done = 0; done < options.steps;) {
    const int steps = std::min(done == 0 ? kRestartAfter : options.steps, options.steps - done);
    void* r = x_next;
    void* t = static_cast<char*>(x_next) + as * e;
    void* z = static_cast<char*>(x_next) + 2 * as * e;
    const detail::GemmOperand xm{x, dt, p, q, q}, xt{x, dt, q, p, q, true}, rm{r, dt, p, p, p}, tm{t, dt, p, p, p};
    symmetric_product<T>(op, k, xm, block * q, xt, block * q, {r, dt, p, p, p}, {&one, &zero}, gemm_ws, in_slots,
                         stream);  // R = X X^T
    for (int j = 0; j < steps; ++j) {
      const auto [fa, fb, fc] = coefficients(options, done + j);
      symmetric_product<T>(op, k, rm, block * p, rm, block,
                           {.data = t, .dtype = dt, .rows = p, .cols = p, .ld = p, .addend = r}, {&fc, &fb},
                           gemm_ws, in_slots, stream);  // T = c R R + b R
      if (j == 0) {  // Q = P
        copy_tiles<T>(op, {static_cast<const T*>(t), p, xs}, count, p, p, false, nullptr,
                      StorePlusDiagonal<T>{{static_cast<T*>(q_now), p, as}, fa}, stream);
      } else {  // Q' = T Q + a Q
        symmetric_product<T>(op, k_general, tm, block_general * p, {q_now, dt, p, p, p}, block_general,
                             {.data = q_next, .dtype = dt, .rows = p, .cols = p, .ld = p, .addend = q_now},
                             {&one, &fa}, gemm_ws, {count, xs, as, as, true}, stream);
        std::swap(q_now, q_next);
      }
      if (j + 1 < steps) {
        symmetric_product<T>(op, k_general, tm, block_general * p, rm, block_general,
                             {.data = z, .dtype = dt, .rows = p, .cols = p, .ld = p, .addend = r}, {&one, &fa},
                             gemm_ws, in_slots, stream);  // Z = T R + a R
        symmetric_product<T>(op, k_general, tm, block_general * p, {z, dt, p, p, p}, block_general,
                             {.data = r, .dtype = dt, .rows = p, .cols = p, .ld = p, .addend = z}, {&one, &fa},
                             gemm_ws, in_slots, stream);  // R' = T Z + a Z
      }
    }
    detail::gemm(op, {q_now, dt, p, p, p}, xm, {x_next, dt, p, q, q}, {&one, &zero}, gemm_ws, kGemmWorkspaceBytes,
                 stream, {count, as, xs, xs, true});  // X = Q X
    std::swap(x, x_next);
    done += steps;
  }
  return x;
}

// Newton-Schulz of `count` matrices [rows, cols] of T read from `src` (which may be the
// workspace's x_next region); returns the workspace region holding the result X [p, q] per
// matrix (x_stride apart): the transpose of the input's orientation when rows > cols.
// gram_split: A = X X^T and A A by symmetric_product's tile triangle (gram_blocks(p) where it
// does not apply) or blocks (1 where they would not divide p into blocks of a multiple of 32 rows).
template <class T>
void* orthogonalize(const char* op, DType dt, const Layout& l, char* base, Strided<const T> src, std::int64_t count,
                    std::int64_t rows, std::int64_t cols, const NewtonSchulzOptions& options, int gram_split,
                    cudaStream_t stream) {
  const bool transpose = rows > cols;
  const std::int64_t p = std::min(rows, cols), q = std::max(rows, cols);
  int k = gram_split;
  if (k == kGramTriangle && !gram_triangle_applies(dt, p, q)) k = gram_blocks(p);
  if (k > 1 && p % (32 * k) != 0) k = 1;
  const std::int64_t block = k == kGramTriangle ? p : p / k;
  void* x = base + l.x;
  void* x_next = base + l.x_next;
  void* a = base + l.a;
  void* b = base + l.b;
  auto* partial = reinterpret_cast<float*>(base + l.partial);
  auto* scale = reinterpret_cast<float*>(base + l.scale);
  sum_squares_kernel<T><<<dim3(kNormBlocks, static_cast<unsigned>(count)), kThreads, 0, stream>>>(src, rows, cols,
                                                                                                  partial);
  detail::check_launch(op);
  inverse_norm_kernel<<<static_cast<unsigned>((count + 31) / 32), 32, 0, stream>>>(partial, count, options.eps, scale);
  detail::check_launch(op);
  copy_tiles<T>(op, src, count, rows, cols, transpose, scale, StoreTo<T>{{static_cast<T*>(x), q, l.x_stride}}, stream);
  if (options.method == NewtonSchulzMethod::kGram && gram_iterates_fit(l, p, q)) {
    return gram_steps<T>(op, dt, l, base, count, p, q, options, k, stream);
  }
  void* gemm_ws = base + l.gemm;
  const detail::GemmBatch xx{count, l.x_stride, l.x_stride, l.a_stride, true};  // [p, q] x [q, p] -> [p, p]
  const detail::GemmBatch aa{count, l.a_stride, l.a_stride, l.a_stride, true};
  const detail::GemmBatch bx{count, l.a_stride, l.x_stride, l.x_stride, true};
  for (int step = 0; step < options.steps; ++step) {
    const auto [fa, fb, fc] = coefficients(options, step);
    const float one = 1.f, zero = 0.f;
    const detail::GemmOperand xm{x, dt, p, q, q}, xt{x, dt, q, p, q, true}, am{a, dt, p, p, p}, bm{b, dt, p, p, p};
    symmetric_product<T>(op, k, xm, block * q, xt, block * q, {a, dt, p, p, p}, {&one, &zero}, gemm_ws, xx,
                         stream);  // A = X X^T
    symmetric_product<T>(op, k, am, block * p, am, block,
                         {.data = b, .dtype = dt, .rows = p, .cols = p, .ld = p, .addend = a}, {&fc, &fb}, gemm_ws,
                         aa, stream);  // B = c A A + b A
    detail::gemm(op, bm, xm, {.data = x_next, .dtype = dt, .rows = p, .cols = q, .ld = q, .addend = x}, {&one, &fa},
                 gemm_ws, kGemmWorkspaceBytes, stream, bx);  // X' = B X + a X
    std::swap(x, x_next);
  }
  return x;
}

}  // namespace

std::size_t newton_schulz_workspace_bytes_cuda(std::int64_t count, std::int64_t rows, std::int64_t cols, DType dtype) {
  return layout_for(count, rows, cols, dtype).bytes;
}

void newton_schulz_cuda(const TensorView& g, TensorView out, const NewtonSchulzOptions& options,
                        const TensorView& workspace, cudaStream_t stream, int gram_split) {
  constexpr const char* kOp = "newton_schulz";
  const detail::Rows rg = detail::row_layout(g), ro = detail::row_layout(out);
  const std::int64_t count = g.ndim == 3 ? g.size(0) : 1, rows = g.size(-2), cols = g.size(-1);
  const Layout l = layout_for(count, rows, cols, g.dtype);
  check_workspace(kOp, workspace, l.bytes, "newton_schulz_workspace_bytes");
  if (count == 0 || rows == 0 || cols == 0) return;
  detail::dispatch_activation_dtype(g.dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const Strided<const T> src{g.ptr<const T>(), rg.row_stride, rows * rg.row_stride};
    void* x = orthogonalize<T>(kOp, g.dtype, l, static_cast<char*>(workspace.data), src, count, rows, cols, options,
                               gram_split, stream);
    const std::int64_t p = std::min(rows, cols), q = std::max(rows, cols);
    copy_tiles<T>(kOp, {static_cast<const T*>(x), q, l.x_stride}, count, p, q, rows > cols, nullptr,
                  StoreTo<T>{{out.ptr<T>(), ro.row_stride, rows * ro.row_stride}}, stream);
  });
}

std::size_t muon_step_workspace_bytes_cuda(std::int64_t count, std::int64_t rows, std::int64_t cols, DType dtype) {
  return layout_for(std::min(count, kMuonMaxBatch), rows, cols, dtype).bytes;
}

void muon_step_cuda(std::span<const TensorView> params, std::span<const TensorView> grads,
                    std::span<const TensorView> momentum_buffers, const MuonOptions& options,
                    const TensorView& workspace, cudaStream_t stream) {
  constexpr const char* kOp = "muon_step";
  const auto total = static_cast<std::int64_t>(params.size());
  const std::int64_t rows = params[0].size(0), cols = params[0].size(1);
  const DType dt = params[0].dtype;
  const Layout l = layout_for(std::min(total, kMuonMaxBatch), rows, cols, dt);
  check_workspace(kOp, workspace, l.bytes, "muon_step_workspace_bytes");
  if (rows == 0 || cols == 0) return;
  char* base = static_cast<char*>(workspace.data);
  const auto decay = static_cast<float>(1.0 - options.lr * options.weight_decay);
  const auto step = static_cast<float>(options.lr * lr_factor(options.lr_adjust, rows, cols));
  detail::dispatch_activation_dtype(dt, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto with_buffer = [&](auto buffer_tag) {
      using B = typename decltype(buffer_tag)::type;
      for (std::int64_t first = 0; first < total; first += kMuonMaxBatch) {
        const std::int64_t count = std::min(kMuonMaxBatch, total - first);
        MomentumArgs<T, B> m{};
        MuonUpdate<T> update{};
        constexpr int V = detail::kVec16<T>;
        bool vectorized = cols % V == 0;
        for (std::int64_t n = 0; n < count; ++n) {
          const TensorView &p = params[first + n], &g = grads[first + n], &b = momentum_buffers[first + n];
          m.grad[n] = g.ptr<const T>();
          m.grad_ld[n] = detail::row_layout(g).row_stride;
          m.buf[n] = b.ptr<B>();
          m.buf_ld[n] = detail::row_layout(b).row_stride;
          update.param[n] = p.ptr<T>();
          update.ld[n] = detail::row_layout(p).row_stride;
          vectorized = vectorized && detail::is_aligned(g.data, 16) && detail::is_aligned(b.data, 16) &&
                       m.grad_ld[n] % V == 0 && m.buf_ld[n] % V == 0;
        }
        m.u = reinterpret_cast<T*>(base + l.x_next);  // Newton-Schulz's input, overwritten by its first step
        m.u_stride = l.x_stride;
        m.rows = rows;
        m.cols = cols;
        m.momentum = static_cast<float>(options.momentum);
        m.nesterov = options.nesterov;
        const dim3 grid(kMomentumBlocks, static_cast<unsigned>(count));
        if (vectorized) {
          momentum_kernel<T, B, V><<<grid, kThreads, 0, stream>>>(m);
        } else {
          momentum_kernel<T, B, 1><<<grid, kThreads, 0, stream>>>(m);
        }
        detail::check_launch(kOp);
        const Strided<const T> u{m.u, cols, l.x_stride};
        void* x = orthogonalize<T>(kOp, dt, l, base, u, count, rows, cols, options.newton_schulz,
                                   gram_blocks(std::min(rows, cols)), stream);
        update.decay = decay;
        update.step = step;
        const std::int64_t p = std::min(rows, cols), q = std::max(rows, cols);
        copy_tiles<T>(kOp, {static_cast<const T*>(x), q, l.x_stride}, count, p, q, rows > cols, nullptr, update,
                      stream);
      }
    };
    if (momentum_buffers[0].dtype == DType::kFloat32) {
      with_buffer(detail::TypeTag<float>{});
    } else {
      with_buffer(tag);
    }
  });
}

}  // namespace trainscale::ops::newton_schulz
