// GPU-test helper for tensors of more than 2^31 elements (large_tensor_cuda_test): a device
// matrix whose row r holds pattern r % P of P host rows, filled on the device by doubling
// copies, so the host never holds the whole tensor. A kernel that forms an element's offset in
// 32 bits reads or writes another row (or another address) past element 2^31 / byte 2^32; the
// rows sampled there then fail against their pattern's reference. P is prime so that no
// power-of-two wrap maps a row onto one of the same pattern.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/host_dtype.h"
#include "util/test_util.h"

namespace trainscale::test {

inline constexpr std::int64_t kPatternRows = 61;

// Rows of `cols` elements such that rows x cols exceeds 2^31 by `extra_rows` rows.
inline std::int64_t rows_past_int32(std::int64_t cols, std::int64_t extra_rows = 64) {
  return ((std::int64_t{1} << 31) + cols - 1) / cols + extra_rows;
}

// Rows worth checking in a [rows, cols] matrix of `elem_bytes` elements: the first, one per
// pattern offset near the start, those around element 2^31, byte 2^32 and row 2^31, and the last.
inline std::vector<std::int64_t> probe_rows(std::int64_t rows, std::int64_t cols,
                                            std::int64_t elem_bytes) {
  std::vector<std::int64_t> out = {0, 1, kPatternRows - 1, kPatternRows};
  for (const std::int64_t edge : {(std::int64_t{1} << 31) / cols,
                                  (std::int64_t{1} << 32) / (cols * elem_bytes), std::int64_t{1} << 31}) {
    for (std::int64_t r = edge - 1; r <= edge + 1; ++r) {
      if (r >= 0 && r < rows) out.push_back(r);
    }
  }
  out.push_back(rows - 2);
  out.push_back(rows - 1);
  return out;
}

// Free device memory for `bytes` more (a 1 GiB margin for the library's scratch).
inline bool device_memory_free(std::int64_t bytes) {
  std::size_t free_bytes = 0, total = 0;
  if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) return false;
  return static_cast<std::int64_t>(free_bytes) > bytes + (std::int64_t{1} << 30);
}

#define TS_REQUIRE_DEVICE_MEMORY(bytes)                                                       \
  do {                                                                                        \
    if (!::trainscale::test::device_memory_free(bytes))                                       \
      GTEST_SKIP() << "needs " << (bytes) / (1 << 20) << " MiB of free device memory";        \
  } while (0)

class RepeatedRows {
 public:
  // Every byte 0xFF (NaN in the float dtypes): an output.
  RepeatedRows(DType dt, std::int64_t rows, std::int64_t cols) : dt_(dt), rows_(rows), cols_(cols) {
    allocate();
    check(cudaMemset(data_, 0xFF, bytes()), "cudaMemset");
  }

  // Row r = patterns[r % P] (P = patterns.size() / cols rows, row-major, rounded to dt).
  RepeatedRows(DType dt, std::int64_t rows, std::int64_t cols, const std::vector<double>& patterns)
      : dt_(dt), rows_(rows), cols_(cols) {
    allocate();
    const auto p = static_cast<std::int64_t>(patterns.size()) / cols;
    const std::int64_t first = std::min(p, rows);
    HostTensor host(dt, {first, cols});
    for (std::int64_t e = 0; e < first * cols; ++e) host.set(e, patterns[e]);
    check(cudaMemcpy(data_, host.data(), first * row_bytes(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    // Rows [0, filled) hold their patterns; copying a multiple of P rows keeps r % P.
    for (std::int64_t filled = first; filled < rows;) {
      const std::int64_t n = std::min(filled / p * p, rows - filled);
      check(cudaMemcpy(static_cast<char*>(data_) + filled * row_bytes(), data_, n * row_bytes(),
                       cudaMemcpyDeviceToDevice),
            "cudaMemcpy D2D");
      filled += n;
    }
  }

  ~RepeatedRows() { cudaFree(data_); }
  RepeatedRows(const RepeatedRows&) = delete;
  RepeatedRows& operator=(const RepeatedRows&) = delete;

  TensorView view() const {
    return TensorView(data_, dt_, {rows_, cols_}, {cols_, 1}, Device::cuda(0));
  }
  // The same memory as another shape (contiguous).
  TensorView view(const std::vector<std::int64_t>& shape) const {
    std::vector<std::int64_t> strides(shape.size(), 1);
    for (std::size_t d = shape.size() - 1; d > 0; --d) strides[d - 1] = strides[d] * shape[d];
    return TensorView::from_arrays(data_, dt_, static_cast<int>(shape.size()), shape.data(),
                                   strides.data(), Device::cuda(0));
  }
  void* data() const { return data_; }

  // Elements [first, first + count) of row r (synchronizes the device).
  std::vector<double> row(std::int64_t r, std::int64_t first = 0, std::int64_t count = -1) const {
    if (count < 0) count = cols_ - first;
    HostTensor host(dt_, {count});
    check(cudaDeviceSynchronize(), "kernel (cudaDeviceSynchronize)");
    check(cudaMemcpy(host.data(), static_cast<const char*>(data_) + (r * cols_ + first) * elem_bytes(),
                     count * elem_bytes(), cudaMemcpyDeviceToHost),
          "cudaMemcpy D2H");
    return host.values();
  }

  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }
  std::int64_t bytes() const { return rows_ * row_bytes(); }

 private:
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw Error(std::string("test CUDA call ") + what + ": " + cudaGetErrorString(e));
  }
  std::int64_t elem_bytes() const { return static_cast<std::int64_t>(dtype_size(dt_)); }
  std::int64_t row_bytes() const { return cols_ * elem_bytes(); }
  void allocate() { check(cudaMalloc(&data_, bytes()), "cudaMalloc"); }

  DType dt_;
  std::int64_t rows_, cols_;
  void* data_ = nullptr;
};

// How many of `rows` rows hold each pattern (row r: r % kPatternRows).
inline std::vector<double> pattern_counts(std::int64_t rows) {
  std::vector<double> count(kPatternRows, static_cast<double>(rows / kPatternRows));
  for (std::int64_t p = 0; p < rows % kPatternRows; ++p) count[p] += 1;
  return count;
}

}  // namespace trainscale::test
