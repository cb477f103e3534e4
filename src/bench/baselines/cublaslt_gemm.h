// cuBLASLt bf16 GEMM (fp32 accumulation): the compute ceiling of the roofline, and a baseline
// for GEMM-shaped work.
#pragma once

#if TRAINSCALE_HAVE_CUDA
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

namespace trainscale::bench {

// D[m, n] = A[m, k] @ B[k, n], all row-major bf16 on the device.
class CublasLtGemm {
 public:
  CublasLtGemm(std::int64_t m, std::int64_t n, std::int64_t k);
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  void run(const void* a, const void* b, void* d, cudaStream_t stream) const;
  std::int64_t workspace_bytes() const { return workspace_bytes_; }

 private:
  struct Plan;
  std::unique_ptr<Plan> plan_;
  std::int64_t workspace_bytes_ = 0;
};

}  // namespace trainscale::bench
#endif
