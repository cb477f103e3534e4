#include "bench/baselines/cublaslt_gemm.h"

#if TRAINSCALE_HAVE_CUDA
#include <cublasLt.h>

#include <string>

#include "bench/cuda_util.h"

namespace trainscale::bench {
namespace {

void cublas_check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw Error(std::string("trainscale-bench: ") + what + ": cuBLAS status " + std::to_string(static_cast<int>(status)));
  }
}

constexpr std::int64_t kWorkspaceBytes = 64ll << 20;

}  // namespace

struct CublasLtGemm::Plan {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  void* workspace = nullptr;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (op) cublasLtMatmulDescDestroy(op);
    if (handle) cublasLtDestroy(handle);
    cudaFree(workspace);
  }
};

// Row-major D = A B is column-major D^T = B^T A^T: cuBLASLt sees B as the first operand.
CublasLtGemm::CublasLtGemm(std::int64_t m, std::int64_t n, std::int64_t k)
    : plan_(std::make_unique<Plan>()), workspace_bytes_(kWorkspaceBytes) {
  cublas_check(cublasLtCreate(&plan_->handle), "cublasLtCreate");
  cublas_check(cublasLtMatmulDescCreate(&plan_->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  cublas_check(cublasLtMatrixLayoutCreate(&plan_->b, CUDA_R_16BF, n, k, n), "layout B");
  cublas_check(cublasLtMatrixLayoutCreate(&plan_->a, CUDA_R_16BF, k, m, k), "layout A");
  cublas_check(cublasLtMatrixLayoutCreate(&plan_->d, CUDA_R_16BF, n, m, n), "layout D");
  cuda_check(cudaMalloc(&plan_->workspace, kWorkspaceBytes), "cudaMalloc (cuBLASLt workspace)");
  cublasLtMatmulPreference_t pref = nullptr;
  cublas_check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const std::uint64_t ws = kWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(plan_->handle, plan_->op, plan_->b, plan_->a, plan_->d,
                                                               plan_->d, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  cublas_check(status, "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0) throw Error("trainscale-bench: cuBLASLt found no bf16 GEMM algorithm");
  plan_->algo = result.algo;
}

CublasLtGemm::~CublasLtGemm() = default;

void CublasLtGemm::run(const void* a, const void* b, void* d, cudaStream_t stream) const {
  const float alpha = 1.0f, beta = 0.0f;
  cublas_check(cublasLtMatmul(plan_->handle, plan_->op, &alpha, b, plan_->b, a, plan_->a, &beta, d, plan_->d, d,
                              plan_->d, &plan_->algo, plan_->workspace, static_cast<std::size_t>(workspace_bytes_), stream),
               "cublasLtMatmul");
}

}  // namespace trainscale::bench
#endif
