// Norm kernels against the fp64 CPU reference. Inputs are rounded to the kernel's dtype first;
// the reference runs on float64 copies of exactly those values.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>

#include "common/cuda_check.h"
#include "ops/norm/norm_cuda.h"
#include "trainscale/norm.h"
#include "util/gpu_util.h"

namespace trainscale {
namespace {

using test::DeviceTensor;
using test::HostTensor;

HostTensor as_f64(const HostTensor& t) {
  return HostTensor::from_values(DType::kFloat64, t.shape(), t.values());
}

struct Shape {
  std::int64_t rows, cols, pad;
};

std::string shape_name(DType dt, const Shape& s, DType wdt, NormVariant v) {
  return std::string(dtype_name(dt)) + " " + std::to_string(s.rows) + "x" + std::to_string(s.cols) +
         " pad " + std::to_string(s.pad) + " weight " + dtype_name(wdt) + " variant " +
         std::to_string(static_cast<int>(v));
}

// dx is a difference of terms of size rstd * |dy * w|; when they cancel (N = 1) the result is
// tiny and its relative error meaningless, so the error is measured against those terms too.
::testing::AssertionResult gradient_matches(const std::vector<double>& out,
                                            const std::vector<double>& ref, const HostTensor& dy,
                                            const HostTensor& rstd, double tol) {
  const double cols = static_cast<double>(dy.shape().back());
  double terms = 0;
  for (std::int64_t i = 0; i < dy.numel(); ++i) {
    const double t = dy.at(i) * rstd.at(static_cast<std::int64_t>(i / cols));
    terms += t * t;
  }
  double ref_sq = 0, err_sq = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(ref[i]) != std::isnan(out[i])) {
      return ::testing::AssertionFailure() << "NaN mismatch at " << i;
    }
    if (std::isnan(ref[i])) continue;
    ref_sq += ref[i] * ref[i];
    err_sq += (out[i] - ref[i]) * (out[i] - ref[i]);
  }
  const double err = std::sqrt(err_sq / std::max(ref_sq, terms));
  if (err > tol) return ::testing::AssertionFailure() << "scaled L2 error " << err << " > " << tol;
  return ::testing::AssertionSuccess();
}

// Same values element by element, NaN matching NaN (unwritten outputs stay poisoned).
::testing::AssertionResult identical(const HostTensor& a, const HostTensor& b) {
  const auto va = a.values(), vb = b.values();
  for (std::size_t i = 0; i < va.size(); ++i) {
    if (va[i] != vb[i] && !(std::isnan(va[i]) && std::isnan(vb[i]))) {
      return ::testing::AssertionFailure() << "at " << i << ": " << va[i] << " vs " << vb[i];
    }
  }
  return ::testing::AssertionSuccess();
}

std::vector<Shape> shapes() {
  // 8 and 16: rows of 1 and 2 (bf16) threads, 256 and 128 rows per block, the last block
  // partly filled; 64 and 248: rows of 4 and 8 (bf16) threads sharing a warp.
  return {{5, 1, 0},    {9, 7, 1},     {300, 8, 0},   {270, 16, 8},  {100, 64, 0},
          {37, 248, 8}, {33, 127, 0},
          {12, 512, 0}, {17, 1000, 8},
          {64, 4096, 0}, {7, 5123, 3}, {5, 8192, 16}, {6, 16384, 8},  {4, 32768, 0},
          {3, 65536, 0}, {2, 131072, 0}, {2, 262144, 0},
          // kPipelined's one vector per thread (16-bit: 5 vectors, 8 threads per row) over more
          // row groups than LayerNorm's persistent grid.
          {26000, 40, 0},
          // More rows than any grid: blocks and clusters take several rows each.
          {560, 65536, 0}};
}

// Register kernels take aligned rows of at most 4096 (forward) / 32768 (backward: a cluster of
// 16 blocks) 16-byte vectors; the forward's kRows up to 8 x 4096 (a cluster of up to 8 blocks).
constexpr std::int64_t kMaxClusterRowVectors = 8 * 4096;

std::int64_t row_vectors(const Shape& s, DType dt) {
  const std::int64_t vec = 16 / static_cast<std::int64_t>(dtype_size(dt));
  return s.cols % vec == 0 && s.pad % vec == 0 ? s.cols / vec : -1;
}

// Whether the forward's kRing runs aligned rows of `vecs` vectors: bulk copies (sm_90), at
// most 1024 vectors, no residual.
bool ring_fits(std::int64_t vecs, bool residual) {
  return detail::current_device_info().major >= 9 && vecs > 0 && vecs <= 1024 && !residual;
}

// kRows, kPipelined and kRing are forward-only: the backward takes them as kAuto.
std::vector<NormVariant> variants_for(const Shape& s, DType dt) {
  const std::int64_t vecs = row_vectors(s, dt);
  if (vecs > 0 && vecs <= 32768) {
    return {NormVariant::kRegisters, NormVariant::kTwoPass, NormVariant::kRows,
            NormVariant::kPipelined, NormVariant::kRing};
  }
  return {NormVariant::kAuto};
}

// Whether the forward's kPipelined has the shared memory for aligned rows of `cols`: fp32
// weight (and bias) tables, and the ring's stages of a block's row group (x, and the residual of
// the fused add): two for LayerNorm's persistent walk, one for RMSNorm and the fused add; a
// block takes 256 threads or one row, at 4 vectors per thread for long rows.
bool pipelined_fits(std::int64_t cols, DType dt, bool layernorm,
                    std::optional<DType> residual = std::nullopt) {
  const std::int64_t vecs = cols / (16 / static_cast<std::int64_t>(dtype_size(dt)));
  std::int64_t threads = 32;
  while (threads * 4 < vecs) threads *= 2;
  const std::int64_t rows_per_block = std::max<std::int64_t>(1, 256 / threads);
  const std::int64_t row_bytes =
      cols * static_cast<std::int64_t>(dtype_size(dt) + (residual ? dtype_size(*residual) : 0));
  const std::int64_t stages = layernorm ? 2 : 1;
  const std::int64_t bytes = cols * (layernorm ? 8 : 4) + stages * rows_per_block * row_bytes;
  const std::int64_t reduction_scratch = 1024 / 32 * 3 * 4;
  return bytes + reduction_scratch <=
         static_cast<std::int64_t>(detail::current_device_info().shared_memory_per_block_optin);
}

// The forward's variant for a backward variant: the forward's register kernels take shorter
// rows (kRows up to 8 x 4096 vectors, split over a cluster beyond 4096), kRegisters stages
// LayerNorm's weight and bias (8 B per column) in shared memory, with no room above about 29000
// columns, and kPipelined two row groups besides.
NormVariant forward_variant(const Shape& s, DType dt, NormVariant backward, bool layernorm = false,
                            std::optional<DType> residual = std::nullopt) {
  const bool short_enough = row_vectors(s, dt) <= 4096;
  bool fits = short_enough;
  if (backward == NormVariant::kRows) fits = row_vectors(s, dt) <= kMaxClusterRowVectors;
  if (backward == NormVariant::kRegisters) fits = short_enough && !(layernorm && s.cols > 16384);
  if (backward == NormVariant::kPipelined) {
    fits = short_enough && pipelined_fits(s.cols, dt, layernorm, residual);
  }
  if (backward == NormVariant::kRing) fits = ring_fits(row_vectors(s, dt), residual.has_value());
  return backward != NormVariant::kTwoPass && !fits ? NormVariant::kAuto : backward;
}

RMSNormOptions rms_options(NormVariant variant, double weight_offset = 0.0) {
  RMSNormOptions o;
  o.weight_offset = weight_offset;
  o.variant = variant;
  return o;
}

LayerNormOptions layer_options(NormVariant variant) {
  LayerNormOptions o;
  o.variant = variant;
  return o;
}

// Large shapes exercise the long-row paths; their fp64 reference is slow, so they run for
// bf16 with a bf16 weight/residual only (the dtype logic is covered by the small shapes).
bool worth_every_dtype(const Shape& s, DType dt, DType second) {
  return s.rows * s.cols <= (1 << 20) || (dt == DType::kBFloat16 && second == dt);
}

// Every dtype, or those TRAINSCALE_TEST_DTYPES names (e.g. "bfloat16,float32"): a sanitizer
// run, hundreds of times slower, can then split a test over processes by dtype.
std::vector<DType> test_dtypes() {
  std::vector<DType> dtypes;
  const char* only = std::getenv("TRAINSCALE_TEST_DTYPES");
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    const std::string name = dtype_name(dt);
    if (!only || ("," + std::string(only) + ",").find("," + name + ",") != std::string::npos) {
      dtypes.push_back(dt);
    }
  }
  if (dtypes.empty()) ADD_FAILURE() << "TRAINSCALE_TEST_DTYPES=" << only << " names no dtype";
  return dtypes;
}

std::size_t workspace_bytes(std::int64_t rows, std::int64_t cols, DType dt) {
  return norm_backward_workspace_bytes(rows, cols, dt, Device::cuda(0));
}

HostTensor byte_buffer(std::size_t bytes) {
  return HostTensor(DType::kFloat32, {static_cast<std::int64_t>((bytes + 3) / 4 + 4)});
}

