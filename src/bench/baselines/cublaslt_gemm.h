// cuBLASLt bf16 GEMM (fp32 accumulation) through the library's own detail::gemm
// (src/common/gemm.h): the compute ceiling of the roofline.
#pragma once

#if TRAINSCALE_HAVE_CUDA
#include <cuda_runtime.h>

#include <cstdint>

#include "bench/cuda_util.h"

namespace trainscale::bench {

// D[m, n] = A[m, k] @ B[k, n], all row-major bf16 on the device. Owns cuBLASLt's workspace;
// the algorithm is chosen on the first run and kept for the process (detail::gemm).
class CublasLtGemm {
 public:
  CublasLtGemm(std::int64_t m, std::int64_t n, std::int64_t k);

  void run(const void* a, const void* b, void* d, cudaStream_t stream) const;
  std::int64_t workspace_bytes() const { return kWorkspaceBytes; }

 private:
  // What detail::gemm says lets cuBLASLt choose any algorithm.
  static constexpr std::int64_t kWorkspaceBytes = std::int64_t{32} << 20;
  std::int64_t m_, n_, k_;
  DeviceBuffer workspace_;
};

}  // namespace trainscale::bench
#endif
