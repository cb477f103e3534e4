// Scaffolding of the row kernels that hold a whole row in registers (softmax, cross-entropy):
// how many threads (and thread-block-cluster blocks) share a row, the row's 16-byte slots, and
// the reduction of a row's statistics across them. A row is read from HBM once, kept as stored
// (16 bytes per slot and thread), reduced, and written once.
//
// Rows of any length and alignment: a row is cut into 16-byte slots from its address rounded
// down to 16 bytes, so its first slot may start `shift` elements before the row and its last
// may end after it. A slot wholly inside the row moves as one 16-byte access; the elements of
// a partial slot move one by one, and only those inside the row are touched. A second tensor
// whose rows sit at the same offset mod 16 bytes moves by vectors too, otherwise by elements.
//
// Rows stream through a ring in shared memory: a persistent grid, each thread copying (cp.async)
// its whole slots of the next rows while it reduces and writes this one, so HBM reads continue
// through a row's reductions and stores. Loading straight into registers left a block with no
// reads in flight from its last load to its next row, and long rows (one 1024-thread block per
// SM) with none on the whole SM.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "common/async_copy.cuh"
#include "common/cluster_launch.h"
#include "common/row_config.h"
#include "common/cuda_check.h"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "core/check.h"
#include "trainscale/error.h"

