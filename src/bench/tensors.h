// Owning, contiguous tensors on the host or a CUDA device, and the data movement the engine
// needs: counter-based random fill (where the tensor lives), NaN poisoning, row gathering.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "bench/random_fill.h"
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

// Writes the values `fill` describes (random_value) into t, converted to t's dtype (exact when
// it is fill.dtype or wider): element i of t gets value i; with `rows`, row r of t (everything
// under dim 0) gets row rows[r] of the tensor `fill` describes, so the host makes only the rows
// it checks. CUDA views are filled on the device (t.dtype == fill.dtype, no `rows`), bit for
// bit as on the host.
void fill_random(const TensorView& t, const RandomFill& fill, std::span<const std::int64_t> rows = {});
// Every byte 0xFF: NaN in every float dtype (so unwritten outputs fail the gate).
void poison(const TensorView& t);
// Byte copy between two views of one dtype and size, on any devices.
void copy_tensor(const TensorView& dst, const TensorView& src);
// dst row r <- src row rows[r], where a row is everything under dim 0. dst on the host, src
// on the host or a CUDA device (so sampled checks copy only the rows they need).
void gather_rows(const TensorView& dst, const TensorView& src, std::span<const std::int64_t> rows);
// Host view's elements as doubles.
std::vector<double> to_doubles(const TensorView& t);

}  // namespace trainscale::bench