// Checks one norm (RMS or Layer) forward and backward for every dtype, shape and variant.
void check_norm(bool layer) {
  TS_REQUIRE_GPU();
  for (DType dt : test_dtypes()) {
    for (DType wdt : {dt, DType::kFloat32}) {
      for (const Shape& s : shapes()) {
        if (!worth_every_dtype(s, dt, wdt)) continue;
        // One set of inputs and its fp64 reference per shape, checked against every variant.
        const double tol = test::tolerance(dt);
        auto x = HostTensor::random(dt, {s.rows, s.cols}, -2, 2, s.pad);
        x.set(0, x.at(0) + 3.0);  // a row with a non-zero mean
        auto w = HostTensor::random(wdt, {s.cols}, 0.5, 1.5);
        auto b = HostTensor::random(wdt, {s.cols}, -0.5, 0.5);
        auto dy = HostTensor::random(dt, {s.rows, s.cols}, -1, 1, s.pad);
        DeviceTensor d_x(x), d_w(w), d_b(b), d_dy(dy);
        auto x64 = as_f64(x), w64 = as_f64(w), b64 = as_f64(b), dy64 = as_f64(dy);
        HostTensor y64(DType::kFloat64, {s.rows, s.cols}), mean64(DType::kFloat64, {s.rows}),
            rstd64(DType::kFloat64, {s.rows}), dx64(DType::kFloat64, {s.rows, s.cols}),
            dw64(DType::kFloat64, {s.cols}), db64(DType::kFloat64, {s.cols});
        if (layer) {
          layernorm_forward(x64.view(), w64.view(), b64.view(), y64.view(), mean64.view(), rstd64.view());
          layernorm_backward({.dy = dy64.view(), .x = x64.view(), .weight = w64.view(), .mean = mean64.view(),
                              .rstd = rstd64.view(), .dx = dx64.view(), .dw = dw64.view(), .db = db64.view()});
        } else {
          const RMSNormOptions opt = rms_options(NormVariant::kAuto, 0.25);
          rmsnorm_forward(x64.view(), w64.view(), y64.view(), rstd64.view(), opt);
          rmsnorm_backward(dy64.view(), x64.view(), w64.view(), rstd64.view(), dx64.view(), dw64.view(), {}, opt);
        }
        const std::vector<double> y_ref = y64.values(), dx_ref = dx64.values();
        for (NormVariant variant : variants_for(s, dt)) {
          SCOPED_TRACE(shape_name(dt, s, wdt, variant));
          DeviceTensor d_y(HostTensor(dt, {s.rows, s.cols}, s.pad), false);
          DeviceTensor d_mean(HostTensor(DType::kFloat32, {s.rows}), false);
          DeviceTensor d_rstd(HostTensor(DType::kFloat32, {s.rows}), false);
          DeviceTensor d_dx(HostTensor(dt, {s.rows, s.cols}, s.pad), false);
          DeviceTensor d_dw(HostTensor(wdt, {s.cols}), false), d_db(HostTensor(wdt, {s.cols}), false);
          DeviceTensor d_ws(byte_buffer(workspace_bytes(s.rows, s.cols, dt)), false);
          if (layer) {
            ops::norm::layernorm_forward_cuda(
                d_x.view(), d_w.view(), d_b.view(), d_y.view(), d_mean.view(), d_rstd.view(),
                layer_options(forward_variant(s, dt, variant, true)), nullptr);
            ops::norm::layernorm_backward_cuda(d_dy.view(), d_x.view(), d_w.view(), d_mean.view(),
                                               d_rstd.view(), d_dx.view(), d_dw.view(),
                                               d_db.view(), d_ws.view(), layer_options(variant),
                                               nullptr);
          } else {
            ops::norm::rmsnorm_forward_cuda(d_x.view(), d_w.view(), d_y.view(), d_rstd.view(),
                                            rms_options(forward_variant(s, dt, variant), 0.25),
                                            nullptr);
            ops::norm::rmsnorm_backward_cuda(d_dy.view(), d_x.view(), d_w.view(), d_rstd.view(),
                                             d_dx.view(), d_dw.view(), d_ws.view(), rms_options(variant, 0.25),
                                             nullptr);
          }
          EXPECT_TRUE(test::matches_reference(d_y.to_host().values(), y_ref, tol)) << "y";
          EXPECT_TRUE(test::matches_reference(d_rstd.to_host().values(), rstd64.values(), 1e-5))
              << "rstd";
          if (layer) {
            // The mean sits near 0: bound its error by the inputs' scale (|x| <= 5), not by itself.
            EXPECT_LE(test::max_abs_err(d_mean.to_host().values(), mean64.values()), 1e-5) << "mean";
          }
          EXPECT_TRUE(gradient_matches(d_dx.to_host().values(), dx_ref, dy64, rstd64, tol)) << "dx";
          const double wtol = test::tolerance(wdt) * (wdt == DType::kFloat32 ? 10 : 1);
          EXPECT_TRUE(test::matches_reference(d_dw.to_host().values(), dw64.values(), wtol)) << "dw";
          if (layer) {
            EXPECT_TRUE(test::matches_reference(d_db.to_host().values(), db64.values(), wtol))
                << "db";
          }
        }
      }
    }
  }
}

TEST(NormCuda, RMSNormMatchesReference) { check_norm(false); }
TEST(NormCuda, LayerNormMatchesReference) { check_norm(true); }

TEST(NormCuda, FusedAddRMSNormMatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : test_dtypes()) {
    for (DType rdt : {dt, DType::kFloat32}) {
      for (const Shape& s : shapes()) {
        if (!worth_every_dtype(s, dt, rdt)) continue;
        // One set of inputs and its reference per shape, checked against every variant: the sum
        // as the kernel stores it (rounded to the residual dtype), then rmsnorm in fp64.
        const double tol = test::tolerance(dt);
        auto x = HostTensor::random(dt, {s.rows, s.cols}, -2, 2, s.pad);
        auto r = HostTensor::random(rdt, {s.rows, s.cols}, -2, 2);
        auto w = HostTensor::random(dt, {s.cols}, 0.5, 1.5);
        auto dy = HostTensor::random(dt, {s.rows, s.cols}, -1, 1, s.pad);
        auto dres = HostTensor::random(rdt, {s.rows, s.cols}, -1, 1);
        DeviceTensor d_w(w), d_dy(dy), d_dres(dres);
        HostTensor sum(rdt, {s.rows, s.cols});
        for (std::int64_t i = 0; i < sum.numel(); ++i) sum.set(i, x.at(i) + r.at(i));
        auto s64 = as_f64(sum), w64 = as_f64(w), dy64 = as_f64(dy), dres64 = as_f64(dres);
        HostTensor y64(DType::kFloat64, {s.rows, s.cols}), rstd64(DType::kFloat64, {s.rows}),
            dx64(DType::kFloat64, {s.rows, s.cols}), dw64(DType::kFloat64, {s.cols});
        rmsnorm_forward(s64.view(), w64.view(), y64.view(), rstd64.view());
        fused_add_rmsnorm_backward(dy64.view(), dres64.view(), s64.view(), w64.view(), rstd64.view(), dx64.view(),
                                   dw64.view(), {});
        for (NormVariant variant : variants_for(s, dt)) {
          SCOPED_TRACE(shape_name(dt, s, rdt, variant));
          DeviceTensor d_x(x), d_r(r);  // the forward writes both in place
          DeviceTensor d_rstd(HostTensor(DType::kFloat32, {s.rows}), false);
          DeviceTensor d_dx(HostTensor(dt, {s.rows, s.cols}, s.pad), false);
          DeviceTensor d_dw(HostTensor(dt, {s.cols}), false);
          DeviceTensor d_ws(byte_buffer(workspace_bytes(s.rows, s.cols, dt)), false);
          const RMSNormOptions forward_options =
              rms_options(forward_variant(s, dt, variant, false, rdt));
          {
            // Out of place first, into poisoned outputs: x and r must stay as they are.
            DeviceTensor d_x_in(x), d_r_in(r);
            DeviceTensor d_y(HostTensor(dt, {s.rows, s.cols}, s.pad), false);
            DeviceTensor d_sum(HostTensor(rdt, {s.rows, s.cols}), false);
            DeviceTensor d_rstd_out(HostTensor(DType::kFloat32, {s.rows}), false);
            d_y.poison();
            d_sum.poison();
            d_rstd_out.poison();
            ops::norm::fused_add_rmsnorm_forward_cuda(d_x_in.view(), d_r_in.view(), d_w.view(),
                                                      d_y.view(), d_sum.view(), d_rstd_out.view(),
                                                      forward_options, nullptr);
            EXPECT_TRUE(test::matches_reference(d_sum.to_host().values(), sum.values(), 1e-6))
                << "residual_out";
            EXPECT_TRUE(test::matches_reference(d_y.to_host().values(), y64.values(), tol)) << "y";
            EXPECT_TRUE(test::matches_reference(d_rstd_out.to_host().values(), rstd64.values(), 1e-5))
                << "rstd";
            EXPECT_TRUE(identical(d_x_in.to_host(), x)) << "x changed";
            EXPECT_TRUE(identical(d_r_in.to_host(), r)) << "residual changed";
          }
          ops::norm::fused_add_rmsnorm_forward_cuda(d_x.view(), d_r.view(), d_w.view(), d_x.view(),
                                                    d_r.view(), d_rstd.view(), forward_options,
                                                    nullptr);
          ops::norm::fused_add_rmsnorm_backward_cuda(d_dy.view(), d_dres.view(), d_r.view(),
                                                     d_w.view(), d_rstd.view(), d_dx.view(),
                                                     d_dw.view(), d_ws.view(),
                                                     rms_options(variant), nullptr);
          EXPECT_TRUE(test::matches_reference(d_r.to_host().values(), sum.values(), 1e-6))
              << "residual";
          EXPECT_TRUE(test::matches_reference(d_x.to_host().values(), y64.values(), tol)) << "x";
          EXPECT_TRUE(test::matches_reference(d_dx.to_host().values(), dx64.values(), tol)) << "dx";
          EXPECT_TRUE(test::matches_reference(d_dw.to_host().values(), dw64.values(), tol)) << "dw";
        }
      }
    }
  }
}

