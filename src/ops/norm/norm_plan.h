// Shape heuristics of the norm kernels: which row kernel (NormVariant) a call takes and how its
// rows are split over threads, as pure host functions of the problem (op kind, M, N, dtype
// sizes, alignment) and the device's limits. The launchers (norm_forward_launch.cuh,
// norm_backward_launch.cuh) turn a plan into template arguments; tests/norm_plan_test.cc checks the
// choices on the CPU. The measurements behind each threshold are in docs/perf/norm.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/row_config.h"
#include "trainscale/norm.h"

namespace trainscale::ops::norm {

enum class Kind { kRms, kLayer };

const char* variant_name(NormVariant variant);

// Whether the whole-row register kernels apply: aligned rows and a row short enough. Forcing
// one (kRegisters, kRows, kPipelined) where it does not apply throws UnsupportedVariantError.
bool use_registers(NormVariant variant, bool aligned, std::int64_t vecs, std::int64_t max_vecs);

// ---- register kernels: a row split over threads ------------------------------------------

// Threads per row (a power of two, 1 ... max_threads) and 16-byte vectors per thread for a row
// of `vecs` vectors (at most max_threads * vecs_per_thread): vecs_per_thread vectors per thread,
// so that each thread keeps that many loads in flight, and as few threads as cover the row.
// Short rows share a warp (threads < 32): with one vector per thread, LayerNorm at bf16 N =
// 256 was bound by the latency of a row's load and its shuffle chain. Rows of at most 4
// vectors take one thread per vector: a block then covers 256 / threads rows, and 131072 rows
// of 8 bf16 fit in one wave (4 threads per row took four; one thread holding 2-4 vectors was
// slower than a thread per vector, its loads striding the row).
struct RowSplit {
  int threads = 1;
  int vecs_per_thread = 1;
};
constexpr int vecs_per_thread_at(int threads, int vecs_per_thread) {
  return threads < 4 ? 1 : vecs_per_thread;
}
// The split is common/row_config.h's within one block; a row longer than the block holds takes
// its widest split (kRows spreads such rows over a cluster of these blocks).
constexpr RowSplit row_split(std::int64_t vecs, int vecs_per_thread, int max_threads) {
  const detail::RowConfig c = detail::row_config(vecs, 1, vecs_per_thread, max_threads);
  if (c.threads == 0 || c.cluster > 1) return {max_threads, vecs_per_thread_at(max_threads, vecs_per_thread)};
  return {c.threads, c.vecs};
}

// Longest row (in 16-byte vectors) the register kernels take; longer rows use two passes.
template <int kVecsPerThread>
inline constexpr std::int64_t kMaxRegisterVecs = 1024 * kVecsPerThread;
inline constexpr int kForwardVecsPerThread = 4;
inline constexpr int kTwoPassThreads = 512;

// ---- forward -----------------------------------------------------------------------------

// Threads of a forward register block: threads_per_row, several rows when short.
inline constexpr int kForwardBlock = 256;
constexpr int forward_block_threads(int threads_per_row) {
  return threads_per_row > kForwardBlock ? threads_per_row : kForwardBlock;
}
// kRows' block: one row of 128 or more threads (bf16 N > 2048), so a block's row is never held
// up by another row's reduction and the SM runs as many rows as registers allow (8 of 128
// threads at bf16 N = 4096); shorter rows share a block as above (one row of 64 threads per
// block ran bf16 32768x2048 at 0.7x the speed of four).
inline constexpr int kRowsMinThreadsAlone = 128;
constexpr int rows_block_threads(int threads_per_row) {
  return threads_per_row >= kRowsMinThreadsAlone ? threads_per_row
                                                 : forward_block_threads(threads_per_row);
}
constexpr int block_threads(NormVariant variant, int threads_per_row) {
  return variant == NormVariant::kRows ? rows_block_threads(threads_per_row)
                                       : forward_block_threads(threads_per_row);
}
// The register kernel's static reduction scratch at most (1024 threads, 3 sums), and the
// shared memory a kernel gets without raising its limit.
inline constexpr std::size_t kMaxScratchBytes = 1024 / 32 * 3 * sizeof(float);
inline constexpr std::size_t kDefaultSharedBytes = 48 * 1024;

// Staged per-column parameter tables of kRegisters / kPipelined: weight (+ bias) as floats.
constexpr int param_tables(Kind kind) { return kind == Kind::kLayer ? 2 : 1; }
constexpr std::size_t staged_param_bytes(Kind kind, std::int64_t cols) {
  return static_cast<std::size_t>(cols) * sizeof(float) * param_tables(kind);
}

// Whether the staged register kernels (kRegisters, kPipelined) run a persistent grid of one
// resident wave whose blocks loop over row groups: LayerNorm, whose tables (8 B per column) cost
// more to restage per row group than the looping wave loses. RMSNorm and the fused add (4 B per
// column) take one row group per block (docs/perf/norm.md).
constexpr bool persistent_grid(Kind kind, NormVariant variant) {
  return kind == Kind::kLayer &&
         (variant == NormVariant::kRegisters || variant == NormVariant::kPipelined);
}

// kPipelined's ring: `stages` stages of a block's row group, each row `chunks` 16-byte chunks
// per vector (x, and the fused add's residual: as many chunks as its elements are wider than
// x's). Two stages where the grid is persistent (the next group's copies start before this
// group's have landed); one where each block takes one row group, which then only overlaps the
// group's copies with the staging of the parameters (a second stage would never be filled, and
// its shared memory halved the fused add's blocks per SM at bf16 N = 4096).
constexpr int ring_chunks(int element_bytes, int residual_bytes) {
  return 1 + residual_bytes / element_bytes;
}
constexpr int ring_stages(Kind kind) {
  return persistent_grid(kind, NormVariant::kPipelined) ? 2 : 1;
}
constexpr std::size_t ring_bytes(int threads_per_row, int chunks, std::int64_t vecs, int stages) {
  const int rows_per_block = forward_block_threads(threads_per_row) / threads_per_row;
  return static_cast<std::size_t>(stages * rows_per_block * chunks) *
         static_cast<std::size_t>(vecs) * 16;
}

// Small rows in about one wave take kPipelined with one vector per thread: more threads per
// row, fewer unrolled steps per thread. At most kOneVectorMaxThreads vectors per row and
// kOneVectorMaxVecs in all: 512 blocks of 256 threads when a row's vectors are a power of two,
// up to twice that otherwise (the H100 holds 528 at 4 blocks per SM). At 32 vectors per row it
// was slower than 4 vectors per thread, hence the cap (docs/perf/norm.md).
inline constexpr int kOneVectorMaxThreads = 16;
inline constexpr std::int64_t kOneVectorMaxVecs = 131072;

// The forward register kernels' row split for vecs_per_thread (kForwardVecsPerThread, or 1 for
// the short rows above).
constexpr RowSplit forward_row_split(std::int64_t vecs, int vecs_per_thread) {
  return row_split(vecs, vecs_per_thread, vecs_per_thread == 1 ? kOneVectorMaxThreads : 1024);
}

// kRows takes rows longer than one block holds over a cluster of the fewest blocks that hold
// them: 2, 4 or 8 (the portable cluster maximum), so bf16 N <= 262144 and fp32 N <= 131072.
inline constexpr std::int64_t kBlockVecs = kMaxRegisterVecs<kForwardVecsPerThread>;
inline constexpr std::int64_t kMaxClusterVecs = 8 * kBlockVecs;
constexpr int rows_cluster_blocks(std::int64_t vecs) {
  return vecs <= kBlockVecs ? 1 : vecs <= 2 * kBlockVecs ? 2 : vecs <= 4 * kBlockVecs ? 4 : 8;
}

// kRing (sm_90): a persistent grid of blocks of kRingThreads, each walking the rows
// blockIdx.x, + gridDim.x, ... Every row arrives by one bulk copy into a ring of `stages`
// shared-memory rows, issued `stages` rows ahead, so a block has that many rows in flight through
// its reductions and stores; weight and bias are read once into registers. Rows of up to 4
// vectors per thread (bf16 N <= 8192, fp32 N <= 4096), without a residual. The ring aims at
// kRingBytesPerSm of shared memory per SM: kRingStagesPerBlock stages in as many blocks as that
// holds (1-4), then as many stages as the blocks' share holds (at most kMaxRingStages). bf16
// RMSNorm 2048x4096 ran in 13.9 us against kRows' 14.7, 8192x4096 in 50.1 against 50.9
// (docs/perf/norm.md, "Training shapes").
inline constexpr int kRingThreads = 256;
inline constexpr int kMaxRingStages = 12;
inline constexpr int kRingStagesPerBlock = 6;
inline constexpr std::size_t kRingBytesPerSm = 192 * 1024;
inline constexpr int kMaxRingBlocksPerSm = 4;
// kAuto takes kRing for 16-bit rows of 257-1024 vectors (N 2056-8192) without a residual, up to
// this many vectors in all (40 MiB: 2048 x 4096-8192, 4096 x 4096-5120). There kRows' grid runs
// under four waves and the ring, a resident grid with rows in flight through every reduction,
// measured 3-8 % faster for RMSNorm and LayerNorm (except LayerNorm 2048x4096, 6 % slower);
// from 8192 x 4096 kRows matched or beat it (docs/perf/norm.md).
inline constexpr std::int64_t kRingAutoMaxVecs = std::int64_t{5} << 19;

struct RingPlan {
  int vecs_per_thread = 0;  // 2 or 4; 0: the row does not fit
  int blocks_per_sm = 0;    // before the occupancy the launch finds
  int stages = 0;           // rows in each block's ring (>= 2)
};

// The ring for rows of `vecs` 16-byte vectors of `stage_bytes` bytes, given the shared memory a
// block may take; vecs_per_thread 0 where it cannot run.
RingPlan ring_plan(std::int64_t vecs, std::size_t stage_bytes, std::size_t shared_memory_per_block);

struct ForwardProblem {
  Kind kind = Kind::kRms;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  int element_bytes = 2;   // x and y
  int residual_bytes = 0;  // the fused add's residual; 0 without
  bool aligned = true;     // x, y (and residual) rows start 16-byte aligned, in whole vectors
  bool bulk_copies = false;  // the device has bulk copies (sm_90 or newer): kAuto may take kRing
};

struct ForwardPlan {
  // kRegisters, kPipelined, kRows, kRing or kTwoPass. kRows still falls back to kTwoPass (or throws
  // when forced) where its cluster cannot be resident: that takes an occupancy query.
  NormVariant variant = NormVariant::kTwoPass;
  std::int64_t vecs = 0;          // 16-byte vectors per row (rounded up)
  int vecs_per_thread = kForwardVecsPerThread;  // kPipelined: 1 for short rows in one wave
  bool vectorized = false;        // kTwoPass: 16-byte loads and stores
  bool persistent = false;        // persistent_grid: one resident wave looping over row groups
  int ring_stages = 0;            // kPipelined: ring_stages(kind)
  RingPlan ring;                  // kRing
};

// Dynamic shared memory of a staged register variant (kRegisters, kPipelined) for aligned
// rows: the staged tables, and kPipelined's ring.
std::size_t forward_shared_bytes(const ForwardProblem& p, NormVariant variant, int vecs_per_thread);

// The forward kernel for `requested` (kAuto, or a forced variant, which throws
// UnsupportedVariantError where it cannot run), given the device's shared memory per block.
ForwardPlan plan_forward(const ForwardProblem& p, NormVariant requested,
                         std::size_t shared_memory_per_block);

}  // namespace trainscale::ops::norm
