// The attention kernels' shape heuristics (attention_heuristics.h), on the CPU: every forward
// and backward plan fits the SM (shared memory, registers, thread count), and the persistent
// tile order visits every tile exactly once, keeps a section's heads together and, causal,
// starts with the query blocks that see the most keys.
#include "ops/attention/attention_heuristics.h"

#include <gtest/gtest.h>

#include <set>
#include <tuple>
#include <vector>

namespace trainscale::ops::attention {
namespace {

TEST(AttentionHeuristics, PlansFitAnH100) {
  for (std::int64_t d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      const ForwardPlan p = forward_plan(d, causal);
      SCOPED_TRACE("D=" + std::to_string(d) + (causal ? " causal" : ""));
      ASSERT_TRUE(p.supported());
      EXPECT_EQ(p.head_dim, d);
      EXPECT_EQ(p.masked, causal);
      EXPECT_EQ(p.block_m, 64 * p.consumer_warpgroups);
      EXPECT_EQ(p.block_n % 16, 0);
      EXPECT_LE(p.block_n, 256);  // one wgmma atom and one TMA box
      EXPECT_LE(p.block_m, 256);
      EXPECT_LE(p.threads(), 512);
      EXPECT_LE(forward_tile_bytes(p), 227 * 1024 - 1024);  // + barriers and alignment
      // Registers of tiles per consumer thread (64 rows each per warp group, 128 threads): the
      // fp32 score and output tiles, and with the overlap the 16-bit P of the previous block.
      const int score = 64 * p.block_n / 128;
      const int registers = score + 64 * static_cast<int>(d) / 128 + (p.overlap ? score / 2 : 0);
      EXPECT_LE(registers, p.consumer_warpgroups == 2 ? 200 : 128);
      EXPECT_EQ(p.overlap, d != 64);
    }
  }
  EXPECT_FALSE(forward_plan(32, false).supported());
  EXPECT_FALSE(forward_plan(96, true).supported());
  EXPECT_FALSE(forward_head_dim_supported(512));
  EXPECT_EQ(forward_plan(128, false).block_n, 176);
  EXPECT_EQ(forward_plan(128, true).block_n, 128);
}

// The backward's tiles: whole swizzle rows and MMA steps, and fp32 accumulators per thread of
// the dK/dV kernel (dK, dV, S, dP over 256 threads) and the dQ kernel (dQ, S, dP) that leave
// room for operands and addresses in 255 registers.
TEST(AttentionHeuristics, BackwardPlansFitTheRegisters) {
  for (std::int64_t d : {64, 128, 256}) {
    const BackwardPlan p = backward_plan(d);
    SCOPED_TRACE("D=" + std::to_string(d));
    ASSERT_TRUE(p.supported());
    ASSERT_TRUE(backward_head_dim_supported(d));
    EXPECT_EQ(p.head_dim, d);
    EXPECT_EQ(p.threads(), 256);
    EXPECT_EQ(p.block_m % 64, 0);
    EXPECT_EQ(p.block_n % 64, 0);
    EXPECT_EQ(p.dq_block_n % 64, 0);
    const std::int64_t dkdv = (2 * p.block_n * d + 2 * p.block_m * p.block_n) / p.threads();
    const std::int64_t dq = (p.block_m * d + 2 * p.block_m * p.dq_block_n) / p.threads();
    EXPECT_LE(dkdv, 192);
    EXPECT_LE(dq, 128);
  }
  EXPECT_FALSE(backward_plan(32).supported());
  EXPECT_FALSE(backward_head_dim_supported(96));
}

TEST(AttentionHeuristics, TileOrderVisitsEveryTileOnce) {
  for (bool causal : {false, true}) {
    for (auto [sq, b, hq, hkv, hps] : std::vector<std::tuple<int, int, int, int, int>>{
             {1, 1, 1, 1, 1}, {1000, 2, 8, 2, 3}, {129, 3, 5, 5, 5}, {16384, 1, 16, 16, 4}, {40, 2, 64, 64, 7}}) {
      TileOrder order;
      order.m_blocks = (sq + 127) / 128;
      order.heads = hq;
      order.batch = b;
      order.heads_per_section = hps;
      order.heaviest_first = causal;
      std::set<std::tuple<int, int, int>> seen;
      int last_section = -1, last_m = -1;
      for (std::int64_t t = 0; t < order.tiles(); ++t) {
        const AttentionTile tile = order.at(t);
        ASSERT_GE(tile.m_block, 0);
        ASSERT_LT(tile.m_block, order.m_blocks);
        ASSERT_GE(tile.head, 0);
        ASSERT_LT(tile.head, hq);
        ASSERT_GE(tile.batch, 0);
        ASSERT_LT(tile.batch, b);
        EXPECT_TRUE(seen.insert({tile.m_block, tile.head, tile.batch}).second) << "tile " << t << " twice";
        const int section = (tile.batch * hq + tile.head) / hps;
        EXPECT_GE(section, last_section) << "sections run one after the other";
        if (section != last_section) last_m = -1;
        // Within a section, query blocks change monotonically: descending when causal.
        if (last_m >= 0 && tile.m_block != last_m) {
          EXPECT_EQ(tile.m_block < last_m, causal) << "tile " << t;
        }
        last_section = section;
        last_m = tile.m_block;
      }
      EXPECT_EQ(static_cast<std::int64_t>(seen.size()), order.tiles());
    }
  }
}

// kStatic and kDynamic are obeyed; kAuto claims from the counter only for masked tiles heavy
// enough to repay it.
TEST(AttentionHeuristics, ForwardScheduleFollowsTheAskOrTheShape) {
  for (bool masked : {false, true}) {
    for (int d : {64, 128, 256}) {
      EXPECT_FALSE(forward_dynamic_schedule(AttentionSchedule::kStatic, masked, d, 16384));
      EXPECT_TRUE(forward_dynamic_schedule(AttentionSchedule::kDynamic, masked, d, 128));
      EXPECT_FALSE(forward_dynamic_schedule(AttentionSchedule::kAuto, false, d, 16384));
    }
  }
  EXPECT_TRUE(forward_dynamic_schedule(AttentionSchedule::kAuto, true, 128, 512));
  EXPECT_TRUE(forward_dynamic_schedule(AttentionSchedule::kAuto, true, 256, 4096));
  EXPECT_FALSE(forward_dynamic_schedule(AttentionSchedule::kAuto, true, 64, 4096));
  EXPECT_TRUE(forward_dynamic_schedule(AttentionSchedule::kAuto, true, 64, 8192));
}

TEST(AttentionHeuristics, SectionsHoldWhatFitsInL2) {
  const ForwardPlan plan = forward_plan(128, true);
  constexpr std::int64_t kL2 = 50 << 20;
  // S = 8k, D = 128, bf16: K + V of one kv head are 4 MiB, so half of L2 holds 6 of them.
  const std::int64_t kv_bytes = 2LL * 8192 * 128 * 2;
  TileOrder mha = forward_tile_order(8192, 2, 16, 16, kv_bytes, kL2, plan);
  EXPECT_EQ(mha.heads_per_section, 6);
  EXPECT_EQ(mha.m_blocks, 64);
  EXPECT_TRUE(mha.heaviest_first);
  // GQA 32/8: a section holds the query heads of the kv heads that fit.
  TileOrder gqa = forward_tile_order(8192, 1, 32, 8, kv_bytes, kL2, plan);
  EXPECT_EQ(gqa.heads_per_section, 24);
  // Never more than all heads, never fewer than one.
  EXPECT_EQ(forward_tile_order(128, 2, 4, 4, 1024, kL2, plan).heads_per_section, 8);
  EXPECT_EQ(forward_tile_order(1 << 20, 1, 4, 4, kL2 * 4, kL2, plan).heads_per_section, 1);
  EXPECT_FALSE(forward_tile_order(128, 1, 1, 1, 1, kL2, forward_plan(64, false)).heaviest_first);
  EXPECT_EQ(forward_grid(10, 132), 10);
  EXPECT_EQ(forward_grid(100000, 132), 132);
  EXPECT_EQ(forward_grid(0, 132), 1);
}

// The backward's workspace: row terms padded to whole query blocks; the Hopper kernel's lse, dQ
// accumulator and counters only for the head dims it has; every part 256-byte aligned.
TEST(AttentionHeuristics, BackwardWorkspaceParts) {
  const BackwardWorkspace w = backward_workspace(2, 3, 65, 128);  // 2 query blocks of 64
  EXPECT_EQ(w.m_blocks, 2);
  EXPECT_EQ(w.stats_len, 128);
  EXPECT_EQ(w.delta, 0u);
  EXPECT_EQ(w.lse_log2, 3072u);                 // 6 * 128 floats
  EXPECT_EQ(w.dq_semaphore, 6144u);
  EXPECT_EQ(w.dq_accum, 6144u + 256u);          // 12 counters, aligned
  EXPECT_EQ(w.bytes, 6400u + 6u * 128 * 128 * 4);
  for (std::size_t offset : {w.lse_log2, w.dq_semaphore, w.dq_accum, w.bytes}) EXPECT_EQ(offset % 256, 0u);
  const BackwardWorkspace d256 = backward_workspace(2, 3, 65, 256);  // the same blocks of 64 queries
  EXPECT_EQ(d256.stats_len, 128);
  EXPECT_EQ(d256.bytes, 6400u + 6u * 128 * 256 * 4);
  EXPECT_FALSE(backward_sm90_plan(96).supported());
  const BackwardWorkspace d96 = backward_workspace(2, 3, 65, 96);  // no Hopper kernel: delta only
  EXPECT_EQ(d96.stats_len, 65);
  EXPECT_EQ(d96.bytes, 1792u);  // 6 * 65 floats, to a multiple of 256
  EXPECT_EQ(backward_workspace(1, 1, 0, 64).bytes, 0u);
}

// The Hopper backward's CTA numbering: every (batch, kv head, key block) once in either order; a
// head's key blocks in increasing order (the deterministic dQ order waits on earlier ones); with
// key blocks outermost the first CTAs are every head's key block 0 (the heaviest under causal).
TEST(AttentionHeuristics, BackwardCtaOrder) {
  const int n_blocks = 5, kv_heads = 3, batch = 2;
  for (bool key_blocks_outermost : {false, true}) {
    std::vector<int> seen(n_blocks * kv_heads * batch, 0);
    std::vector<int> last_block(kv_heads * batch, -1);
    for (int i = 0; i < n_blocks * kv_heads * batch; ++i) {
      const BackwardCta c = backward_cta(i, n_blocks, kv_heads, batch, key_blocks_outermost);
      ASSERT_GE(c.batch, 0);
      ASSERT_LT(c.batch, batch);
      ASSERT_GE(c.kv_head, 0);
      ASSERT_LT(c.kv_head, kv_heads);
      ASSERT_GE(c.n_block, 0);
      ASSERT_LT(c.n_block, n_blocks);
      const int head = c.batch * kv_heads + c.kv_head;
      ++seen[head * n_blocks + c.n_block];
      EXPECT_GT(c.n_block, last_block[head]) << "CTA " << i;
      last_block[head] = c.n_block;
      if (key_blocks_outermost && i < kv_heads * batch) {
        EXPECT_EQ(c.n_block, 0);
      }
      if (!key_blocks_outermost && i < n_blocks) {
        EXPECT_EQ(head, 0);
      }
    }
    for (int count : seen) EXPECT_EQ(count, 1);
  }
  EXPECT_TRUE(backward_key_blocks_outermost(true, 528, 132));
  EXPECT_FALSE(backward_key_blocks_outermost(true, 529, 132));
  EXPECT_FALSE(backward_key_blocks_outermost(false, 64, 132));
}

}  // namespace
}  // namespace trainscale::ops::attention