// Backward only, on the longest rows: the one-block-per-SM register kernels (4 vectors per
// thread, clusters of 8 and 16 blocks, the next row prefetched into shared memory) with 1.5-3
// rows per cluster, strided rows, a row just above the 8-block limit (131072 + 8 bf16: 16
// blocks of about 8200 columns), fp32 weights (fp32 residual for the fused add), RMSNorm's weight
// offset and the fused add's d_residual. rstd and mean come from the fp64 reference (as fp32),
// so the backward alone is under test; outputs start poisoned. dw (and db) must be bitwise the
// same on a second run, and dx the same computed in place (dx = dy).
void check_long_row_backward(int which) {  // 0 RMSNorm, 1 LayerNorm, 2 fused add + RMSNorm
  TS_REQUIRE_GPU();
  const bool layer = which == 1;
  for (DType dt : test_dtypes()) {
    // fp32 rows reach the 16-block kernel at 131072 (32768 vectors); 262144 is two passes.
    const std::vector<Shape> long_shapes =
        dt == DType::kFloat32
            ? std::vector<Shape>{{24, 131072, 4}, {24, 65536 + 4, 0}, {20, 65536, 0}}
            : std::vector<Shape>{{24, 262144, 8}, {24, 131072 + 8, 0}, {24, 131072, 8}};
    for (DType pdt : {dt, DType::kFloat32}) {
      if (dt == DType::kFloat16 && pdt != dt) continue;  // bf16 covers fp32 parameters
      for (const Shape& s : long_shapes) {
        const NormVariant variant =
            row_vectors(s, dt) <= 32768 ? NormVariant::kRegisters : NormVariant::kAuto;
        SCOPED_TRACE(shape_name(dt, s, pdt, variant) + " op " + std::to_string(which));
        // The fused add's input is the saved sum, in the residual's dtype pdt.
        const DType xdt = which == 2 ? pdt : dt;
        const DType wdt = which == 2 ? dt : pdt;
        auto x = HostTensor::random(xdt, {s.rows, s.cols}, -2, 2, which == 2 ? 0 : s.pad);
        x.set(0, x.at(0) + 3.0);  // a row with a non-zero mean
        auto w = HostTensor::random(wdt, {s.cols}, 0.5, 1.5);
        auto dy = HostTensor::random(dt, {s.rows, s.cols}, -1, 1, s.pad);
        auto dres = which == 2 ? HostTensor::random(xdt, {s.rows, s.cols}, -1, 1)
                               : HostTensor(xdt, {1, 1});  // the fused add's only
        auto x64 = as_f64(x), w64 = as_f64(w), dy64 = as_f64(dy), dres64 = as_f64(dres);
        HostTensor y64(DType::kFloat64, {s.rows, s.cols}), mean64(DType::kFloat64, {s.rows}),
            rstd64(DType::kFloat64, {s.rows}), dx64(DType::kFloat64, {s.rows, s.cols}),
            dw64(DType::kFloat64, {s.cols}), db64(DType::kFloat64, {s.cols});
        const RMSNormOptions rms = rms_options(variant, 0.25);
        if (layer) {
          layernorm_forward(x64.view(), w64.view(), {}, y64.view(), mean64.view(), rstd64.view());
          layernorm_backward({.dy = dy64.view(), .x = x64.view(), .weight = w64.view(),
                              .mean = mean64.view(), .rstd = rstd64.view(), .dx = dx64.view(),
                              .dw = dw64.view(), .db = db64.view()});
        } else {
          rmsnorm_forward(x64.view(), w64.view(), y64.view(), rstd64.view(), rms);
          if (which == 0) {
            rmsnorm_backward(dy64.view(), x64.view(), w64.view(), rstd64.view(), dx64.view(),
                             dw64.view(), {}, rms);
          } else {
            fused_add_rmsnorm_backward(dy64.view(), dres64.view(), x64.view(), w64.view(),
                                       rstd64.view(), dx64.view(), dw64.view(), {}, rms);
          }
        }
        DeviceTensor d_x(x), d_w(w), d_dy(dy), d_dres(dres);
        DeviceTensor d_mean(HostTensor::from_values(DType::kFloat32, {s.rows}, mean64.values()));
        DeviceTensor d_rstd(HostTensor::from_values(DType::kFloat32, {s.rows}, rstd64.values()));
        DeviceTensor d_ws(byte_buffer(workspace_bytes(s.rows, s.cols, dt)), false);
        // dx into `dx` (dy's own view when in place), dw and db into fresh poisoned tensors.
        const auto run = [&](const TensorView& dy_view, const TensorView& dx, HostTensor* dw,
                             HostTensor* db) {
          DeviceTensor d_dw(HostTensor(wdt, {s.cols}), false), d_db(HostTensor(wdt, {s.cols}), false);
          if (layer) {
            ops::norm::layernorm_backward_cuda(dy_view, d_x.view(), d_w.view(), d_mean.view(),
                                               d_rstd.view(), dx, d_dw.view(), d_db.view(),
                                               d_ws.view(), layer_options(variant), nullptr);
          } else if (which == 0) {
            ops::norm::rmsnorm_backward_cuda(dy_view, d_x.view(), d_w.view(), d_rstd.view(), dx,
                                             d_dw.view(), d_ws.view(), rms, nullptr);
          } else {
            ops::norm::fused_add_rmsnorm_backward_cuda(dy_view, d_dres.view(), d_x.view(),
                                                       d_w.view(), d_rstd.view(), dx, d_dw.view(),
                                                       d_ws.view(), rms, nullptr);
          }
          *dw = d_dw.to_host();
          *db = d_db.to_host();
        };
        DeviceTensor d_dx(HostTensor(dt, {s.rows, s.cols}, s.pad), false);
        HostTensor dw, db, dw_again, db_again;
        run(d_dy.view(), d_dx.view(), &dw, &db);
        const HostTensor dx = d_dx.to_host();
        d_dx.poison();
        run(d_dy.view(), d_dx.view(), &dw_again, &db_again);
        DeviceTensor d_in_place(dy);
        HostTensor unused_dw, unused_db;
        run(d_in_place.view(), d_in_place.view(), &unused_dw, &unused_db);

        const double tol = test::tolerance(dt);
        EXPECT_TRUE(gradient_matches(dx.values(), dx64.values(), dy64, rstd64, tol)) << "dx";
        const double wtol = test::tolerance(wdt) * (wdt == DType::kFloat32 ? 10 : 1);
        EXPECT_TRUE(test::matches_reference(dw.values(), dw64.values(), wtol)) << "dw";
        const auto weight_bytes = static_cast<std::size_t>(s.cols) * dtype_size(wdt);
        if (layer) {
          EXPECT_TRUE(test::matches_reference(db.values(), db64.values(), wtol)) << "db";
          EXPECT_EQ(std::memcmp(db.data(), db_again.data(), weight_bytes), 0) << "db again";
        }
        EXPECT_EQ(std::memcmp(dw.data(), dw_again.data(), weight_bytes), 0) << "dw again";
        EXPECT_TRUE(identical(dx, d_dx.to_host())) << "dx again";
        EXPECT_TRUE(identical(dx, d_in_place.to_host())) << "dx in place";
      }
    }
  }
}

TEST(NormCuda, RMSNormLongRowsBackward) { check_long_row_backward(0); }
TEST(NormCuda, LayerNormLongRowsBackward) { check_long_row_backward(1); }
TEST(NormCuda, FusedAddRMSNormLongRowsBackward) { check_long_row_backward(2); }

