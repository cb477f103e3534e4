#include "bench/roofline.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <vector>

#include "bench/report_json.h"
#include "bench/reporters.h"
#include "trainscale/error.h"

#if TRAINSCALE_HAVE_CUDA
#include "bench/baselines/cublaslt_gemm.h"
#include "bench/cuda_util.h"
#include "bench/gate.h"
#include "bench/gpu_kernels.h"
#include "bench/gpu_timing.h"
#include "core/host_dtype.h"
#endif

namespace trainscale::bench {

std::string roofline_cache_path(const Environment& env) {
  std::filesystem::path dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) {
    dir = xdg;
  } else if (const char* home = std::getenv("HOME"); home && *home) {
    dir = std::filesystem::path(home) / ".cache";
  } else {
    dir = std::filesystem::temp_directory_path();
  }
  return (dir / "trainscale" / ("roofline-" + slug(env.gpu_name) + "-" + slug(env.driver) + ".json")).string();
}

#if TRAINSCALE_HAVE_CUDA
namespace {

constexpr std::int64_t kStreamBytes = 2ll << 30;  // per buffer
constexpr std::int64_t kGemmN = 8192;
constexpr int kGemmCheckedElements = 64;

double median_ms(GpuContext& gpu, const TimingOptions& timing, const std::function<void(cudaStream_t)>& launch) {
  TimingOptions plain = timing;
  plain.flush_l2 = false;  // the buffers dwarf the L2
  plain.rotate = 1;
  plain.batch = 1;
  auto timed = gpu.make_source([&](int, cudaStream_t s) { launch(s); }, plain, 1);
  const SampleSet samples = collect_samples(*timed.source, plain, nullptr);
  if (samples.ms.empty()) throw Error("trainscale-bench: roofline measurement interrupted");
  return summarize(samples.ms).median;
}

// A few output elements of the GEMM against fp64 dot products of the same bf16 inputs.
void check_gemm(const void* a, const void* b, const void* d, std::int64_t n) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::int64_t> pick(0, n - 1);
  std::vector<std::uint16_t> row(n), col(n);
  std::vector<double> out, ref;
  for (int e = 0; e < kGemmCheckedElements; ++e) {
    const std::int64_t i = pick(rng), j = pick(rng);
    cuda_check(cudaMemcpy(row.data(), static_cast<const std::uint16_t*>(a) + i * n, n * 2, cudaMemcpyDeviceToHost),
               "cudaMemcpy (GEMM check)");
    cuda_check(cudaMemcpy2D(col.data(), 2, static_cast<const std::uint16_t*>(b) + j, n * 2, 2, n,
                            cudaMemcpyDeviceToHost),
               "cudaMemcpy2D (GEMM check)");
    std::uint16_t value = 0;
    cuda_check(cudaMemcpy(&value, static_cast<const std::uint16_t*>(d) + i * n + j, 2, cudaMemcpyDeviceToHost),
               "cudaMemcpy (GEMM check)");
    double dot = 0;
    for (std::int64_t k = 0; k < n; ++k) dot += detail::bf16_to_double(row[k]) * detail::bf16_to_double(col[k]);
    ref.push_back(dot);
    out.push_back(detail::bf16_to_double(value));
  }
  const ValueCheck check = check_values(out, ref, default_tolerance(DType::kBFloat16));
  if (!check.ok) throw Error("trainscale-bench: cuBLASLt GEMM failed its correctness check: " + check.problem);
}

