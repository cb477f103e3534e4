// What every family's binding file (<family>_ops.cc) shares: at::Tensor -> TensorView, the
// device guard and stream of a call, trainscale::Error -> Python exceptions, and def_op, which
// defines an op and registers it for CPU and CUDA tensors (trainscale itself dispatches on the
// device: CPU reference or CUDA kernels). Loaded with the extension (trainscale/_C.so).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <string_view>

#include "trainscale/error.h"
#include "trainscale/tensor.h"

#if defined(TRAINSCALE_TORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace trainscale::binding {

namespace ts = ::trainscale;
using at::Tensor;
using OptTensor = std::optional<Tensor>;

// A ValueError "trainscale::<op>: argument '<arg>': <what>".
[[noreturn]] void arg_error(const char* op, const char* arg, const std::string& what);

ts::DType to_dtype(at::ScalarType t, const char* op, const char* arg);

ts::TensorView view(const Tensor& t, const char* op, const char* arg);
// An absent (or undefined) optional tensor is an absent view.
ts::TensorView view(const OptTensor& t, const char* op, const char* arg);
// A scratch tensor (allocated by the binding or passed by the caller): uint8 or any dtype view()
// takes.
ts::TensorView workspace_view(const Tensor& t, const char* op, const char* arg);

// Device guard + stream for the call; CPU: nothing.
struct Ctx {
#if defined(TRAINSCALE_TORCH_CUDA)
  std::optional<c10::cuda::CUDAGuard> guard;
#endif
  cudaStream_t stream = nullptr;
  // t: the op's first tensor argument `arg`. Its device selects the stream; its dtype is checked
  // here, before any output is allocated like it, so that an unsupported one is reported under
  // its own name.
  Ctx(const Tensor& t, const char* op, const char* arg) {
    to_dtype(t.scalar_type(), op, arg);
    if (t.is_cuda()) {
#if defined(TRAINSCALE_TORCH_CUDA)
      guard.emplace(t.device());
      stream = c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
#else
      TORCH_CHECK(false, "trainscale: CUDA tensor given, but the extension was built without CUDA");
#endif
    }
  }
};

// ValueError for argument errors, RuntimeError otherwise.
[[noreturn]] void rethrow(const ts::Error& e);

// Runs f, turning a trainscale::Error into the matching Python exception.
template <class F>
auto guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const ts::Error& e) {
    rethrow(e);
  }
}

// Defines the op from its schema ("name(Tensor x, ...) -> ...") and registers fn for CPU and
// CUDA tensors.
template <class Fn>
void def_op(torch::Library& m, const char* schema, Fn* fn) {
  m.def(schema);
  const std::string_view s(schema);
  const std::string name(s.substr(0, s.find('(')));
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::CPU, fn));
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::CUDA, fn));
}

}  // namespace trainscale::binding