// The training shapes' paths (issue 25), every op, 16-bit activations with weights in their
// dtype and in fp32: the forward's kAuto at every boundary of its choice there (kPipelined up to
// N = 1024, the fused add's up to 2048, kRows beyond, kRing for mid-sized inputs without a
// residual), an odd row length (two passes), M = 1, M not a multiple of
// the rows per block; the backward reducing its dw/db partial rows in the same (cooperative)
// launch for one block per row group (N <= 8192 at 16 bits), against the fp64 reference, twice
// into NaN-poisoned dw/db and a poisoned workspace: bitwise the same.
TEST(NormCuda, TrainingShapesMatchReferenceAndReproduce) {
  TS_REQUIRE_GPU();
  const std::vector<Shape> shapes = {{1, 4096, 0},    {3, 2048, 0},   {129, 2048, 0}, {2049, 4096, 0},
                                     {257, 4104, 0},  {1000, 5120, 0}, {65, 6144, 0},  {1031, 8192, 0},
                                     {300, 5123, 0},  {4096, 4096, 0}, {5, 8200, 0},   {66, 1024, 0},
                                     {33, 1032, 0},   {17, 2056, 0}};
  for (DType dt : test_dtypes()) {
    if (dt == DType::kFloat32) continue;  // the 16-bit training dtypes
    for (const Shape& s : shapes) {
      // The activations, their device copies and float64 forms serve all six (weight dtype, op)
      // pairs of the shape: drawing and converting them is most of this test's host time.
      auto x = HostTensor::random(dt, {s.rows, s.cols}, -2, 2);
      x.set(0, x.at(0) + 3.0);  // a row with a non-zero mean
      auto r = HostTensor::random(dt, {s.rows, s.cols}, -2, 2);
      auto dy = HostTensor::random(dt, {s.rows, s.cols}, -1, 1);
      auto dres = HostTensor::random(dt, {s.rows, s.cols}, -1, 1);
      // The fused add's sum rounded to its dtype: its norm's input.
      HostTensor sum(dt, {s.rows, s.cols});
      for (std::int64_t i = 0; i < sum.numel(); ++i) sum.set(i, x.at(i) + r.at(i));
      const HostTensor x64 = as_f64(x), sum64 = as_f64(sum), dy64 = as_f64(dy), dres64 = as_f64(dres);
      DeviceTensor d_dy(dy), d_dres(dres), d_x_in(x), d_sum_in(sum);
      for (DType wdt : {dt, DType::kFloat32}) {
        auto w = HostTensor::random(wdt, {s.cols}, 0.5, 1.5);
        auto b = HostTensor::random(wdt, {s.cols}, -0.5, 0.5);
        const HostTensor w64 = as_f64(w), b64 = as_f64(b);
        DeviceTensor d_w(w), d_b(b);
        for (int which = 0; which < 3; ++which) {  // RMSNorm, LayerNorm, fused add + RMSNorm
          SCOPED_TRACE(shape_name(dt, s, wdt, NormVariant::kAuto) + " op " + std::to_string(which));
          const bool layer = which == 1;
          const double tol = test::tolerance(dt);
          const HostTensor& in = which == 2 ? sum : x;
          const HostTensor& in64 = which == 2 ? sum64 : x64;
          HostTensor y64(DType::kFloat64, {s.rows, s.cols}), mean64(DType::kFloat64, {s.rows}),
              rstd64(DType::kFloat64, {s.rows}), dx64(DType::kFloat64, {s.rows, s.cols}),
              dw64(DType::kFloat64, {s.cols}), db64(DType::kFloat64, {s.cols});
          if (layer) {
            layernorm_forward(in64.view(), w64.view(), b64.view(), y64.view(), mean64.view(),
                              rstd64.view());
            layernorm_backward({.dy = dy64.view(), .x = in64.view(), .weight = w64.view(),
                                .mean = mean64.view(), .rstd = rstd64.view(), .dx = dx64.view(),
                                .dw = dw64.view(), .db = db64.view()});
          } else {
            rmsnorm_forward(in64.view(), w64.view(), y64.view(), rstd64.view());
            if (which == 0) {
              rmsnorm_backward(dy64.view(), in64.view(), w64.view(), rstd64.view(), dx64.view(),
                               dw64.view(), {});
            } else {
              fused_add_rmsnorm_backward(dy64.view(), dres64.view(), in64.view(), w64.view(),
                                         rstd64.view(), dx64.view(), dw64.view(), {});
            }
          }
          // Forward (the fused add writes over its inputs: fresh copies).
          DeviceTensor d_x(x), d_r(r);
          DeviceTensor d_y(HostTensor(dt, {s.rows, s.cols}), false);
          DeviceTensor d_mean(HostTensor(DType::kFloat32, {s.rows}), false);
          DeviceTensor d_rstd(HostTensor(DType::kFloat32, {s.rows}), false);
          if (which == 0) {
            rmsnorm_forward(d_x.view(), d_w.view(), d_y.view(), d_rstd.view());
          } else if (which == 1) {
            layernorm_forward(d_x.view(), d_w.view(), d_b.view(), d_y.view(), d_mean.view(),
                              d_rstd.view());
          } else {
            fused_add_rmsnorm_forward(d_x.view(), d_r.view(), d_w.view(), d_rstd.view());
            EXPECT_TRUE(identical(d_r.to_host(), in)) << "residual";
          }
          EXPECT_TRUE(test::matches_reference((which == 2 ? d_x : d_y).to_host().values(),
                                              y64.values(), tol))
              << "y";
          EXPECT_TRUE(test::matches_reference(d_rstd.to_host().values(), rstd64.values(), 1e-5))
              << "rstd";
          if (layer) {
            EXPECT_LE(test::max_abs_err(d_mean.to_host().values(), mean64.values()), 1e-5) << "mean";
          }
          // Backward on the saved statistics of the reference (as fp32), twice.
          const DeviceTensor& d_in = which == 2 ? d_sum_in : d_x_in;
          DeviceTensor d_smean(HostTensor::from_values(DType::kFloat32, {s.rows}, mean64.values()));
          DeviceTensor d_srstd(HostTensor::from_values(DType::kFloat32, {s.rows}, rstd64.values()));
          HostTensor dx[2], dw[2], db[2];
          for (int run = 0; run < 2; ++run) {
            DeviceTensor d_dx(HostTensor(dt, {s.rows, s.cols}), false);
            DeviceTensor d_dw(HostTensor(wdt, {s.cols}), false), d_db(HostTensor(wdt, {s.cols}), false);
            DeviceTensor d_ws(byte_buffer(workspace_bytes(s.rows, s.cols, dt)), false);
            if (which == 0) {
              rmsnorm_backward(d_dy.view(), d_in.view(), d_w.view(), d_srstd.view(), d_dx.view(),
                               d_dw.view(), d_ws.view());
            } else if (which == 1) {
              layernorm_backward({.dy = d_dy.view(), .x = d_in.view(), .weight = d_w.view(),
                                  .mean = d_smean.view(), .rstd = d_srstd.view(), .dx = d_dx.view(),
                                  .dw = d_dw.view(), .db = d_db.view(), .workspace = d_ws.view()});
            } else {
              fused_add_rmsnorm_backward(d_dy.view(), d_dres.view(), d_in.view(), d_w.view(),
                                         d_srstd.view(), d_dx.view(), d_dw.view(), d_ws.view());
            }
            dx[run] = d_dx.to_host();
            dw[run] = d_dw.to_host();
            db[run] = d_db.to_host();
          }
          EXPECT_TRUE(gradient_matches(dx[0].values(), dx64.values(), dy64, rstd64, tol)) << "dx";
          const double wtol = test::tolerance(wdt) * (wdt == DType::kFloat32 ? 10 : 1);
          EXPECT_TRUE(test::matches_reference(dw[0].values(), dw64.values(), wtol)) << "dw";
          const auto weight_bytes = static_cast<std::size_t>(s.cols) * dtype_size(wdt);
          EXPECT_EQ(std::memcmp(dw[0].data(), dw[1].data(), weight_bytes), 0) << "dw again";
          if (layer) {
            EXPECT_TRUE(test::matches_reference(db[0].values(), db64.values(), wtol)) << "db";
            EXPECT_EQ(std::memcmp(db[0].data(), db[1].data(), weight_bytes), 0) << "db again";
          }
          EXPECT_TRUE(identical(dx[0], dx[1])) << "dx again";
        }
      }
    }
  }
}

// A backward with only db or only dw asked for (LayerNorm), and without either: the in-kernel
// reduction writes what is asked and nothing else (the other output stays poisoned).
TEST(NormCuda, LayerNormBackwardWithoutDbGivesTheSameDw) {
  TS_REQUIRE_GPU();
  const std::int64_t rows = 1000, cols = 4096;
  auto x = HostTensor::random(DType::kBFloat16, {rows, cols}, -2, 2);
  auto dy = HostTensor::random(DType::kBFloat16, {rows, cols}, -1, 1);
  auto w = HostTensor::random(DType::kFloat32, {cols}, 0.5, 1.5);
  auto mean = HostTensor::random(DType::kFloat32, {rows}, -0.1, 0.1);
  auto rstd = HostTensor::random(DType::kFloat32, {rows}, 0.5, 2.0);
  DeviceTensor d_x(x), d_dy(dy), d_w(w), d_mean(mean), d_rstd(rstd);
  DeviceTensor d_ws(byte_buffer(workspace_bytes(rows, cols, DType::kBFloat16)), false);
  HostTensor with_db[2];
  for (const bool db : {true, false}) {  // dw is required with a weight; db is optional
    SCOPED_TRACE(db ? "dw and db" : "dw only");
    DeviceTensor d_dx(HostTensor(DType::kBFloat16, {rows, cols}), false);
    DeviceTensor d_dw(HostTensor(DType::kFloat32, {cols}), false), d_db(HostTensor(DType::kFloat32, {cols}), false);
    d_dw.poison();
    d_db.poison();
    layernorm_backward({.dy = d_dy.view(), .x = d_x.view(), .weight = d_w.view(), .mean = d_mean.view(),
                        .rstd = d_rstd.view(), .dx = d_dx.view(), .dw = d_dw.view(),
                        .db = db ? d_db.view() : TensorView{}, .workspace = d_ws.view()});
    if (db) {
      with_db[0] = d_dx.to_host();
      with_db[1] = d_dw.to_host();
    } else {
      EXPECT_TRUE(identical(d_dx.to_host(), with_db[0]));
      EXPECT_TRUE(identical(d_dw.to_host(), with_db[1]));
    }
  }
}

