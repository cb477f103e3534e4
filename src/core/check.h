// Argument validation shared by every entry point. Messages follow one pattern:
//   trainscale::<op>: argument '<arg>': expected <what was expected>, got <what was given>
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "trainscale/error.h"
#include "trainscale/tensor.h"

namespace trainscale::detail {

[[noreturn]] void throw_arg_error(std::string_view op, std::string_view arg,
                                  std::string_view expected, std::string_view got);
[[noreturn]] void throw_op_error(std::string_view op, std::string_view message);
// A CUDA tensor reached a build without CUDA.
[[noreturn]] void throw_no_cuda_build(std::string_view op);
// A CUDA tensor reached an op that has only its CPU reference so far.
[[noreturn]] void throw_no_cuda_kernel(std::string_view op);

// CUDA tensors must live on the caller's current device (kernels launch there).
void require_current_device(std::string_view op, Device device);

std::string dtype_list(std::initializer_list<DType> dtypes);  // "float32, bfloat16"
// A number for a message, shortest form (%g): "1e-06", "0.5", "inf", "nan".
std::string format_number(double v);

// A tensor seen as M rows of N contiguous elements: leading dims flattened into rows,
// which must share one row stride (so a [B, S, N] view with padded rows is fine).
struct Rows {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;  // elements
};

// Every entry point starts with one, so it also opens the NVTX range named after the op (seen
// in Nsight Systems and the PyTorch profiler), closed when the entry point returns. Without a
// profiler attached a range costs two calls through NVTX's no-op function pointers.
class OpChecker {
 public:
  explicit OpChecker(const char* op);
  ~OpChecker();
  OpChecker(const OpChecker&) = delete;
  OpChecker& operator=(const OpChecker&) = delete;
  const char* op() const { return op_; }

  // The argument is given, has sane shape/strides, a non-null pointer when non-empty, and
  // lives on the same device as every other argument checked so far.
  OpChecker& present(const TensorView& t, const char* name);
  // Like present() for an optional argument: no-op when absent.
  OpChecker& optional(const TensorView& t, const char* name);

  OpChecker& dtype_in(const TensorView& t, const char* name, std::initializer_list<DType> allowed);
  OpChecker& same_dtype(const TensorView& t, const char* name, const TensorView& ref,
                        const char* ref_name);
  OpChecker& ndim(const TensorView& t, const char* name, int expected);
  OpChecker& ndim_at_least(const TensorView& t, const char* name, int expected);
  OpChecker& dim_size(const TensorView& t, const char* name, int dim, std::int64_t expected,
                      const char* meaning);
  OpChecker& same_shape(const TensorView& t, const char* name, const TensorView& ref,
                        const char* ref_name);
  OpChecker& contiguous(const TensorView& t, const char* name);
  OpChecker& unit_last_stride(const TensorView& t, const char* name);
  // An output documented as in place: exactly `in`'s view (same_view), or disjoint from it.
  OpChecker& in_place_or_disjoint(const TensorView& out, const char* out_name, const TensorView& in,
                                  const char* in_name);
  // Byte ranges of a and b must not intersect (outputs vs inputs, outputs vs outputs).
  OpChecker& no_overlap(const TensorView& a, const char* a_name, const TensorView& b,
                        const char* b_name);
  // Throws the argument error. Callers test their condition first, so the message strings are
  // only built for a failing call, never on the hot path of a valid one.
  [[noreturn]] void fail(const char* arg, std::string_view expected, std::string_view got) const;

  // Device shared by every argument checked (CPU when none was given).
  Device device() const { return device_; }
  bool on_cuda() const { return device_.is_cuda(); }

  Rows rows(const TensorView& t, const char* name) const;

 private:
  const char* op_;
  Device device_{};
  const char* device_arg_ = nullptr;
};

// Same memory element for element: pointer, dtype, device, shape and strides.
bool same_view(const TensorView& a, const TensorView& b);

// For CUDA arguments, runs `launch()` (after checking they are on the current device) and
// returns true; for CPU arguments returns false so the caller runs the reference. A build
// without CUDA reports CUDA arguments as an error. The launchers `launch` calls are declared
// in every build and defined only with CUDA: the lambda is never called without it.
template <class Launch>
bool ran_on_cuda(const OpChecker& c, Launch&& launch) {
  if (!c.on_cuda()) return false;
#if TRAINSCALE_HAVE_CUDA
  require_current_device(c.op(), c.device());
  launch();
  return true;
#else
  (void)launch;
  throw_no_cuda_build(c.op());
#endif
}

// Lowest and one-past-highest byte a view can touch (equal when empty).
std::pair<std::uintptr_t, std::uintptr_t> byte_extent(const TensorView& t);

}  // namespace trainscale::detail
