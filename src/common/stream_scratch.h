// Device scratch memory a kernel needs between calls (row partials, a tile counter): one buffer
// per (device, stream, user), grown to the largest request and kept for the process. Calls on one
// stream are ordered, so they can share it, and calls on different streams never do. Growing
// frees the old buffer after synchronizing its stream, which a stream being captured into a CUDA
// graph does not allow: make one uncaptured call of the largest size first.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace trainscale::detail {

// At least `bytes` (at least 4 KiB, 256-byte aligned) for `user` (a string literal naming the
// kernel family) on the current device and `stream`; errors name `op`.
void* stream_scratch(std::size_t bytes, cudaStream_t stream, const char* user, const char* op);

}  // namespace trainscale::detail
