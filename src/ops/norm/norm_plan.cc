#include "ops/norm/norm_plan.h"

#include <algorithm>
#include <string>

#include "trainscale/error.h"

namespace trainscale::ops::norm {

const char* variant_name(NormVariant variant) {
  switch (variant) {
    case NormVariant::kAuto: return "auto";
    case NormVariant::kRegisters: return "register";
    case NormVariant::kTwoPass: return "two-pass";
    case NormVariant::kRows: return "rows";
    case NormVariant::kPipelined: return "pipelined";
    case NormVariant::kRing: return "ring";
  }
  return "unknown";
}

bool use_registers(NormVariant variant, bool aligned, std::int64_t vecs, std::int64_t max_vecs) {
  if (variant == NormVariant::kTwoPass) return false;
  const bool fits = aligned && vecs <= max_vecs;
  if (variant != NormVariant::kAuto && !fits) {
    throw UnsupportedVariantError(std::string("trainscale norm: the ") + variant_name(variant) +
                                  " variant needs 16-byte aligned rows of at most " +
                                  std::to_string(max_vecs) + " vectors");
  }
  return fits;
}

namespace {

// kAuto's kernel for aligned rows one block holds (kPipelined or kRows; plan_forward then takes
// kRing for mid-sized inputs, auto_ring); kAuto falls back to two passes where it cannot run.
// kRows, one row group per block and no staged tables, from 129 vectors (bf16 N 1032) for
// RMSNorm and LayerNorm, from 257 (bf16 N 2056) for the fused add: one run of every training
// shape with the variant forced had it take 12-42 % less time than kPipelined at LayerNorm
// N = 2048 and 3-9 % at RMSNorm N = 2048; the fused add 0-8 % at N = 4096 and 14-21 % at 5120
// (kRegisters there before); never more than 1 % more. Up to there, kPipelined: its next row
// group's loads overlap this group's reduction, which short rows spend most of their time in.
// Measurements: docs/perf/norm.md.
NormVariant auto_register_variant(std::int64_t vecs, bool fused_add) {
  return vecs <= (fused_add ? 256 : 128) ? NormVariant::kPipelined : NormVariant::kRows;
}

// kAuto's kRing (kRingAutoMaxVecs), given the ring the row would get.
bool auto_ring(const ForwardProblem& p, std::int64_t vecs, const RingPlan& ring) {
  return p.bulk_copies && p.aligned && p.residual_bytes == 0 && p.element_bytes == 2 &&
         vecs > 256 && p.rows * vecs <= kRingAutoMaxVecs && ring.vecs_per_thread > 0;
}

bool one_vector_per_thread(NormVariant chosen, std::int64_t rows, std::int64_t vecs) {
  return chosen == NormVariant::kPipelined && vecs <= kOneVectorMaxThreads &&
         rows * vecs <= kOneVectorMaxVecs;
}

}  // namespace

RingPlan ring_plan(std::int64_t vecs, std::size_t stage_bytes, std::size_t shared_memory_per_block) {
  RingPlan plan;
  if (vecs <= 0 || stage_bytes == 0) return plan;
  const int per_thread = vecs <= 2 * kRingThreads ? 2 : vecs <= 4 * kRingThreads ? 4 : 0;
  if (per_thread == 0) return plan;
  const std::size_t wanted = kRingBytesPerSm / (kRingStagesPerBlock * stage_bytes);
  const int blocks = static_cast<int>(std::clamp<std::size_t>(wanted, 1, kMaxRingBlocksPerSm));
  const std::size_t share = std::min(kRingBytesPerSm / blocks,
                                     shared_memory_per_block > kMaxScratchBytes
                                         ? shared_memory_per_block - kMaxScratchBytes
                                         : 0);
  const int stages = static_cast<int>(std::min<std::size_t>(kMaxRingStages, share / stage_bytes));
  if (stages < 2) return plan;
  return {per_thread, blocks, stages};
}

std::size_t forward_shared_bytes(const ForwardProblem& p, NormVariant variant, int vecs_per_thread) {
  std::size_t bytes = staged_param_bytes(p.kind, p.cols);
  if (variant == NormVariant::kPipelined) {
    const std::int64_t vecs = p.cols / (16 / p.element_bytes);
    bytes += ring_bytes(forward_row_split(vecs, vecs_per_thread).threads,
                        ring_chunks(p.element_bytes, p.residual_bytes), vecs, ring_stages(p.kind));
  }
  return bytes;
}

// Choice per row (H100, ptxas for sm_90a: every register configuration <= 64 registers,
// no spills, so 4 blocks of 256 threads per SM, 5 for RMSNorm (kMinBlocksPerSm), unless
// shared memory says fewer):
//   16-bit N <= 32 (fp32 N <= 16): 1 vector per thread, 1 ... 4 threads per row, 256 ... 64
//     rows per block.
//   16-bit N <= 1024 (fp32 N <= 512): 4 vectors per thread, 4 ... 32 threads per row, 64 ... 8
//     rows per block; kPipelined with 16-bit N <= 128 and at most 131072 vectors in all: 1
//     vector per thread, 4 ... 16 threads per row (one_vector_per_thread).
//   16-bit N 2048 / 4096 / 8192: 64 / 128 / 256 threads per row, 4 vectors each; kRegisters
//     stages tables of 4 B per column (RMSNorm) or 8 B (LayerNorm): LayerNorm N = 8192 takes
//     64 KB, so 3 blocks per SM.
//   16-bit N 16384 / 32768: 512 / 1024 threads per row (one row per block): RMSNorm 2 / 1
//     blocks per SM (registers), kRegisters' LayerNorm N = 16384 1 block (128 KB of tables).
//   kRows: the same threads per row, one row group per block, no tables (any N <= 4096
//     vectors; 27-64 registers, no spills). Longer rows (16-bit N <= 262144, fp32 N <=
//     131072), and kAuto's choice for them: a cluster of 2 / 4 / 8 blocks of 1024 threads
//     per row, one block per SM.
//   kPipelined (kAuto's choice up to 128 vectors, the fused add's up to 256): kRegisters'
//     threads per row, 40-64 registers, no spills, plus its ring in shared memory: one row group for RMSNorm and the fused add (one group per block), two for
//     LayerNorm's persistent walk. 16-bit RMSNorm N = 4096 32 KB per block (5 blocks per SM),
//     N = 8192 48 KB (4), N = 32768 192 KB (1); LayerNorm N = 4096 64 KB (3), N = 5120 60 KB
//     (3), N = 8192 96 KB (2), N = 16384 1 block of 512; the fused add's residual doubles the
//     ring (fp32: triples it): N = 4096 48 KB (4). No room for 16-bit LayerNorm N = 32768.
//   kRegisters' LayerNorm 16-bit N > 29008 (tables over the 227 KB per block), rows beyond
//   kRows' cluster or whose cluster cannot be resident, and unaligned rows: two passes.
ForwardPlan plan_forward(const ForwardProblem& p, NormVariant requested,
                         std::size_t shared_memory_per_block) {
  const int v = 16 / p.element_bytes;
  ForwardPlan plan;
  plan.vecs = (p.cols + v - 1) / v;
  plan.vectorized = p.aligned;
  NormVariant chosen = requested == NormVariant::kAuto
                           ? auto_register_variant(plan.vecs, p.residual_bytes > 0)
                           : requested;
  if (requested == NormVariant::kAuto && plan.vecs > kBlockVecs) chosen = NormVariant::kRows;
  const RingPlan ring =
      ring_plan(plan.vecs, static_cast<std::size_t>(p.cols) * p.element_bytes, shared_memory_per_block);
  if (requested == NormVariant::kAuto && auto_ring(p, plan.vecs, ring)) chosen = NormVariant::kRing;
  const std::int64_t max_vecs = chosen == NormVariant::kRows ? kMaxClusterVecs : kBlockVecs;
  if (chosen != NormVariant::kTwoPass && !use_registers(requested, p.aligned, plan.vecs, max_vecs)) {
    chosen = NormVariant::kTwoPass;
  }
  if (one_vector_per_thread(chosen, p.rows, plan.vecs)) plan.vecs_per_thread = 1;
  // kAuto's kPipelined without the shared memory for its ring: kRegisters, if its tables fit.
  if (requested == NormVariant::kAuto && chosen == NormVariant::kPipelined &&
      forward_shared_bytes(p, chosen, plan.vecs_per_thread) + kMaxScratchBytes >
          shared_memory_per_block) {
    chosen = NormVariant::kRegisters;
    plan.vecs_per_thread = kForwardVecsPerThread;
  }
  if (chosen == NormVariant::kRegisters || chosen == NormVariant::kPipelined) {
    const bool pipelined = chosen == NormVariant::kPipelined;
    const std::size_t needed = forward_shared_bytes(p, chosen, plan.vecs_per_thread);
    if (needed + kMaxScratchBytes > shared_memory_per_block) {
      if (requested == chosen) {
        throw UnsupportedVariantError(
            std::string("trainscale norm: the ") + variant_name(chosen) + " variant stages " +
            (pipelined ? "the row's parameters and its ring of row groups" : "the row's parameters") +
            " in shared memory, which has no room for " + std::to_string(p.cols) + " columns");
      }
      chosen = NormVariant::kTwoPass;
    }
  }
  if (chosen == NormVariant::kRing) {
    if (!p.bulk_copies) {
      throw UnsupportedVariantError(
          "trainscale norm: the ring variant needs bulk copies (sm_90 or newer)");
    }
    plan.ring = ring;
    if (!p.aligned || p.residual_bytes > 0 || plan.ring.vecs_per_thread == 0) {
      throw UnsupportedVariantError(
          std::string("trainscale norm: the ring variant needs 16-byte aligned rows of at most ") +
          std::to_string(4 * kRingThreads) + " vectors, without a residual, and two of them in " +
          "shared memory; given " + std::to_string(p.cols) + " columns" +
          (p.residual_bytes > 0 ? " with a residual" : ""));
    }
  }
  plan.variant = chosen;
  plan.persistent = persistent_grid(p.kind, chosen);
  plan.ring_stages = chosen == NormVariant::kPipelined ? ring_stages(p.kind) : 0;
  return plan;
}

}  // namespace trainscale::ops::norm
