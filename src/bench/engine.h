// Runs the selected cases: builds each, gates every implementation against the reference,
// times those that pass, and turns the samples into rows.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "bench/gate.h"
#include "bench/registry.h"
#include "bench/result.h"
#include "bench/timing.h"

namespace trainscale::bench {

inline constexpr const char* kOursGpu = "trainscale";
inline constexpr const char* kOursCpu = "cpu-ref";
// The reason a GPU run lists a case under `skipped` when the op has no CUDA kernel of ours yet.
inline constexpr const char* kCpuReferenceOnly = "CPU reference only";

struct Selection {
  std::vector<std::string> suites = {"smoke"};       // configs of each, duplicates once
  std::vector<std::string> ops;                    // empty: all
  std::vector<DType> dtypes;                       // empty: all
  std::vector<std::vector<std::int64_t>> configs;  // empty: all
  std::vector<std::string> impls;                  // empty: all
};

struct RunOptions {
  Selection selection;
  bool use_gpu = false;
  int device_index = 0;
  TimingOptions timing;
  std::uint64_t seed = 1;
  GateLimits gate;  // when the gate samples rows or takes a prefix problem
};

// The configs of the suite that pass the filters, in suite order.
std::vector<Config> select_configs(const Registry& registry, const Selection& selection);

// Called before each case: index (0-based), count, case name.
using ProgressCallback = std::function<void(std::size_t index, std::size_t count, const std::string& name)>;

// Fills result.rows / skipped / interrupted (result.env, roofline and suite come from the
// caller and are used for the % of roofline).
void run_cases(const Registry& registry, const RunOptions& options, RunResult& result,
               const ProgressCallback& progress = nullptr);

// Per-case seed: the run's seed mixed with the case name, so filters do not change the data.
std::uint64_t case_seed(std::uint64_t seed, const std::string& case_name);

// Input sets that the launches of a CUDA-graph batch cycle through so that every launch, not only
// the first after the L2 flush, runs cold: between two uses of a set the others move at least
// twice the L2's bytes (at most `batch` sets).
int cold_input_sets(std::int64_t set_bytes, std::int64_t l2_bytes, int batch);

// DRAM's ceiling for a kernel whose bytes are `read_share` reads (the rest writes): the copy's
// up to one read per write, then linear in the share between the measured mixes (copy at 1/2,
// two reads per write at 2/3, reads alone at 1). Reads outrun writes, so a read-heavy kernel can
// pass the copy's bandwidth from DRAM alone.
double memory_ceiling_gbps(const Roofline& roofline, double read_share);

// A cold memory-bound row at least 4x the L2 in size at the mix of one of the measured ceilings
// (one, two or no writes per read) that moves more than that ceiling shows DRAM can do more than
// the stream kernels reached: the ceiling is raised to that row's bandwidth (noted in
// roofline.raised_by) and every memory-bound row's % is taken against the raised ceilings, so
// none passes 100 % by a ceiling measured low.
void raise_ceilings_to_rows(RunResult& result);

// % of the measured ceiling `bound` (and, memory-bound, the read share) selects; nullopt without
// a roofline.
std::optional<double> percent_of_roofline(const std::optional<Roofline>& roofline, Bound bound, double gbps,
                                          double tflops, double read_share);

}  // namespace trainscale::bench
