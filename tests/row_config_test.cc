// The row kernels' split (common/row_config.h): a pure function of the row length.
#include <gtest/gtest.h>

#include "common/row_config.h"

namespace trainscale::detail {
namespace {

TEST(RowConfig, ThreadsGrowWithTheRowThenClusters) {
  struct Expect {
    std::int64_t slots;
    int threads, vecs, cluster;
  };
  for (const Expect& e : std::initializer_list<Expect>{
           {1, 1, 1, 1},      {2, 2, 1, 1},       {3, 4, 4, 1},       {16, 4, 4, 1},
           {17, 8, 4, 1},     {1024, 256, 4, 1},  {4096, 1024, 4, 1}, {4097, 1024, 4, 2},
           {16384, 1024, 4, 4}, {32768, 1024, 4, 8}, {32769, 1024, 4, 16}, {65536, 1024, 4, 16}}) {
    const RowConfig c = row_config(e.slots, 1);
    EXPECT_EQ(c.threads, e.threads) << e.slots;
    EXPECT_EQ(c.vecs, e.vecs) << e.slots;
    EXPECT_EQ(c.cluster, e.cluster) << e.slots;
  }
  EXPECT_EQ(row_config(65537, 1).threads, 0);  // longer than 16 blocks of 1024 threads hold
  EXPECT_EQ(row_config(1, 32).threads, 32);    // a warp per row at least where asked
  EXPECT_EQ(row_config(1, 32).vecs, 4);
}

// Fewer slots per thread (more threads) and a cap on the threads, for kernels that pick the split
// by ranges of the row length.
TEST(RowConfig, SlotsPerThreadAndThreadCap) {
  EXPECT_EQ(row_config(129, 128, 2, 512).threads, 128);
  EXPECT_EQ(row_config(129, 128, 2, 512).vecs, 2);
  EXPECT_EQ(row_config(1024, 128, 2, 512).threads, 512);
  EXPECT_EQ(row_config(1025, 128, 2, 512).threads, 0);  // beyond the cap: no split
  EXPECT_EQ(row_config(128, 1, 4, 32).threads, 32);
  EXPECT_EQ(row_config(129, 1, 4, 32).threads, 0);
  EXPECT_EQ(row_config(1025, 512).threads, 512);  // the default slots per thread
  EXPECT_EQ(row_config(4097, 512).cluster, 2);
}

// A ring's persistent grid packs rows of up to 256 threads into blocks of 256; a grid of a block
// per row group gives rows of 128 threads or more a block of their own.
TEST(RowConfig, BlockThreads) {
  EXPECT_EQ(row_block_threads(32), 256);
  EXPECT_EQ(row_block_threads(128), 256);
  EXPECT_EQ(row_block_threads(512), 512);
  EXPECT_EQ(row_block_threads(64, false), 256);
  EXPECT_EQ(row_block_threads(128, false), 128);
  EXPECT_EQ(row_block_threads(1024, false), 1024);
}

TEST(RowConfig, SlotsCountTheFirstRowsShift) {
  // bf16: 8 per slot. 8194 elements starting on 16 bytes span 1025 slots; shifted, up to 1026.
  EXPECT_EQ(row_slots(8194, 8, 0), 1025);
  EXPECT_EQ(row_slots(8194, 8, 7), 1026);
  EXPECT_EQ(max_row_cols(8), 16 * 1024 * 4 * 8 - 7);
  alignas(16) static char buffer[64];
  EXPECT_EQ(rows_max_shift(buffer, 8, 2), 0);      // 16-byte rows from a 16-byte base
  EXPECT_EQ(rows_max_shift(buffer + 2, 8, 2), 1);  // every row one element in
  EXPECT_EQ(rows_max_shift(buffer, 9, 2), 7);      // rows at every phase
}

TEST(RowConfig, RowsAtSlotsNeedBaseStrideAndLengthAtSixteenBytes) {
  alignas(16) static char buffer[64];
  EXPECT_TRUE(rows_at_slots(buffer, 8, 8, 2));       // bf16: 16-byte rows of 8
  EXPECT_TRUE(rows_at_slots(buffer, 16, 8, 2));      // strided, every row at 16 bytes
  EXPECT_TRUE(rows_at_slots(buffer, 4, 4, 4));       // fp32: 4 per slot
  EXPECT_FALSE(rows_at_slots(buffer + 2, 8, 8, 2));  // base one element in
  EXPECT_FALSE(rows_at_slots(buffer, 12, 8, 2));     // every other row off 16 bytes
  EXPECT_FALSE(rows_at_slots(buffer, 8, 7, 2));      // a partial last slot
  EXPECT_FALSE(rows_at_slots(buffer, 6, 6, 4));      // fp32 rows of 6: 24 bytes
}

TEST(RowConfig, DirectSplitTakesABlockThenTheFewestClustersOf1024Threads) {
  EXPECT_EQ(direct_split(128).threads, 0);  // short rows: the row splits
  EXPECT_EQ(direct_split(129).threads, 64);
  EXPECT_EQ(direct_split(256).threads, 64);
  EXPECT_EQ(direct_split(257).threads, 128);
  EXPECT_EQ(direct_split(1024).threads, 256);
  EXPECT_EQ(direct_split(1024).cluster, 1);
  EXPECT_EQ(direct_split(1025).threads, 512);
  EXPECT_EQ(direct_split(2048).threads, 512);
  EXPECT_EQ(direct_split(2049).threads, 1024);
  EXPECT_EQ(direct_split(4096).cluster, 1);
  EXPECT_EQ(direct_split(4097).cluster, 2);
  EXPECT_EQ(direct_split(8193).cluster, 4);
  EXPECT_EQ(direct_split(16032).cluster, 4);  // bf16 N 128256
  EXPECT_EQ(direct_split(32768).cluster, 8);  // bf16 N 262144
  EXPECT_EQ(direct_split(32768).threads, 1024);
  EXPECT_EQ(direct_split(32769).threads, 0);
}

}  // namespace
}  // namespace trainscale::detail
