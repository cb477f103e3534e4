#include "bench/tensors.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "bench/cuda_util.h"
#include "bench/gpu_kernels.h"
#include "core/host_dtype.h"
#include "core/parallel.h"
#include "trainscale/error.h"

namespace trainscale::bench {

std::int64_t tensor_bytes(DType dtype, std::span<const std::int64_t> shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n * static_cast<std::int64_t>(dtype_size(dtype));
}

namespace {

void* allocate(Device device, std::int64_t bytes) {
  // At least one aligned element so empty tensors still have a valid pointer.
  const auto size = static_cast<std::size_t>(std::max<std::int64_t>(bytes, 16));
  if (device.is_cuda()) {
#if TRAINSCALE_HAVE_CUDA
    void* p = nullptr;
    cuda_check(cudaSetDevice(device.index), "cudaSetDevice");
    cuda_check(cudaMalloc(&p, size), "cudaMalloc");
    return p;
#else
    throw Error("trainscale-bench: a CUDA tensor was requested in a build without CUDA");
#endif
  }
  void* p = std::aligned_alloc(64, (size + 63) / 64 * 64);
  if (!p) throw Error("trainscale-bench: out of host memory");
  return p;
}

void deallocate(Device device, void* p) {
  if (!p) return;
  if (device.is_cuda()) {
#if TRAINSCALE_HAVE_CUDA
    cudaFree(p);
#endif
    return;
  }
  std::free(p);
}

}  // namespace

OwnedTensor::OwnedTensor(DType dtype, std::span<const std::int64_t> shape, Device device)
    : bytes_(tensor_bytes(dtype, shape)) {
  void* data = allocate(device, bytes_);
  view_ = TensorView::from_arrays(data, dtype, static_cast<int>(shape.size()), shape.data(),
                                  nullptr, device);
}

OwnedTensor::~OwnedTensor() { release(); }

OwnedTensor::OwnedTensor(OwnedTensor&& other) noexcept
    : view_(std::exchange(other.view_, TensorView{})), bytes_(std::exchange(other.bytes_, 0)) {}

OwnedTensor& OwnedTensor::operator=(OwnedTensor&& other) noexcept {
  if (this != &other) {
    release();
    view_ = std::exchange(other.view_, TensorView{});
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void OwnedTensor::release() {
  deallocate(view_.device, view_.data);
  view_ = TensorView{};
}

void fill_random(const TensorView& t, const RandomFill& fill, std::span<const std::int64_t> rows) {
  if (t.is_cuda()) {
    if (t.dtype != fill.dtype || !rows.empty()) {
      throw Error("trainscale-bench: a device fill writes whole tensors of the fill's dtype");
    }
#if TRAINSCALE_HAVE_CUDA
    // Legacy stream, then a device sync: the engine's non-blocking stream is not ordered after it.
    launch_fill_random(t.data, t.numel(), fill, nullptr);
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (random fill)");
#endif
    return;
  }
  const std::int64_t row = rows.empty() || t.size(0) == 0 ? 0 : t.numel() / t.size(0);
  detail::parallel_for(t.numel(), 1 << 16, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      const std::int64_t index = rows.empty() ? i : rows[i / row] * row + i % row;
      detail::store_from_double(t.dtype, t.data, i, random_value(fill, index));
    }
  });
}

void poison(const TensorView& t) {
  const auto bytes = static_cast<std::size_t>(t.numel()) * t.element_size();
  if (t.is_cuda()) {
#if TRAINSCALE_HAVE_CUDA
    // The engine's stream is non-blocking: nothing orders it after the legacy stream, so the
    // poison must have landed before any kernel runs.
    cuda_check(cudaMemset(t.data, 0xFF, bytes), "cudaMemset (poison)");
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (poison)");
#endif
    return;
  }
  std::memset(t.data, 0xFF, bytes);
}

void copy_tensor(const TensorView& dst, const TensorView& src) {
  const auto bytes = static_cast<std::size_t>(src.numel()) * src.element_size();
  if (dst.is_cuda() || src.is_cuda()) {
#if TRAINSCALE_HAVE_CUDA
    cuda_check(cudaMemcpy(dst.data, src.data, bytes, cudaMemcpyDefault), "cudaMemcpy");
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (copy)");
#endif
    return;
  }
  std::memcpy(dst.data, src.data, bytes);
}

void gather_rows(const TensorView& dst, const TensorView& src, std::span<const std::int64_t> rows) {
  const std::int64_t row_bytes =
      src.size(0) == 0 ? 0 : src.numel() / src.size(0) * static_cast<std::int64_t>(src.element_size());
  auto* out = static_cast<char*>(dst.data);
  const auto* in = static_cast<const char*>(src.data);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    char* to = out + static_cast<std::int64_t>(r) * row_bytes;
    const char* from = in + rows[r] * row_bytes;
    if (src.is_cuda()) {
#if TRAINSCALE_HAVE_CUDA
      cuda_check(cudaMemcpy(to, from, static_cast<std::size_t>(row_bytes), cudaMemcpyDeviceToHost),
                 "cudaMemcpy (gather rows)");
#endif
    } else {
      std::memcpy(to, from, static_cast<std::size_t>(row_bytes));
    }
  }
}

std::vector<double> to_doubles(const TensorView& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  detail::parallel_for(t.numel(), 1 << 16, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) v[i] = detail::load_as_double(t.dtype, t.data, i);
  });
  return v;
}

}  // namespace trainscale::bench
