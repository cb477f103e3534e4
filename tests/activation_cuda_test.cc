// Activation kernels, through the public entry points, against the fp64 CPU reference run on
// float64 copies of the same rounded inputs (reference outputs rounded to the kernel's dtype,
// so an overflow to Inf is expected where the dtype cannot hold the value). Layouts cover the
// 16-byte path (flat and strided rows, with and without row tails), the scalar path (odd
// strides, a base pointer one element off), M = 0, NaN/Inf inputs, in-place calls, and a shape
// larger than one grid's worth of work.
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <vector>

#include "util/strided_device_buffer.h"
#include "trainscale/activation.h"

namespace trainscale {
namespace {

using test::HostTensor;
using test::Layout;
using test::StridedDeviceBuffer;
using Values = std::vector<double>;

constexpr DType kDtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};

enum class Act { kGeluErf, kGeluTanh, kSilu };
constexpr Act kActs[] = {Act::kGeluErf, Act::kGeluTanh, Act::kSilu};

const char* name(Act a) {
  return a == Act::kGeluErf ? "gelu(erf)" : a == Act::kGeluTanh ? "gelu(tanh)" : "silu";
}
GeluApproximation approx(Act a) {
  return a == Act::kGeluTanh ? GeluApproximation::kTanh : GeluApproximation::kNone;
}

// The public entry point of each form, for CPU (reference) and CUDA views alike.
void forward(Act a, const TensorView& x, TensorView y) {
  if (a == Act::kSilu) return silu_forward(x, y);
  gelu_forward(x, y, approx(a));
}
void backward(Act a, const TensorView& dy, const TensorView& x, TensorView dx) {
  if (a == Act::kSilu) return silu_backward(dy, x, dx);
  gelu_backward(dy, x, dx, approx(a));
}
void gated_forward(Act act, const TensorView& a, const TensorView& b, TensorView y) {
  if (act == Act::kSilu) return swiglu_forward(a, b, y);
  geglu_forward(a, b, y, approx(act));
}
void gated_backward(Act act, const TensorView& dy, const TensorView& a, const TensorView& b,
                    TensorView da, TensorView db) {
  if (act == Act::kSilu) return swiglu_backward(dy, a, b, da, db);
  geglu_backward(dy, a, b, da, db, approx(act));
}
void packed_forward(Act act, const TensorView& ab, TensorView y) {
  if (act == Act::kSilu) return swiglu_forward_packed(ab, y);
  geglu_forward_packed(ab, y, approx(act));
}
void packed_backward(Act act, const TensorView& dy, const TensorView& ab, TensorView dab) {
  if (act == Act::kSilu) return swiglu_backward_packed(dy, ab, dab);
  geglu_backward_packed(dy, ab, dab, approx(act));
}

std::vector<Layout> layouts() {
  return {
      {1, 1, 0, false},     {3, 7, 0, false},     {5, 127, 0, false},  {4, 1000, 0, false},
      {2, 4097, 0, false},  {16, 256, 0, false},  // flat: 16-byte units (+ a tail for 4097)
      {9, 1000, 24, false},                       // strided rows, 16-byte units
      {5, 1003, 13, false},                       // strided rows, units + a 3-element row tail
      {64, 8, 8, false},                          // one unit per row
      {7, 127, 3, false},                         // row stride not a multiple of 16 bytes
      {6, 520, 8, true},    {1, 4097, 0, true},   // base pointer one element off
      {0, 64, 0, false},                          // M = 0
  };
}

// Larger than one grid's worth of units for every dtype: the walk wraps rows mid-tile and each
// thread takes several tiles.
constexpr Layout kLarge{1100, 4100, 4, false};

std::string trace(DType dt, Act a, const Layout& l, int alias) {
  return test::describe(dt, l) + " " + name(a) + " alias " + std::to_string(alias);
}

// x of the forms below: uniform in [lo, hi], with or without the specials (NaN, Inf, ...).
struct XRange {
  double lo = -5, hi = 5;
  bool specials = true;
  std::string name() const {
    return " x in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]" +
           (specials ? " with specials" : "");
  }
};

// y = act(x); alias 1: y is x.
void check_forward(DType dt, Act act, const Layout& l, int alias, const XRange& r = {}) {
  SCOPED_TRACE(trace(dt, act, l, alias) + r.name());
  const Values x = test::random_inputs(dt, l.rows * l.cols, 0, r.lo, r.hi, r.specials);
  StridedDeviceBuffer d_x(dt, l, &x), d_y(dt, l);
  const StridedDeviceBuffer& out = alias == 1 ? d_x : d_y;
  forward(act, d_x.view(), out.view());
  auto x64 = test::as_f64(x, l.rows, l.cols);
  HostTensor y64(DType::kFloat64, {l.rows, l.cols});
  forward(act, x64.view(), y64.view());
  EXPECT_TRUE(test::matches_reference(out.values(), test::rounded(dt, y64), test::tolerance(dt)))
      << "y";
  EXPECT_TRUE(out.padding_untouched());
}

// dx = dy * act'(x); alias 1: dx is dy; alias 2: dx is x.
void check_backward(DType dt, Act act, const Layout& l, int alias, const XRange& r = {}) {
  SCOPED_TRACE(trace(dt, act, l, alias) + r.name());
  // Specials in dy only where x has them too: an Inf dy times a derivative that is tiny in
  // one precision and zero (or a cancelling sum) in the other is Inf or NaN, both propagated.
  const Values dy = test::random_inputs(dt, l.rows * l.cols, 0, -1, 1, r.specials);
  const Values x = test::random_inputs(dt, l.rows * l.cols, 1, r.lo, r.hi, r.specials);
  StridedDeviceBuffer d_dy(dt, l, &dy), d_x(dt, l, &x), d_dx(dt, l);
  const StridedDeviceBuffer& out = alias == 1 ? d_dy : alias == 2 ? d_x : d_dx;
  backward(act, d_dy.view(), d_x.view(), out.view());
  auto dy64 = test::as_f64(dy, l.rows, l.cols), x64 = test::as_f64(x, l.rows, l.cols);
  HostTensor dx64(DType::kFloat64, {l.rows, l.cols});
  backward(act, dy64.view(), x64.view(), dx64.view());
  EXPECT_TRUE(test::matches_reference(out.values(), test::rounded(dt, dx64), test::tolerance(dt)))
      << "dx";
  EXPECT_TRUE(out.padding_untouched());
}

// y = act(a) * b; alias 1: y is a; alias 2: y is b.
void check_gated_forward(DType dt, Act act, const Layout& l, int alias) {
  SCOPED_TRACE(trace(dt, act, l, alias));
  const Values a = test::random_inputs(dt, l.rows * l.cols, 0);
  const Values b = test::random_inputs(dt, l.rows * l.cols, 1, -2, 2);
  StridedDeviceBuffer d_a(dt, l, &a), d_b(dt, l, &b), d_y(dt, l);
  const StridedDeviceBuffer& out = alias == 1 ? d_a : alias == 2 ? d_b : d_y;
  gated_forward(act, d_a.view(), d_b.view(), out.view());
  auto a64 = test::as_f64(a, l.rows, l.cols), b64 = test::as_f64(b, l.rows, l.cols);
  HostTensor y64(DType::kFloat64, {l.rows, l.cols});
  gated_forward(act, a64.view(), b64.view(), y64.view());
  EXPECT_TRUE(test::matches_reference(out.values(), test::rounded(dt, y64), test::tolerance(dt)))
      << "y";
  EXPECT_TRUE(out.padding_untouched());
}

// da = dy * b * act'(a), db = dy * act(a); alias 1: da is a and db is b; alias 2: da is dy.
void check_gated_backward(DType dt, Act act, const Layout& l, int alias) {
  SCOPED_TRACE(trace(dt, act, l, alias));
  const std::int64_t n = l.rows * l.cols;
  const Values dy = test::random_inputs(dt, n, 0, -1, 1);
  const Values a = test::random_inputs(dt, n, 1);
  const Values b = test::random_inputs(dt, n, 2, -2, 2);
  StridedDeviceBuffer d_dy(dt, l, &dy), d_a(dt, l, &a), d_b(dt, l, &b), d_da(dt, l), d_db(dt, l);
  const StridedDeviceBuffer& out_a = alias == 1 ? d_a : alias == 2 ? d_dy : d_da;
  const StridedDeviceBuffer& out_b = alias == 1 ? d_b : d_db;
  gated_backward(act, d_dy.view(), d_a.view(), d_b.view(), out_a.view(), out_b.view());
  auto dy64 = test::as_f64(dy, l.rows, l.cols), a64 = test::as_f64(a, l.rows, l.cols),
       b64 = test::as_f64(b, l.rows, l.cols);
  HostTensor da64(DType::kFloat64, {l.rows, l.cols}), db64(DType::kFloat64, {l.rows, l.cols});
  gated_backward(act, dy64.view(), a64.view(), b64.view(), da64.view(), db64.view());
  const double tol = test::tolerance(dt);
  EXPECT_TRUE(test::matches_reference(out_a.values(), test::rounded(dt, da64), tol)) << "da";
  EXPECT_TRUE(test::matches_reference(out_b.values(), test::rounded(dt, db64), tol)) << "db";
  EXPECT_TRUE(out_a.padding_untouched());
  EXPECT_TRUE(out_b.padding_untouched());
}

// Element for element the same value (NaN where the other has NaN).
bool same_values(const Values& x, const Values& y) {
  if (x.size() != y.size()) return false;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!(x[i] == y[i] || (std::isnan(x[i]) && std::isnan(y[i])))) return false;
  }
  return true;
}

