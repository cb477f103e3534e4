#include "bench/gpu_kernels.h"

#include <cuda_bf16.h>

#include <algorithm>

#include "bench/cuda_util.h"
#include "common/cuda_check.h"

namespace trainscale::bench {
namespace {

__global__ void clock_probe_kernel(long long spin_cycles, unsigned long long* out) {
  unsigned long long t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long c0 = clock64();
  long long c1 = c0;
  while (c1 - c0 < spin_cycles) c1 = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  out[0] = static_cast<unsigned long long>(c1 - c0);
  out[1] = t1 - t0;
}

// Plain (coherent) loads and a grid as large as the copy: on the H100 this reached 3020 GB/s,
// where the read-only path (ld.global.nc) or one resident wave of blocks looping over the
// buffers stayed near 2830 GB/s (docs/perf-notes.md), which understated the ceiling.
__global__ void copy_kernel(int4* dst, const int4* src, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    dst[i] = src[i];
  }
}

__global__ void read_kernel(const int4* __restrict__ src, std::size_t n, int* sink) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  int acc = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const int4 v = src[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x7fffffff) *sink = acc;  // practically never: keeps the loads alive
}

__device__ std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void fill_random_bf16_kernel(__nv_bfloat16* dst, std::size_t count, std::uint64_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count; i += stride) {
    const double u = static_cast<double>(splitmix64(seed ^ i) >> 11) * 0x1.0p-53;  // [0, 1)
    dst[i] = __float2bfloat16(static_cast<float>(2.0 * u - 1.0));
  }
}

// Enough blocks to fill the device a few times over; the loops are grid-stride.
unsigned grid_for(std::size_t n, unsigned block) {
  int device = 0, sms = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  const std::size_t needed = (n + block - 1) / block;
  return static_cast<unsigned>(std::min<std::size_t>(needed, static_cast<std::size_t>(sms) * 8));
}

constexpr unsigned kBlock = 512;

}  // namespace

double probe_sm_clock_mhz(cudaStream_t stream) {
  unsigned long long* out = nullptr;
  cuda_check(cudaMallocAsync(&out, 2 * sizeof(unsigned long long), stream), "cudaMallocAsync (clock probe)");
  clock_probe_kernel<<<1, 1, 0, stream>>>(2'000'000, out);
  cuda_check(cudaGetLastError(), "clock probe launch");
  unsigned long long host[2] = {};
  cuda_check(cudaMemcpyAsync(host, out, sizeof host, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync (clock probe)");
  cuda_check(cudaFreeAsync(out, stream), "cudaFreeAsync (clock probe)");
  cuda_check(cudaStreamSynchronize(stream), "clock probe");
  return host[1] == 0 ? 0.0 : static_cast<double>(host[0]) / static_cast<double>(host[1]) * 1e3;
}

void launch_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  const std::size_t n = bytes / sizeof(int4);
  const auto grid = detail::grid_for_tiles(static_cast<std::int64_t>(n), kBlock);
  copy_kernel<<<static_cast<unsigned>(grid), kBlock, 0, stream>>>(static_cast<int4*>(dst), static_cast<const int4*>(src), n);
  cuda_check(cudaGetLastError(), "copy kernel launch");
}

void launch_read(const void* src, std::size_t bytes, void* sink, cudaStream_t stream) {
  const std::size_t n = bytes / sizeof(int4);
  read_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(static_cast<const int4*>(src), n, static_cast<int*>(sink));
  cuda_check(cudaGetLastError(), "read kernel launch");
}

void launch_fill_random_bf16(void* dst, std::size_t count, std::uint64_t seed, cudaStream_t stream) {
  fill_random_bf16_kernel<<<grid_for(count, 256), 256, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), count, seed);
  cuda_check(cudaGetLastError(), "random fill launch");
}

}  // namespace trainscale::bench
