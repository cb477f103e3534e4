// RoPE forward / backward: q and k rotated in one launch.
//
// Work item = (token, group of kHeadsPerThread heads, chunk of the head dim). Heads run over q's
// Hq heads, then k's Hk heads, so one launch covers both tensors. Items are numbered token-major
// and a block takes kBlock consecutive items (a tile; one tile per block). Each thread owns whole
// rotation pairs (for NeoX: the chunk's vector in the first half of the rotary dims and the
// matching vector R/2 further on) and loads all of its heads' vectors before it stores any, so
// an output may be its input's exact view (in place).
//
// Chunks, of N elements (16 bytes on the vector path, 1 or 2 elements on the scalar path):
//   NeoX: chunks [0, R / 2N) rotate pairs (i, i + R/2) for i in [cN, cN + N); the following
//         (D - R) / N chunks copy the tail dims [R, D).
//   GPT-J: chunk c holds elements [cN, cN + N) of the head, pairs (2i, 2i + 1) inside it; its
//         elements below R rotate, the rest are copied (N is even, so no pair straddles chunks).
// In place, chunks of tail dims only are skipped (those dims stay untouched); a GPT-J chunk that
// straddles R writes its tail elements back with their own bits.
//
// Angles: a tile spans a few tokens, and every (token, pair) angle of them is computed once per
// tile into shared memory (while the tile's loads are in flight), then read by every head of q
// and k. That keeps the trigonometry and its registers out of the per-head path. Rotary dims so
// large that the tile's table would not fit (thousands of dims) compute angles per thread.
//
// Angles from theta: inv_freq_i = theta^(-2i/R) and angle / pi = position * inv_freq_i / pi are
// formed in double and reduced modulo 2 exactly; only the reduced value (in [-1, 1]) is rounded
// to float, for sincospif.
// A float angle would be off by up to half an ulp of the angle (2^-11 rad at position 8192), and a
// float inv_freq by ~1e-7 relative, which at 8192 rad is ~1e-3 rad: far beyond float32's 1e-5.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "common/cuda_check.h"
#include "common/dtype.cuh"
#include "common/vec.cuh"
#include "ops/rope/rope_cuda.h"

