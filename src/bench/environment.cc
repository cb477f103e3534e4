#include <cstdlib>
#include "bench/environment.h"

#include <dlfcn.h>
#include <array>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <memory>
#include <optional>
#include <thread>

#include "bench/cuda_util.h"
#include "bench/nvml.h"

#if TRAINSCALE_HAVE_CUDA
#include <cublasLt.h>

#include "bench/gpu_kernels.h"
#endif

#ifndef TRAINSCALE_SOURCE_DIR
#define TRAINSCALE_SOURCE_DIR "."
#endif
#ifndef TRAINSCALE_GIT_COMMIT
#define TRAINSCALE_GIT_COMMIT "unknown"
#endif
#ifndef TRAINSCALE_VERSION
#define TRAINSCALE_VERSION "unknown"
#endif

namespace trainscale::bench {
namespace {

// stdout of a shell command, trailing whitespace trimmed; nullopt when it fails.
std::optional<std::string> command_output(const std::string& command) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command.c_str(), "r"), pclose);
  if (!pipe) return std::nullopt;
  std::string out;
  std::array<char, 256> buf;
  while (std::fgets(buf.data(), buf.size(), pipe.get())) out += buf.data();
  if (pclose(pipe.release()) != 0) return std::nullopt;
  while (!out.empty() && std::isspace(static_cast<unsigned char>(out.back()))) out.pop_back();
  return out;
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown";
}

#if TRAINSCALE_HAVE_CUDA
// 13000 -> "13.0" (CUDA's major * 1000 + minor * 10 encoding)
std::string cuda_version_string(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

// 91900 -> "9.19.0", 130000 -> "13.0.0" (major * 10000 + minor * 100 + patch)
std::string library_version_string(std::size_t v) {
  return std::to_string(v / 10000) + "." + std::to_string(v % 10000 / 100) + "." + std::to_string(v % 100);
}

// cudnnGetVersion through dlopen, so the bench does not depend on cuDNN.
std::string cudnn_version() {
  void* lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return "";
  std::string version;
  if (auto get = reinterpret_cast<std::size_t (*)()>(dlsym(lib, "cudnnGetVersion"))) {
    version = library_version_string(get());
  }
  dlclose(lib);
  return version;
}

void capture_gpu(Environment& env, int device_index) {
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, device_index), "cudaGetDeviceProperties");
  env.device = "cuda";
  env.device_index = device_index;
  env.gpu_name = prop.name;
  env.compute_capability = std::to_string(prop.major) + "." + std::to_string(prop.minor);
  env.sm_count = prop.multiProcessorCount;
  env.l2_bytes = prop.l2CacheSize;
  env.memory_bytes = static_cast<std::int64_t>(prop.totalGlobalMem);
  int v = 0;
  if (cudaRuntimeGetVersion(&v) == cudaSuccess) env.cuda_runtime = cuda_version_string(v);
  if (cudaDriverGetVersion(&v) == cudaSuccess) env.cuda_driver = cuda_version_string(v);
  env.driver = env.cuda_driver;
  env.cublas = library_version_string(cublasLtGetVersion());
  env.cudnn = cudnn_version();

  char bus_id[32] = {};
  cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, device_index);
  Nvml* nvml = Nvml::get();
  const auto handle = nvml ? nvml->device(bus_id, device_index) : std::nullopt;
  if (handle) {
    env.clock_source = "nvml";
    env.driver = nvml->driver_version().value_or(env.driver);
    env.sm_clock_mhz = nvml->sm_clock_mhz(*handle).value_or(0);
    env.sm_clock_max_mhz = nvml->max_sm_clock_mhz(*handle).value_or(0);
    env.mem_clock_mhz = nvml->mem_clock_mhz(*handle).value_or(0);
    env.power_w = nvml->power_w(*handle).value_or(0);
    env.temperature_c = nvml->temperature_c(*handle).value_or(0);
  } else {
    env.clock_source = "probe";
    cuda_check(cudaSetDevice(device_index), "cudaSetDevice");
    env.sm_clock_mhz = probe_sm_clock_mhz(nullptr);
  }
}
#endif

}  // namespace

std::string git_commit() {
  // A copy of the tree without .git (an offline GPU host) is told its commit by the caller.
  if (const char* given = std::getenv("TRAINSCALE_GIT_COMMIT"); given && *given) return given;
  const std::string dir = TRAINSCALE_SOURCE_DIR;
  if (auto head = command_output("git -C '" + dir + "' rev-parse HEAD 2>/dev/null")) {
    const auto changes = command_output("git -C '" + dir + "' status --porcelain --untracked-files=no 2>/dev/null");
    return *head + (changes && !changes->empty() ? "-dirty" : "");
  }
  return TRAINSCALE_GIT_COMMIT;
}

std::string utc_now_iso() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return buf;
}

std::string slug(const std::string& name) {
  std::string s;
  for (char ch : name) {
    const auto c = static_cast<unsigned char>(ch);
    if (std::isalnum(c) || ch == '.') {
      s += static_cast<char>(std::tolower(c));
    } else if (!s.empty() && s.back() != '-') {
      s += '-';
    }
  }
  while (!s.empty() && s.back() == '-') s.pop_back();
  return s.empty() ? "unknown" : s;
}

Environment capture_environment(bool use_gpu, int device_index) {
  Environment env;
  env.cpu_name = cpu_name();
  env.cpu_threads = static_cast<int>(std::thread::hardware_concurrency());
  env.git_commit = git_commit();
  env.date_utc = utc_now_iso();
  env.trainscale_version = TRAINSCALE_VERSION;
#if TRAINSCALE_HAVE_CUDA
  if (use_gpu) capture_gpu(env, device_index);
#else
  (void)use_gpu;
  (void)device_index;
#endif
  return env;
}

}  // namespace trainscale::bench
