// RoPE forward / backward: q and k rotated in one launch.
//
// Work item = (token, group of kHeadsPerThread heads, chunk of the head dim). Heads run over q's
// Hq heads, then k's Hk heads, so one launch covers both tensors. A thread computes the cos / sin
// of its chunk's pairs once per item (from the tables or from theta) and applies them to every
// head of its group; it loads all of the group's vectors before it stores any. Each thread owns
// whole rotation pairs (for NeoX: the chunk's vector in the first half of the rotary dims and the
// matching vector R/2 further on), so an output may be its input's exact view (in place).
//
// Chunks, of N elements (16 bytes on the vector path, 1 or 2 elements on the scalar path):
//   NeoX: chunks [0, R / 2N) rotate pairs (i, i + R/2) for i in [cN, cN + N); the following
//         (D - R) / N chunks copy the tail dims [R, D).
//   GPT-J: chunk c holds elements [cN, cN + N) of the head, pairs (2i, 2i + 1) inside it; its
//         elements below R rotate, the rest are copied (N is even, so no pair straddles chunks).
// In place, chunks of tail dims only are skipped (those dims stay untouched); a GPT-J chunk that
// straddles R writes its tail elements back with their own bits.
//
// Angles from theta: inv_freq_i = theta^(-2i/R) and angle / pi = position * inv_freq_i / pi are
// formed in double and reduced modulo 2 exactly; only the reduced value (in [-1, 1]) is rounded
// to float, for sincospif.
// A float angle would be off by up to half an ulp of the angle (2^-11 rad at position 8192), and a
// float inv_freq by ~1e-7 relative, which at 8192 rad is ~1e-3 rad: far beyond float32's 1e-5.
// The double work is a handful of instructions per pair, shared by the kHeadsPerThread heads.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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
constexpr int kHeadsPerThread = 4;

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
  std::int64_t chunks = 0;      // per head
  std::int64_t rot_chunks = 0;  // NeoX: chunks that rotate; the rest copy the tail
  std::int64_t head_groups = 0;
  std::int64_t items = 0;  // tokens * head_groups * chunks
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

