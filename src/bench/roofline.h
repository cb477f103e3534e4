// The measured roofline of a GPU: HBM copy and read bandwidth (STREAM-like 16-byte vectorized
// kernels over >= 2 GiB; copy counts bytes read + written) and bf16 GEMM peak (cuBLASLt,
// 8192^3, random data). Measured once and cached per GPU and driver.
#pragma once

#include <optional>
#include <ostream>
#include <string>

#include "bench/environment.h"
#include "bench/result.h"
#include "bench/timing.h"

namespace trainscale::bench {

// $XDG_CACHE_HOME/trainscale/roofline-<gpu>-<driver>.json, else ~/.cache/trainscale/...
std::string roofline_cache_path(const Environment& env);

// The cached roofline for this GPU and driver, or a fresh measurement (then cached) when there
// is none or `refresh` is set. CUDA builds with a device only; throws trainscale::Error
// otherwise or when the GEMM fails its correctness check.
Roofline load_or_measure_roofline(const Environment& env, const TimingOptions& timing, bool refresh);

void write_roofline_markdown(std::ostream& out, const Roofline& roofline, const Environment& env);

}  // namespace trainscale::bench