namespace trainscale::detail {

// Calls fn(threads, vecs, cluster) (std::integral_constant each) for a configuration
// row_config(slots, kMinThreads, kVecs, kMaxThreads) can return; only those are compiled.
// Other slot counts than kRowVecs are for blocks of fewer than kRowMaxThreads threads only
// (1024-thread blocks and clusters take kRowVecs).
template <int kMinThreads, int kVecs = kRowVecs, int kMaxThreads = kRowMaxThreads,
          int kThreads = (kMinThreads < 1 ? 1 : kMinThreads), class Fn>
auto with_row_config(const RowConfig& c, Fn&& fn) {
  using std::integral_constant;
  static_assert(kVecs == kRowVecs || kMaxThreads < kRowMaxThreads);
  if constexpr (kThreads < kRowMaxThreads) {
    if (c.cluster == 1 && c.threads == kThreads) {
      return fn(integral_constant<int, kThreads>{}, integral_constant<int, (kThreads < 4 ? 1 : kVecs)>{},
                integral_constant<int, 1>{});
    }
    if constexpr (kThreads * 2 <= kMaxThreads) {
      return with_row_config<kMinThreads, kVecs, kMaxThreads, kThreads * 2>(c, std::forward<Fn>(fn));
    } else {
      // Past the widest compiled split: row_config returns none of these (the caller checked).
      using Result = decltype(fn(integral_constant<int, kThreads>{},
                                 integral_constant<int, (kThreads < 4 ? 1 : kVecs)>{}, integral_constant<int, 1>{}));
      return Result{};
    }
  } else {
    using Widest = integral_constant<int, kRowMaxThreads>;
    using Vecs = integral_constant<int, kRowVecs>;
    switch (c.cluster) {
      case 1: return fn(Widest{}, Vecs{}, integral_constant<int, 1>{});
      case 2: return fn(Widest{}, Vecs{}, integral_constant<int, 2>{});
      case 4: return fn(Widest{}, Vecs{}, integral_constant<int, 4>{});
      case 8: return fn(Widest{}, Vecs{}, integral_constant<int, 8>{});
      default: return fn(Widest{}, Vecs{}, integral_constant<int, 16>{});
    }
  }
}

// fn(std::true_type{}) where every row the kernel moves satisfies rows_at_slots (RowTile's
// kAligned), else fn(std::false_type{}): the launchers' choice between the two compilations.
template <class Fn>
auto with_aligned(bool aligned, Fn&& fn) {
  return aligned ? fn(std::true_type{}) : fn(std::false_type{});
}

// Stages of the row ring of a kernel that streams one tensor: rows in flight per thread beyond
// the one it works on. Two: 32 KiB per 256-thread block, 128 KiB per 1024-thread block. Three
// measured the same for softmax and up to 6 % slower for cross-entropy at N 1024 to 4096, and
// slower at N 65536 (H100, bf16).
inline constexpr int kRowRingStages = 2;

// Bytes of the row ring (RowTile::staged) of a block of `threads` per row and `vecs` slots per
// thread holding `buffers` copies of them (stages times tensors).
constexpr std::size_t row_ring_bytes(int threads, int vecs, int buffers) {
  return static_cast<std::size_t>(buffers) * vecs * 16 * row_block_threads(threads, buffers > 0);
}

// Launches `kernel` (compiled for `threads` per row and `cluster` blocks per row, with a row ring
// of `ring_buffers` buffers) over `rows` rows. With a ring, on a persistent grid: as many blocks
// (clusters) as are resident at once, at most one per row group. Without, a block per row group
// (kClusterRowGroups per cluster): a grid as large as the work keeps more reads in flight than
// one resident wave loading into registers. False, launching nothing, where such a block or
// cluster cannot be resident on the device.
template <class... Params, class... Args>
bool launch_row_kernel(void (*kernel)(Params...), int threads, int vecs, int cluster,
                       int ring_buffers, std::int64_t rows, cudaStream_t stream,
                       std::string_view op, Args&&... args) {
  const int block = row_block_threads(threads, ring_buffers > 0);
  const std::size_t smem = row_ring_bytes(threads, vecs, ring_buffers);
  const std::int64_t rows_per_block = block / threads;
  const std::int64_t groups = (rows + rows_per_block - 1) / rows_per_block;
  std::int64_t units = 0;  // blocks, or clusters
  if (ring_buffers == 0 && cluster == 1) {
    units = groups;
  } else {
    const std::int64_t resident = cluster == 1 ? max_resident_blocks(kernel, block, smem, op)
                                               : max_active_clusters(kernel, block, cluster, smem, op);
    if (resident == 0) return false;
    units = ring_buffers > 0 ? std::min(groups, resident)
                             : (groups + kClusterRowGroups - 1) / kClusterRowGroups;
  }
  units = std::min<std::int64_t>(units, std::numeric_limits<int>::max() / cluster);
  launch_in_clusters(kernel, units * cluster, block, cluster, smem, stream, op,
                     std::forward<Args>(args)...);
  return true;
}

// Launches the row kernel for rows of T: make_kernel(threads, vecs, cluster) returns the kernel
// compiled for the split row_config(slots, kMinThreads, kVecs, kMaxThreads) picks for `cols`
// elements (the caller keeps rows within what kMaxThreads holds) whose largest
// shift is max_shift (rows_max_shift), with a row ring of ring_buffers(threads) buffers;
// args.slots is set. Throws for rows no split holds, or whose cluster of 16 blocks cannot be
// resident.
template <class T, int kMinThreads, int kVecs = kRowVecs, int kMaxThreads = kRowMaxThreads,
          class MakeKernel, class RingBuffers, class Args>
void launch_rows(std::string_view op, std::int64_t rows, std::int64_t cols, int max_shift,
                 cudaStream_t stream, MakeKernel&& make_kernel, RingBuffers&& ring_buffers,
                 Args& args) {
  if (rows == 0) return;
  constexpr int V = kVec16<T>;
  const std::int64_t slots = row_slots(cols, V, max_shift);
  args.slots = static_cast<int>(std::min<std::int64_t>(slots, 1 << 30));
  const RowConfig config = row_config(slots, kMinThreads, kVecs, kMaxThreads);
  const bool launched =
      config.threads > 0 &&
      with_row_config<kMinThreads, kVecs, kMaxThreads>(config, [&](auto threads, auto vecs, auto cluster) {
        return launch_row_kernel(make_kernel(threads, vecs, cluster), threads, vecs, cluster,
                                 ring_buffers(threads), rows, stream, op, args);
      });
  if (launched) return;
  throw_op_error(op, "rows of " + std::to_string(cols) +
                         " elements are longer than the CUDA kernels hold (at most " +
                         std::to_string(max_row_cols(V)) +
                         " with rows at 16 bytes, where a cluster of 16 blocks can be resident)");
}

// Launches make_kernel(threads, cluster) (std::integral_constant each), compiled for the direct
// feed's split (direct_split) of rows of `slots` slots, without a ring, over `rows` rows: only
// its eight splits are compiled. Throws UnsupportedVariantError naming `op` for rows it does not
// take (not `aligned`, i.e. rows_at_slots for every tensor moved, or outside
// kDirectMinSlots-kDirectMaxSlots slots; `cols` for the message), and an op error where the
// cluster cannot be resident.
template <class MakeKernel, class Args>
void launch_direct(const char* op, bool aligned, std::int64_t slots, std::int64_t rows, std::int64_t cols,
                   cudaStream_t stream, MakeKernel&& make_kernel, Args& args) {
  const DirectSplit d = aligned ? direct_split(slots) : DirectSplit{};
  if (d.threads == 0) {
    throw UnsupportedVariantError(std::string("trainscale ") + op + ": the direct feed takes rows at 16 bytes of " +
                                  std::to_string(kDirectMinSlots) + "-" + std::to_string(kDirectMaxSlots) +
                                  " 16-byte slots; got rows of " + std::to_string(cols) + " elements");
  }
  args.slots = static_cast<int>(slots);
  if (rows == 0) return;
  using std::integral_constant;
  const auto launch = [&](auto threads, auto cluster) {
    return launch_row_kernel(make_kernel(threads, cluster), decltype(threads)::value, kRowVecs,
                             decltype(cluster)::value, 0, rows, stream, op, args);
  };
  using One = integral_constant<int, 1>;
  bool launched = false;
  if (d.cluster == 1) {
    switch (d.threads) {
      case 64: launched = launch(integral_constant<int, 64>{}, One{}); break;
      case 128: launched = launch(integral_constant<int, 128>{}, One{}); break;
      case 256: launched = launch(integral_constant<int, 256>{}, One{}); break;
      case 512: launched = launch(integral_constant<int, 512>{}, One{}); break;
      default: launched = launch(integral_constant<int, kRowMaxThreads>{}, One{});
    }
  } else if (d.cluster == 2) {
    launched = launch(integral_constant<int, kRowMaxThreads>{}, integral_constant<int, 2>{});
  } else if (d.cluster == 4) {
    launched = launch(integral_constant<int, kRowMaxThreads>{}, integral_constant<int, 4>{});
  } else {
    launched = launch(integral_constant<int, kRowMaxThreads>{}, integral_constant<int, 8>{});
  }
  if (!launched) throw_op_error(op, "a cluster of " + std::to_string(d.cluster) + " blocks cannot be resident");
}

// ---- device side ----

__device__ __forceinline__ bool in_row(int col, int n) {
  return static_cast<unsigned>(col) < static_cast<unsigned>(n);
}

// Elements of `row` before it in its first 16-byte slot.
template <class T>
__device__ __forceinline__ int row_shift(const T* row) {
  return static_cast<int>((reinterpret_cast<std::uintptr_t>(row) % 16) / sizeof(T));
}

// Whether `other`'s row keeps the same offset mod 16 bytes as `row`'s (same slot cuts).
__device__ __forceinline__ bool same_phase(const void* row, const void* other) {
  return (reinterpret_cast<std::uintptr_t>(row) - reinterpret_cast<std::uintptr_t>(other)) % 16 == 0;
}

// The slot whose first element is column c of a row of n: a vector access when `vector` (the
// slot lies inside the row and at 16 bytes), else the elements inside the row one by one, the
// rest set to `fill` (a neutral value spares the passes over the row a bounds test per element). The element loop is not unrolled: unrolled, the element loads of
// every slot were hoisted together and spilled (fp16 softmax backward: 200 bytes at 64
// registers); rolled, the rare partial slots go through 16 bytes of stack instead.
template <class T, int V>
__device__ __forceinline__ Vec<T, V> load_slot(const T* row, int c, int n, bool vector,
                                                T fill = T(0.f)) {
  if (vector) return load_raw<T, V>(row + c);
  Vec<T, V> out;
#pragma unroll 1
  for (int j = 0; j < V; ++j) out.v[j] = in_row(c + j, n) ? row[c + j] : fill;
  return out;
}

template <class T, int V>
__device__ __forceinline__ void store_slot(T* row, int c, int n, bool vector, const float (&v)[V]) {
  if (vector) {
    store_floats<T, V>(row + c, v);
    return;
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (in_row(c + j, n)) row[c + j] = from_float<T>(v[j]);
  }
}

// The largest element a thread holds (fmaxf skips NaN; -inf when it holds none, padding
// included as the caller loaded it).
template <class T, int V, int kVecs>
__device__ __forceinline__ float held_max(const Vec<T, V> (&held)[kVecs]) {
  float m = -std::numeric_limits<float>::infinity();
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    float v[V];
    to_floats(held[i], v);
#pragma unroll
    for (int j = 0; j < V; ++j) m = fmaxf(m, v[j]);
  }
  return m;
}

