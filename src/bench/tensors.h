// Owning, contiguous tensors on the host or a CUDA device, and the host-side data movement the
// engine needs: seeded random fill, NaN poisoning, dtype conversion and row gathering.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "trainscale/tensor.h"

namespace trainscale::bench {

class OwnedTensor {
 public:
  OwnedTensor() = default;
  OwnedTensor(DType dtype, std::span<const std::int64_t> shape, Device device);
  ~OwnedTensor();
  OwnedTensor(OwnedTensor&& other) noexcept;
  OwnedTensor& operator=(OwnedTensor&& other) noexcept;
  OwnedTensor(const OwnedTensor&) = delete;
  OwnedTensor& operator=(const OwnedTensor&) = delete;

  const TensorView& view() const { return view_; }
  std::int64_t bytes() const { return bytes_; }

 private:
  void release();
  TensorView view_;
  std::int64_t bytes_ = 0;
};

std::int64_t tensor_bytes(DType dtype, std::span<const std::int64_t> shape);

// Uniform in [lo, hi] (integers: uniform over [lo, hi]), rounded to the dtype. The values
// depend only on the seed, not on the thread count. Host views only.
void fill_uniform(const TensorView& t, double lo, double hi, std::uint64_t seed);
// Every byte 0xFF: NaN in every float dtype (so unwritten outputs fail the gate).
void poison(const TensorView& t);
// Byte copy between two views of one dtype and size, on any devices.
void copy_tensor(const TensorView& dst, const TensorView& src);
// Elementwise dtype conversion on the host, through double.
void convert_tensor(const TensorView& dst, const TensorView& src);
// dst row r <- src row rows[r], where a row is everything under dim 0. dst on the host, src
// on the host or a CUDA device (so sampled checks copy only the rows they need).
void gather_rows(const TensorView& dst, const TensorView& src, std::span<const std::int64_t> rows);
// Host view's elements as doubles.
std::vector<double> to_doubles(const TensorView& t);

}  // namespace trainscale::bench
