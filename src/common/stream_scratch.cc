#include "common/stream_scratch.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "common/cuda_check.h"

namespace trainscale::detail {

void* stream_scratch(std::size_t bytes, cudaStream_t stream, const char* user, const char* op) {
  struct Buffer {
    void* data = nullptr;
    std::size_t bytes = 0;
  };
  static std::mutex mutex;
  static std::map<std::tuple<int, cudaStream_t, std::string>, Buffer> buffers;
  int device = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  const std::lock_guard<std::mutex> lock(mutex);
  Buffer& b = buffers[{device, stream, user}];
  if (b.bytes < bytes) {
    if (b.data != nullptr) {
      check_cuda(cudaStreamSynchronize(stream), op, "cudaStreamSynchronize (scratch)");
      check_cuda(cudaFree(b.data), op, "cudaFree (scratch)");
      b = {};
    }
    const std::size_t size = std::max<std::size_t>(bytes, 4096);
    check_cuda(cudaMalloc(&b.data, size), op, "cudaMalloc (scratch)");
    b.bytes = size;
  }
  return b.data;
}

}  // namespace trainscale::detail
