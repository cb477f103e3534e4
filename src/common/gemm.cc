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

// What the algorithm choice depends on (with the batch, unless batch_invariant; pointer_array:
// the algorithm is for cuBLASLt's pointer-array batch, chosen for one product).
using AlgoKey = std::tuple<int, int, int, int, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                           std::int64_t, std::int64_t, bool, bool, int, int, int, std::size_t, bool,
                           std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool>;

void set_attribute(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attribute, const void* value,
                   std::size_t bytes, const char* op) {
  check_cublas(cublasLtMatrixLayoutSetAttribute(layout, attribute, value, bytes), op,
               "cublasLtMatrixLayoutSetAttribute");
}

void set_batch(cublasLtMatrixLayout_t layout, std::int64_t count, std::int64_t stride, const char* op) {
  const auto n = static_cast<std::int32_t>(count);
  set_attribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof(n), op);
  set_attribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride), op);
}

// The three layouts of a call (cuBLASLt's A is our b: out^T = b^T a^T) batched `count` times.
void set_batches(const Descriptors& d, const GemmBatch& batch, std::int64_t count, const char* op) {
  set_batch(d.a, count, batch.stride_b, op);
  set_batch(d.b, count, batch.stride_a, op);
  set_batch(d.d, count, batch.stride_out, op);
}

void set_pointer_arrays(const Descriptors& d, std::int64_t count, const char* op) {
  const auto n = static_cast<std::int32_t>(count);
  const std::uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
  for (cublasLtMatrixLayout_t layout : {d.a, d.b, d.d}) {
    set_attribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof(mode), op);
    set_attribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof(n), op);
  }
}

// One entry per device: algorithms by key, and, for batch-invariant calls, whether the
// algorithm chosen for one product runs a whole batch (count, strides; pointer arrays: count)
// in one call.
struct Cache {
  std::mutex mutex;
  std::map<std::pair<int, AlgoKey>, cublasLtMatmulAlgo_t> algos;
  std::map<std::tuple<int, AlgoKey, std::int64_t, std::int64_t, std::int64_t, std::int64_t>, bool> batched;
};
Cache& cache() {
  static Cache c;
  return c;
}

void check_shapes(const char* op, const GemmOperand& a, const GemmOperand& b, const GemmResult& out,
                  std::int64_t count) {
  if (!(a.cols == b.rows && out.rows == a.rows && out.cols == b.cols && a.dtype == b.dtype && count >= 0 &&
        count <= INT32_MAX))
    throw_op_error(op, "internal GEMM shape mismatch");
}

// A product's descriptors (unbatched) and what its algorithm depends on.
struct Product {
  Descriptors d;
  AlgoKey key;
};
void describe(const char* op, const GemmOperand& a, const GemmOperand& b, const GemmResult& out,
              const GemmScalars& scalars, std::size_t workspace_bytes, const GemmBatch& batch, bool pointer_array,
              Product& product) {
  if (pointer_array && out.row_bias != nullptr) throw_op_error(op, "internal: no bias with pointer arrays");
  const ColumnMajor ca = column_major(b), cb = column_major(a);  // out^T = b^T a^T
  const cudaDataType_t in_type = cuda_type(a.dtype, op), out_type = cuda_type(out.dtype, op);
  Descriptors& d = product.d;
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
  if (pointer_array) {
    set_pointer_arrays(d, 1, op);
  } else if (batched_choice) {
    set_batches(d, batch, batch.count, op);
  }
  const void* addend = out.addend != nullptr ? out.addend : out.data;
  product.key = AlgoKey{static_cast<int>(a.dtype), static_cast<int>(out.dtype), static_cast<int>(ca.op),
                        static_cast<int>(cb.op), a.rows, a.cols, b.cols, a.ld, b.ld, out.ld,
                        scalars.on_device, out.row_bias != nullptr, alignment_of(a.data), alignment_of(b.data),
                        std::min(alignment_of(out.data), alignment_of(addend)), workspace_bytes,
                        batch.batch_invariant || pointer_array, batched_choice ? batch.count : 1,
                        batched_choice ? batch.stride_a : 0, batched_choice ? batch.stride_b : 0,
                        batched_choice ? batch.stride_out : 0, pointer_array};
}

// The product's algorithm (cuBLASLt's heuristic, once per device and key; batch-invariant keys
// exclude split-K reductions). Call with the cache's mutex held.
cublasLtMatmulAlgo_t algorithm(const char* op, cublasLtHandle_t handle, int device, Product& product,
                               std::size_t workspace_bytes) {
  Cache& c = cache();
  auto it = c.algos.find({device, product.key});
  if (it != c.algos.end()) return it->second;
  Descriptors& d = product.d;
  check_cublas(cublasLtMatmulPreferenceCreate(&d.preference), op, "cublasLtMatmulPreferenceCreate");
  check_cublas(cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &workspace_bytes, sizeof(workspace_bytes)),
               op, "cublasLtMatmulPreferenceSetAttribute");
  if (std::get<16>(product.key)) {  // batch-invariant
    const std::uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    check_cublas(cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                      &none, sizeof(none)),
                 op, "cublasLtMatmulPreferenceSetAttribute (REDUCTION_SCHEME_MASK)");
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(handle, d.matmul, d.a, d.b, d.d, d.d, d.preference, 1, &result, &found);
  // A pointer-array key cuBLASLt cannot serve is answered "none" (the caller falls back).
  const bool pointer_array = std::get<21>(product.key);
  if (!pointer_array) check_cublas(status, op, "cublasLtMatmulAlgoGetHeuristic");
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) {
    if (pointer_array) return c.algos.emplace(std::pair{device, product.key}, cublasLtMatmulAlgo_t{}).first->second;
    const auto& k = product.key;
    throw_op_error(op, "cuBLASLt has no algorithm for a " + std::to_string(std::get<4>(k)) + "x" +
                           std::to_string(std::get<5>(k)) + " @ " + std::to_string(std::get<5>(k)) + "x" +
                           std::to_string(std::get<6>(k)) + " product of " +
                           dtype_name(static_cast<DType>(std::get<0>(k))));
  }
  return c.algos.emplace(std::pair{device, product.key}, result.algo).first->second;
}