// What a row kernel keeps exponentials in (0, 1] as, in the registers of the held row: the
// storage width of T (fp16 for 16-bit types, which holds them to 2^-11).
template <class T>
using ExpStorage = std::conditional_t<std::is_same_v<T, float>, float, __half>;

// V exponentials rounded to ExpStorage<T>: fp16 pairs one conversion each (converted one by one,
// every value took a conversion and a register of its own until the output: bf16 softmax
// forward 32768 x 4096-8192 1-2 % slower).
template <class T, int V>
__device__ __forceinline__ Vec<ExpStorage<T>, V> to_exp_storage(const float (&v)[V]) {
  Vec<ExpStorage<T>, V> e;
  if constexpr (std::is_same_v<ExpStorage<T>, __half> && V % 2 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 2) {
      const __half2 pair = __floats2half2_rn(v[j], v[j + 1]);  // .x at the lower address
      memcpy(&e.v[j], &pair, sizeof(pair));
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) e.v[j] = from_float<ExpStorage<T>>(v[j]);
  }
  return e;
}

// Hides the held slots' values from the compiler at this point, so that what a pass over them
// converted to float (and softcapped) is converted again by the next pass, rather than kept
// live between the passes as floats: for 16-bit types that doubled the registers of the held
// row and spilled (cross-entropy forward at 64 registers: 96 bytes).
template <class T, int V, int kVecs>
__device__ __forceinline__ void reconvert_after(Vec<T, V> (&held)[kVecs]) {
  static_assert(sizeof(Vec<T, V>) == 16);
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    unsigned words[4];
    memcpy(words, &held[i], sizeof(words));
#pragma unroll
    for (int k = 0; k < 4; ++k) asm volatile("" : "+r"(words[k]));
    memcpy(&held[i], words, sizeof(words));
  }
}

