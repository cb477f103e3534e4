// The norm kernels' shape heuristics (src/ops/norm/norm_plan.h), checked on the CPU: the
// variant each shape gets, the row splits and the shared-memory limits, as documented there.
#include "ops/norm/norm_plan.h"

#include <gtest/gtest.h>

#include "trainscale/error.h"

namespace trainscale::ops::norm {
namespace {

// The H100's shared memory per block (opt-in).
constexpr std::size_t kH100Shared = 232448;

// A problem on an H100 (bulk copies).
ForwardProblem bf16(Kind kind, std::int64_t rows, std::int64_t cols, int residual_bytes = 0) {
  return {.kind = kind, .rows = rows, .cols = cols, .element_bytes = 2,
          .residual_bytes = residual_bytes, .aligned = true, .bulk_copies = true};
}

NormVariant auto_variant(const ForwardProblem& p) {
  return plan_forward(p, NormVariant::kAuto, kH100Shared).variant;
}

TEST(NormPlan, RowSplitTakesTheFewestThreadsThatCoverTheRow) {
  struct Expected {
    std::int64_t vecs;
    int threads, per_thread;
  };
  // 4 vectors per thread from 4 threads per row; up to 1024 threads.
  for (const Expected& e : {Expected{1, 1, 1}, Expected{2, 2, 1}, Expected{3, 4, 4},
                            Expected{16, 4, 4}, Expected{17, 8, 4}, Expected{128, 32, 4},
                            Expected{1024, 256, 4}, Expected{4096, 1024, 4},
                            Expected{5000, 1024, 4}}) {
    const RowSplit s = forward_row_split(e.vecs, kForwardVecsPerThread);
    EXPECT_EQ(s.threads, e.threads) << e.vecs;
    EXPECT_EQ(s.vecs_per_thread, e.per_thread) << e.vecs;
  }
  // One vector per thread: at most 16 threads.
  EXPECT_EQ(forward_row_split(16, 1).threads, 16);
  EXPECT_EQ(forward_row_split(9, 1).threads, 16);
  EXPECT_EQ(forward_row_split(4, 1).threads, 4);
  EXPECT_EQ(forward_row_split(64, 1).vecs_per_thread, 1);
}

TEST(NormPlan, RowsBlockHoldsOneRowFrom128Threads) {
  EXPECT_EQ(block_threads(NormVariant::kRows, 64), 256);
  EXPECT_EQ(block_threads(NormVariant::kRows, 128), 128);
  EXPECT_EQ(block_threads(NormVariant::kRows, 1024), 1024);
  EXPECT_EQ(block_threads(NormVariant::kRows, 32), 256);
  EXPECT_EQ(block_threads(NormVariant::kRegisters, 128), 256);
  EXPECT_EQ(block_threads(NormVariant::kPipelined, 64), 256);
}

TEST(NormPlan, RingHoldsSixRowsPerBlockInAboutTwoThirdsOfTheSm) {
  // bf16 N = 4096: 8 KB rows, 4 blocks of 6 stages (192 KB per SM); N = 8192 and fp32 N = 4096:
  // 16 KB rows, 2 blocks of 6; N = 2048: 4 KB rows, 4 blocks (the most) of 12 (the most).
  const RingPlan n4096 = ring_plan(512, 8192, kH100Shared);
  EXPECT_EQ(n4096.vecs_per_thread, 2);
  EXPECT_EQ(n4096.blocks_per_sm, 4);
  EXPECT_EQ(n4096.stages, 6);
  const RingPlan n8192 = ring_plan(1024, 16384, kH100Shared);
  EXPECT_EQ(n8192.vecs_per_thread, 4);
  EXPECT_EQ(n8192.blocks_per_sm, 2);
  EXPECT_EQ(n8192.stages, 6);
  const RingPlan n2048 = ring_plan(256, 4096, kH100Shared);
  EXPECT_EQ(n2048.blocks_per_sm, 4);
  EXPECT_EQ(n2048.stages, 12);
  EXPECT_EQ(ring_plan(1, 16, kH100Shared).vecs_per_thread, 2);
  // Too long for 4 vectors per thread, or no room for two rows.
  EXPECT_EQ(ring_plan(1025, 16400, kH100Shared).vecs_per_thread, 0);
  EXPECT_EQ(ring_plan(1024, 16384, 24 * 1024).vecs_per_thread, 0);
  EXPECT_EQ(ring_plan(1024, 16384, 40 * 1024).stages, 2);
}

TEST(NormPlan, AutoTakesTheRingForMidSizedInputsAndForcedRingRefusesWhatItCannotRun) {
  // kAuto: 16-bit rows of 257-1024 vectors, at most 2.5 Mi vectors in all, no residual, on a
  // device with bulk copies.
  for (const ForwardProblem& p : {bf16(Kind::kRms, 2048, 4096), bf16(Kind::kLayer, 2048, 8192),
                                  bf16(Kind::kRms, 4096, 5120), bf16(Kind::kLayer, 4096, 4096),
                                  bf16(Kind::kRms, 1, 2056)}) {
    const ForwardPlan plan = plan_forward(p, NormVariant::kAuto, kH100Shared);
    EXPECT_EQ(plan.variant, NormVariant::kRing) << p.rows << "x" << p.cols;
    EXPECT_GE(plan.ring.stages, 2);
  }
  ForwardProblem no_bulk = bf16(Kind::kRms, 2048, 4096);
  no_bulk.bulk_copies = false;
  ForwardProblem fp32 = bf16(Kind::kRms, 2048, 2048);
  fp32.element_bytes = 4;
  ForwardProblem unaligned = bf16(Kind::kRms, 2048, 4096);
  unaligned.aligned = false;
  for (const ForwardProblem& p : {bf16(Kind::kRms, 8192, 4096), bf16(Kind::kRms, 4096, 8192),
                                  bf16(Kind::kRms, 2048, 2048), bf16(Kind::kRms, 2048, 4096, 2),
                                  no_bulk, fp32, unaligned}) {
    EXPECT_NE(plan_forward(p, NormVariant::kAuto, kH100Shared).variant, NormVariant::kRing)
        << p.rows << "x" << p.cols;
  }
  // Forced: any aligned row of at most 1024 vectors.
  for (const ForwardProblem& p : {bf16(Kind::kRms, 8192, 4096), bf16(Kind::kRms, 16, 64)}) {
    const ForwardPlan forced = plan_forward(p, NormVariant::kRing, kH100Shared);
    EXPECT_EQ(forced.variant, NormVariant::kRing);
    EXPECT_GE(forced.ring.stages, 2);
  }
  EXPECT_THROW(plan_forward(bf16(Kind::kRms, 64, 4096, 2), NormVariant::kRing, kH100Shared),
               UnsupportedVariantError);  // the fused add
  EXPECT_THROW(plan_forward(bf16(Kind::kRms, 64, 8200), NormVariant::kRing, kH100Shared),
               UnsupportedVariantError);  // 1025 vectors
  EXPECT_THROW(plan_forward(no_bulk, NormVariant::kRing, kH100Shared), UnsupportedVariantError);
}

TEST(NormPlan, AutoChoosesByRowLength) {
  // Up to 128 vectors (bf16 N = 1024) kPipelined, the fused add's up to 256 (bf16 N = 2048);
  // beyond, kRows, over a cluster beyond 4096 vectors (kAuto's kRing for mid-sized inputs:
  // above).
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 32768, 512)), NormVariant::kPipelined);
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 32768, 1024)), NormVariant::kPipelined);
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 32768, 1032)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 32768, 2048)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 32768, 2048, 2)), NormVariant::kPipelined);
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 32768, 2056, 2)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 32768, 4096)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 32768, 4096, 2)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 8192, 5120)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 8192, 5120, 2)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kLayer, 32768, 1024)), NormVariant::kPipelined);
  EXPECT_EQ(auto_variant(bf16(Kind::kLayer, 32768, 2048)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kLayer, 8192, 4096)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kLayer, 8192, 5120)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kLayer, 8192, 6136)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kLayer, 4096, 6144)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kLayer, 8192, 8192)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 8192, 8192)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 65536, 8192)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 8192, 262144)), NormVariant::kRows);
  EXPECT_EQ(auto_variant(bf16(Kind::kRms, 8192, 262152)), NormVariant::kTwoPass);
  // fp32: 4 elements per vector, so 2048 columns are 512 vectors.
  ForwardProblem fp32 = bf16(Kind::kRms, 32768, 2048);
  fp32.element_bytes = 4;
  EXPECT_EQ(auto_variant(fp32), NormVariant::kRows);
  EXPECT_EQ(plan_forward(fp32, NormVariant::kAuto, kH100Shared).vecs, 512);
}