bool is_empty(const cublasLtMatmulAlgo_t& algo) {
  for (std::uint64_t word : algo.data) {
    if (word != 0) return false;
  }
  return true;
}

// Whether `algo`, chosen for one product, runs the batch the layouts now describe in one call
// (once per device, key and batch). Call with the cache's mutex held.
bool runs_batch(cublasLtHandle_t handle, int device, const Product& product,
                const cublasLtMatmulAlgo_t& algo, std::size_t workspace_bytes, std::int64_t count,
                std::int64_t stride_a, std::int64_t stride_b, std::int64_t stride_out) {
  Cache& c = cache();
  const auto batched_key = std::tuple{device, product.key, count, stride_a, stride_b, stride_out};
  auto checked = c.batched.find(batched_key);
  if (checked == c.batched.end()) {
    const Descriptors& d = product.d;
    cublasLtMatmulHeuristicResult_t result{};
    const bool ok = !is_empty(algo) &&
                    cublasLtMatmulAlgoCheck(handle, d.matmul, d.a, d.b, d.d, d.d, &algo, &result) ==
                        CUBLAS_STATUS_SUCCESS &&
                    result.workspaceSize <= workspace_bytes;
    checked = c.batched.emplace(batched_key, ok).first;
  }
  return checked->second;
}

int current_device(const char* op) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  return device;
}

}  // namespace

void gemm(const char* op, const GemmOperand& a, const GemmOperand& b, const GemmResult& out,
          const GemmScalars& scalars, void* workspace, std::size_t workspace_bytes,
          cudaStream_t stream, const GemmBatch& batch) {
  check_shapes(op, a, b, out, batch.count);
  if (out.rows == 0 || out.cols == 0 || batch.count == 0) return;
  Product product;
  describe(op, a, b, out, scalars, workspace_bytes, batch, false, product);
  cublasLtHandle_t handle = handle_for_current_device(op);
  const int device = current_device(op);
  Cache& c = cache();
  cublasLtMatmulAlgo_t algo{};
  bool one_call = true;
  {
    const std::lock_guard<std::mutex> lock(c.mutex);
    algo = algorithm(op, handle, device, product, workspace_bytes);
    if (batch.batch_invariant && batch.count > 1) {
      set_batches(product.d, batch, batch.count, op);
      one_call = runs_batch(handle, device, product, algo, workspace_bytes, batch.count, batch.stride_a,
                            batch.stride_b, batch.stride_out);
      set_batches(product.d, batch, one_call ? batch.count : 1, op);
    }
  }
  const Descriptors& d = product.d;
  const void* addend = out.addend != nullptr ? out.addend : out.data;
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

namespace {

// The pointer-array product's descriptors batched `count` times and its algorithm; false when
// cuBLASLt has none that runs the batch in one call.
bool prepare_pointer_arrays(const char* op, const GemmOperand& a, const GemmOperand& b, const GemmResult& out,
                            const GemmScalars& scalars, std::size_t workspace_bytes, std::int64_t count,
                            cublasLtHandle_t handle, Product& product, cublasLtMatmulAlgo_t& algo) {
  describe(op, a, b, out, scalars, workspace_bytes, {.count = count, .batch_invariant = true}, true, product);
  const int device = current_device(op);
  const std::lock_guard<std::mutex> lock(cache().mutex);
  algo = algorithm(op, handle, device, product, workspace_bytes);
  set_pointer_arrays(product.d, count, op);
  return runs_batch(handle, device, product, algo, workspace_bytes, count, 0, 0, 0);
}

}  // namespace

bool gemm_takes_pointer_arrays(const char* op, const GemmOperand& a, const GemmOperand& b, const GemmResult& out,
                               const GemmScalars& scalars, std::size_t workspace_bytes, std::int64_t count) {
  check_shapes(op, a, b, out, count);
  if (count < 1 || out.rows == 0 || out.cols == 0) return false;
  Product product;
  cublasLtMatmulAlgo_t algo{};
  return prepare_pointer_arrays(op, a, b, out, scalars, workspace_bytes, count, handle_for_current_device(op),
                                product, algo);
}

void gemm_pointer_array(const char* op, const GemmOperand& a, const GemmOperand& b, const GemmResult& out,
                        const GemmScalars& scalars, void* workspace, std::size_t workspace_bytes,
                        cudaStream_t stream, const GemmPointerArrays& arrays) {
  check_shapes(op, a, b, out, arrays.count);
  if (out.rows == 0 || out.cols == 0 || arrays.count == 0) return;
  cublasLtHandle_t handle = handle_for_current_device(op);
  Product product;
  cublasLtMatmulAlgo_t algo{};
  if (!prepare_pointer_arrays(op, a, b, out, scalars, workspace_bytes, arrays.count, handle, product, algo))
    throw_op_error(op, "internal: cuBLASLt runs no pointer-array batch of this product");
  const Descriptors& d = product.d;
  check_cublas(cublasLtMatmul(handle, d.matmul, scalars.alpha, arrays.b, d.a, arrays.a, d.b, scalars.beta,
                              arrays.addend, d.d, arrays.out, d.d, &algo, workspace, workspace_bytes, stream),
               op, "cublasLtMatmul (pointer arrays)");
}

}  // namespace trainscale::detail