// swiglu_backward_recompute: da / db bit for bit swiglu_backward's, y swiglu_forward's (each run
// on the GPU beside it), both against the fp64 reference; alias 1: da is a and db is b.
void check_swiglu_backward_recompute(DType dt, const Layout& l, int alias) {
  SCOPED_TRACE(trace(dt, Act::kSilu, l, alias) + " recompute");
  const std::int64_t n = l.rows * l.cols;
  const Values dy = test::random_inputs(dt, n, 0, -1, 1);
  const Values a = test::random_inputs(dt, n, 1);
  const Values b = test::random_inputs(dt, n, 2, -2, 2);
  StridedDeviceBuffer d_dy(dt, l, &dy), d_a(dt, l, &a), d_b(dt, l, &b), d_da(dt, l), d_db(dt, l),
      d_y(dt, l), d_y_forward(dt, l), d_da_plain(dt, l), d_db_plain(dt, l);
  swiglu_forward(d_a.view(), d_b.view(), d_y_forward.view());
  swiglu_backward(d_dy.view(), d_a.view(), d_b.view(), d_da_plain.view(), d_db_plain.view());
  const StridedDeviceBuffer& out_a = alias == 1 ? d_a : d_da;
  const StridedDeviceBuffer& out_b = alias == 1 ? d_b : d_db;
  swiglu_backward_recompute(d_dy.view(), d_a.view(), d_b.view(), out_a.view(), out_b.view(),
                            d_y.view());
  EXPECT_TRUE(same_values(d_y.values(), d_y_forward.values())) << "y";
  EXPECT_TRUE(same_values(out_a.values(), d_da_plain.values())) << "da";
  EXPECT_TRUE(same_values(out_b.values(), d_db_plain.values())) << "db";
  auto a64 = test::as_f64(a, l.rows, l.cols), b64 = test::as_f64(b, l.rows, l.cols);
  HostTensor y64(DType::kFloat64, {l.rows, l.cols});
  swiglu_forward(a64.view(), b64.view(), y64.view());
  EXPECT_TRUE(test::matches_reference(d_y.values(), test::rounded(dt, y64), test::tolerance(dt)))
      << "y";
  EXPECT_TRUE(d_y.padding_untouched());
  EXPECT_TRUE(out_a.padding_untouched());
  EXPECT_TRUE(out_b.padding_untouched());
}