TEST(NormPlan, RowsTakeAClusterOfTheFewestBlocksThatHoldThem) {
  EXPECT_EQ(rows_cluster_blocks(4096), 1);
  EXPECT_EQ(rows_cluster_blocks(4097), 2);
  EXPECT_EQ(rows_cluster_blocks(8192), 2);
  EXPECT_EQ(rows_cluster_blocks(8193), 4);
  EXPECT_EQ(rows_cluster_blocks(16385), 8);
  EXPECT_EQ(rows_cluster_blocks(kMaxClusterVecs), 8);
}

TEST(NormPlan, ShortRowsInOneWaveTakeOneVectorPerThread) {
  const ForwardPlan small = plan_forward(bf16(Kind::kRms, 32768, 32), NormVariant::kAuto, kH100Shared);
  EXPECT_EQ(small.variant, NormVariant::kPipelined);
  EXPECT_EQ(small.vecs_per_thread, 1);
  // 262144 vectors in all: more than one wave of one-vector rows.
  EXPECT_EQ(plan_forward(bf16(Kind::kRms, 65536, 32), NormVariant::kAuto, kH100Shared).vecs_per_thread,
            kForwardVecsPerThread);
  // 32 vectors per row: more than 16 threads' worth.
  EXPECT_EQ(plan_forward(bf16(Kind::kLayer, 4096, 256), NormVariant::kAuto, kH100Shared).vecs_per_thread,
            kForwardVecsPerThread);
  EXPECT_EQ(plan_forward(bf16(Kind::kRms, 32768, 32), NormVariant::kRegisters, kH100Shared).vecs_per_thread,
            kForwardVecsPerThread);
}