// The backward's cooperative launch (dw/db reduced in the same launch) captured in a CUDA
// graph, as the bench captures short calls: two replays into a poisoned dw/db give the bits of
// the direct call on the stream.
TEST(NormCuda, BackwardWithInKernelReductionRunsInACudaGraph) {
  TS_REQUIRE_GPU();
  const std::int64_t rows = 2048, cols = 2048;
  auto x = HostTensor::random(DType::kBFloat16, {rows, cols}, -2, 2);
  auto dy = HostTensor::random(DType::kBFloat16, {rows, cols}, -1, 1);
  auto w = HostTensor::random(DType::kBFloat16, {cols}, 0.5, 1.5);
  auto mean = HostTensor::random(DType::kFloat32, {rows}, -0.1, 0.1);
  auto rstd = HostTensor::random(DType::kFloat32, {rows}, 0.5, 2.0);
  DeviceTensor d_x(x), d_dy(dy), d_w(w), d_mean(mean), d_rstd(rstd);
  DeviceTensor d_ws(byte_buffer(workspace_bytes(rows, cols, DType::kBFloat16)), false);
  DeviceTensor d_dx(HostTensor(DType::kBFloat16, {rows, cols}), false);
  DeviceTensor d_dw(HostTensor(DType::kBFloat16, {cols}), false), d_db(HostTensor(DType::kBFloat16, {cols}), false);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const auto call = [&] {
    layernorm_backward({.dy = d_dy.view(), .x = d_x.view(), .weight = d_w.view(), .mean = d_mean.view(),
                        .rstd = d_rstd.view(), .dx = d_dx.view(), .dw = d_dw.view(), .db = d_db.view(),
                        .workspace = d_ws.view()},
                       {}, stream);
  };
  call();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const HostTensor dx = d_dx.to_host(), dw = d_dw.to_host(), db = d_db.to_host();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  call();
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    d_dx.poison();
    d_dw.poison();
    d_db.poison();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the poison (default stream) before the replay
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(identical(d_dx.to_host(), dx)) << replay;
    EXPECT_TRUE(identical(d_dw.to_host(), dw)) << replay;
    EXPECT_TRUE(identical(d_db.to_host(), db)) << replay;
  }
  for (double v : dw.values()) ASSERT_TRUE(std::isfinite(v));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Forward only, on long rows: the register kernels at 512 and 1024 threads per row (kRegisters'
// staged weight and bias tables need more than the default 48 KB of shared memory) and kRows
// split over a cluster of 2, 4 or 8 blocks beyond 4096 vectors, against two passes and auto.
// Weight and bias in fp32 or the activation dtype, residual of either for the fused add.
std::vector<NormVariant> forward_variants(std::int64_t cols, DType dt, bool layer,
                                          std::optional<DType> residual = std::nullopt) {
  const std::int64_t vec = 16 / static_cast<std::int64_t>(dtype_size(dt));
  std::vector<NormVariant> variants = {NormVariant::kTwoPass, NormVariant::kAuto};
  if (cols / vec <= kMaxClusterRowVectors) variants.push_back(NormVariant::kRows);
  if (cols / vec > 4096) return variants;
  // kRegisters stages 4 bytes per column for RMSNorm, 8 for LayerNorm; stay well under any
  // Hopper block's shared-memory limit (227 KB) when forcing it.
  if (cols * (layer ? 8 : 4) <= 160 * 1024) variants.push_back(NormVariant::kRegisters);
  if (pipelined_fits(cols, dt, layer, residual)) variants.push_back(NormVariant::kPipelined);
  if (cols % vec == 0 && ring_fits(cols / vec, residual.has_value())) {
    variants.push_back(NormVariant::kRing);
  }
  return variants;
}

// The forward variants that apply to the shape: on unaligned rows only two passes and auto.
std::vector<NormVariant> applicable_forward_variants(const Shape& s, DType dt, bool layer) {
  std::vector<NormVariant> variants = forward_variants(s.cols, dt, layer);
  if (row_vectors(s, dt) > 0) return variants;
  std::erase_if(variants, [](NormVariant v) {
    return v != NormVariant::kTwoPass && v != NormVariant::kAuto;
  });
  return variants;
}

// LayerNorm forward on the device and in the fp64 reference over the same inputs (x uniform in
// [x_lo, x_hi], strided as the shape says; weight and bias of dtype dt unless absent).
struct LayerNormForwardRun {
  HostTensor y, mean, rstd;           // device
  HostTensor y64, mean64, rstd64;     // reference
};

LayerNormForwardRun run_layernorm_forward(DType dt, const Shape& s, NormVariant variant,
                                          double x_lo = -2, double x_hi = 2, bool has_w = true,
                                          bool has_b = true) {
  auto x = HostTensor::random(dt, {s.rows, s.cols}, x_lo, x_hi, s.pad);
  auto w = HostTensor::random(dt, {s.cols}, 0.5, 1.5);
  auto b = HostTensor::random(dt, {s.cols}, -0.5, 0.5);
  DeviceTensor d_x(x), d_w(w), d_b(b);
  DeviceTensor d_y(HostTensor(dt, {s.rows, s.cols}, s.pad), false);
  DeviceTensor d_mean(HostTensor(DType::kFloat32, {s.rows}), false);
  DeviceTensor d_rstd(HostTensor(DType::kFloat32, {s.rows}), false);
  auto x64 = as_f64(x), w64 = as_f64(w), b64 = as_f64(b);
  LayerNormForwardRun run{{}, {}, {}, HostTensor(DType::kFloat64, {s.rows, s.cols}),
                          HostTensor(DType::kFloat64, {s.rows}),
                          HostTensor(DType::kFloat64, {s.rows})};
  layernorm_forward(x64.view(), has_w ? w64.view() : TensorView{},
                    has_b ? b64.view() : TensorView{}, run.y64.view(), run.mean64.view(),
                    run.rstd64.view());
  ops::norm::layernorm_forward_cuda(d_x.view(), has_w ? d_w.view() : TensorView{},
                                    has_b ? d_b.view() : TensorView{}, d_y.view(), d_mean.view(),
                                    d_rstd.view(), layer_options(variant), nullptr);
  run.y = d_y.to_host();
  run.mean = d_mean.to_host();
  run.rstd = d_rstd.to_host();
  return run;
}

// rstd at fp32 accuracy always; y at the dtype's tolerance and the mean at mean_tolerance when given.
void expect_layernorm_matches(const LayerNormForwardRun& run, std::optional<double> y_tolerance,
                              std::optional<double> mean_tolerance) {
  if (y_tolerance) {
    EXPECT_TRUE(test::matches_reference(run.y.values(), run.y64.values(), *y_tolerance)) << "y";
  }
  EXPECT_TRUE(test::matches_reference(run.rstd.values(), run.rstd64.values(), 1e-5)) << "rstd";
  if (mean_tolerance) {
    EXPECT_TRUE(test::matches_reference(run.mean.values(), run.mean64.values(), *mean_tolerance))
        << "mean";
  }
}

void check_long_row_forward(int which) {  // 0 RMSNorm, 1 LayerNorm, 2 fused add + RMSNorm
  TS_REQUIRE_GPU();
  const bool layer = which == 1;
  for (DType dt : test_dtypes()) {
    for (DType pdt : {dt, DType::kFloat32}) {
      // Beyond 4096 vectors the cluster sizes and their bounds (bf16: 32776 is 4097 vectors,
      // 2 blocks of 2049 and 2048; 65536 exactly 2 x 4096; 65544 4 blocks; 131080 8 blocks of
      // 2049 and the last of 2042; 262144 8 x 4096, fp32 past the cluster: two passes), strided.
      for (const Shape& s : std::vector<Shape>{{3, 16384, 8},
                                               {2, 32768, 0},
                                               {3, 12288, 0},
                                               {3, 32776, 8},
                                               {2, 65536, 16},
                                               {2, 65544, 0},
                                               {2, 131080, 8},
                                               {2, 262144, 0}}) {
        const auto residual = which == 2 ? std::optional<DType>(pdt) : std::nullopt;
        for (NormVariant variant : forward_variants(s.cols, dt, layer, residual)) {
          SCOPED_TRACE(shape_name(dt, s, pdt, variant) + " op " + std::to_string(which));
          const double tol = test::tolerance(dt);
          auto x = HostTensor::random(dt, {s.rows, s.cols}, -2, 2, s.pad);
          auto r = HostTensor::random(pdt, {s.rows, s.cols}, -2, 2);
          auto w = HostTensor::random(pdt, {s.cols}, 0.5, 1.5);
          auto b = HostTensor::random(pdt, {s.cols}, -0.5, 0.5);
          DeviceTensor d_x(x), d_r(r), d_w(w), d_b(b);
          DeviceTensor d_y(HostTensor(dt, {s.rows, s.cols}, s.pad), false);
          DeviceTensor d_mean(HostTensor(DType::kFloat32, {s.rows}), false);
          DeviceTensor d_rstd(HostTensor(DType::kFloat32, {s.rows}), false);
          HostTensor in = x;
          if (which == 2) {
            in = HostTensor(pdt, {s.rows, s.cols});
            for (std::int64_t i = 0; i < in.numel(); ++i) in.set(i, x.at(i) + r.at(i));
          }
          auto in64 = as_f64(in), w64 = as_f64(w), b64 = as_f64(b);
          HostTensor y64(DType::kFloat64, {s.rows, s.cols}), mean64(DType::kFloat64, {s.rows}),
              rstd64(DType::kFloat64, {s.rows});
          const RMSNormOptions opt = rms_options(variant, 0.25);
          if (which == 0) {
            rmsnorm_forward(in64.view(), w64.view(), y64.view(), rstd64.view(), opt);
            ops::norm::rmsnorm_forward_cuda(d_x.view(), d_w.view(), d_y.view(), d_rstd.view(),
                                            opt, nullptr);
          } else if (which == 1) {
            layernorm_forward(in64.view(), w64.view(), b64.view(), y64.view(), mean64.view(),
                              rstd64.view());
            ops::norm::layernorm_forward_cuda(d_x.view(), d_w.view(), d_b.view(), d_y.view(),
                                              d_mean.view(), d_rstd.view(),
                                              layer_options(variant), nullptr);
          } else {
            rmsnorm_forward(in64.view(), w64.view(), y64.view(), rstd64.view(), opt);
            ops::norm::fused_add_rmsnorm_forward_cuda(d_x.view(), d_r.view(), d_w.view(),
                                                      d_x.view(), d_r.view(), d_rstd.view(), opt,
                                                      nullptr);
          }
          const auto& out = which == 2 ? d_x : d_y;
          EXPECT_TRUE(test::matches_reference(out.to_host().values(), y64.values(), tol)) << "y";
          EXPECT_TRUE(test::matches_reference(d_rstd.to_host().values(), rstd64.values(), 1e-5))
              << "rstd";
          if (layer) {
            EXPECT_LE(test::max_abs_err(d_mean.to_host().values(), mean64.values()), 1e-5)
                << "mean";
          }
          if (which == 2) {
            EXPECT_TRUE(test::matches_reference(d_r.to_host().values(), in.values(), 1e-6))
                << "residual";
          }
        }
      }
    }
  }
}

TEST(NormCuda, RMSNormLongRowsForward) { check_long_row_forward(0); }
TEST(NormCuda, LayerNormLongRowsForward) { check_long_row_forward(1); }
TEST(NormCuda, FusedAddRMSNormLongRowsForward) { check_long_row_forward(2); }

// The blocks of a cluster each normalize their chunk with the totals ClusterRowSum leaves
// them, which must be bitwise those of the block that saves rstd: without a weight, RMSNorm's y
// is x * rstd (times 1), so every element equals its product with the saved rstd rounded to
// the dtype. Uneven chunks (8193 vectors: 4 blocks of 2049, 2049, 2049, 2046) and even ones
// (8 x 4096), strided rows.
TEST(NormCuda, ClusterBlocksNormalizeWithTheSavedStatistics) {
  TS_REQUIRE_GPU();
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    const std::int64_t vec = 16 / static_cast<std::int64_t>(dtype_size(dt));
    for (std::int64_t vecs : {8193, 32768}) {
      const Shape s{5, vecs * vec, vec};
      for (NormVariant variant : {NormVariant::kAuto, NormVariant::kRows}) {
        SCOPED_TRACE(shape_name(dt, s, dt, variant));
        auto x = HostTensor::random(dt, {s.rows, s.cols}, -2, 2, s.pad);
        DeviceTensor d_x(x), d_y(HostTensor(dt, {s.rows, s.cols}, s.pad), false);
        DeviceTensor d_rstd(HostTensor(DType::kFloat32, {s.rows}), false);
        rmsnorm_forward(d_x.view(), {}, d_y.view(), d_rstd.view(), rms_options(variant));
        const auto y = d_y.to_host();
        const auto rstd = d_rstd.to_host();
        HostTensor expected(dt, {s.rows, s.cols});
        for (std::int64_t i = 0; i < x.numel(); ++i) {
          expected.set(i, static_cast<float>(x.at(i)) * static_cast<float>(rstd.at(i / s.cols)));
        }
        std::int64_t mismatches = 0;
        for (std::int64_t i = 0; i < x.numel(); ++i) mismatches += y.at(i) != expected.at(i);
        EXPECT_EQ(mismatches, 0);
      }
    }
  }
}