// Packed: ab [M, 2F] laid out like `l` with 2F columns; y / dy [M, F] like `l`. The reference
// runs the separate form on ab's halves.
Layout packed_layout(const Layout& l) { return {l.rows, 2 * l.cols, l.pad, l.shift}; }

std::pair<Values, Values> split_halves(const Values& ab, const Layout& l) {
  Values a, b;
  for (std::int64_t i = 0; i < l.rows; ++i) {
    for (std::int64_t j = 0; j < l.cols; ++j) {
      a.push_back(ab[i * 2 * l.cols + j]);
      b.push_back(ab[i * 2 * l.cols + l.cols + j]);
    }
  }
  return {a, b};
}

void check_packed_forward(DType dt, Act act, const Layout& l) {
  SCOPED_TRACE(trace(dt, act, l, 0) + " packed");
  const Layout pl = packed_layout(l);
  const Values ab = test::random_inputs(dt, pl.rows * pl.cols, 0);
  StridedDeviceBuffer d_ab(dt, pl, &ab), d_y(dt, l);
  packed_forward(act, d_ab.view(), d_y.view());
  const auto [a, b] = split_halves(ab, l);
  auto a64 = test::as_f64(a, l.rows, l.cols), b64 = test::as_f64(b, l.rows, l.cols);
  HostTensor y64(DType::kFloat64, {l.rows, l.cols});
  gated_forward(act, a64.view(), b64.view(), y64.view());
  EXPECT_TRUE(test::matches_reference(d_y.values(), test::rounded(dt, y64), test::tolerance(dt)))
      << "y";
  EXPECT_TRUE(d_y.padding_untouched());
}

