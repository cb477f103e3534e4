// How the row kernels (common/row_kernel.cuh) split a row: pure functions of the row's
// length in 16-byte slots, so tests and tools can see the choice without a device.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace trainscale::detail {

// Threads per row (a power of two), 16-byte slots per thread, blocks per row (a cluster).
struct RowConfig {
  int threads = 0;  // 0: rows this long are not supported
  int vecs = 0;
  int cluster = 1;
};

inline constexpr int kRowVecs = 4;           // slots per thread: 4 loads in flight each
inline constexpr int kRowMaxThreads = 1024;
inline constexpr int kRowMaxCluster = 16;    // beyond the portable 8: asked for, may not fit

// Threads of a block: 256 (several rows of fewer threads each), or one row of `threads`. A
// persistent grid streaming through a row ring keeps rows of up to 256 threads in blocks of 256
// (the ring is per block); a grid of one block per row group gives rows of kRowAloneThreads or
// more a block each, so that no row's stores wait on another row's reduction.
inline constexpr int kRowAloneThreads = 128;
constexpr int row_block_threads(int threads, bool ring = true) {
  return threads > 256 || (!ring && threads >= kRowAloneThreads) ? threads : 256;
}

// Slots a row of `cols` elements can span: its elements, plus up to vec - 1 before them when
// some row does not start on 16 bytes.
inline std::int64_t row_slots(std::int64_t cols, int vec, int max_shift) {
  return (cols + max_shift + vec - 1) / vec;
}

// Largest shift (elements before the row in its first slot) over rows at `data` every `stride`
// elements: the base's own when every row keeps its offset mod 16 bytes, else up to vec - 1.
inline int rows_max_shift(const void* data, std::int64_t stride, std::size_t elem_bytes) {
  const auto vec = static_cast<std::int64_t>(16 / elem_bytes);
  if ((stride * static_cast<std::int64_t>(elem_bytes)) % 16 != 0) return static_cast<int>(vec - 1);
  return static_cast<int>((reinterpret_cast<std::uintptr_t>(data) % 16) / elem_bytes);
}

// Whether every row at `data` every `stride` elements of `elem_bytes` starts at 16 bytes and
// `cols` of them fill whole 16-byte slots (RowTile's kAligned).
inline bool rows_at_slots(const void* data, std::int64_t stride, std::int64_t cols,
                          std::size_t elem_bytes) {
  const auto bytes = static_cast<std::int64_t>(elem_bytes);
  return reinterpret_cast<std::uintptr_t>(data) % 16 == 0 && (stride * bytes) % 16 == 0 &&
         (cols * bytes) % 16 == 0;
}

// The split of a row of `slots` slots, a pure function of its length:
//   up to 2 slots: 1 or 2 threads of one slot each; then `vecs` slots per thread (4 by default)
//   and as few threads as cover the row (at least min_threads), up to 1024 (bf16 N = 32768,
//   fp32 16384 with 4 slots each) in one block; longer rows: clusters of 2, 4, 8 or 16 blocks of
//   1024 threads of 4 slots (bf16 N <= 262144 and fp32 131072 in the portable 8; 16 where the
//   device lets such a cluster be resident). Rows that need more than max_threads threads, or a
//   cluster where max_threads is below 1024, are not supported (threads 0).
// The norms' register kernels split rows alike (kRows: 1024-thread blocks in clusters of 2 to
// 8); the first softmax kernels, with clusters of 512-thread blocks, ran 1604-1864 GB/s from
// N = 32768 on an H200 where N = 8192 took 2416 (bf16).
constexpr RowConfig row_config(std::int64_t slots, int min_threads, int vecs = kRowVecs,
                               int max_threads = kRowMaxThreads) {
  if (slots <= 2 && min_threads <= 2) {
    const int t = static_cast<int>(std::max<std::int64_t>(slots, min_threads));
    return {t < 1 ? 1 : t, 1, 1};
  }
  int threads = std::max(4, min_threads);
  while (threads < max_threads && threads * vecs < slots) threads *= 2;
  if (threads * vecs >= slots) return {threads, vecs, 1};
  if (max_threads < kRowMaxThreads) return {};
  for (int cluster = 2; cluster <= kRowMaxCluster; cluster *= 2) {
    if (std::int64_t{kRowMaxThreads} * kRowVecs * cluster >= slots)
      return {kRowMaxThreads, kRowVecs, cluster};
  }
  return {};
}

// Row groups each cluster takes in turn where rows are loaded straight into registers (this
// layer's direct feed, the norms' kRows): one per cluster paid every cluster's launch, its first
// cluster barrier and its first L1 misses on the weights once per row (H100: 4 groups 2925 vs 1
// group 2768 GB/s at rmsnorm 32768x65536; 16 was slower too, docs/perf/norm.md).
inline constexpr std::int64_t kClusterRowGroups = 4;

// Longest supported row in elements (for messages).
inline std::int64_t max_row_cols(int vec) {
  return std::int64_t{kRowMaxThreads} * kRowVecs * kRowMaxCluster * vec - (vec - 1);
}

// The direct feed: aligned rows (rows_at_slots) loaded straight from global memory into
// registers, no ring, 4 slots per thread on the fewest threads that hold the row (64 to 1024;
// rows of up to 64 threads share a block of 256, longer ones get a block each), beyond 4096
// slots a cluster of the fewest blocks of 1024 (2, 4 or 8); a grid of a block (cluster) per row
// group (launch_direct). Rows of kDirectMinSlots to kDirectMaxSlots slots (bf16 N 1032-262144);
// threads 0 outside.
inline constexpr std::int64_t kDirectMinSlots = 129, kDirectBlockSlots = 4096;
inline constexpr std::int64_t kDirectMaxSlots = 8 * kDirectBlockSlots;
struct DirectSplit {
  int threads = 0, cluster = 0;
};
inline DirectSplit direct_split(std::int64_t slots) {
  if (slots < kDirectMinSlots || slots > kDirectMaxSlots) return {};
  if (slots <= kDirectBlockSlots) {
    int threads = 64;
    while (threads * kRowVecs < slots) threads *= 2;
    return {threads, 1};
  }
  int cluster = 2;
  while (cluster * kDirectBlockSlots < slots) cluster *= 2;
  return {kRowMaxThreads, cluster};
}

}  // namespace trainscale::detail
