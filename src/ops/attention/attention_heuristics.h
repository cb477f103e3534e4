// Shape heuristics of the attention kernels, as pure functions of the shape, so that the CPU
// tests check them and the kernels' template arguments come from the same table
// (attention_fwd_hdim*.cu / attention_bwd_hdim*.cu instantiate exactly the plans forward_plan /
// backward_plan return).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "trainscale/attention.h"

#if defined(__CUDACC__)
#define TS_ATTN_HOST_DEVICE __host__ __device__
#else
#define TS_ATTN_HOST_DEVICE
#endif

namespace trainscale::ops::attention {

// One compiled variant of the forward kernel: a CTA computes block_m query rows of one head
// against all the keys it sees, block_n keys at a time, with `stages` K/V buffers in flight.
// consumer_warpgroups = block_m / 64 warp groups run the MMAs and softmax (64 rows each); one
// more warp group issues the TMA loads.
struct ForwardPlan {
  int head_dim = 0;  // 0: no kernel for this head dim
  int block_m = 0;
  int block_n = 0;
  int stages = 0;
  int consumer_warpgroups = 0;
  bool masked = false;  // causal or a sliding window: tiles the mask cuts
  // The softmax of one key block runs while the tensor cores multiply the next block's scores and
  // the previous block's P V (attention_fwd_kernel.cuh); costs the registers of a second score tile.
  bool overlap = false;