// alias 1: dab is ab.
void check_packed_backward(DType dt, Act act, const Layout& l, int alias) {
  SCOPED_TRACE(trace(dt, act, l, alias) + " packed");
  const Layout pl = packed_layout(l);
  const Values dy = test::random_inputs(dt, l.rows * l.cols, 0, -1, 1);
  const Values ab = test::random_inputs(dt, pl.rows * pl.cols, 1);
  StridedDeviceBuffer d_dy(dt, l, &dy), d_ab(dt, pl, &ab), d_dab(dt, pl);
  const StridedDeviceBuffer& out = alias == 1 ? d_ab : d_dab;
  packed_backward(act, d_dy.view(), d_ab.view(), out.view());
  const auto [a, b] = split_halves(ab, l);
  auto dy64 = test::as_f64(dy, l.rows, l.cols), a64 = test::as_f64(a, l.rows, l.cols),
       b64 = test::as_f64(b, l.rows, l.cols);
  HostTensor da64(DType::kFloat64, {l.rows, l.cols}), db64(DType::kFloat64, {l.rows, l.cols});
  gated_backward(act, dy64.view(), a64.view(), b64.view(), da64.view(), db64.view());
  const auto [da, db] = split_halves(out.values(), l);
  const double tol = test::tolerance(dt);
  EXPECT_TRUE(test::matches_reference(da, test::rounded(dt, da64), tol)) << "da";
  EXPECT_TRUE(test::matches_reference(db, test::rounded(dt, db64), tol)) << "db";
  EXPECT_TRUE(out.padding_untouched());
}

TEST(ActivationCuda, ForwardMatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (Act act : kActs)
      for (const Layout& l : layouts())
        for (int alias : {0, 1}) check_forward(dt, act, l, alias);
}

TEST(ActivationCuda, BackwardMatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (Act act : kActs)
      for (const Layout& l : layouts())
        for (int alias : {0, 1, 2}) check_backward(dt, act, l, alias);
}