Roofline measure(const Environment& env, const TimingOptions& timing) {
  GpuContext gpu(env.device_index);
  Roofline r;
  r.gpu = env.gpu_name;
  r.driver = env.driver;
  r.measured_at = utc_now_iso();
  r.source = "measured";

  // Two buffers of 2 GiB, or what fits when the device is smaller.
  const std::int64_t buffer = std::min(kStreamBytes, gpu.free_memory() / 3 / 16 * 16);
  {
    const char* what = "cudaMalloc (roofline)";
    DeviceBuffer src(buffer, what), dst(buffer, what), sink(16, what);
    cuda_check(cudaMemset(src.data, 1, buffer), "cudaMemset (roofline)");
    // The faster of our 16-byte copy kernel and the driver's device-to-device copy: a ceiling
    // set by one copy kernel alone sat up to 1 % under the best memory-bound kernels.
    const double kernel_ms = median_ms(gpu, timing, [&](cudaStream_t s) { launch_copy(dst.data, src.data, buffer, s); });
    const double driver_ms = median_ms(gpu, timing, [&](cudaStream_t s) {
      cuda_check(cudaMemcpyAsync(dst.data, src.data, buffer, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync (roofline)");
    });
    const double copy_ms = std::min(kernel_ms, driver_ms);
    const double read_ms = median_ms(gpu, timing, [&](cudaStream_t s) { launch_read(src.data, buffer, sink.data, s); });
    // The two halves of src into the first half of dst.
    const std::int64_t half = buffer / 32 * 16;
    const double mix_ms = median_ms(gpu, timing, [&](cudaStream_t s) {
      launch_read2_write1(dst.data, src.data, static_cast<const char*>(src.data) + half, half, s);
    });
    r.copy_bytes = 2 * buffer;
    r.read_bytes = buffer;
    r.read2_write1_bytes = 3 * half;
    r.copy_gbps = static_cast<double>(r.copy_bytes) / (copy_ms * 1e-3) / 1e9;
    r.read_gbps = static_cast<double>(r.read_bytes) / (read_ms * 1e-3) / 1e9;
    r.read2_write1_gbps = static_cast<double>(r.read2_write1_bytes) / (mix_ms * 1e-3) / 1e9;
  }
  {
    // Timed as the rows are (the same L2 flush, graph batching since it is tiny): the floor under
    // every row's time, which small shapes are judged against.
    const GpuLaunch empty = [](int, cudaStream_t s) { launch_empty(s); };
    auto timed = gpu.make_source(empty, timing, gpu.choose_batch(empty, timing));
    const SampleSet samples = collect_samples(*timed.source, timing, nullptr);
    if (samples.ms.empty()) throw Error("trainscale-bench: roofline measurement interrupted");
    r.empty_kernel_us = summarize(samples.ms).median * 1e3;
  }

  const std::int64_t n = kGemmN;
  const std::int64_t bytes = n * n * 2;
  const char* what = "cudaMalloc (roofline GEMM)";
  DeviceBuffer a(bytes, what), b(bytes, what), d(bytes, what);
  launch_fill_random(a.data, n * n, RandomFill(1, -1.0, 1.0, DType::kBFloat16), gpu.stream());
  launch_fill_random(b.data, n * n, RandomFill(2, -1.0, 1.0, DType::kBFloat16), gpu.stream());
  CublasLtGemm gemm(n, n, n);
  gemm.run(a.data, b.data, d.data, gpu.stream());
  gpu.synchronize();
  check_gemm(a.data, b.data, d.data, n);
  const double gemm_ms = median_ms(gpu, timing, [&](cudaStream_t s) { gemm.run(a.data, b.data, d.data, s); });
  r.gemm_n = n;
  r.gemm_bf16_tflops = 2.0 * static_cast<double>(n) * n * n / (gemm_ms * 1e-3) / 1e12;
  return r;
}

}  // namespace
#endif

Roofline load_or_measure_roofline(const Environment& env, const TimingOptions& timing, bool refresh) {
  if (env.device != "cuda") throw Error("trainscale-bench: the roofline needs a CUDA device");
  const std::string path = roofline_cache_path(env);
  if (!refresh && std::filesystem::exists(path)) {
    Roofline cached = roofline_from_json(read_json_file(path));
    cached.source = path;
    // Else written before every ceiling was measured.
    if (cached.empty_kernel_us > 0 && cached.read2_write1_gbps > 0) return cached;
  }
#if TRAINSCALE_HAVE_CUDA
  Roofline measured = measure(env, timing);
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (!ec) write_json_file(path, to_json(measured));  // a cache: failing to write it is not an error
  return measured;
#else
  (void)timing;
  throw Error("trainscale-bench: this build has no CUDA support");
#endif
}

void write_roofline_markdown(std::ostream& out, const Roofline& r, const Environment& env) {
  out << "# Measured roofline: " << r.gpu << "\n\n";
  out << "Driver " << r.driver << ", CUDA runtime " << env.cuda_runtime << ", cuBLAS " << env.cublas << ", "
      << env.sm_count << " SMs, L2 " << format_bytes(static_cast<double>(env.l2_bytes)) << ", measured "
      << r.measured_at << " at commit `" << env.git_commit << "`.\n\n";
  out << "| Ceiling | Value | How |\n|---|---:|---|\n";
  out << "| HBM copy bandwidth | " << format_fixed(r.copy_gbps, 0)
      << " GB/s | the faster of a 16-byte vector copy kernel and cudaMemcpyAsync, "
      << format_bytes(static_cast<double>(r.copy_bytes / 2)) << " read + written, bytes counted both ways |\n";
  out << "| HBM read bandwidth | " << format_fixed(r.read_gbps, 0) << " GB/s | 16-byte vector loads over "
      << format_bytes(static_cast<double>(r.read_bytes)) << " |\n";
  out << "| HBM bandwidth, 2 reads per write | " << format_fixed(r.read2_write1_gbps, 0)
      << " GB/s | 16-byte vector kernel, two streams of " << format_bytes(static_cast<double>(r.read2_write1_bytes / 3))
      << " read, one written |\n";
  out << "| bf16 GEMM | " << format_fixed(r.gemm_bf16_tflops, 1) << " TFLOP/s | cuBLASLt " << r.gemm_n << "^3, fp32 "
      << "accumulation, random inputs |\n";
  out << "| Empty kernel | " << format_fixed(r.empty_kernel_us, 2) << " us | timed as the rows are: launch and "
      << "timing overhead, the floor under every row |\n\n";
  out << "Memory-bound rows report % of the bandwidth at their own mix of reads and writes: the copy's "
      << "for one read per write or fewer, then interpolated linearly in the share of bytes read between "
      << "the copy (1/2), two reads per write (2/3) and reads alone (1). Compute-bound rows report % of the "
      << "GEMM peak.\n";
}

}  // namespace trainscale::bench