// N: elements per chunk access; kVec: 16-byte accesses (N * sizeof(T) == 16).
template <class T, RopeStyle kStyle, int N, bool kVec>
__global__ void __launch_bounds__(kBlock) rope_kernel(const RopeArgs a) {
  static_assert(!kVec || N * static_cast<int>(sizeof(T)) == 16);
  static_assert(kStyle == RopeStyle::kNeox || N % 2 == 0);
  constexpr bool kNeox = kStyle == RopeStyle::kNeox;
  constexpr int NP = kNeox ? N : N / 2;  // pairs per chunk
  const std::int64_t half = a.rotary_dim / 2;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kBlock;
  for (std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kBlock + threadIdx.x;
       item < a.items; item += stride) {
    const std::int64_t chunk = item % a.chunks;
    const std::int64_t rest = item / a.chunks;
    const std::int64_t group = rest % a.head_groups;
    const std::int64_t token = rest / a.head_groups;
    const std::int64_t b = token / a.seq;
    const std::int64_t s = token - b * a.seq;

    std::int64_t position = s;
    if (a.offsets != nullptr) {
      position += a.offsets_i64
                      ? __ldg(static_cast<const long long*>(a.offsets) + b * a.offsets_stride)
                      : __ldg(static_cast<const int*>(a.offsets) + b * a.offsets_stride);
    }

    // e0: first element of the chunk in the head; NeoX's partner range starts at e0 + half.
    bool rotated;
    std::int64_t e0, pair0;
    if constexpr (kNeox) {
      rotated = chunk < a.rot_chunks;
      e0 = rotated ? chunk * N : a.rotary_dim + (chunk - a.rot_chunks) * N;
      pair0 = chunk * N;
    } else {
      e0 = chunk * N;
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
      const std::int64_t h = group * kHeadsPerThread + j;
      if (h >= a.heads) continue;
      // Field by field, so the kernel parameters are never addressed dynamically.
      const bool is_k = h >= a.q_heads;
      if (!rotated && (is_k ? a.k.in_place : a.q.in_place)) continue;  // tail untouched in place
      const std::int64_t hh = is_k ? h - a.q_heads : h;
      const std::int64_t in_offset =
          b * (is_k ? a.k.in_stride[0] : a.q.in_stride[0]) +
          s * (is_k ? a.k.in_stride[1] : a.q.in_stride[1]) +
          hh * (is_k ? a.k.in_stride[2] : a.q.in_stride[2]) + e0;
      const std::int64_t out_offset =
          b * (is_k ? a.k.out_stride[0] : a.q.out_stride[0]) +
          s * (is_k ? a.k.out_stride[1] : a.q.out_stride[1]) +
          hh * (is_k ? a.k.out_stride[2] : a.q.out_stride[2]) + e0;
      const T* in = static_cast<const T*>(is_k ? a.k.in : a.q.in) + in_offset;
      out[j] = static_cast<T*>(is_k ? a.k.out : a.q.out) + out_offset;
      x0[j] = load_part<T, N, kVec>(in, count);
      if constexpr (kNeox) {
        if (rotated) x1[j] = load_part<T, N, kVec>(in + half, count);
      }
    }

    if (!rotated) {
#pragma unroll
      for (int j = 0; j < kHeadsPerThread; ++j) {
        if (out[j] != nullptr) store_part<T, N, kVec>(out[j], x0[j], count);
      }
      continue;
    }

    float c[NP], sn[NP];
    rotation<T, NP>(a, position, pair0, c, sn);

#pragma unroll
    for (int j = 0; j < kHeadsPerThread; ++j) {
      if (out[j] == nullptr) continue;
      if constexpr (kNeox) {
        Vec<T, N> y0, y1;
#pragma unroll
        for (int p = 0; p < N; ++p) {
          y0.v[p] = rotate_first(x0[j].v[p], x1[j].v[p], c[p], sn[p]);
          y1.v[p] = rotate_second(x0[j].v[p], x1[j].v[p], c[p], sn[p]);
        }
        store_part<T, N, kVec>(out[j], y0, count);
        store_part<T, N, kVec>(out[j] + half, y1, count);
      } else {
        Vec<T, N> y = x0[j];  // elements at or beyond R keep their bits
#pragma unroll
        for (int p = 0; p < NP; ++p) {
          if (e0 + 2 * p < a.rotary_dim) {
            y.v[2 * p] = rotate_first(x0[j].v[2 * p], x0[j].v[2 * p + 1], c[p], sn[p]);
            y.v[2 * p + 1] = rotate_second(x0[j].v[2 * p], x0[j].v[2 * p + 1], c[p], sn[p]);
          }
        }
        store_part<T, N, kVec>(out[j], y, count);
      }
    }
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
  if constexpr (kStyle == RopeStyle::kNeox) {
    a.rot_chunks = r / 2 / N;  // exact: N divides R/2 (N == 1 or checked by the caller)
    a.chunks = a.rot_chunks + (all_in_place ? 0 : (d - r) / N);
  } else {
    a.rot_chunks = 0;
    a.chunks = ((all_in_place ? r : d) + N - 1) / N;
  }
  a.items = a.items * a.head_groups * a.chunks;  // a.items holds the token count on entry
  if (a.items == 0) return;
  auto kernel = rope_kernel<T, kStyle, N, kVec>;
  const std::int64_t grid = detail::grid_for_tiles(a.items, kBlock);
  kernel<<<static_cast<unsigned>(grid), kBlock, 0, stream>>>(a);
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
  a.head_groups = (a.heads + kHeadsPerThread - 1) / kHeadsPerThread;
  a.items = x_q.size(0) * a.seq;  // tokens; launch() multiplies in groups and chunks
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
  if (a.items == 0 || a.heads == 0 || a.head_dim == 0) return;

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