  constexpr bool supported() const { return head_dim != 0; }
  constexpr int threads() const { return 128 * (consumer_warpgroups + 1); }
};

// Head dims with a CUDA kernel.
constexpr bool forward_head_dim_supported(std::int64_t head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// The variant for a head dim and mask. Tiles as FlashAttention-3 picks them for H100: the score
// tile (block_m x block_n fp32 accumulators) and the output tile (block_m x head_dim) must fit
// the consumer warp groups' registers, and Q plus `stages` K and V tiles the 227 KiB of shared
// memory. Unmasked head dim 128 takes wider key tiles (176: fewer softmax passes per key);
// masked (causal or a window) keeps 128 so the tiles on the mask's edges waste less. Head dim 64
// runs without the softmax overlap: its three consumer warp groups (160 registers each) spill
// with it, and measured 2-10 % slower (docs/perf/attention.md).
constexpr ForwardPlan forward_plan(std::int64_t head_dim, bool masked) {
  switch (head_dim) {
    case 64: return {64, 192, 128, 2, 3, masked, false};
    case 128: return {128, 128, masked ? 128 : 176, 2, 2, masked, true};
    case 256: return {256, 128, 80, 2, 2, masked, true};
    default: return {};
  }
}

// Shared memory of a plan's Q tile and K/V stages, in bytes (16-bit elements).
constexpr std::int64_t forward_tile_bytes(const ForwardPlan& p) {
  return 2LL * p.head_dim * (p.block_m + 2LL * p.stages * p.block_n);
}

// One compiled variant of the backward (attention_bwd_*.cuh): `warps` warps per CTA; the dK/dV
// kernel takes block_m queries at a time against its block_n keys, the dQ kernel dq_block_n keys
// at a time against its block_m queries. Both double-buffer the tiles they stream (Q and dO, or
// K and V). The dK/dV CTA keeps its dK and dV tiles (2 * block_n * D fp32) in registers beside
// the score and dP tiles (2 * block_m * block_n fp32): 64 x 128 keeps that at 192 floats per
// thread for D <= 128 (256 threads); D = 256 halves the key block (64 x 64: 160 floats). The dQ
// kernel streams two stages of K and V, which for D >= 128 fit shared memory only 64 keys wide.
// Shared memory: D = 64 about 97 KiB (every sm_80+ GPU), D = 128 up to 161 KiB (sm_80, sm_90),
// D = 256 up to 209 KiB (sm_90); the launcher says so on a GPU with less.
struct BackwardPlan {
  int head_dim = 0;  // 0: no kernel for this head dim
  int block_m = 0;
  int block_n = 0;
  int dq_block_n = 0;
  int warps = 0;

  constexpr bool supported() const { return head_dim != 0; }
  constexpr int threads() const { return 32 * warps; }
};

constexpr bool backward_head_dim_supported(std::int64_t head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

constexpr BackwardPlan backward_plan(std::int64_t head_dim) {
  switch (head_dim) {
    case 64: return {64, 64, 128, 128, 8};
    case 128: return {128, 64, 128, 64, 8};
    case 256: return {256, 64, 64, 64, 8};
    default: return {};
  }
}

// The Hopper backward (attention_bwd_sm90_*): a CTA of 2 consumer warp groups owns block_n keys
// and walks block_m queries at a time with `stages` Q / dO buffers in flight; dK and dV stay in
// registers. Up to D = 128 each warp group owns 64 keys (2 x 64 x D fp32 accumulators); D = 64
// takes 128 queries a step (its score tiles fit; half the steps, and each warp group's dQ product
// covers its own 64 queries and every column); at D = 256
// the CTA owns 64 keys and the warp groups split the head dim. The deterministic mode at D = 256
// runs the sm_80 kernels (the Hopper kernel adds dQ by atomics).
struct BackwardSm90Plan {
  int head_dim = 0;  // 0: no Hopper kernel for this head dim
  int block_m = 0;
  int block_n = 0;
  int stages = 0;

  constexpr bool supported() const { return head_dim != 0; }
};

constexpr BackwardSm90Plan backward_sm90_plan(std::int64_t head_dim) {
  switch (head_dim) {
    case 64: return {64, 128, 128, 2};
    case 128: return {128, 64, 128, 2};
    case 256: return {256, 64, 64, 2};
    default: return {};
  }
}

// The Hopper backward's CTAs: (batch, kv head, key block) from blockIdx.x. By default the kv
// heads are outermost, so the CTAs running together share their heads' Q and dO in L2. Under a
// causal mask key block n is seen by fewer query blocks the larger n is; when the grid is only a
// few waves (backward_key_blocks_outermost), the last heads' heaviest CTAs would start last and
// run alone, so key blocks go outermost: every head's heaviest CTAs start in the first wave, the
// lightest fill the tail. Either way a key block's CTA starts after every earlier key block's CTA
// of its head, which the deterministic dQ order waits on.
struct BackwardCta {
  int batch, kv_head, n_block;
};

// Key blocks outermost for a causal-like mask (a bounded right side) on a grid of at most four
// waves. Measured on an H100 (docs/perf/attention.md): 1 x 32 x 8 x 8192 causal (512 CTAs) 3.38
// against 4.15 ms; on grids of 8+ waves key blocks outermost lost up to 1.5x (their CTAs read
// every head's Q and dO at once, more than L2 holds).
constexpr bool backward_key_blocks_outermost(bool right_bounded, std::int64_t ctas, int sm_count) {
  return right_bounded && ctas <= 4 * static_cast<std::int64_t>(sm_count);
}

TS_ATTN_HOST_DEVICE inline BackwardCta backward_cta(std::int64_t index, int n_blocks, int kv_heads, int batch,
                                                    bool key_blocks_outermost) {
  if (key_blocks_outermost) {
    const std::int64_t heads = static_cast<std::int64_t>(kv_heads) * batch;
    const std::int64_t head = index % heads;
    return {static_cast<int>(head / kv_heads), static_cast<int>(head % kv_heads), static_cast<int>(index / heads)};
  }
  return {static_cast<int>(index / n_blocks / kv_heads), static_cast<int>(index / n_blocks % kv_heads),
          static_cast<int>(index % n_blocks)};
}

// The backward's workspace, byte offsets into it (each 256-byte aligned): the fp32 row terms
// delta [B, Hq, stats_len]; for a head dim with a Hopper kernel also lse * log2(e) in the same
// layout, the fp32 dQ accumulator [B, Hq, m_blocks, block_m x D] and one int32 counter per
// (batch, query head, query block) for the deterministic order. stats_len is Sq rounded up to
// whole query blocks (the Hopper kernel loads whole blocks of row terms).
struct BackwardWorkspace {
  std::int64_t stats_len = 0;
  std::int64_t m_blocks = 0;
  std::size_t delta = 0, lse_log2 = 0, dq_accum = 0, dq_semaphore = 0;
  std::size_t bytes = 0;
};

inline BackwardWorkspace backward_workspace(std::int64_t batch, std::int64_t q_heads, std::int64_t q_len,
                                            std::int64_t head_dim) {
  constexpr std::size_t kAlign = 256;
  auto aligned = [](std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; };
  const BackwardSm90Plan plan = backward_sm90_plan(head_dim);
  const std::int64_t block_m = plan.supported() ? plan.block_m : 1;
  BackwardWorkspace w;
  w.m_blocks = (q_len + block_m - 1) / block_m;
  w.stats_len = w.m_blocks * block_m;
  const auto rows = static_cast<std::size_t>(batch * q_heads * w.stats_len);
  w.delta = 0;
  w.bytes = aligned(rows * sizeof(float));
  if (plan.supported()) {
    w.lse_log2 = w.bytes;
    w.bytes += aligned(rows * sizeof(float));
    w.dq_semaphore = w.bytes;
    w.bytes += aligned(static_cast<std::size_t>(batch * q_heads * w.m_blocks) * sizeof(std::int32_t));
    w.dq_accum = w.bytes;
    w.bytes += aligned(rows * static_cast<std::size_t>(head_dim) * sizeof(float));
  }
  return w;
}

// One unit of work of the persistent scheduler: query block m_block of head h of batch b.
struct AttentionTile {
  int m_block, head, batch;
};

// The order in which the persistent CTAs take tiles; CTA c takes tiles c, c + grid, c + 2 grid...
// Heads are cut into sections of `heads_per_section` (batch, head) pairs whose K/V fit in a share
// of L2; a section's tiles run together, query blocks outermost, so the CTAs working at one time
// read the same few heads' K/V. Query heads sharing a kv head are adjacent. With a causal mask the
// query blocks go last to first: the ones that see the most keys start first, the short ones fill
// the tail.
struct TileOrder {
  int m_blocks = 0;
  int heads = 0;  // query heads
  int batch = 0;
  int heads_per_section = 1;
  bool heaviest_first = false;

  TS_ATTN_HOST_DEVICE std::int64_t tiles() const {
    return static_cast<std::int64_t>(m_blocks) * heads * batch;
  }

  TS_ATTN_HOST_DEVICE AttentionTile at(std::int64_t t) const {
    const std::int64_t section_tiles = static_cast<std::int64_t>(m_blocks) * heads_per_section;
    const std::int64_t section = t / section_tiles;
    const std::int64_t r = t - section * section_tiles;
    const std::int64_t first = section * heads_per_section;
    const std::int64_t total = static_cast<std::int64_t>(heads) * batch;
    const std::int64_t in_section =
        total - first < heads_per_section ? total - first : heads_per_section;
    const std::int64_t m = r / in_section;
    const std::int64_t bh = first + (r - m * in_section);
    const int m_block = heaviest_first ? m_blocks - 1 - static_cast<int>(m) : static_cast<int>(m);
    return {m_block, static_cast<int>(bh % heads), static_cast<int>(bh / heads)};
  }
};

// Sections sized so one section's K and V take at most half of L2 (the rest holds Q, O and the
// other section's tail). kv_bytes_per_head: 2 * Sk * D * element size of one kv head.
inline TileOrder forward_tile_order(std::int64_t q_len, std::int64_t batch, std::int64_t q_heads,
                                    std::int64_t kv_heads, std::int64_t kv_bytes_per_head,
                                    std::int64_t l2_bytes, const ForwardPlan& plan) {
  TileOrder order;
  order.m_blocks = static_cast<int>((q_len + plan.block_m - 1) / plan.block_m);
  order.heads = static_cast<int>(q_heads);
  order.batch = static_cast<int>(batch);
  order.heaviest_first = plan.masked;
  const std::int64_t group = q_heads / std::max<std::int64_t>(kv_heads, 1);
  const std::int64_t kv_heads_fit =
      std::max<std::int64_t>(1, (l2_bytes / 2) / std::max<std::int64_t>(kv_bytes_per_head, 1));
  order.heads_per_section = static_cast<int>(
      std::clamp<std::int64_t>(kv_heads_fit * group, 1, std::max<std::int64_t>(1, q_heads * batch)));
  return order;
}

// Whether the forward's persistent grid claims its tiles from a counter (TileScheduler). kAuto
// claims when a mask makes tile costs uneven and the tiles are heavy enough to repay the counter
// (a memset and one atomic per tile): head dim 128 and 256 at any length, head dim 64 from 8192
// queries. Unmasked tiles cost alike, and the counter only adds to them (docs/perf/attention.md,
// "Scheduler", has the measurements behind the rule).
constexpr bool forward_dynamic_schedule(AttentionSchedule schedule, bool masked, int head_dim,
                                        std::int64_t q_len) {
  if (schedule != AttentionSchedule::kAuto) return schedule == AttentionSchedule::kDynamic;
  return masked && (head_dim >= 128 || q_len >= 8192);
}

// CTAs of the persistent grid: one per SM (a CTA fills an SM's shared memory), at most one per tile.
inline std::int64_t forward_grid(std::int64_t tiles, int sm_count) {
  return std::clamp<std::int64_t>(tiles, 1, std::max(sm_count, 1));
}

}  // namespace trainscale::ops::attention
