#include "binding.h"

namespace trainscale::binding {

[[noreturn]] void arg_error(const char* op, const char* arg, const std::string& what) {
  TORCH_CHECK_VALUE(false, "trainscale::", op, ": argument '", arg, "': ", what);
}

ts::DType to_dtype(at::ScalarType t, const char* op, const char* arg) {
  switch (t) {
    case at::kDouble: return ts::DType::kFloat64;
    case at::kFloat: return ts::DType::kFloat32;
    case at::kHalf: return ts::DType::kFloat16;
    case at::kBFloat16: return ts::DType::kBFloat16;
    case at::kFloat8_e4m3fn: return ts::DType::kFloat8E4M3;
    case at::kFloat8_e5m2: return ts::DType::kFloat8E5M2;
    case at::kInt: return ts::DType::kInt32;
    case at::kLong: return ts::DType::kInt64;
    default:
      arg_error(op, arg,
                std::string("expected a dtype in {float64, float32, float16, bfloat16, float8_e4m3fn, "
                            "float8_e5m2, int32, int64}, got ") +
                    std::string(c10::getDtypeNames(t).first));
  }
}

namespace {

ts::TensorView view_as(const Tensor& t, ts::DType dtype, const char* op, const char* arg) {
  ts::Device dev;
  if (t.is_cuda()) {
    dev = ts::Device::cuda(t.get_device());
  } else if (!t.is_cpu()) {
    arg_error(op, arg, "expected a CPU or CUDA tensor, got device " + t.device().str());
  }
  if (t.dim() > ts::kMaxDims) {
    arg_error(op, arg, "expected at most " + std::to_string(ts::kMaxDims) + " dims, got " +
                           std::to_string(t.dim()));
  }
  return ts::TensorView::from_arrays(t.data_ptr(), dtype, static_cast<int>(t.dim()), t.sizes().data(),
                                     t.strides().data(), dev);
}

}  // namespace

ts::TensorView view(const Tensor& t, const char* op, const char* arg) {
  return view_as(t, to_dtype(t.scalar_type(), op, arg), op, arg);
}

ts::TensorView workspace_view(const Tensor& t, const char* op, const char* arg) {
  // The ops check a workspace's bytes and alignment, not its element type: uint8 is viewed as a
  // one-byte dtype.
  const ts::DType dtype = t.scalar_type() == at::kByte ? ts::DType::kFloat8E4M3 : to_dtype(t.scalar_type(), op, arg);
  return view_as(t, dtype, op, arg);
}

ts::TensorView view(const OptTensor& t, const char* op, const char* arg) {
  return t.has_value() && t->defined() ? view(*t, op, arg) : ts::TensorView{};
}


void rethrow(const ts::Error& e) {
  std::string_view msg(e.what());
  if (msg.find("argument '") != std::string_view::npos) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  TORCH_CHECK(false, e.what());
}

}  // namespace trainscale::binding
