#include "bench/gpu_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "bench/cuda_util.h"
#include "common/cuda_check.h"
#include "common/dtype.cuh"

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

// Plain (coherent) loads and a grid as large as the copy: the read-only path (ld.global.nc) or
// one resident wave of blocks looping over the buffers stays several percent lower
// (docs/perf/README.md), which would understate the ceiling.
__global__ void copy_kernel(int4* dst, const int4* src, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    dst[i] = src[i];
  }
}

// Two reads per write: the mix of most memory-bound backward passes and of quantization.
__global__ void read2_write1_kernel(int4* dst, const int4* a, const int4* b, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const int4 x = a[i], y = b[i];
    dst[i] = make_int4(x.x ^ y.x, x.y ^ y.y, x.z ^ y.z, x.w ^ y.w);
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

template <class T>
__global__ void fill_random_kernel(T* dst, std::int64_t count, RandomFill fill) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count; i += stride) {
    const double v = random_value(fill, i);  // representable in T: any conversion is exact
    if constexpr (std::is_integral_v<T> || std::is_same_v<T, double>) {
      dst[i] = static_cast<T>(v);
    } else if constexpr (std::is_same_v<T, __nv_fp8_e4m3> || std::is_same_v<T, __nv_fp8_e5m2>) {
      dst[i] = T(static_cast<float>(v));
    } else {
      dst[i] = detail::from_float<T>(static_cast<float>(v));
    }
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

void launch_read2_write1(void* dst, const void* a, const void* b, std::size_t bytes, cudaStream_t stream) {
  const std::size_t n = bytes / sizeof(int4);
  const auto grid = detail::grid_for_tiles(static_cast<std::int64_t>(n), kBlock);
  read2_write1_kernel<<<static_cast<unsigned>(grid), kBlock, 0, stream>>>(
      static_cast<int4*>(dst), static_cast<const int4*>(a), static_cast<const int4*>(b), n);
  cuda_check(cudaGetLastError(), "read2-write1 kernel launch");
}

void launch_read(const void* src, std::size_t bytes, void* sink, cudaStream_t stream) {
  const std::size_t n = bytes / sizeof(int4);
  read_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(static_cast<const int4*>(src), n, static_cast<int*>(sink));
  cuda_check(cudaGetLastError(), "read kernel launch");
}

__global__ void hold_stream_kernel(const volatile int* release, int* timed_out, unsigned long long timeout_ns) {
  unsigned long long t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (*release == 0) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > timeout_ns) {
      *timed_out = 1;
      return;
    }
    __nanosleep(256);
  }
}

void launch_hold_stream(const int* release_device, int* timed_out_device, unsigned long long timeout_ns,
                        cudaStream_t stream) {
  hold_stream_kernel<<<1, 1, 0, stream>>>(release_device, timed_out_device, timeout_ns);
  cuda_check(cudaGetLastError(), "stream hold kernel launch");
}

__global__ void empty_kernel() {}

void launch_empty(cudaStream_t stream) {
  empty_kernel<<<1, 32, 0, stream>>>();
  cuda_check(cudaGetLastError(), "empty kernel launch");
}

void launch_fill_random(void* dst, std::int64_t count, const RandomFill& fill, cudaStream_t stream) {
  if (count <= 0) return;
  const auto launch = [&](auto* typed) {
    fill_random_kernel<<<grid_for(static_cast<std::size_t>(count), kBlock), kBlock, 0, stream>>>(typed, count, fill);
  };
  switch (fill.dtype) {
    case DType::kFloat64: launch(static_cast<double*>(dst)); break;
    case DType::kFloat32: launch(static_cast<float*>(dst)); break;
    case DType::kFloat16: launch(static_cast<__half*>(dst)); break;
    case DType::kBFloat16: launch(static_cast<__nv_bfloat16*>(dst)); break;
    case DType::kFloat8E4M3: launch(static_cast<__nv_fp8_e4m3*>(dst)); break;
    case DType::kFloat8E5M2: launch(static_cast<__nv_fp8_e5m2*>(dst)); break;
    case DType::kInt32: launch(static_cast<std::int32_t*>(dst)); break;
    case DType::kInt64: launch(static_cast<std::int64_t*>(dst)); break;
  }
  cuda_check(cudaGetLastError(), "random fill launch");
}

}  // namespace trainscale::bench
