// What a result was measured on: device, versions, clocks, commit, date, seed, command line.
#pragma once

#include <cstdint>
#include <string>

namespace trainscale::bench {

struct Environment {
  std::string device = "cpu";  // "cuda" or "cpu"
  // GPU (empty / 0 on the CPU path or when unknown)
  std::string gpu_name;
  std::string compute_capability;  // "9.0"
  int device_index = 0;
  int sm_count = 0;
  std::int64_t l2_bytes = 0;
  std::int64_t memory_bytes = 0;
  std::string driver;        // NVML's driver version, else the CUDA driver API version
  std::string cuda_runtime;  // "13.0"
  std::string cuda_driver;   // highest CUDA version the driver supports
  std::string cudnn;         // "9.19.0"
  std::string cublas;        // "13.0.0"
  std::string clock_source;  // "nvml", "probe" or ""
  double sm_clock_mhz = 0, sm_clock_max_mhz = 0, mem_clock_mhz = 0;
  double power_w = 0, temperature_c = 0;
  // Host
  std::string cpu_name;
  int cpu_threads = 0;
  // Run
  std::string git_commit;
  std::string date_utc;  // ISO 8601
  std::string command_line;
  std::string trainscale_version;
  std::uint64_t seed = 0;
};

// `use_gpu`: fill the GPU fields for CUDA device `device_index` (CUDA builds).
Environment capture_environment(bool use_gpu, int device_index);

// `git rev-parse HEAD` in the source tree at run time ("-dirty" appended when it has local
// changes), else the commit CMake saw at configure time, else "unknown".
std::string git_commit();
std::string utc_now_iso();

// Filesystem-safe form of a name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3".
std::string slug(const std::string& name);

}  // namespace trainscale::bench
