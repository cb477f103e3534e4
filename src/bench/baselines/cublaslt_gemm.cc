#include "bench/baselines/cublaslt_gemm.h"

#if TRAINSCALE_HAVE_CUDA
#include "common/gemm.h"

namespace trainscale::bench {

CublasLtGemm::CublasLtGemm(std::int64_t m, std::int64_t n, std::int64_t k)
    : m_(m), n_(n), k_(k), workspace_(kWorkspaceBytes, "cudaMalloc (cuBLASLt workspace)") {}

void CublasLtGemm::run(const void* a, const void* b, void* d, cudaStream_t stream) const {
  static constexpr float kOne = 1.0f, kZero = 0.0f;
  detail::gemm("bench_gemm", {a, DType::kBFloat16, m_, k_, k_}, {b, DType::kBFloat16, k_, n_, n_},
               {d, DType::kBFloat16, m_, n_, n_}, {&kOne, &kZero, false}, workspace_.data,
               static_cast<std::size_t>(kWorkspaceBytes), stream);
}

}  // namespace trainscale::bench
#endif
