#include "core/check.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#if TRAINSCALE_HAVE_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace trainscale::detail {

OpChecker::OpChecker(const char* op) : op_(op) {
#if TRAINSCALE_HAVE_CUDA
  nvtxRangePushA(op);
#endif
}

OpChecker::~OpChecker() {
#if TRAINSCALE_HAVE_CUDA
  nvtxRangePop();
#endif
}

void throw_arg_error(std::string_view op, std::string_view arg, std::string_view expected,
                     std::string_view got) {
  std::string msg = "trainscale::";
  msg.append(op).append(": argument '").append(arg).append("': expected ");
  msg.append(expected).append(", got ").append(got);
  throw Error(msg);
}

void throw_op_error(std::string_view op, std::string_view message) {
  std::string msg = "trainscale::";
  msg.append(op).append(": ").append(message);
  throw Error(msg);
}

void throw_no_cuda_build(std::string_view op) {
  throw_op_error(op,
                 "CUDA tensors given, but this build of TrainScale has no CUDA support "
                 "(rebuild with -DTRAINSCALE_ENABLE_CUDA=ON, or pass CPU tensors)");
}

void throw_no_cuda_kernel(std::string_view op) {
  throw_op_error(op,
                 "CUDA tensors given, but this op has only its CPU reference so far "
                 "(pass CPU tensors)");
}

std::string format_number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

std::string dtype_list(std::initializer_list<DType> dtypes) {
  std::string s;
  for (DType d : dtypes) {
    if (!s.empty()) s += ", ";
    s += dtype_name(d);
  }
  return s;
}

std::pair<std::uintptr_t, std::uintptr_t> byte_extent(const TensorView& t) {
  auto base = reinterpret_cast<std::uintptr_t>(t.data);
  if (!t.defined() || t.numel() == 0) return {base, base};
  std::int64_t lo = 0, hi = 0;
  for (int d = 0; d < t.ndim; ++d) {
    std::int64_t span = (t.shape[d] - 1) * t.strides[d];
    (span < 0 ? lo : hi) += span;
  }
  const auto es = static_cast<std::int64_t>(t.element_size());
  return {base + lo * es, base + (hi + 1) * es};
}

OpChecker& OpChecker::present(const TensorView& t, const char* name) {
  if (!t.defined()) throw_arg_error(op_, name, "a tensor", "none");
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) throw_arg_error(op_, name, "non-negative sizes", t.shape_str());
    if (t.strides[d] < 0) throw_arg_error(op_, name, "non-negative strides", t.strides_str());
  }
  if (t.data == nullptr && t.numel() > 0) {
    throw_arg_error(op_, name, "a non-null data pointer", "null with " + t.shape_str());
  }
  if (device_arg_ == nullptr) {
    device_ = t.device;
    device_arg_ = name;
  } else if (!(t.device == device_)) {
    throw_arg_error(op_, name, std::string("a tensor on ") + device_.str() + " like '" +
                                   device_arg_ + "'",
                    "one on " + t.device.str());
  }
  if (t.dtype == DType::kFloat64 && t.device.is_cuda()) {
    throw_arg_error(op_, name, "float64 tensors on the CPU only (the reference)",
                    t.describe());
  }
  return *this;
}

OpChecker& OpChecker::optional(const TensorView& t, const char* name) {
  return t.defined() ? present(t, name) : *this;
}

OpChecker& OpChecker::dtype_in(const TensorView& t, const char* name,
                               std::initializer_list<DType> allowed) {
  for (DType d : allowed) {
    if (t.dtype == d) return *this;
  }
  throw_arg_error(op_, name, "dtype in {" + dtype_list(allowed) + "}", dtype_name(t.dtype));
}

OpChecker& OpChecker::same_dtype(const TensorView& t, const char* name, const TensorView& ref,
                                 const char* ref_name) {
  if (t.dtype != ref.dtype) {
    throw_arg_error(op_, name, std::string(dtype_name(ref.dtype)) + " (the dtype of '" +
                                   ref_name + "')",
                    dtype_name(t.dtype));
  }
  return *this;
}

OpChecker& OpChecker::ndim(const TensorView& t, const char* name, int expected) {
  if (t.ndim != expected) {
    throw_arg_error(op_, name, std::to_string(expected) + " dimensions",
                    std::to_string(t.ndim) + " (shape " + t.shape_str() + ")");
  }
  return *this;
}

OpChecker& OpChecker::ndim_at_least(const TensorView& t, const char* name, int expected) {
  if (t.ndim < expected) {
    throw_arg_error(op_, name, "at least " + std::to_string(expected) + " dimensions",
                    std::to_string(t.ndim) + " (shape " + t.shape_str() + ")");
  }
  return *this;
}