// A thread's place in a row kernel compiled for kThreads threads per row, kVecs slots per
// thread and kCluster blocks per row: which rows its block takes (row groups of kRowsPerBlock
// rows, or one row per cluster) and which slots of them (a contiguous share per block of the
// cluster, spread over the threads slot by slot so that a warp's accesses are contiguous).
// kCount values are reduced per row with Op (reduce()). kRing: the rows stream through a row
// ring (for_each_row with stages), which sets the block (row_block_threads). kAlternating: the
// reduction's scratch alternates between two buffers by row, so each row takes one block
// barrier instead of two (row_reduce without its leading barrier). kAligned: every row of every
// tensor the kernel moves starts at 16 bytes and fills whole slots (rows_at_slots), so each slot
// a thread owns moves as one vector, without bounds or shift tests. Lives in shared memory (the
// reduction scratch and the cluster's exchange); every thread runs every row group of its block.
template <class T, int kThreads, int kVecs, int kCluster, class Op, int kCount, bool kRing = true,
          bool kAlternating = false, bool kAligned = false>
struct RowTile {
  static constexpr int V = kVec16<T>;
  static constexpr int kBlock = row_block_threads(kThreads, kRing);
  static constexpr int kRowsPerBlock = kBlock / kThreads;
  static_assert(kCluster == 1 || kRowsPerBlock == 1, "a cluster shares one row");
  float scratch[kAlternating ? 2 : 1][kThreads > 32 ? kBlock / 32 * kCount : 1];
  ClusterRowReduce<kCluster, kCount, Op> cluster;  // kCluster > 1

