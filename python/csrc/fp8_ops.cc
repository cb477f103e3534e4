// The fp8 family as torch.ops.trainscale ops: python/trainscale/fp8.py wraps them, the
// entry points are in include/trainscale/fp8.h. Outputs are allocated here.
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "binding.h"
#include "trainscale/fp8.h"

namespace trainscale::binding {
namespace {

std::tuple<Tensor, Tensor> fp8_quantize(const Tensor& x, at::ScalarType dtype,
                                        c10::string_view granularity, bool power_of_two_scales,
                                        bool scales_m_major) {
  const char* op = "fp8_quantize";
  Ctx ctx(x, op, "x");
  if (dtype != at::kFloat8_e4m3fn && dtype != at::kFloat8_e5m2) {
    arg_error(op, "dtype", std::string("expected float8_e4m3fn or float8_e5m2, got ") +
                               c10::toString(dtype));
  }
  if (x.dim() != 2) {
    arg_error(op, "x", "expected 2 dims [M, N], got shape " + c10::str(x.sizes()));
  }
  std::string_view g(granularity.data(), granularity.size());
  const std::int64_t M = x.size(0), N = x.size(1), tiles = (N + 127) / 128;
  ts::Fp8QuantizeOptions o{.power_of_two_scales = power_of_two_scales,
                           .scales_m_major = scales_m_major};
  std::vector<std::int64_t> ssizes;
  if (g == "row") {
    o.granularity = ts::Fp8Granularity::kRow;
    ssizes = {M};
  } else if (g == "1x128") {
    o.granularity = ts::Fp8Granularity::kTile1x128;
    ssizes = scales_m_major ? std::vector<std::int64_t>{tiles, (M + 3) / 4 * 4}
                            : std::vector<std::int64_t>{M, tiles};
  } else {
    arg_error(op, "granularity", "expected 'row' or '1x128', got '" + std::string(g) + "'");
  }
  Tensor q = at::empty({M, N}, x.options().dtype(dtype));
  Tensor scales = at::empty(ssizes, x.options().dtype(at::kFloat));
  guarded([&] {
    ts::fp8_quantize(view(x, op, "x"), view(q, op, "q"), view(scales, op, "scales"), {}, {}, o,
                     ctx.stream);
  });
  return {q, scales};
}

}  // namespace
}  // namespace trainscale::binding

TORCH_LIBRARY_FRAGMENT(trainscale, m) {
  using namespace trainscale::binding;
  def_op(m, "fp8_quantize(Tensor x, ScalarType dtype, str granularity, bool power_of_two_scales, "
            "bool scales_m_major) -> (Tensor, Tensor)",
         &fp8_quantize);
}
