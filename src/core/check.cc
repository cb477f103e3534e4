#include "core/check.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <string_view>
#include <utility>
#include <vector>

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

OpChecker& OpChecker::finite(double value, const char* name, bool non_negative) {
  if (!(std::isfinite(value) && (!non_negative || value >= 0)))
    fail(name, non_negative ? "a finite value >= 0" : "a finite value", format_number(value));
  return *this;
}

OpChecker& OpChecker::workspace(const TensorView& w, std::size_t needed, std::size_t alignment, const char* query) {
  const std::size_t given = w.defined() ? static_cast<std::size_t>(w.numel()) * w.element_size() : 0;
  if (needed > 0 && !(given >= needed && w.is_contiguous() && reinterpret_cast<std::uintptr_t>(w.data) % alignment == 0))
    fail("workspace",
         "a contiguous, " + std::to_string(alignment) + "-byte aligned buffer of at least " + std::to_string(needed) +
             " bytes (" + query + ")",
         w.defined() ? w.describe() : std::string("none"));
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
  if (t.ndim > 0 && t.numel() > 0 && t.size(-1) > 1 && t.stride(-1) != 1) {
    throw_arg_error(op_, name, "stride 1 in the last dimension",
                    "strides " + t.strides_str() + " for shape " + t.shape_str());
  }
  return *this;
}

bool injective_layout(const std::array<std::int64_t, kMaxDims>& shape,
                      const std::array<std::int64_t, kMaxDims>& strides, int ndim) {
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] <= 1) continue;
    std::int64_t finer_reach = 0;
    for (int e = 0; e < ndim; ++e) {
      const bool finer = strides[e] < strides[d] || (strides[e] == strides[d] && e < d);
      if (e != d && finer && shape[e] > 1) finer_reach += (shape[e] - 1) * strides[e];
    }
    if (strides[d] <= finer_reach) return false;
  }
  return true;
}

namespace {

// True when a and b are slices of one injective layout that differ along a single dim over
// non-intersecting index ranges: q and k as head ranges of one fused QKV buffer, whose byte
// ranges interleave although no element is shared.
bool disjoint_slices(const TensorView& a, const TensorView& b) {
  if (a.dtype != b.dtype || a.ndim != b.ndim ||
      !std::equal(a.strides.begin(), a.strides.begin() + a.ndim, b.strides.begin())) {
    return false;
  }
  const auto element = static_cast<std::int64_t>(a.element_size());
  const std::int64_t byte_delta = static_cast<std::int64_t>(
      reinterpret_cast<std::uintptr_t>(b.data) - reinterpret_cast<std::uintptr_t>(a.data));
  if (byte_delta % element != 0) return false;
  const std::int64_t delta = byte_delta / element;
  for (int h = 0; h < a.ndim; ++h) {
    const std::int64_t step = a.strides[h];
    if (step <= 0 || delta % step != 0) continue;
    const std::int64_t shift = delta / step;  // b's index 0 along h is a's index `shift`
    if (shift < a.shape[h] && -shift < b.shape[h]) continue;  // the index ranges intersect
    std::array<std::int64_t, kMaxDims> extent{};
    for (int d = 0; d < a.ndim; ++d) extent[d] = std::max(a.shape[d], b.shape[d]);
    extent[h] = std::max(a.shape[h], shift + b.shape[h]) - std::min<std::int64_t>(0, shift);
    if (injective_layout(extent, a.strides, a.ndim)) return true;
  }
  return false;
}

}  // namespace

bool disjoint(const TensorView& a, const TensorView& b, Disjoint how) {
  if (!a.defined() || !b.defined()) return true;
  const auto [a_lo, a_hi] = byte_extent(a);
  const auto [b_lo, b_hi] = byte_extent(b);
  if (a_hi <= b_lo || b_hi <= a_lo) return true;
  return how == Disjoint::kElements && disjoint_slices(a, b);
}

