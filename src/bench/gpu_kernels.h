// The engine's own CUDA kernels: SM clock probe, STREAM-like bandwidth kernels, random fill.
#pragma once

#if TRAINSCALE_HAVE_CUDA
#include <cuda_runtime.h>

#include <cstdint>

#include "bench/random_fill.h"

namespace trainscale::bench {

// SM clock in MHz from clock64() cycles over globaltimer nanoseconds in a ~1 ms spin on one
// SM (synchronizes the stream).
double probe_sm_clock_mhz(cudaStream_t stream);

// 16-byte vectorized grid-stride kernels over `bytes` (a multiple of 16).
void launch_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t stream);
// dst = a ^ b over `bytes` of each: two bytes read per byte written.
void launch_read2_write1(void* dst, const void* a, const void* b, std::size_t bytes, cudaStream_t stream);
// Reads every byte; writes one word to `sink` only when a (never met) condition holds, so the
// loads cannot be optimized away.
void launch_read(const void* src, std::size_t bytes, void* sink, cudaStream_t stream);

// Holds `stream` until the host writes a non-zero value to `*release` (host-mapped memory seen
// through `release_device`), so that the work queued behind it runs back to back however long
// the host takes to queue it; gives up after `timeout_ns` and writes 1 to `*timed_out_device`
// (the host queued work that waits for this stream, which would otherwise deadlock).
void launch_hold_stream(const int* release_device, int* timed_out_device, unsigned long long timeout_ns,
                        cudaStream_t stream);

// A kernel that does nothing: what launching and timing cost by themselves.
void launch_empty(cudaStream_t stream);

// `count` elements of fill.dtype: element i = random_value(fill, i), as the host fill makes it.
void launch_fill_random(void* dst, std::int64_t count, const RandomFill& fill, cudaStream_t stream);

}  // namespace trainscale::bench
#endif
