// Which keys a query sees: the one definition of the attention mask, used by the CPU reference
// and the CUDA kernels alike (host and device).
//
// Query i of q_len and key j of kv_len are aligned bottom-right: query i sits at key position
// i + (kv_len - q_len). It sees key j iff
//   i + offset - left <= j <= i + offset + right      (offset = kv_len - q_len)
// with left / right < 0 meaning unbounded on that side; causal is right = 0. Ranges are clamped
// to the keys and queries that exist, and may be empty (a query that sees no key).
#pragma once

#include <cstdint>

#include "trainscale/attention.h"

#if defined(__CUDACC__)
#define TRAINSCALE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TRAINSCALE_HOST_DEVICE inline
#endif

namespace trainscale::ops::attention {

template <class Int>
struct AttentionMask {
  Int q_len, kv_len;
  Int left, right;  // window sides; < 0: unbounded

  TRAINSCALE_HOST_DEVICE Int offset() const { return kv_len - q_len; }
  TRAINSCALE_HOST_DEVICE bool masks() const { return left >= 0 || right >= 0; }

  // Query i sees keys [key_begin(i), key_end(i)).
  TRAINSCALE_HOST_DEVICE Int key_begin(Int i) const {
    return left < 0 ? Int(0) : clamp(i + offset() - left, Int(0), kv_len);
  }
  TRAINSCALE_HOST_DEVICE Int key_end(Int i) const {
    return right < 0 ? kv_len : clamp(i + offset() + right + 1, Int(0), kv_len);
  }
  // Key j is seen by queries [query_begin(j), query_end(j)): the inverse of the above.
  TRAINSCALE_HOST_DEVICE Int query_begin(Int j) const {
    return right < 0 ? Int(0) : clamp(j - offset() - right, Int(0), q_len);
  }
  TRAINSCALE_HOST_DEVICE Int query_end(Int j) const {
    return left < 0 ? q_len : clamp(j - offset() + left + 1, Int(0), q_len);
  }
  // The blocks of `block` queries holding a query that sees a key of [j0, j1) (j1 > j0): blocks
  // [first, first + count), count 0 when none (the Hopper backward's loop over query blocks).
  struct Blocks {
    Int first, count;
  };
  TRAINSCALE_HOST_DEVICE Blocks query_blocks(Int j0, Int j1, Int block) const {
    const Int begin = query_begin(j0), end = query_end(j1 - 1);
    if (end <= begin) return {Int(0), Int(0)};
    return {begin / block, (end + block - 1) / block - begin / block};
  }
  TRAINSCALE_HOST_DEVICE bool sees(Int i, Int j) const {
    return j >= key_begin(i) && j < key_end(i);
  }

 private:
  TRAINSCALE_HOST_DEVICE static Int clamp(Int x, Int lo, Int hi) { return x < lo ? lo : (x > hi ? hi : x); }
};

// The mask the options stand for: causal is a right side of 0.
template <class Int>
TRAINSCALE_HOST_DEVICE AttentionMask<Int> make_attention_mask(Int q_len, Int kv_len, bool causal,
                                                              Int window_left, Int window_right) {
  return {q_len, kv_len, window_left, causal ? Int(0) : window_right};
}

// The options' mask in a kernel's 32-bit indices. A window side at least as long as the sequence
// it reaches across hides nothing (the mask clamps it), so it becomes unbounded; the mask's sums
// then stay below Sq + Sk, which the callers keep below 2^31.
inline AttentionMask<int> kernel_attention_mask(std::int64_t q_len, std::int64_t kv_len,
                                                const AttentionOptions& options) {
  const AttentionMask<std::int64_t> mask = make_attention_mask<std::int64_t>(
      q_len, kv_len, options.causal, options.window_left, options.window_right);
  return {static_cast<int>(q_len), static_cast<int>(kv_len), mask.left >= kv_len ? -1 : static_cast<int>(mask.left),
          mask.right >= q_len ? -1 : static_cast<int>(mask.right)};
}

// Whether the options mask anything beyond the ends of the sequences (causal or a window).
inline bool attention_is_masked(const AttentionOptions& options) {
  return options.causal || options.window_left >= 0 || options.window_right >= 0;
}

}  // namespace trainscale::ops::attention

#undef TRAINSCALE_HOST_DEVICE