// kRows takes aligned rows of up to 8 x 4096 vectors (a cluster of 8 blocks); forcing it on
// longer ones is an UnsupportedVariantError, and auto takes two passes there. kRegisters and
// kPipelined still stop at 4096 vectors.
TEST(NormCuda, RowsVariantStopsAtEightBlocksPerRow) {
  TS_REQUIRE_GPU();
  const std::int64_t cols = 4 * 32768 + 4;  // fp32: 32769 vectors
  auto x = HostTensor::random(DType::kFloat32, {2, cols});
  DeviceTensor d_x(x), d_y(HostTensor(DType::kFloat32, {2, cols}), false);
  DeviceTensor d_rstd(HostTensor(DType::kFloat32, {2}), false);
  EXPECT_THROW(rmsnorm_forward(d_x.view(), {}, d_y.view(), d_rstd.view(),
                               rms_options(NormVariant::kRows)),
               UnsupportedVariantError);
  TS_EXPECT_ERROR(rmsnorm_forward(d_x.view(), {}, d_y.view(), d_rstd.view(),
                                  rms_options(NormVariant::kRows)),
                  "rows variant", "at most 32768 vectors");
  rmsnorm_forward(d_x.view(), {}, d_y.view(), d_rstd.view(), rms_options(NormVariant::kAuto));
  HostTensor y64(DType::kFloat64, {2, cols}), rstd64(DType::kFloat64, {2});
  auto x64 = as_f64(x);
  rmsnorm_forward(x64.view(), {}, y64.view(), rstd64.view());
  EXPECT_TRUE(test::matches_reference(d_y.to_host().values(), y64.values(), 1e-5));

  auto x16 = HostTensor::random(DType::kBFloat16, {2, 32776});  // 4097 vectors
  DeviceTensor d_x16(x16), d_y16(HostTensor(DType::kBFloat16, {2, 32776}), false);
  for (NormVariant variant : {NormVariant::kRegisters, NormVariant::kPipelined}) {
    TS_EXPECT_ERROR(rmsnorm_forward(d_x16.view(), {}, d_y16.view(), {}, rms_options(variant)),
                    "variant", "at most 4096 vectors");
  }
}

// Rows with |mean| >> std (64 +- 1): the variance must not come from E[x^2] - E[x]^2, which
// cancels to a few bits here; every variant keeps rstd at fp32 accuracy.
TEST(NormCuda, LayerNormVarianceWhenMeanDominates) {
  TS_REQUIRE_GPU();
  for (DType dt : test_dtypes()) {
    for (const Shape& s : std::vector<Shape>{{33, 1024, 0}, {9, 4096, 8}, {7, 5123, 3},
                                             {4, 8192, 0}, {3, 65536, 0}}) {
      for (NormVariant variant : applicable_forward_variants(s, dt, true)) {
        SCOPED_TRACE(shape_name(dt, s, dt, variant));
        expect_layernorm_matches(run_layernorm_forward(dt, s, variant, 63, 65),
                                 test::tolerance(dt), 1e-6);
      }
    }
  }
}

// The saved LayerNorm mean at the contract's fp32 tolerance (relative L2 <= 1e-5, as the bench
// gates it) over many long rows whose means sit near 0, so the error is measured against a
// small quantity: a mean formed as pivot + mean(x - pivot) passed the per-element check of
// check_norm but failed this (its partial sums of x - pivot grow with the row).
TEST(NormCuda, LayerNormSavedMeanAtFp32Accuracy) {
  TS_REQUIRE_GPU();
  const DType dt = DType::kBFloat16;
  for (const Shape& s : std::vector<Shape>{{512, 8192, 0}, {64, 65536, 0}, {16, 262144, 0},
                                           {97, 5123, 3}}) {
    for (NormVariant variant : applicable_forward_variants(s, dt, true)) {
      SCOPED_TRACE(shape_name(dt, s, dt, variant));
      expect_layernorm_matches(run_layernorm_forward(dt, s, variant), std::nullopt, 1e-5);
    }
  }
}

// An absent weight counts as ones and an absent bias as zeros on every forward path. The rows
// variant takes a loop without null checks when all parameters are given, and another when one
// is missing: both must agree with the reference. bf16 (16-byte vectors of 8) and fp32, rows of
// one warp, of one block and of a cluster, and an unaligned row (two passes).
TEST(NormCuda, ForwardWithoutWeightOrBias) {
  TS_REQUIRE_GPU();
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    for (const Shape& s : std::vector<Shape>{{37, 248, 8}, {9, 8192, 0}, {3, 65536, 0},
                                             {5, 5123, 3}}) {
      for (NormVariant variant : applicable_forward_variants(s, dt, true)) {
        // LayerNorm: each absence alone and both.
        for (auto [has_w, has_b] : {std::pair{false, true}, {true, false}, {false, false}}) {
          SCOPED_TRACE(shape_name(dt, s, dt, variant) + " layer weight " +
                       std::to_string(has_w) + " bias " + std::to_string(has_b));
          expect_layernorm_matches(run_layernorm_forward(dt, s, variant, -2, 2, has_w, has_b),
                                   test::tolerance(dt), std::nullopt);
        }
      }
      for (NormVariant variant : applicable_forward_variants(s, dt, false)) {
        SCOPED_TRACE(shape_name(dt, s, dt, variant) + " rms without weight");
        auto x = HostTensor::random(dt, {s.rows, s.cols}, -2, 2, s.pad);
        DeviceTensor d_x(x), d_y(HostTensor(dt, {s.rows, s.cols}, s.pad), false);
        DeviceTensor d_rstd(HostTensor(DType::kFloat32, {s.rows}), false);
        auto x64 = as_f64(x);
        HostTensor y64(DType::kFloat64, {s.rows, s.cols}), rstd64(DType::kFloat64, {s.rows});
        rmsnorm_forward(x64.view(), {}, y64.view(), rstd64.view(), rms_options(variant));
        ops::norm::rmsnorm_forward_cuda(d_x.view(), {}, d_y.view(), d_rstd.view(),
                                        rms_options(variant), nullptr);
        EXPECT_TRUE(test::matches_reference(d_y.to_host().values(), y64.values(),
                                            test::tolerance(dt)))
            << "y";
        EXPECT_TRUE(test::matches_reference(d_rstd.to_host().values(), rstd64.values(), 1e-5))
            << "rstd";
      }
    }
  }
}

