#include "trainscale/tensor.h"


#include "core/check.h"

namespace trainscale {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return 8;
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
    case DType::kFloat8E5M2: return 1;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return "float64";
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "float8_e4m3";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown";
}

bool is_floating(DType dtype) { return dtype != DType::kInt32 && dtype != DType::kInt64; }

std::string Device::str() const {
  return is_cuda() ? "cuda:" + std::to_string(index) : std::string("cpu");
}

namespace {
void fill_contiguous_strides(TensorView& t) {
  std::int64_t s = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = s;
    s *= t.shape[d];
  }
}

void check_rank(std::size_t rank) {
  if (rank > static_cast<std::size_t>(kMaxDims)) {
    throw Error("trainscale::TensorView: argument 'shape': expected at most " +
                std::to_string(kMaxDims) + " dimensions, got " + std::to_string(rank));
  }
}
}  // namespace

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<std::int64_t> shape_,
                       Device device_)
    : data(data_), dtype(dtype_), ndim(static_cast<int>(shape_.size())), device(device_) {
  check_rank(shape_.size());
  int d = 0;
  for (auto s : shape_) shape[d++] = s;
  fill_contiguous_strides(*this);
}

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<std::int64_t> shape_,
                       std::initializer_list<std::int64_t> strides_, Device device_)
    : data(data_), dtype(dtype_), ndim(static_cast<int>(shape_.size())), device(device_) {
  check_rank(shape_.size());
  if (strides_.size() != shape_.size()) {
    throw Error("trainscale::TensorView: argument 'strides': expected " +
                std::to_string(shape_.size()) + " strides, got " + std::to_string(strides_.size()));
  }
  int d = 0;
  for (auto s : shape_) shape[d++] = s;
  d = 0;
  for (auto s : strides_) strides[d++] = s;
}

TensorView TensorView::from_arrays(void* data, DType dtype, int ndim, const std::int64_t* shape,
                                   const std::int64_t* strides, Device device) {
  if (ndim < 0) throw Error("trainscale::TensorView: argument 'ndim': expected >= 0, got " + std::to_string(ndim));
  check_rank(static_cast<std::size_t>(ndim));
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = ndim;
  t.device = device;
  for (int d = 0; d < ndim; ++d) t.shape[d] = shape[d];
  if (strides) {
    for (int d = 0; d < ndim; ++d) t.strides[d] = strides[d];
  } else {
    fill_contiguous_strides(t);
  }
  return t;
}

std::int64_t TensorView::size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
std::int64_t TensorView::stride(int dim) const { return strides[dim < 0 ? dim + ndim : dim]; }

std::int64_t TensorView::numel() const {
  if (ndim < 0) return 0;
  std::int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // no element to place: any strides (PyTorch's rule too)
  std::int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

namespace {
std::string join(const std::array<std::int64_t, kMaxDims>& v, int n) {
  std::string text = "[";
  for (int d = 0; d < n; ++d) text += (d ? ", " : "") + std::to_string(v[d]);
  return text + "]";
}
}  // namespace

std::string TensorView::shape_str() const { return defined() ? join(shape, ndim) : "none"; }
std::string TensorView::strides_str() const { return defined() ? join(strides, ndim) : "none"; }

std::string TensorView::describe() const {
  if (!defined()) return "no tensor";
  return std::string(dtype_name(dtype)) + shape_str() + " (strides " + strides_str() + ") on " +
         device.str();
}

}  // namespace trainscale