  // The block's share of a row of `slots` slots (the launch's maximum over rows).
  struct Share {
    int first;  // slot
    int count;
  };
  static __device__ __forceinline__ Share share(int slots) {
    if constexpr (kCluster == 1) {
      return {0, slots};
    } else {
      const int per_block = (slots + kCluster - 1) / kCluster;
      const int first = static_cast<int>(blockIdx.x % kCluster) * per_block;
      return {first, max(0, min(per_block, slots - first))};
    }
  }
  static __device__ __forceinline__ int lane() { return threadIdx.x % kThreads; }
  // The thread's i-th slot of the share, and whether it has one.
  static __device__ __forceinline__ bool owns(const Share& s, int i) {
    return i * kThreads + lane() < s.count;
  }
  static __device__ __forceinline__ int slot(const Share& s, int i) {
    return s.first + i * kThreads + lane();
  }
  // The first column of the thread's i-th slot in a row of n with that shift; n (past the row)
  // for a slot it does not own, whose columns may be another block's of the cluster.
  static __device__ __forceinline__ int column(const Share& s, int i, int shift, int n) {
    return owns(s, i) ? slot(s, i) * V - shift : n;
  }
  // The ring in dynamic shared memory (row_ring_bytes): kBuffers buffers (stages times tensors)
  // of the thread's kVecs slots, laid out [buffer][slot i][thread] so that a warp's 16-byte
  // accesses are consecutive. The thread's slot 0 of `buffer`; slot i is kBlock further.
  // Null for a kernel without a ring (kStages 0).
  template <int kStages>
  static __device__ __forceinline__ uint4* staged(int buffer) {
    if constexpr (kStages == 0) {
      return nullptr;
    } else {
      extern __shared__ uint4 row_ring[];
      return row_ring + buffer * kVecs * kBlock + threadIdx.x;
    }
  }
  // Whether the slot at column c moves by a vector: wholly inside the row, and at 16 bytes in
  // this tensor (`vectors`: its rows share the phase of the rows the slots are cut along).
  // Always, for a slot the thread owns, under kAligned.
  static __device__ __forceinline__ bool whole(int c, int n, bool vectors) {
    if constexpr (kAligned) return true;
    return vectors && c >= 0 && c + V <= n;
  }
  // Elements of `row` before it in its first slot (row_shift; 0 under kAligned).
  static __device__ __forceinline__ int shift_of(const T* row) {
    if constexpr (kAligned) return 0;
    return row_shift(row);
  }
  // Starts copying the thread's whole slots of `row` into the ring at `to` (staged()); partial
  // slots are read by take().
  static __device__ __forceinline__ void fetch(const T* row, const Share& s, int shift, int n,
                                               bool vectors, uint4* to) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int c = slot(s, i) * V - shift;
      if (owns(s, i) && whole(c, n, vectors)) cp_async_16(to + i * kBlock, row + c);
    }
  }
  // for_each_row's fetch for a kernel that streams one tensor, whose rows lie at `base` every
  // `stride` elements.
  template <int kStages>
  static __device__ __forceinline__ auto fetch_rows(const T* base, std::int64_t stride,
                                                    const Share& s, int n) {
    return [=](std::int64_t row, int stage) {
      const T* r = base + row * stride;
      fetch(r, s, shift_of(r), n, true, staged<kStages>(stage));
    };
  }
  // The thread's slot i (first column c) of `row`: from the ring at `from` when it is whole and
  // there is a ring, else from global memory (load_slot); for kernels that loop over their slots
  // themselves. take() writes the same out in its loop: calling this changed the code generated
  // for the cross-entropy forward.
  static __device__ __forceinline__ void take_slot(const T* row, int c, int n, bool whole, T pad,
                                                   const uint4* from, int i, Vec<T, V>& out) {
    if (from != nullptr && whole) {
      const uint4 raw = from[i * kBlock];
      memcpy(&out, &raw, sizeof(raw));
    } else {
      out = load_slot<T, V>(row, c, n, whole, pad);
    }
  }
  // The thread's slots of `row` (shift: row_shift(row)), whole ones from the ring at `from`
  // (fetched, landed) or, without a ring (null), from global memory like partial ones; elements
  // outside the row, slots the thread does not own and every slot of a row past the last (valid
  // false) hold `pad`.
  static __device__ __forceinline__ void take(const T* row, const Share& s, int shift, int n,
                                              bool valid, bool vectors, T pad, const uint4* from,
                                              Vec<T, V> (&held)[kVecs]) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int c = slot(s, i) * V - shift;
      if (valid && owns(s, i)) {
        if (from != nullptr && whole(c, n, vectors)) {
          const uint4 raw = from[i * kBlock];
          memcpy(&held[i], &raw, sizeof(raw));
        } else {
          held[i] = load_slot<T, V>(row, c, n, whole(c, n, vectors), pad);
        }
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) held[i].v[j] = pad;
      }
    }
  }
  // Whether this thread reports the row's per-row results (one thread per row).
  static __device__ __forceinline__ bool reporter() {
    return lane() == 0 && (kCluster == 1 || blockIdx.x % kCluster == 0);
  }

  // Calls body(row, valid, stage, refill) for each row of the block's row groups (valid false
  // past the last row: the thread still joins the reductions), the rows streaming through a
  // ring of kStages stages: fetch(row, stage) starts the copies of a row (one that exists) into
  // `stage`; when body runs, its row's copies (the thread's own) have landed in `stage`. body
  // calls refill() once, after it used the values it read from the stage: refill starts the
  // copies of the row kStages groups on into that stage. A thread's copies and reads of the
  // ring are its own, so cp.async.wait_group orders them without a barrier. kStages 0: no ring
  // (fetch and refill do nothing; body loads its row itself).
  template <int kStages, class Fetch, class Body>
  static __device__ __forceinline__ void for_each_row(std::int64_t rows, Fetch&& fetch,
                                                      Body&& body) {
    static_assert((kStages > 0) == kRing, "the block was sized for the ring (row_block_threads)");
    const std::int64_t stride = static_cast<std::int64_t>(gridDim.x / kCluster) * kRowsPerBlock;
    const std::int64_t first_base = static_cast<std::int64_t>(blockIdx.x / kCluster) * kRowsPerBlock;
    const int in_group = static_cast<int>(threadIdx.x) / kThreads;
    if constexpr (kStages == 0) {
      for (std::int64_t base = first_base; base < rows; base += stride) {
        body(base + in_group, base + in_group < rows, 0, [] {});
      }
    } else {
#pragma unroll
      for (int s = 0; s < kStages; ++s) {
        const std::int64_t row = first_base + s * stride + in_group;
        if (row < rows) fetch(row, s);
        cp_async_commit();
      }
      int stage = 0;
      for (std::int64_t base = first_base; base < rows; base += stride) {
        const std::int64_t row = base + in_group;
        cp_async_wait<kStages - 1>();
        const auto refill = [&] {
          const std::int64_t next = row + kStages * stride;
          if (next < rows) fetch(next, stage);
          cp_async_commit();
        };
        body(row, row < rows, stage, refill);
        stage = stage + 1 == kStages ? 0 : stage + 1;
      }
      cp_async_wait<0>();
    }
  }

  __device__ __forceinline__ void start() {
    if constexpr (kCluster > 1) cluster.start();
  }

  // v: this thread's partial values, replaced by the row's (bitwise alike in every thread of
  // the row, across the cluster too). reduced: the thread's count of rows reduced so far.
  __device__ __forceinline__ void reduce(float (&v)[kCount], int& reduced) {
    if constexpr (kAlternating) {
      row_reduce<kThreads, Op, false>(v, scratch[reduced & 1]);
    } else {
      row_reduce<kThreads, Op>(v, scratch[0]);
    }
    if constexpr (kCluster > 1) {
      if (reduced == 0) cluster.wait_started();
      cluster.reduce(v, reduced);  // advances reduced
    } else {
      ++reduced;
    }
  }
};

}  // namespace trainscale::detail