namespace trainscale::ops::rope {
namespace {

using detail::from_float;
using detail::to_float;
using detail::Vec;

constexpr int kBlock = 256;
// Two heads x (two NeoX halves) x 16 bytes in flight per thread: few enough registers for 4+
// blocks per SM (4 heads needed 103 registers: 2 blocks per SM, too few loads in flight).
constexpr int kHeadsPerThread = 2;
// Keeps every instantiation at <= 64 registers (none spills; NeoX bf16 needs exactly 64).
constexpr int kMinBlocksPerSm = 4;
// A tile's angle table (cos and sin, fp32, per token of the tile and pair) is staged in shared
// memory up to this size: rotary dims up to ~4000. The default dynamic shared memory limit.
constexpr std::int64_t kMaxAngleTableBytes = 48 * 1024;
// Table rows are padded to a multiple of this many pairs, so a chunk's pairs (at most 8, at a
// multiple of their count) are read as aligned vectors.
constexpr int kAngleRowAlign = 8;

// One of q / k: the input and the output written from it. Strides in elements, dims b, s, h.
struct HeadTensor {
  const void* in = nullptr;
  void* out = nullptr;
  std::int64_t in_stride[3] = {0, 0, 0};
  std::int64_t out_stride[3] = {0, 0, 0};
  bool in_place = false;
};

struct RopeArgs {
  HeadTensor q, k;
  std::int64_t q_heads = 0;  // heads [0, q_heads) are q's, [q_heads, heads) k's
  std::int64_t heads = 0;
  std::int64_t seq = 0;
  std::int64_t head_dim = 0;
  std::int64_t rotary_dim = 0;
  std::int64_t tokens = 0;
  int chunks = 0;      // per head
  int rot_chunks = 0;  // NeoX: chunks that rotate; the rest copy the tail
  int items_per_token = 0;  // head groups (of kHeadsPerThread) * chunks
  std::int64_t items = 0;   // tokens * items_per_token
  // Shared angle table: rows of angle_row pairs (>= R/2) for up to table_tokens tokens.
  int angle_row = 0;
  int table_tokens = 0;
  // Tables [P, R/2] (cos == nullptr: angles from theta).
  const void* cos = nullptr;
  const void* sin = nullptr;
  std::int64_t cos_stride = 0;
  std::int64_t sin_stride = 0;
  bool table_f32 = false;
  bool table_vec = false;  // both tables 16-byte aligned with 16-byte row strides
  const void* offsets = nullptr;
  std::int64_t offsets_stride = 0;
  bool offsets_i64 = false;
  double log2_freq_step = 0;  // inv_freq_i = 2^(-i * log2_freq_step) = theta^(-2i/R)
  double freq_ratio = 1;      // inv_freq_{i+1} / inv_freq_i = 2^(-log2_freq_step)
  float sin_sign = 1.f;       // -1: backward (rotation by -angle)
};

// Elements [0, count) of N at p: one 16-byte access per 16 bytes on the vector path (p aligned
// and count == N there), element accesses otherwise.
template <class T, int N, bool kVec>
__device__ __forceinline__ Vec<T, N> load_part(const T* p, int count) {
  if constexpr (kVec) {
    return detail::load_raw<T, N, true>(p);
  } else {
    Vec<T, N> v;
#pragma unroll
    for (int j = 0; j < N; ++j) v.v[j] = j < count ? p[j] : from_float<T>(0.f);
    return v;
  }
}

template <class T, int N, bool kVec>
__device__ __forceinline__ void store_part(T* p, const Vec<T, N>& v, int count) {
  if constexpr (kVec) {
    detail::store_raw<T, N>(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (j < count) p[j] = v.v[j];
    }
  }
}

// Table values of pairs [pair0, pair0 + NP) at row `position`; pairs >= half (a GPT-J chunk
// straddling R) are not read.
template <class TT, int NP>
__device__ __forceinline__ void load_table(const void* table, std::int64_t row_stride,
                                           std::int64_t position, std::int64_t pair0,
                                           std::int64_t half, bool vec, float (&out)[NP]) {
  const TT* p = static_cast<const TT*>(table) + position * row_stride + pair0;
  if constexpr (sizeof(TT) * NP % 16 == 0) {
    if (vec && pair0 + NP <= half) {
      detail::load_floats<TT, NP, false>(p, out);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < NP; ++j) out[j] = pair0 + j < half ? to_float(__ldg(p + j)) : 0.f;
}

// cos and direction-signed sin of pairs [pair0, pair0 + NP) at `position`.
template <class T, int NP>
__device__ __forceinline__ void rotation(const RopeArgs& a, std::int64_t position,
                                         std::int64_t pair0, float (&c)[NP], float (&s)[NP]) {
  const std::int64_t half = a.rotary_dim / 2;
  if (a.cos != nullptr) {
    if (a.table_f32) {
      load_table<float, NP>(a.cos, a.cos_stride, position, pair0, half, a.table_vec, c);
      load_table<float, NP>(a.sin, a.sin_stride, position, pair0, half, a.table_vec, s);
    } else {
      load_table<T, NP>(a.cos, a.cos_stride, position, pair0, half, a.table_vec, c);
      load_table<T, NP>(a.sin, a.sin_stride, position, pair0, half, a.table_vec, s);
    }
  } else {
    // angle / pi, reduced to [-1, 1] exactly in double (u - 2 rint(u / 2)), then sincospif:
    // no large-argument path, and the only float rounding is that of the reduced value.
    constexpr double kInvPi = 0.31830988618379067;
    const double pos = static_cast<double>(position);
    double inv_freq_over_pi = exp2(-static_cast<double>(pair0) * a.log2_freq_step) * kInvPi;
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      const double u = pos * inv_freq_over_pi;
      const double reduced = fma(-2.0, rint(0.5 * u), u);
      sincospif(static_cast<float>(reduced), &s[j], &c[j]);
      inv_freq_over_pi *= a.freq_ratio;
    }
  }
#pragma unroll
  for (int j = 0; j < NP; ++j) s[j] *= a.sin_sign;
}

template <class T>
__device__ __forceinline__ T rotate_first(T x0, T x1, float c, float s) {
  const float f0 = to_float(x0), f1 = to_float(x1);
  return from_float<T>(fmaf(f0, c, -f1 * s));
}
template <class T>
__device__ __forceinline__ T rotate_second(T x0, T x1, float c, float s) {
  const float f0 = to_float(x0), f1 = to_float(x1);
  return from_float<T>(fmaf(f0, s, f1 * c));
}

// Batch and sequence index of a token.
struct TokenIndex {
  std::int64_t b, s;
};

// Token `first` + `offset` (offset >= 0) given first's index. No 64-bit division: its
// subroutine, called where the tile's loads are in flight, raised the kernel's register count.
__device__ __forceinline__ TokenIndex token_after(const RopeArgs& a, TokenIndex first,
                                                  int offset) {
  TokenIndex t{first.b, first.s + offset};
  if (t.s >= a.seq) {
    // offset < seq: first.s < seq, so one batch further; else seq <= offset < 2^31 and
    // t.s < seq + offset < 2^32.
    const std::int64_t carry =
        offset < a.seq ? 1
                       : static_cast<std::uint32_t>(t.s) / static_cast<std::uint32_t>(a.seq);
    t.b += carry;
    t.s -= carry * a.seq;
  }
  return t;
}

__device__ __forceinline__ std::int64_t position_of(const RopeArgs& a, TokenIndex t) {
  if (a.offsets == nullptr) return t.s;
  return t.s + (a.offsets_i64
                    ? __ldg(static_cast<const long long*>(a.offsets) + t.b * a.offsets_stride)
                    : __ldg(static_cast<const int*>(a.offsets) + t.b * a.offsets_stride));
}

// cos and signed sin of every pair of `tokens` tokens from `first` into [token][angle_row]
// tables (pairs past R/2, the row padding, hold 0).
template <class T>
__device__ __forceinline__ void fill_angle_table(const RopeArgs& a, TokenIndex first, int tokens,
                                                 float* cos_table, float* sin_table) {
  const int half = static_cast<int>(a.rotary_dim / 2);
  const int entries = tokens * a.angle_row;
  for (int e = threadIdx.x; e < entries; e += kBlock) {
    const int token = e / a.angle_row;
    const int pair = e - token * a.angle_row;
    float c[1] = {0.f}, sn[1] = {0.f};
    if (pair < half) rotation<T, 1>(a, position_of(a, token_after(a, first, token)), pair, c, sn);
    cos_table[e] = c[0];
    sin_table[e] = sn[0];
  }
}

// NP consecutive floats of shared memory at p (p aligned to NP floats).
template <int NP>
__device__ __forceinline__ void load_shared(const float* p, float (&out)[NP]) {
  const Vec<float, NP> v = *reinterpret_cast<const Vec<float, NP>*>(p);
#pragma unroll
  for (int j = 0; j < NP; ++j) out[j] = v.v[j];
}

// N: elements per chunk access; kVec: 16-byte accesses (N * sizeof(T) == 16); kSharedAngles:
// angles from the tile's shared table (else computed per thread).
template <class T, RopeStyle kStyle, int N, bool kVec, bool kSharedAngles>
__global__ void __launch_bounds__(kBlock, kMinBlocksPerSm) rope_kernel(const RopeArgs a) {
  static_assert(!kVec || N * static_cast<int>(sizeof(T)) == 16);
  static_assert(kStyle == RopeStyle::kNeox || N % 2 == 0);
  constexpr bool kNeox = kStyle == RopeStyle::kNeox;
  constexpr int NP = kNeox ? N : N / 2;  // pairs per chunk
  static_assert(kAngleRowAlign % NP == 0);
  extern __shared__ __align__(32) float angle_table[];  // cos [table_tokens][angle_row], then sin
  float* const cos_table = angle_table;
  float* const sin_table = angle_table + a.table_tokens * a.angle_row;
  const std::int64_t half = a.rotary_dim / 2;
  const std::int64_t tiles = (a.items + kBlock - 1) / kBlock;
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    // The tile's first token, and this thread's item as (token offset, head group, chunk).
    const std::int64_t first_item = tile * kBlock;
    const std::int64_t first_token_id = first_item / a.items_per_token;
    const TokenIndex first_token{first_token_id / a.seq, first_token_id % a.seq};
    const int first_local = static_cast<int>(first_item - first_token_id * a.items_per_token);
    const int tile_items = static_cast<int>(std::min<std::int64_t>(kBlock, a.items - first_item));
    const bool active = static_cast<int>(threadIdx.x) < tile_items;
    const int local = first_local + static_cast<int>(threadIdx.x);
    const int token = local / a.items_per_token;
    const int within = local - token * a.items_per_token;
    const int group = within / a.chunks;
    const int chunk = within - group * a.chunks;
    const TokenIndex t = token_after(a, first_token, token);

    // e0: first element of the chunk in the head; NeoX's partner range starts at e0 + half.
    bool rotated;
    std::int64_t e0, pair0;
    if constexpr (kNeox) {
      rotated = chunk < a.rot_chunks;
      e0 = rotated ? chunk * N : a.rotary_dim + static_cast<std::int64_t>(chunk - a.rot_chunks) * N;
      pair0 = chunk * N;
    } else {
      e0 = static_cast<std::int64_t>(chunk) * N;
      rotated = e0 < a.rotary_dim;
      pair0 = e0 / 2;
    }
    // Elements of the chunk inside the head (N except for the scalar GPT-J chunk at an odd D).
    const int count = kVec ? N : static_cast<int>(std::min<std::int64_t>(N, a.head_dim - e0));

    Vec<T, N> x0[kHeadsPerThread], x1[kNeox ? kHeadsPerThread : 1];
    T* out[kHeadsPerThread];
#pragma unroll
    for (int j = 0; j < kHeadsPerThread; ++j) {
      out[j] = nullptr;
      const std::int64_t h = static_cast<std::int64_t>(group) * kHeadsPerThread + j;
      if (!active || h >= a.heads) continue;
      // Field by field, so the kernel parameters are never addressed dynamically.
      const bool is_k = h >= a.q_heads;
      if (!rotated && (is_k ? a.k.in_place : a.q.in_place)) continue;  // tail untouched in place
      const std::int64_t hh = is_k ? h - a.q_heads : h;
      const std::int64_t in_offset =
          t.b * (is_k ? a.k.in_stride[0] : a.q.in_stride[0]) +
          t.s * (is_k ? a.k.in_stride[1] : a.q.in_stride[1]) +
          hh * (is_k ? a.k.in_stride[2] : a.q.in_stride[2]) + e0;
      const std::int64_t out_offset =
          t.b * (is_k ? a.k.out_stride[0] : a.q.out_stride[0]) +
          t.s * (is_k ? a.k.out_stride[1] : a.q.out_stride[1]) +
          hh * (is_k ? a.k.out_stride[2] : a.q.out_stride[2]) + e0;
      const T* in = static_cast<const T*>(is_k ? a.k.in : a.q.in) + in_offset;
      out[j] = static_cast<T*>(is_k ? a.k.out : a.q.out) + out_offset;
      x0[j] = load_part<T, N, kVec>(in, count);
      if constexpr (kNeox) {
        if (rotated) x1[j] = load_part<T, N, kVec>(in + half, count);
      }
    }

    // Every thread of the block fills the table, whatever its own item.
    if constexpr (kSharedAngles) {
      const int tile_tokens = (first_local + tile_items - 1) / a.items_per_token + 1;
      fill_angle_table<T>(a, first_token, tile_tokens, cos_table, sin_table);
      __syncthreads();
    }

    if (active && rotated) {
      float c[NP], sn[NP];
      if constexpr (kSharedAngles) {
        const int row = token * a.angle_row + static_cast<int>(pair0);
        load_shared<NP>(cos_table + row, c);
        load_shared<NP>(sin_table + row, sn);
      } else {
        rotation<T, NP>(a, position_of(a, t), pair0, c, sn);
      }
      // Rotated in place, pair by pair over the heads: each cos / sin is needed only while its
      // pair is rotated (GPT-J elements at or beyond R keep their bits).
#pragma unroll
      for (int p = 0; p < NP; ++p) {
#pragma unroll
        for (int j = 0; j < kHeadsPerThread; ++j) {
          T& first = x0[j].v[kNeox ? p : 2 * p];
          T& second = kNeox ? x1[j].v[p] : x0[j].v[2 * p + 1];
          if (kNeox || e0 + 2 * p < a.rotary_dim) {
            const T first_in = first, second_in = second;
            first = rotate_first(first_in, second_in, c[p], sn[p]);
            second = rotate_second(first_in, second_in, c[p], sn[p]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kHeadsPerThread; ++j) {
        if (out[j] == nullptr) continue;
        store_part<T, N, kVec>(out[j], x0[j], count);
        if constexpr (kNeox) store_part<T, N, kVec>(out[j] + half, x1[j], count);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kHeadsPerThread; ++j) {
        if (out[j] != nullptr) store_part<T, N, kVec>(out[j], x0[j], count);
      }
    }
    // The next tile refills the table (one tile per block: no next tile).
    if (kSharedAngles && tile + gridDim.x < tiles) __syncthreads();
  }
}

HeadTensor head_tensor(const TensorView& in, const TensorView& out) {
  HeadTensor t;
  if (!in.defined()) return t;
  t.in = in.data;
  t.out = out.data;
  for (int d = 0; d < 3; ++d) {
    t.in_stride[d] = in.stride(d);
    t.out_stride[d] = out.stride(d);
  }
  t.in_place = detail::same_view(in, out);
  return t;
}

// 16-byte accesses apply to a [B, S, H, D] view: aligned base, and every dim above the head dim
// that has more than one index steps in whole 16-byte vectors.
bool vector_layout(const TensorView& t) {
  if (!t.defined()) return true;
  const auto elem = static_cast<std::int64_t>(t.element_size());
  if (!detail::is_aligned(t.data, 16)) return false;
  for (int d = 0; d < t.ndim - 1; ++d) {
    if (t.size(d) > 1 && (t.stride(d) * elem) % 16 != 0) return false;
  }
  return true;
}

template <class T, RopeStyle kStyle, int N, bool kVec>
void launch(RopeArgs a, cudaStream_t stream, const char* op) {
  const std::int64_t d = a.head_dim, r = a.rotary_dim;
  const bool all_in_place = a.q.in_place && (a.k.in == nullptr || a.k.in_place);
  std::int64_t chunks = 0;
  if constexpr (kStyle == RopeStyle::kNeox) {
    a.rot_chunks = static_cast<int>(r / 2 / N);  // exact: N divides R/2 (N == 1 or checked)
    chunks = a.rot_chunks + (all_in_place ? 0 : (d - r) / N);
  } else {
    a.rot_chunks = 0;
    chunks = ((all_in_place ? r : d) + N - 1) / N;
  }
  const std::int64_t head_groups = (a.heads + kHeadsPerThread - 1) / kHeadsPerThread;
  const std::int64_t items_per_token = head_groups * chunks;
  if (items_per_token == 0) return;
  // Item indices inside a tile's tokens are ints.
  if (items_per_token > std::numeric_limits<int>::max() - kBlock) {
    detail::throw_op_error(op, "a token of " + std::to_string(a.heads) + " heads of " +
                                   std::to_string(d) + " elements is more work items than the "
                                   "CUDA kernel indexes (2^31)");
  }
  a.chunks = static_cast<int>(chunks);
  a.items_per_token = static_cast<int>(items_per_token);
  a.items = a.tokens * items_per_token;
  // The shared angle table: rows of R/2 pairs (padded) for the tokens a tile of kBlock
  // consecutive items can touch.
  const std::int64_t table_tokens =
      std::min<std::int64_t>(a.tokens, (kBlock - 1) / items_per_token + 2);
  const std::int64_t angle_row = (r / 2 + kAngleRowAlign - 1) / kAngleRowAlign * kAngleRowAlign;
  const std::int64_t table_bytes =
      2 * table_tokens * angle_row * static_cast<std::int64_t>(sizeof(float));
  const bool shared_angles = table_bytes <= kMaxAngleTableBytes;
  if (shared_angles) {
    a.table_tokens = static_cast<int>(table_tokens);
    a.angle_row = static_cast<int>(angle_row);
  }
  const std::int64_t grid = detail::grid_for_tiles(a.items, kBlock);
  if (shared_angles) {
    rope_kernel<T, kStyle, N, kVec, true>
        <<<static_cast<unsigned>(grid), kBlock, static_cast<std::size_t>(table_bytes), stream>>>(a);
  } else {
    rope_kernel<T, kStyle, N, kVec, false><<<static_cast<unsigned>(grid), kBlock, 0, stream>>>(a);
  }
  detail::check_launch(op);
}

}  // namespace

void rope_cuda(Direction direction, const TensorView& x_q, const TensorView& x_k, TensorView out_q,
               TensorView out_k, const TensorView& cos, const TensorView& sin,
               const TensorView& position_offsets, std::int64_t rotary_dim,
               const RopeOptions& options, cudaStream_t stream, RopeVariant variant) {
  const char* op = direction == Direction::kForward ? "rope_forward" : "rope_backward";
  RopeArgs a;
  a.q = head_tensor(x_q, out_q);
  a.k = head_tensor(x_k, out_k);
  a.q_heads = x_q.size(2);
  a.heads = a.q_heads + (x_k.defined() ? x_k.size(2) : 0);
  a.seq = x_q.size(1);
  a.head_dim = x_q.size(3);
  a.rotary_dim = rotary_dim;
  a.tokens = x_q.size(0) * a.seq;
  if (cos.defined()) {
    a.cos = cos.data;
    a.sin = sin.data;
    a.cos_stride = cos.stride(0);
    a.sin_stride = sin.stride(0);
    a.table_f32 = cos.dtype == DType::kFloat32;
    auto table_vec = [](const TensorView& t) {
      return detail::is_aligned(t.data, 16) &&
             (t.size(0) <= 1 || (t.stride(0) * static_cast<std::int64_t>(t.element_size())) % 16 == 0);
    };
    a.table_vec = table_vec(cos) && table_vec(sin);
  }
  if (position_offsets.defined()) {
    a.offsets = position_offsets.data;
    a.offsets_stride = position_offsets.stride(0);
    a.offsets_i64 = position_offsets.dtype == DType::kInt64;
  }
  if (rotary_dim > 0) {
    a.log2_freq_step = 2.0 * std::log2(options.theta) / static_cast<double>(rotary_dim);
    a.freq_ratio = std::exp2(-a.log2_freq_step);
  }
  a.sin_sign = direction == Direction::kForward ? 1.f : -1.f;
  if (a.tokens == 0 || a.heads == 0 || a.head_dim == 0) return;

  detail::dispatch_activation_dtype(x_q.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = detail::kVec16<T>;
    const bool dims_fit = a.head_dim % V == 0 &&
                          (options.style == RopeStyle::kGptJ || (rotary_dim / 2) % V == 0);
    const bool vec_fits = dims_fit && vector_layout(x_q) && vector_layout(out_q) &&
                          vector_layout(x_k) && vector_layout(out_k);
    if (variant == RopeVariant::kVector && !vec_fits) {
      detail::throw_op_error(op, "the vector variant needs 16-byte aligned views with 16-byte "
                                 "strides, a head dim in whole 16-byte vectors and, for NeoX, "
                                 "rotary_dim / 2 in whole vectors");
    }
    const bool vec = variant != RopeVariant::kScalar && vec_fits;
    if (options.style == RopeStyle::kNeox) {
      if (vec) {
        launch<T, RopeStyle::kNeox, V, true>(a, stream, op);
      } else {
        launch<T, RopeStyle::kNeox, 1, false>(a, stream, op);
      }
    } else {
      if (vec) {
        launch<T, RopeStyle::kGptJ, V, true>(a, stream, op);
      } else {
        launch<T, RopeStyle::kGptJ, 2, false>(a, stream, op);
      }
    }
  });
}

}  // namespace trainscale::ops::rope
