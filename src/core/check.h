// Argument validation shared by every entry point. Messages follow one pattern:
//   trainscale::<op>: argument '<arg>': expected <what was expected>, got <what was given>
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>

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

// The floating-point activations an op accepts (float64: the CPU reference only).
inline constexpr std::initializer_list<DType> kFloatDTypes = {DType::kFloat32, DType::kFloat16,
                                                              DType::kBFloat16, DType::kFloat64};

// A tensor seen as M rows of N contiguous elements: leading dims flattened into rows,
// which must share one row stride (so a [B, S, N] view with padded rows is fine).
struct Rows {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;  // elements
};

// The row layout of a view OpChecker::rows() accepted, without checking it again: kernels
// and references read the layout of arguments their entry point validated.
Rows row_layout(const TensorView& t);

// What "disjoint" means for no_overlap and disjoint_or_in_place.
enum class Disjoint {
  kBytes,     // the byte ranges [lowest, highest] the two views can touch do not intersect
  kElements,  // no element in common: also slices of one buffer whose byte ranges interleave
              // (q and k head ranges of a fused QKV buffer), when the kernel was built for them
};

// An argument and the name messages give it.
struct Arg {
  const TensorView& view;
  const char* name;
};

// Every entry point checks its arguments with one OpChecker; the first failing check throws.
// It also opens the NVTX range named after the op (seen in Nsight Systems and the PyTorch
// profiler), closed when the entry point returns. Without a profiler attached a range costs two
// calls through NVTX's no-op function pointers.
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
  // float32, or the dtype of `ref` (parameters and buffers kept in float32 beside activations).
  OpChecker& float32_or_dtype_of(const TensorView& t, const char* name, const TensorView& ref,
                                 const char* ref_name);
  OpChecker& ndim(const TensorView& t, const char* name, int expected);
  OpChecker& ndim_at_least(const TensorView& t, const char* name, int expected);
  OpChecker& dim_size(const TensorView& t, const char* name, int dim, std::int64_t expected,
                      const char* meaning);
  OpChecker& same_shape(const TensorView& t, const char* name, const TensorView& ref,
                        const char* ref_name);
  OpChecker& contiguous(const TensorView& t, const char* name);
  OpChecker& unit_last_stride(const TensorView& t, const char* name);
  // No two elements of the view share an address (an output written by many threads).
  OpChecker& distinct_elements(const TensorView& t, const char* name);

  // present(), with the dtype and shape of `ref` (and so, through present(), its device).
  OpChecker& matches(const TensorView& t, const char* name, const TensorView& ref,
                     const char* ref_name);
  // matches() and rows(): a row tensor like `ref`, with a row stride of its own.
  OpChecker& like(const TensorView& t, const char* name, const TensorView& ref,
                  const char* ref_name);
  // present() and a floating-point dtype (kFloatDTypes), seen as rows: the activation the
  // other arguments of a row op are measured against.
  Rows float_rows(const TensorView& t, const char* name);
  // present(), a dtype of `allowed`, and 2 dimensions with contiguous rows.
  Rows matrix(const TensorView& t, const char* name,
              std::initializer_list<DType> allowed = kFloatDTypes);

  // A scalar option: finite, and >= 0 when `non_negative`.
  OpChecker& finite(double value, const char* name, bool non_negative = false);

  // A CUDA path's workspace "workspace": when `needed` > 0, contiguous, `alignment`-byte
  // aligned and at least `needed` bytes; the message names the size query (`query`).
  OpChecker& workspace(const TensorView& w, std::size_t needed, std::size_t alignment, const char* query);

  // a and b are disjoint (absent views are disjoint from everything).
  OpChecker& no_overlap(const TensorView& a, const char* a_name, const TensorView& b,
                        const char* b_name, Disjoint how = Disjoint::kBytes);
  // An output that may be written in place over an input: exactly `in`'s view (same_view), or
  // disjoint from it.
  OpChecker& disjoint_or_in_place(const TensorView& out, const char* out_name,
                                  const TensorView& in, const char* in_name,
                                  Disjoint how = Disjoint::kBytes);
  // Every output disjoint (kBytes) from every input and from the other outputs; absent views
  // are skipped. The one pair (in_place_output, in_place_input), named as in the lists, is
  // checked with disjoint_or_in_place instead (dx written over dy).
  OpChecker& outputs_disjoint(std::initializer_list<Arg> outputs, std::initializer_list<Arg> inputs,
                              const char* in_place_output = nullptr,
                              const char* in_place_input = nullptr);

  // Updated tensors that share no byte with any other argument, written or read (absent views
  // are skipped). Checked by sorted byte ranges: lists of a model's hundreds of tensors cost
  // O(n log n), not a check per pair.
  OpChecker& updates_disjoint(std::span<const Arg> written, std::span<const Arg> read);

  // Throws the argument error. Callers test their condition first, so the message strings are
  // only built for a failing call, never on the hot path of a valid one.
  [[noreturn]] void fail(const char* arg, std::string_view expected, std::string_view got) const;

  // Device shared by every argument checked (CPU when none was given).
  Device device() const { return device_; }
  bool on_cuda() const { return device_.is_cuda(); }

  // The tensor as rows: at least 1 dim, stride 1 in the last, leading dims of one row stride.
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

// Whether a and b are disjoint in the sense of `how` (absent views are disjoint).
bool disjoint(const TensorView& a, const TensorView& b, Disjoint how);

// Sufficient condition for no two indices of `shape` under `strides` sharing an address: every
// stride exceeds the largest offset the finer dims (smaller stride; ties by position) reach.
bool injective_layout(const std::array<std::int64_t, kMaxDims>& shape,
                      const std::array<std::int64_t, kMaxDims>& strides, int ndim);

}  // namespace trainscale::detail