OpChecker& OpChecker::no_overlap(const TensorView& a, const char* a_name, const TensorView& b,
                                 const char* b_name, Disjoint how) {
  if (!disjoint(a, b, how)) {
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

OpChecker& OpChecker::disjoint_or_in_place(const TensorView& out, const char* out_name,
                                           const TensorView& in, const char* in_name,
                                           Disjoint how) {
  if (!(same_view(out, in) || disjoint(out, in, how))) {
    throw_arg_error(op_, out_name,
                    std::string("memory disjoint from '") + in_name + "' or exactly its view (in place)",
                    "a partially overlapping view");
  }
  return *this;
}

OpChecker& OpChecker::outputs_disjoint(std::initializer_list<Arg> outputs,
                                       std::initializer_list<Arg> inputs,
                                       const char* in_place_output, const char* in_place_input) {
  const auto is = [](const char* a, const char* b) {
    return b != nullptr && std::string_view(a) == b;
  };
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    for (const Arg& in : inputs) {
      if (is(out->name, in_place_output) && is(in.name, in_place_input)) {
        disjoint_or_in_place(out->view, out->name, in.view, in.name);
      } else {
        no_overlap(out->view, out->name, in.view, in.name);
      }
    }
    for (auto earlier = outputs.begin(); earlier != out; ++earlier) {
      no_overlap(out->view, out->name, earlier->view, earlier->name);
    }
  }
  return *this;
}

OpChecker& OpChecker::updates_disjoint(std::span<const Arg> written, std::span<const Arg> read) {
  struct Extent {
    std::uintptr_t lo, hi;
    bool written;
    const char* name;
  };
  std::vector<Extent> extents;
  extents.reserve(written.size() + read.size());
  for (auto [args, is_written] : {std::pair{written, true}, std::pair{read, false}}) {
    for (const Arg& a : args) {
      const auto [lo, hi] = byte_extent(a.view);
      if (lo != hi) extents.push_back({lo, hi, is_written, a.name});
    }
  }
  // By address; at one address reads first, so the error names the updated tensor.
  std::stable_sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) {
    return a.lo != b.lo ? a.lo < b.lo : (!a.written && b.written);
  });
  const Extent *reach_all = nullptr, *reach_written = nullptr;  // the earlier extents reaching furthest
  for (const Extent& e : extents) {
    const Extent* hit = e.written ? reach_all : reach_written;
    if (hit != nullptr && e.lo < hit->hi) {
      fail(e.name, std::string("memory disjoint from '") + hit->name + "' (" + (e.written ? "updated" : "read") +
                       " while the other is " + (hit->written ? "updated" : "read") + ")",
           "overlapping views");
    }
    if (reach_all == nullptr || e.hi > reach_all->hi) reach_all = &e;
    if (e.written && (reach_written == nullptr || e.hi > reach_written->hi)) reach_written = &e;
  }
  return *this;
}

OpChecker& OpChecker::distinct_elements(const TensorView& t, const char* name) {
  if (t.numel() > 0 && !injective_layout(t.shape, t.strides, t.ndim)) {
    throw_arg_error(op_, name, "strides under which no two elements share memory",
                    "strides " + t.strides_str() + " for shape " + t.shape_str());
  }
  return *this;
}

OpChecker& OpChecker::float32_or_dtype_of(const TensorView& t, const char* name,
                                          const TensorView& ref, const char* ref_name) {
  if (t.dtype == DType::kFloat32 || t.dtype == ref.dtype) return *this;
  const std::string ref_dtype =
      std::string(dtype_name(ref.dtype)) + " (the dtype of '" + ref_name + "')";
  throw_arg_error(op_, name, ref.dtype == DType::kFloat32 ? ref_dtype : "float32 or " + ref_dtype,
                  dtype_name(t.dtype));
}

OpChecker& OpChecker::matches(const TensorView& t, const char* name, const TensorView& ref,
                              const char* ref_name) {
  return present(t, name).same_dtype(t, name, ref, ref_name).same_shape(t, name, ref, ref_name);
}

OpChecker& OpChecker::like(const TensorView& t, const char* name, const TensorView& ref,
                           const char* ref_name) {
  matches(t, name, ref, ref_name).rows(t, name);
  return *this;
}

Rows OpChecker::float_rows(const TensorView& t, const char* name) {
  return present(t, name).dtype_in(t, name, kFloatDTypes).rows(t, name);
}

Rows OpChecker::matrix(const TensorView& t, const char* name,
                        std::initializer_list<DType> allowed) {
  return present(t, name).dtype_in(t, name, allowed).ndim(t, name, 2).rows(t, name);
}

void OpChecker::fail(const char* arg, std::string_view expected, std::string_view got) const {
  throw_arg_error(op_, arg, expected, got);
}

Rows row_layout(const TensorView& t) {
  Rows r;
  r.cols = t.size(-1);
  r.rows = 1;
  for (int d = 0; d < t.ndim - 1; ++d) r.rows *= t.shape[d];
  r.row_stride = r.cols;  // a single row, rows of size-1 leading dims only, or no element
  for (int d = t.ndim - 2; d >= 0 && t.numel() > 0; --d) {
    if (t.shape[d] != 1) {
      r.row_stride = t.strides[d];
      break;
    }
  }
  return r;
}

Rows OpChecker::rows(const TensorView& t, const char* name) const {
  if (t.ndim < 1) throw_arg_error(op_, name, "at least 1 dimension", "a scalar");
  const Rows r = row_layout(t);
  // No element, so no layout to check: autograd hands empty gradients over with any strides
  // (a [0, N] expand of a scalar has strides [0, 0]).
  if (t.numel() == 0) return r;
  if (r.cols > 1 && t.stride(-1) != 1) {
    throw_arg_error(op_, name, "stride 1 in the last dimension",
                    "strides " + t.strides_str() + " for shape " + t.shape_str());
  }
  // Leading dims must collapse into rows of one stride: each steps over the finer ones.
  std::int64_t inner = 1;  // rows spanned by one step of dim d
  for (int d = t.ndim - 2; d >= 0; --d) {
    if (t.shape[d] != 1 && t.strides[d] != r.row_stride * inner) {
      throw_arg_error(op_, name, "leading dimensions that flatten into evenly strided rows",
                      "strides " + t.strides_str() + " for shape " + t.shape_str());
    }
    inner *= t.shape[d];
  }
  if (r.rows > 1 && r.row_stride < r.cols) {
    throw_arg_error(op_, name, "a row stride >= the row length " + std::to_string(r.cols),
                    "row stride " + std::to_string(r.row_stride));
  }
  return r;
}

}  // namespace trainscale::detail
