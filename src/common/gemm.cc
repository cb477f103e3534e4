#include "common/gemm.h"

#include <cublasLt.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "common/cuda_check.h"
#include "core/check.h"

namespace trainscale::detail {
namespace {

void check_cublas(cublasStatus_t status, const char* op, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw Error(std::string("trainscale::") + op + ": " + what + " failed: " +
                cublasLtGetStatusName(status) + " (" + cublasLtGetStatusString(status) + ")");
  }
}

cudaDataType_t cuda_type(DType t, const char* op) {
  switch (t) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kBFloat16: return CUDA_R_16BF;
    default: break;
  }
  throw_op_error(op, std::string("no GEMM for dtype ") + dtype_name(t));
}

// One cuBLASLt handle per device, created on first use and kept for the process.
cublasLtHandle_t handle_for_current_device(const char* op) {
  static std::mutex mutex;
  static std::map<int, cublasLtHandle_t> handles;
  int device = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = handles.find(device);
  if (it == handles.end()) {
    cublasLtHandle_t h = nullptr;
    check_cublas(cublasLtCreate(&h), op, "cublasLtCreate");
    it = handles.emplace(device, h).first;
  }
  return it->second;
}

// RAII for the descriptors of one call.
struct Descriptors {
  cublasLtMatmulDesc_t matmul = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~Descriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (matmul) cublasLtMatmulDescDestroy(matmul);
  }
};

// The column-major layout cuBLASLt sees for a row-major operand (its transpose: cuBLAS
// computes out^T = b^T a^T), and whether it is to be transposed again.
struct ColumnMajor {
  std::uint64_t rows, cols;
  std::int64_t ld;
  cublasOperation_t op;
};
ColumnMajor column_major(const GemmOperand& m) {
  const auto r = static_cast<std::uint64_t>(m.rows), c = static_cast<std::uint64_t>(m.cols);
  return m.transposed ? ColumnMajor{r, c, m.ld, CUBLAS_OP_T} : ColumnMajor{c, r, m.ld, CUBLAS_OP_N};
}

int alignment_of(const void* p) {
  const auto v = reinterpret_cast<std::uintptr_t>(p);
  for (int a = 16; a > 1; a /= 2) {
    if (v % static_cast<std::uintptr_t>(a) == 0) return a;
  }
  return 1;
}

// What the algorithm choice depends on.
using AlgoKey = std::tuple<int, int, int, int, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                           std::int64_t, std::int64_t, bool, bool, int, int, int, std::size_t>;

}  // namespace

void gemm(const char* op, const GemmOperand& a, const GemmOperand& b, const GemmResult& out,
          const GemmScalars& scalars, void* workspace, std::size_t workspace_bytes,
          cudaStream_t stream) {
  if (!(a.cols == b.rows && out.rows == a.rows && out.cols == b.cols && a.dtype == b.dtype))
    throw_op_error(op, "internal GEMM shape mismatch");
  if (out.rows == 0 || out.cols == 0) return;
  cublasLtHandle_t handle = handle_for_current_device(op);
  const ColumnMajor ca = column_major(b), cb = column_major(a);  // out^T = b^T a^T
  const cudaDataType_t in_type = cuda_type(a.dtype, op), out_type = cuda_type(out.dtype, op);
  Descriptors d;
  check_cublas(cublasLtMatmulDescCreate(&d.matmul, CUBLAS_COMPUTE_32F, CUDA_R_32F), op,
               "cublasLtMatmulDescCreate");
  check_cublas(cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_TRANSA, &ca.op, sizeof(ca.op)),
               op, "cublasLtMatmulDescSetAttribute (TRANSA)");
  check_cublas(cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_TRANSB, &cb.op, sizeof(cb.op)),
               op, "cublasLtMatmulDescSetAttribute (TRANSB)");
  const cublasLtPointerMode_t mode = scalars.on_device ? CUBLASLT_POINTER_MODE_DEVICE : CUBLASLT_POINTER_MODE_HOST;
  check_cublas(cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode, sizeof(mode)),
               op, "cublasLtMatmulDescSetAttribute (POINTER_MODE)");
  if (out.row_bias != nullptr) {
    // out^T's rows are out's columns: cuBLASLt's bias, one value per row of its D.
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    check_cublas(cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
                 op, "cublasLtMatmulDescSetAttribute (EPILOGUE)");
    check_cublas(cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &out.row_bias,
                                                sizeof(out.row_bias)),
                 op, "cublasLtMatmulDescSetAttribute (BIAS_POINTER)");
  }
  check_cublas(cublasLtMatrixLayoutCreate(&d.a, in_type, ca.rows, ca.cols, ca.ld), op, "cublasLtMatrixLayoutCreate");
  check_cublas(cublasLtMatrixLayoutCreate(&d.b, in_type, cb.rows, cb.cols, cb.ld), op, "cublasLtMatrixLayoutCreate");
  check_cublas(cublasLtMatrixLayoutCreate(&d.d, out_type, static_cast<std::uint64_t>(out.cols),
                                          static_cast<std::uint64_t>(out.rows), out.ld),
               op, "cublasLtMatrixLayoutCreate");

  const AlgoKey key{static_cast<int>(a.dtype), static_cast<int>(out.dtype), static_cast<int>(ca.op),
                    static_cast<int>(cb.op), a.rows, a.cols, b.cols, a.ld, b.ld, out.ld,
                    scalars.on_device, out.row_bias != nullptr, alignment_of(a.data), alignment_of(b.data),
                    alignment_of(out.data), workspace_bytes};
  static std::mutex mutex;
  static std::map<std::pair<int, AlgoKey>, cublasLtMatmulAlgo_t> algos;
  int device = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  cublasLtMatmulAlgo_t algo{};
  {
    const std::lock_guard<std::mutex> lock(mutex);
    auto it = algos.find({device, key});
    if (it == algos.end()) {
      check_cublas(cublasLtMatmulPreferenceCreate(&d.preference), op, "cublasLtMatmulPreferenceCreate");
      check_cublas(cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                        &workspace_bytes, sizeof(workspace_bytes)),
                   op, "cublasLtMatmulPreferenceSetAttribute");
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      check_cublas(cublasLtMatmulAlgoGetHeuristic(handle, d.matmul, d.a, d.b, d.d, d.d, d.preference, 1,
                                                  &result, &found),
                   op, "cublasLtMatmulAlgoGetHeuristic");
      if (found == 0) {
        throw_op_error(op, "cuBLASLt has no algorithm for a " + std::to_string(a.rows) + "x" +
                               std::to_string(a.cols) + " @ " + std::to_string(b.rows) + "x" +
                               std::to_string(b.cols) + " product of " + dtype_name(a.dtype));
      }
      it = algos.emplace(std::pair{device, key}, result.algo).first;
    }
    algo = it->second;
  }
  check_cublas(cublasLtMatmul(handle, d.matmul, scalars.alpha, b.data, d.a, a.data, d.b, scalars.beta,
                              out.data, d.d, out.data, d.d, &algo, workspace, workspace_bytes, stream),
               op, "cublasLtMatmul");
}

}  // namespace trainscale::detail