TEST(NormPlan, UnalignedRowsTakeTwoPassesAndForcedVariantsThrow) {
  ForwardProblem p = bf16(Kind::kRms, 1024, 4096);
  p.aligned = false;
  const ForwardPlan plan = plan_forward(p, NormVariant::kAuto, kH100Shared);
  EXPECT_EQ(plan.variant, NormVariant::kTwoPass);
  EXPECT_FALSE(plan.vectorized);
  for (NormVariant forced : {NormVariant::kRegisters, NormVariant::kRows, NormVariant::kPipelined,
                             NormVariant::kRing}) {
    EXPECT_THROW(plan_forward(p, forced, kH100Shared), UnsupportedVariantError);
  }
  EXPECT_EQ(plan_forward(p, NormVariant::kTwoPass, kH100Shared).variant, NormVariant::kTwoPass);
  EXPECT_TRUE(plan_forward(bf16(Kind::kRms, 1024, 4096), NormVariant::kTwoPass, kH100Shared).vectorized);
  // Longer rows than a forced variant holds.
  EXPECT_THROW(plan_forward(bf16(Kind::kRms, 8, 32776), NormVariant::kRegisters, kH100Shared),
               UnsupportedVariantError);
  EXPECT_THROW(plan_forward(bf16(Kind::kRms, 8, 262152), NormVariant::kRows, kH100Shared),
               UnsupportedVariantError);
}