OpChecker& OpChecker::dim_size(const TensorView& t, const char* name, int dim,
                               std::int64_t expected, const char* meaning) {
  if (t.size(dim) != expected) {
    throw_arg_error(op_, name,
                    "size " + std::to_string(expected) + " in dim " + std::to_string(dim) +
                        " (" + meaning + ")",
                    "shape " + t.shape_str());
  }
  return *this;
}

OpChecker& OpChecker::same_shape(const TensorView& t, const char* name, const TensorView& ref,
                                 const char* ref_name) {
  bool same = t.ndim == ref.ndim;
  for (int d = 0; same && d < t.ndim; ++d) same = t.shape[d] == ref.shape[d];
  if (!same) {
    throw_arg_error(op_, name, "shape " + ref.shape_str() + " (the shape of '" + ref_name + "')",
                    t.shape_str());
  }
  return *this;
}

OpChecker& OpChecker::contiguous(const TensorView& t, const char* name) {
  if (!t.is_contiguous()) {
    throw_arg_error(op_, name, "a contiguous tensor", "strides " + t.strides_str() +
                                                          " for shape " + t.shape_str());
  }
  return *this;
}

OpChecker& OpChecker::unit_last_stride(const TensorView& t, const char* name) {
  if (t.ndim > 0 && t.size(-1) > 1 && t.stride(-1) != 1) {
    throw_arg_error(op_, name, "stride 1 in the last dimension",
                    "strides " + t.strides_str() + " for shape " + t.shape_str());
  }
  return *this;
}

OpChecker& OpChecker::no_overlap(const TensorView& a, const char* a_name, const TensorView& b,
                                 const char* b_name) {
  if (!a.defined() || !b.defined()) return *this;
  auto [a_lo, a_hi] = byte_extent(a);
  auto [b_lo, b_hi] = byte_extent(b);
  if (a_lo < b_hi && b_lo < a_hi) {
    throw_arg_error(op_, a_name, std::string("memory disjoint from '") + b_name + "'",
                    "overlapping views");
  }
  return *this;
}

bool same_view(const TensorView& a, const TensorView& b) {
  return a.data == b.data && a.dtype == b.dtype && a.ndim == b.ndim && a.device == b.device &&
         std::equal(a.shape.begin(), a.shape.begin() + std::max(a.ndim, 0), b.shape.begin()) &&
         std::equal(a.strides.begin(), a.strides.begin() + std::max(a.ndim, 0), b.strides.begin());
}

OpChecker& OpChecker::in_place_or_disjoint(const TensorView& out, const char* out_name,
                                           const TensorView& in, const char* in_name) {
  if (!out.defined() || !in.defined() || same_view(out, in)) return *this;
  auto [out_lo, out_hi] = byte_extent(out);
  auto [in_lo, in_hi] = byte_extent(in);
  if (out_lo < in_hi && in_lo < out_hi) {
    throw_arg_error(op_, out_name,
                    std::string("memory disjoint from '") + in_name + "' or exactly its view (in place)",
                    "a partially overlapping view");
  }
  return *this;
}

void OpChecker::fail(const char* arg, std::string_view expected, std::string_view got) const {
  throw_arg_error(op_, arg, expected, got);
}

Rows OpChecker::rows(const TensorView& t, const char* name) const {
  if (t.ndim < 1) throw_arg_error(op_, name, "at least 1 dimension", "a scalar");
  Rows r;
  r.cols = t.size(-1);
  if (r.cols > 1 && t.stride(-1) != 1) {
    throw_arg_error(op_, name, "stride 1 in the last dimension",
                    "strides " + t.strides_str() + " for shape " + t.shape_str());
  }
  r.rows = 1;
  for (int d = 0; d < t.ndim - 1; ++d) r.rows *= t.shape[d];
  // Leading dims must collapse into rows of one stride.
  std::int64_t row_stride = -1;
  for (int d = t.ndim - 2; d >= 0; --d) {
    if (t.shape[d] == 1) continue;
    if (row_stride < 0) {
      row_stride = t.strides[d];
    } else {
      std::int64_t inner = 1;
      for (int e = d + 1; e < t.ndim - 1; ++e) inner *= t.shape[e];
      if (t.strides[d] != row_stride * inner) {
        throw_arg_error(op_, name, "leading dimensions that flatten into evenly strided rows",
                        "strides " + t.strides_str() + " for shape " + t.shape_str());
      }
    }
  }
  r.row_stride = row_stride < 0 ? r.cols : row_stride;
  if (r.rows > 1 && r.row_stride < r.cols) {
    throw_arg_error(op_, name, "a row stride >= the row length " + std::to_string(r.cols),
                    "row stride " + std::to_string(r.row_stride));
  }
  return r;
}

}  // namespace trainscale::detail
