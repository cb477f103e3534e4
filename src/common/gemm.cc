#include "common/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
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

// What the algorithm choice depends on (with the batch, unless batch_invariant).
using AlgoKey = std::tuple<int, int, int, int, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                           std::int64_t, std::int64_t, bool, bool, int, int, int, std::size_t, bool,
                           std::int64_t, std::int64_t, std::int64_t, std::int64_t>;

void set_batch(cublasLtMatrixLayout_t layout, std::int64_t count, std::int64_t stride, const char* op) {
  const auto n = static_cast<std::int32_t>(count);
  check_cublas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof(n)), op,
               "cublasLtMatrixLayoutSetAttribute (BATCH_COUNT)");
  check_cublas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                sizeof(stride)),
               op, "cublasLtMatrixLayoutSetAttribute (STRIDED_BATCH_OFFSET)");
}

// The three layouts of a call (cuBLASLt's A is our b: out^T = b^T a^T) batched `count` times.
void set_batches(const Descriptors& d, const GemmBatch& batch, std::int64_t count, const char* op) {
  set_batch(d.a, count, batch.stride_b, op);
  set_batch(d.b, count, batch.stride_a, op);
  set_batch(d.d, count, batch.stride_out, op);
}

// One entry per device: algorithms by key, and, for batch-invariant calls, whether the
// algorithm chosen for one product runs a whole batch (count, strides) in one call.
struct Cache {
  std::mutex mutex;
  std::map<std::pair<int, AlgoKey>, cublasLtMatmulAlgo_t> algos;
  std::map<std::tuple<int, AlgoKey, std::int64_t, std::int64_t, std::int64_t, std::int64_t>, bool> batched;
};
Cache& cache() {
  static Cache c;
  return c;
}

}  // namespace

void gemm(const char* op, const GemmOperand& a, const GemmOperand& b, const GemmResult& out,
          const GemmScalars& scalars, void* workspace, std::size_t workspace_bytes,
          cudaStream_t stream, const GemmBatch& batch) {
  if (!(a.cols == b.rows && out.rows == a.rows && out.cols == b.cols && a.dtype == b.dtype && batch.count >= 0 &&
        batch.count <= INT32_MAX))
    throw_op_error(op, "internal GEMM shape mismatch");
  if (out.rows == 0 || out.cols == 0 || batch.count == 0) return;
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
  // Without batch invariance the algorithm is chosen for the batched call itself.
  const bool batched_choice = !batch.batch_invariant && batch.count > 1;
  if (batched_choice) set_batches(d, batch, batch.count, op);

  const void* addend = out.addend != nullptr ? out.addend : out.data;
  const AlgoKey key{static_cast<int>(a.dtype), static_cast<int>(out.dtype), static_cast<int>(ca.op),
                    static_cast<int>(cb.op), a.rows, a.cols, b.cols, a.ld, b.ld, out.ld,
                    scalars.on_device, out.row_bias != nullptr, alignment_of(a.data), alignment_of(b.data),
                    std::min(alignment_of(out.data), alignment_of(addend)), workspace_bytes, batch.batch_invariant,
                    batched_choice ? batch.count : 1, batched_choice ? batch.stride_a : 0,
                    batched_choice ? batch.stride_b : 0, batched_choice ? batch.stride_out : 0};
  Cache& c = cache();
  int device = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  cublasLtMatmulAlgo_t algo{};
  bool one_call = true;
  {
    const std::lock_guard<std::mutex> lock(c.mutex);
    auto it = c.algos.find({device, key});
    if (it == c.algos.end()) {
      check_cublas(cublasLtMatmulPreferenceCreate(&d.preference), op, "cublasLtMatmulPreferenceCreate");
      check_cublas(cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                        &workspace_bytes, sizeof(workspace_bytes)),
                   op, "cublasLtMatmulPreferenceSetAttribute");
      if (batch.batch_invariant) {
        const std::uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
        check_cublas(cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                          &none, sizeof(none)),
                     op, "cublasLtMatmulPreferenceSetAttribute (REDUCTION_SCHEME_MASK)");
      }
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
      it = c.algos.emplace(std::pair{device, key}, result.algo).first;
    }
    algo = it->second;
    if (batch.batch_invariant && batch.count > 1) {
      const auto batched_key = std::tuple{device, key, batch.count, batch.stride_a, batch.stride_b, batch.stride_out};
      auto checked = c.batched.find(batched_key);
      if (checked == c.batched.end()) {
        set_batches(d, batch, batch.count, op);
        cublasLtMatmulHeuristicResult_t result{};
        const bool ok = cublasLtMatmulAlgoCheck(handle, d.matmul, d.a, d.b, d.d, d.d, &algo, &result) ==
                            CUBLAS_STATUS_SUCCESS &&
                        result.workspaceSize <= workspace_bytes;
        checked = c.batched.emplace(batched_key, ok).first;
      }
      one_call = checked->second;
      set_batches(d, batch, one_call ? batch.count : 1, op);
    }
  }
  const std::int64_t calls = one_call ? 1 : batch.count;
  const auto in_bytes = static_cast<std::int64_t>(dtype_size(a.dtype)),
             out_bytes = static_cast<std::int64_t>(dtype_size(out.dtype));
  for (std::int64_t i = 0; i < calls; ++i) {
    const auto* pa = static_cast<const char*>(a.data) + i * batch.stride_a * in_bytes;
    const auto* pb = static_cast<const char*>(b.data) + i * batch.stride_b * in_bytes;
    const auto* pc = static_cast<const char*>(addend) + i * batch.stride_out * out_bytes;
    auto* pd = static_cast<char*>(out.data) + i * batch.stride_out * out_bytes;
    check_cublas(cublasLtMatmul(handle, d.matmul, scalars.alpha, pb, d.a, pa, d.b, scalars.beta, pc, d.d, pd, d.d,
                                &algo, workspace, workspace_bytes, stream),
                 op, "cublasLtMatmul");
  }
}

}  // namespace trainscale::detail