// Forcing the register kernel (or the pipelined one) on a row whose staged LayerNorm weight and
// bias (8 bytes per column) exceed a block's shared memory is an error, not a fault; auto takes
// two passes, and the rows variant, which stages nothing, runs it.
TEST(NormCuda, LayerNormRegisterVariantRejectsRowsBeyondSharedMemory) {
  TS_REQUIRE_GPU();
  const std::int64_t cols = 32768;
  auto x = HostTensor::random(DType::kBFloat16, {2, cols});
  auto w = HostTensor::random(DType::kBFloat16, {cols});
  DeviceTensor d_x(x), d_w(w), d_b(w);
  DeviceTensor d_y(HostTensor(DType::kBFloat16, {2, cols}), false);
  DeviceTensor d_mean(HostTensor(DType::kFloat32, {2}), false);
  DeviceTensor d_rstd(HostTensor(DType::kFloat32, {2}), false);
  EXPECT_THROW(ops::norm::layernorm_forward_cuda(d_x.view(), d_w.view(), d_b.view(),
                                                 d_y.view(), d_mean.view(), d_rstd.view(),
                                                 layer_options(NormVariant::kRegisters), nullptr),
               UnsupportedVariantError);
  TS_EXPECT_ERROR(ops::norm::layernorm_forward_cuda(d_x.view(), d_w.view(), d_b.view(),
                                                    d_y.view(), d_mean.view(), d_rstd.view(),
                                                    layer_options(NormVariant::kRegisters),
                                                    nullptr),
                  "register variant", "shared memory", "32768");
  TS_EXPECT_ERROR(ops::norm::layernorm_forward_cuda(d_x.view(), d_w.view(), d_b.view(),
                                                    d_y.view(), d_mean.view(), d_rstd.view(),
                                                    layer_options(NormVariant::kPipelined),
                                                    nullptr),
                  "pipelined variant", "shared memory", "32768");
  ops::norm::layernorm_forward_cuda(d_x.view(), d_w.view(), d_b.view(), d_y.view(),
                                    d_mean.view(), d_rstd.view(), layer_options(NormVariant::kRows),
                                    nullptr);
  for (double v : d_rstd.to_host().values()) EXPECT_TRUE(std::isfinite(v));
}

// The register kernels need 16-byte aligned rows: forcing one on others is an
// UnsupportedVariantError through the public entry point too.
TEST(NormCuda, RegisterVariantsRejectUnalignedRows) {
  TS_REQUIRE_GPU();
  auto x = HostTensor::random(DType::kBFloat16, {4, 1001});
  DeviceTensor d_x(x), d_y(HostTensor(DType::kBFloat16, {4, 1001}), false);
  for (NormVariant variant :
       {NormVariant::kRegisters, NormVariant::kRows, NormVariant::kPipelined}) {
    EXPECT_THROW(rmsnorm_forward(d_x.view(), {}, d_y.view(), {}, rms_options(variant)),
                 UnsupportedVariantError);
    TS_EXPECT_ERROR(rmsnorm_forward(d_x.view(), {}, d_y.view(), {}, rms_options(variant)),
                    "variant", "16-byte aligned");
  }
}

// kPipelined with several row groups per block (the tests above have fewer rows than its
// persistent grid, so the ring's second stage and the pivot carried to the next group run only
// here), the last group partial: bit-identical to kRegisters, whose arithmetic it shares, for
// every op and dtype, the fused add's residual write-back included.
TEST(NormCuda, PipelinedMatchesRegistersOverManyRowGroups) {
  TS_REQUIRE_GPU();
  for (DType dt : test_dtypes()) {
    for (const Shape& s : std::vector<Shape>{{20011, 1024, 0}, {3001, 4096, 8}, {1201, 8192, 0}}) {
      for (int which = 0; which < 4; ++which) {  // RMSNorm, LayerNorm, fused add (residual dt, fp32)
        const DType rdt = which == 3 ? DType::kFloat32 : dt;
        SCOPED_TRACE(shape_name(dt, s, rdt, NormVariant::kPipelined) + " op " +
                     std::to_string(which));
        auto x = HostTensor::random(dt, {s.rows, s.cols}, -2, 2, s.pad);
        x.set(0, x.at(0) + 3.0);  // a row with a non-zero mean
        auto r = HostTensor::random(rdt, {s.rows, s.cols}, -2, 2);
        auto w = HostTensor::random(dt, {s.cols}, 0.5, 1.5);
        auto b = HostTensor::random(dt, {s.cols}, -0.5, 0.5);
        std::vector<HostTensor> outputs[2];  // y (x for the fused add), rstd, mean, residual
        for (int k = 0; k < 2; ++k) {
          const NormVariant variant = k == 0 ? NormVariant::kRegisters : NormVariant::kPipelined;
          DeviceTensor d_x(x), d_r(r), d_w(w), d_b(b);
          DeviceTensor d_y(HostTensor(dt, {s.rows, s.cols}, s.pad), false);
          DeviceTensor d_mean(HostTensor(DType::kFloat32, {s.rows}), false);
          DeviceTensor d_rstd(HostTensor(DType::kFloat32, {s.rows}), false);
          if (which == 0) {
            ops::norm::rmsnorm_forward_cuda(d_x.view(), d_w.view(), d_y.view(), d_rstd.view(),
                                            rms_options(variant, 0.25), nullptr);
          } else if (which == 1) {
            ops::norm::layernorm_forward_cuda(d_x.view(), d_w.view(), d_b.view(), d_y.view(),
                                              d_mean.view(), d_rstd.view(),
                                              layer_options(variant), nullptr);
          } else {
            ops::norm::fused_add_rmsnorm_forward_cuda(d_x.view(), d_r.view(), d_w.view(),
                                                      d_x.view(), d_r.view(), d_rstd.view(),
                                                      rms_options(variant, 0.25), nullptr);
          }
          outputs[k] = {(which >= 2 ? d_x : d_y).to_host(), d_rstd.to_host(), d_mean.to_host(),
                        d_r.to_host()};
        }
        EXPECT_TRUE(identical(outputs[0][0], outputs[1][0])) << "y";
        EXPECT_TRUE(identical(outputs[0][1], outputs[1][1])) << "rstd";
        EXPECT_TRUE(identical(outputs[0][2], outputs[1][2])) << "mean";
        EXPECT_TRUE(identical(outputs[0][3], outputs[1][3])) << "residual";
      }
    }
  }
}

// kRing over more rows than its persistent grid (every stage refilled many times, the last
// rows partial), strided rows included, against the fp64 reference; a long row again after a
// short one (the long row's shared-memory limit must still hold).
TEST(NormCuda, RingOverManyRowsMatchesReference) {
  TS_REQUIRE_GPU();
  if (!ring_fits(1, false)) GTEST_SKIP() << "kRing needs sm_90";
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    for (const Shape& s : std::vector<Shape>{
             {3001, 4096, 8}, {20011, 1024, 0}, {5003, 64, 0}, {1201, 4096, 0}}) {
      SCOPED_TRACE(shape_name(dt, s, dt, NormVariant::kRing));
      expect_layernorm_matches(run_layernorm_forward(dt, s, NormVariant::kRing), test::tolerance(dt),
                               1e-5);
      auto x = HostTensor::random(dt, {s.rows, s.cols}, -2, 2, s.pad);
      auto w = HostTensor::random(dt, {s.cols}, 0.5, 1.5);
      DeviceTensor d_x(x), d_w(w);
      DeviceTensor d_y(HostTensor(dt, {s.rows, s.cols}, s.pad), false);
      DeviceTensor d_rstd(HostTensor(DType::kFloat32, {s.rows}), false);
      auto x64 = as_f64(x), w64 = as_f64(w);
      HostTensor y64(DType::kFloat64, {s.rows, s.cols}), rstd64(DType::kFloat64, {s.rows});
      rmsnorm_forward(x64.view(), w64.view(), y64.view(), rstd64.view(),
                      rms_options(NormVariant::kAuto, 0.25));
      ops::norm::rmsnorm_forward_cuda(d_x.view(), d_w.view(), d_y.view(), d_rstd.view(),
                                      rms_options(NormVariant::kRing, 0.25), nullptr);
      EXPECT_TRUE(test::matches_reference(d_y.to_host().values(), y64.values(), test::tolerance(dt)))
          << "rms y";
      EXPECT_TRUE(test::matches_reference(d_rstd.to_host().values(), rstd64.values(), 1e-5))
          << "rms rstd";
    }
  }
}

TEST(NormCuda, PublicEntryPointsDispatchToCuda) {
  TS_REQUIRE_GPU();
  auto x = HostTensor::random(DType::kBFloat16, {8, 256});
  auto w = HostTensor::random(DType::kBFloat16, {256});
  DeviceTensor d_x(x), d_w(w);
  DeviceTensor d_y(HostTensor(DType::kBFloat16, {8, 256}), false);
  DeviceTensor d_rstd(HostTensor(DType::kFloat32, {8}), false);
  rmsnorm_forward(d_x.view(), d_w.view(), d_y.view(), d_rstd.view());
  HostTensor y(DType::kBFloat16, {8, 256}), rstd(DType::kFloat32, {8});
  rmsnorm_forward(x.view(), w.view(), y.view(), rstd.view());
  EXPECT_TRUE(test::matches_reference(d_y.to_host().values(), y.values(), 1e-2));
  // Too small a workspace is an argument error, not a fault.
  auto dy = HostTensor::random(DType::kBFloat16, {8, 256});
  DeviceTensor d_dy(dy), d_dx(HostTensor(DType::kBFloat16, {8, 256}), false),
      d_dw(HostTensor(DType::kBFloat16, {256}), false), d_small(HostTensor(DType::kFloat32, {4}));
  TS_EXPECT_ERROR(rmsnorm_backward(d_dy.view(), d_x.view(), d_w.view(), d_rstd.view(),
                                   d_dx.view(), d_dw.view(), d_small.view()),
                  "rmsnorm_backward", "'workspace'", "bytes");
}