TEST(ActivationCuda, GatedForwardMatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (Act act : kActs)
      for (const Layout& l : layouts())
        for (int alias : {0, 1, 2}) check_gated_forward(dt, act, l, alias);
}

TEST(ActivationCuda, GatedBackwardMatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (Act act : kActs)
      for (const Layout& l : layouts())
        for (int alias : {0, 1, 2}) check_gated_backward(dt, act, l, alias);
}

TEST(ActivationCuda, SwigluBackwardRecomputeMatchesBackwardAndForward) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Layout& l : layouts())
      for (int alias : {0, 1}) check_swiglu_backward_recompute(dt, l, alias);
  check_swiglu_backward_recompute(DType::kBFloat16, kLarge, 0);
}

TEST(ActivationCuda, PackedForwardMatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (Act act : kActs)
      for (const Layout& l : layouts()) check_packed_forward(dt, act, l);
}

TEST(ActivationCuda, PackedBackwardMatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (Act act : kActs)
      for (const Layout& l : layouts())
        for (int alias : {0, 1}) check_packed_backward(dt, act, l, alias);
}

// The MUFU sigmoid (gelu_tanh, silu) band by band, without specials: each band's relative L2
// error is dominated by its own outputs, so the negative tails (outputs far below |x|, where
// 0.5 (1 + tanh(u)) would cancel) are held to the same tolerance as the bulk. gelu_tanh's
// tail underflows below x = -10.4; silu's goes on to -80. The last bands reach large finite x.
TEST(ActivationCuda, SigmoidFormsHoldTheirToleranceInEveryMagnitudeBand) {
  TS_REQUIRE_GPU();
  const Layout l{64, 1000, 0, false};
  for (DType dt : kDtypes) {
    const double huge = dt == DType::kFloat16 ? 6e4 : 1e30;
    for (Act act : {Act::kGeluTanh, Act::kSilu}) {
      std::vector<XRange> bands = {{-10, -4, false}, {-4, -1, false},   {-1, 1, false},
                                   {1, 4, false},    {4, 12, false},    {-1e3, 1e3, false},
                                   {-huge, huge, false}};
      if (act == Act::kSilu) bands.push_back({-80, -10, false});
      for (const XRange& band : bands) {
        check_forward(dt, act, l, 0, band);
        check_backward(dt, act, l, 0, band);
      }
    }
  }
}

TEST(ActivationCuda, MoreWorkThanOneGrid) {
  TS_REQUIRE_GPU();
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    check_forward(dt, Act::kGeluTanh, kLarge, 0);
    check_gated_forward(dt, Act::kSilu, kLarge, 0);
    check_gated_backward(dt, Act::kSilu, kLarge, 1);
    check_packed_backward(dt, Act::kGeluErf, {kLarge.rows, 2048, 8, false}, 1);
  }
}

// The caller's stream is used (and the launches are capturable): a graph of two launches on a
// non-blocking stream replays to the same bits as direct calls.
TEST(ActivationCuda, StreamAndGraphCapture) {
  TS_REQUIRE_GPU();
  const Layout l{64, 1000, 0, false};
  const DType dt = DType::kBFloat16;
  const Values a = test::random_inputs(dt, l.rows * l.cols, 0, -5, 5, false);
  const Values b = test::random_inputs(dt, l.rows * l.cols, 1, -2, 2, false);
  StridedDeviceBuffer d_a(dt, l, &a), d_b(dt, l, &b), d_y(dt, l), d_z(dt, l), d_ref(dt, l);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  swiglu_forward(d_a.view(), d_b.view(), d_y.view(), stream);
  gelu_forward(d_y.view(), d_z.view(), GeluApproximation::kTanh, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  swiglu_forward(d_a.view(), d_b.view(), d_ref.view());
  gelu_forward(d_ref.view(), d_ref.view(), GeluApproximation::kTanh);
  EXPECT_EQ(d_z.values(), d_ref.values());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace trainscale