TEST(NormPlan, StagedVariantsNeedTheirSharedMemory) {
  // LayerNorm's staged tables take 8 B per column: bf16 N = 29008 is the longest row that fits
  // next to the reduction scratch in 227 KB.
  EXPECT_EQ(staged_param_bytes(Kind::kLayer, 29008) + kMaxScratchBytes, kH100Shared);
  EXPECT_EQ(plan_forward(bf16(Kind::kLayer, 64, 29008), NormVariant::kRegisters, kH100Shared).variant,
            NormVariant::kRegisters);
  EXPECT_THROW(plan_forward(bf16(Kind::kLayer, 64, 29016), NormVariant::kRegisters, kH100Shared),
               UnsupportedVariantError);
  // kPipelined's ring: one row group where each block takes one (RMSNorm, the fused add), two
  // in LayerNorm's persistent walk. bf16 RMSNorm N = 4096: 512 vectors over 128 threads, 2 rows
  // per block: 2 x 512 x 16 B = 16 KB, plus 16 KB of tables.
  EXPECT_EQ(ring_stages(Kind::kRms), 1);
  EXPECT_EQ(ring_stages(Kind::kLayer), 2);
  EXPECT_FALSE(persistent_grid(Kind::kRms, NormVariant::kPipelined));
  EXPECT_TRUE(persistent_grid(Kind::kLayer, NormVariant::kPipelined));
  EXPECT_TRUE(persistent_grid(Kind::kLayer, NormVariant::kRegisters));
  EXPECT_FALSE(persistent_grid(Kind::kLayer, NormVariant::kRows));
  EXPECT_EQ(forward_shared_bytes(bf16(Kind::kRms, 64, 4096), NormVariant::kPipelined, 4),
            32u * 1024);
  EXPECT_EQ(forward_shared_bytes(bf16(Kind::kRms, 64, 4096), NormVariant::kRegisters, 4),
            16u * 1024);
  // LayerNorm: 8 B of tables per column and two stages: 32 + 2 x 2 x 8 KB at N = 4096 (3 blocks
  // per SM), 40 + 2 x 10 KB at N = 5120 (one row per block of 256 threads).
  EXPECT_EQ(forward_shared_bytes(bf16(Kind::kLayer, 64, 4096), NormVariant::kPipelined, 4),
            64u * 1024);
  EXPECT_EQ(forward_shared_bytes(bf16(Kind::kLayer, 64, 5120), NormVariant::kPipelined, 4),
            60u * 1024);
  const ForwardPlan layer = plan_forward(bf16(Kind::kLayer, 8192, 4096), NormVariant::kPipelined, kH100Shared);
  EXPECT_TRUE(layer.persistent);
  EXPECT_EQ(layer.ring_stages, 2);
  const ForwardPlan layer_auto = plan_forward(bf16(Kind::kLayer, 8192, 4096), NormVariant::kAuto, kH100Shared);
  EXPECT_EQ(layer_auto.variant, NormVariant::kRows);
  EXPECT_FALSE(layer_auto.persistent);
  const ForwardPlan fused = plan_forward(bf16(Kind::kRms, 8192, 2048, 2), NormVariant::kAuto, kH100Shared);
  EXPECT_EQ(fused.variant, NormVariant::kPipelined);
  EXPECT_FALSE(fused.persistent);
  EXPECT_EQ(fused.ring_stages, 1);
  // The fused add's residual doubles the ring (48 KB at N = 4096: 4 blocks per SM, where two
  // stages took 80 KB and 2), an fp32 residual beside bf16 triples it.
  EXPECT_EQ(forward_shared_bytes(bf16(Kind::kRms, 64, 4096, 2), NormVariant::kPipelined, 4),
            16u * 1024 + 32u * 1024);
  EXPECT_EQ(forward_shared_bytes(bf16(Kind::kRms, 64, 4096, 4), NormVariant::kPipelined, 4),
            16u * 1024 + 48u * 1024);
  // bf16 RMSNorm N = 32768 fits one stage (128 + 64 KB); LayerNorm's tables alone take 256 KB.
  EXPECT_EQ(plan_forward(bf16(Kind::kRms, 64, 32768), NormVariant::kPipelined, kH100Shared).variant,
            NormVariant::kPipelined);
  EXPECT_THROW(plan_forward(bf16(Kind::kLayer, 64, 32768), NormVariant::kPipelined, kH100Shared),
               UnsupportedVariantError);
  // kAuto's kPipelined without room for its ring takes kRegisters where its tables fit, and
  // falls back to two passes on a device with room for neither.
  const ForwardProblem layer_1024 = bf16(Kind::kLayer, 64, 1024);
  const std::size_t tables_only =
      forward_shared_bytes(layer_1024, NormVariant::kRegisters, 4) + kMaxScratchBytes;
  ASSERT_LT(tables_only,
            forward_shared_bytes(layer_1024, NormVariant::kPipelined, 4) + kMaxScratchBytes);
  EXPECT_EQ(plan_forward(layer_1024, NormVariant::kAuto, tables_only).variant,
            NormVariant::kRegisters);
  EXPECT_EQ(plan_forward(bf16(Kind::kRms, 64, 1024), NormVariant::kAuto, 1024).variant,
            NormVariant::kTwoPass);
}

}  // namespace
}  // namespace trainscale::ops::norm