TEST(NormCuda, WeightGradientIsBitwiseReproducible) {
  TS_REQUIRE_GPU();
  // Register kernel (one block per row group, a cluster per row, the longest rows' clusters of 8
  // and 16 blocks with the next row prefetched), two-pass kernel.
  for (std::int64_t cols : {4096, 16384, 5123, 65536, 131072, 131072 + 8, 262144}) {
    const std::int64_t rows = cols > 65536 ? 100 : 1500;
    auto x = HostTensor::random(DType::kBFloat16, {rows, cols});
    auto dy = HostTensor::random(DType::kBFloat16, {rows, cols});
    auto w = HostTensor::random(DType::kFloat32, {cols});
    DeviceTensor d_x(x), d_dy(dy), d_w(w);
    DeviceTensor d_y(HostTensor(DType::kBFloat16, {rows, cols}), false);
    DeviceTensor d_rstd(HostTensor(DType::kFloat32, {rows}), false);
    DeviceTensor d_dx(HostTensor(DType::kBFloat16, {rows, cols}), false);
    DeviceTensor d_ws(byte_buffer(workspace_bytes(rows, cols, DType::kBFloat16)), false);
    DeviceTensor d_mean(HostTensor(DType::kFloat32, {rows}), false);
    rmsnorm_forward(d_x.view(), d_w.view(), d_y.view(), d_rstd.view());
    std::vector<HostTensor> results;
    for (int run = 0; run < 3; ++run) {
      DeviceTensor d_dw(HostTensor(DType::kFloat32, {cols}), false);
      rmsnorm_backward(d_dy.view(), d_x.view(), d_w.view(), d_rstd.view(), d_dx.view(),
                       d_dw.view(), d_ws.view());
      results.push_back(d_dw.to_host());
    }
    layernorm_forward(d_x.view(), d_w.view(), {}, d_y.view(), d_mean.view(), d_rstd.view());
    for (int run = 0; run < 3; ++run) {
      DeviceTensor d_dw(HostTensor(DType::kFloat32, {cols}), false);
      DeviceTensor d_db(HostTensor(DType::kFloat32, {cols}), false);
      layernorm_backward({.dy = d_dy.view(), .x = d_x.view(), .weight = d_w.view(),
                          .mean = d_mean.view(), .rstd = d_rstd.view(), .dx = d_dx.view(),
                          .dw = d_dw.view(), .db = d_db.view(), .workspace = d_ws.view()});
      results.push_back(d_dw.to_host());
      results.push_back(d_db.to_host());
    }
    for (int run = 1; run < 3; ++run) {
      EXPECT_EQ(std::memcmp(results[0].data(), results[run].data(), cols * 4), 0) << cols;
      for (int k = 0; k < 2; ++k) {  // LayerNorm dw, db
        const HostTensor& first = results[3 + k];
        const HostTensor& again = results[3 + 2 * run + k];
        EXPECT_EQ(std::memcmp(first.data(), again.data(), cols * 4), 0) << cols << " layernorm " << k;
      }
    }
  }
}

TEST(NormCuda, NaNPropagatesToItsRowOnly) {
  TS_REQUIRE_GPU();
  // Row 11 of 20: with the longest rows (backward clusters of 8 and 16 blocks) not the first row
  // of its cluster, so it arrives through the prefetch. Beyond 4096 vectors (32776, 65536,
  // 131080, 262144) the forward splits the row over a cluster: the NaN sits in the last block's
  // chunk and must reach the first's (which writes rstd) and every other.
  constexpr std::int64_t kRows = 20, kNaNRow = 11;
  for (std::int64_t cols : {4096, 65536, 5123, 32776, 131072 + 8, 262144}) {
    auto x = HostTensor::random(DType::kBFloat16, {kRows, cols});
    x.set(kNaNRow * cols + cols - 5, NAN);
    auto r = HostTensor::random(DType::kFloat32, {kRows, cols});
    DeviceTensor d_x(x), d_y(HostTensor(DType::kBFloat16, {kRows, cols}), false);
    DeviceTensor d_mean(HostTensor(DType::kFloat32, {kRows}), false);
    DeviceTensor d_rstd(HostTensor(DType::kFloat32, {kRows}), false);
    // Auto, and the rows and pipelined variants where they apply (aligned rows of at most
    // 262144 bf16, a cluster beyond 32768; the pipelined ring and tables in shared memory).
    std::vector<NormVariant> variants = {NormVariant::kAuto};
    if (cols % 8 == 0 && cols <= 262144) variants.push_back(NormVariant::kRows);
    if (cols % 8 == 0 && cols <= 32768 && pipelined_fits(cols, DType::kBFloat16, false)) {
      variants.push_back(NormVariant::kPipelined);
    }
    for (NormVariant variant : variants) {
      for (int which = 2; which >= 0; --which) {  // fused add (fp32 residual), LayerNorm, RMSNorm
        SCOPED_TRACE(std::to_string(cols) + " variant " +
                     std::to_string(static_cast<int>(variant)) + " op " + std::to_string(which));
        HostTensor y;
        if (which == 0) {
          rmsnorm_forward(d_x.view(), {}, d_y.view(), d_rstd.view(), rms_options(variant));
          y = d_y.to_host();
        } else if (which == 1) {
          layernorm_forward(d_x.view(), {}, {}, d_y.view(), d_mean.view(), d_rstd.view(),
                            layer_options(variant));
          y = d_y.to_host();
          const auto mean = d_mean.to_host();
          EXPECT_TRUE(std::isnan(mean.at(kNaNRow)));
          EXPECT_TRUE(std::isfinite(mean.at(kNaNRow - 1)) && std::isfinite(mean.at(kNaNRow + 1)));
        } else {
          DeviceTensor d_in(x), d_r(r);
          fused_add_rmsnorm_forward(d_in.view(), d_r.view(), {}, d_rstd.view(),
                                    rms_options(variant));
          y = d_in.to_host();
        }
        const auto rstd = d_rstd.to_host();
        EXPECT_TRUE(std::isnan(rstd.at(kNaNRow)));
        EXPECT_TRUE(std::isfinite(rstd.at(kNaNRow - 1)) && std::isfinite(rstd.at(kNaNRow + 1)));
        for (std::int64_t col : {std::int64_t{100}, cols / 2, cols - 1}) {
          EXPECT_TRUE(std::isnan(y.at(kNaNRow * cols + col))) << col;
          EXPECT_TRUE(std::isfinite(y.at((kNaNRow - 1) * cols + col)) &&
                      std::isfinite(y.at((kNaNRow + 1) * cols + col)))
              << col;
        }
      }
    }
    // Backward, RMSNorm without a weight (rstd of its forward) and LayerNorm with one: dx of that
    // row only (dw and db sum every row, so they are NaN as a whole).
    SCOPED_TRACE(std::to_string(cols) + " backward");
    rmsnorm_forward(d_x.view(), {}, d_y.view(), d_rstd.view());
    DeviceTensor d_dy(HostTensor::random(DType::kBFloat16, {kRows, cols}));
    DeviceTensor d_dx(HostTensor(DType::kBFloat16, {kRows, cols}), false);
    const auto expect_nan_row_only = [&] {
      const auto dx = d_dx.to_host();
      for (std::int64_t row = 0; row < kRows; ++row) {
        for (std::int64_t col : {std::int64_t{0}, cols / 2 + 1, cols - 1}) {
          EXPECT_EQ(std::isnan(dx.at(row * cols + col)), row == kNaNRow) << row << ", " << col;
        }
      }
    };
    rmsnorm_backward(d_dy.view(), d_x.view(), {}, d_rstd.view(), d_dx.view(), {}, {});
    expect_nan_row_only();
    DeviceTensor d_w(HostTensor::random(DType::kBFloat16, {cols}, 0.5, 1.5));
    DeviceTensor d_dw(HostTensor(DType::kBFloat16, {cols}), false);
    DeviceTensor d_ws(byte_buffer(workspace_bytes(kRows, cols, DType::kBFloat16)), false);
    layernorm_forward(d_x.view(), d_w.view(), {}, d_y.view(), d_mean.view(), d_rstd.view());
    d_dx.poison();
    layernorm_backward({.dy = d_dy.view(), .x = d_x.view(), .weight = d_w.view(),
                        .mean = d_mean.view(), .rstd = d_rstd.view(), .dx = d_dx.view(),
                        .dw = d_dw.view(), .workspace = d_ws.view()});
    expect_nan_row_only();
  }
}

TEST(NormCuda, EmptyBatchWritesZeroWeightGradient) {
  TS_REQUIRE_GPU();
  HostTensor x(DType::kBFloat16, {0, 512}), w = HostTensor::random(DType::kBFloat16, {512});
  DeviceTensor d_x(x), d_w(w), d_y(HostTensor(DType::kBFloat16, {0, 512}), false);
  DeviceTensor d_rstd(HostTensor(DType::kFloat32, {0}), false);
  DeviceTensor d_dw(HostTensor(DType::kBFloat16, {512}), false);
  rmsnorm_forward(d_x.view(), d_w.view(), d_y.view(), d_rstd.view());
  rmsnorm_backward(d_x.view(), d_x.view(), d_w.view(), d_rstd.view(), d_y.view(), d_dw.view(),
                   {});
  for (double v : d_dw.to_host().values()) ASSERT_EQ(v, 0.0);
}

}  // namespace
}  // namespace trainscale
