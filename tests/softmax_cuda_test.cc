// Softmax kernels, through the public entry points, against the fp64 CPU reference on float64
// copies of the same rounded inputs: every dtype, row lengths from 1 to 262144 (one thread per
// row up to a cluster of 16 blocks), each way a row reaches the registers, strided and
// misaligned rows, in place, M = 0, NaN / Inf rows, and the error past the longest row.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/row_config.h"
#include "ops/softmax/softmax_cuda.h"
#include "trainscale/error.h"
#include "trainscale/softmax.h"
#include "util/strided_device_buffer.h"

namespace trainscale {
namespace {

using test::HostTensor;
using test::Layout;
using test::StridedDeviceBuffer;
using Values = std::vector<double>;

constexpr DType kDtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
constexpr double kInf = std::numeric_limits<double>::infinity();

// Rows per length: a few, and enough for several row groups where rows are short.
std::vector<Layout> layouts() {
  std::vector<Layout> out;
  for (std::int64_t n : {1, 3, 17, 1000, 4096, 8193, 32768, 131072, 262144}) {
    const std::int64_t rows = n <= 1000 ? 600 : n <= 8193 ? 9 : n <= 32768 ? 5 : 2;
    out.push_back({rows, n, 0, false});
  }
  // Strided rows (whole vectors of padding), padding that breaks the 16-byte phase, a base one
  // element off 16 bytes.
  out.push_back({7, 4096, 8, false});
  out.push_back({5, 1000, 3, false});
  out.push_back({6, 520, 8, true});
  out.push_back({3, 40000, 5, true});
  out.push_back({0, 64, 0, false});
  return out;
}

Values reference_forward(DType dt, const Values& x, const Layout& l) {
  auto x64 = test::as_f64(x, l.rows, l.cols);
  HostTensor y64(DType::kFloat64, {l.rows, l.cols});
  softmax_forward(x64.view(), y64.view());
  return test::rounded(dt, y64);
}

// feed kAuto: through the public entry point; else the CUDA launcher with that feed forced.
using ops::softmax::SoftmaxFeed;

void check_forward(DType dt, const Layout& l, bool in_place, SoftmaxFeed feed = SoftmaxFeed::kAuto) {
  SCOPED_TRACE(test::describe(dt, l) + (in_place ? " in place" : ""));
  const Values x = test::random_inputs(dt, l.rows * l.cols, 0, -8, 8, /*specials=*/false);
  StridedDeviceBuffer d_x(dt, l, &x), d_y(dt, l);
  const StridedDeviceBuffer& out = in_place ? d_x : d_y;
  if (feed == SoftmaxFeed::kAuto) {
    softmax_forward(d_x.view(), out.view());
  } else {
    ops::softmax::softmax_forward_cuda(d_x.view(), out.view(), nullptr, feed);
  }
  EXPECT_TRUE(test::matches_reference(out.values(), reference_forward(dt, x, l), test::tolerance(dt)));
  EXPECT_TRUE(out.padding_untouched());
}

TEST(SoftmaxCuda, ForwardMatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Layout& l : layouts()) check_forward(dt, l, false);
}

TEST(SoftmaxCuda, ForwardInPlace) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Layout& l : {Layout{33, 1000, 0, false}, Layout{4, 32768, 0, false},
                            Layout{2, 131072, 0, false}, Layout{5, 777, 5, true}})
      check_forward(dt, l, true);
}

// Rows of specials: NaN anywhere or +inf or no finite element make the row NaN; -inf entries
// give 0. Each row is long enough to span threads (and, at 40000, a cluster) that hold only
// -inf, only finite values, or both; the last row's finite values sit so far below 0 that
// exp(-max) overflows float.
TEST(SoftmaxCuda, ForwardNanInfRows) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes) {
    for (std::int64_t n : {5, 300, 40000}) {
      const Layout l{7, n, 0, false};
      SCOPED_TRACE(test::describe(dt, l));
      Values x = test::random_inputs(dt, l.rows * n, 0, -4, 4, false);
      auto at = [&](std::int64_t r, std::int64_t j) -> double& { return x[r * n + j]; };
      at(0, n / 2) = std::nan("");
      at(1, n - 1) = kInf;
      for (std::int64_t j = 0; j < n; ++j) at(2, j) = -kInf;
      for (std::int64_t j = 0; j < n / 2 + 1; ++j) at(3, j) = -kInf;  // the first half -inf
      at(4, 0) = -kInf;
      for (std::int64_t j = 0; j < n; ++j) at(5, j) = j % 3 == 0 ? 30.0 : -kInf;
      for (std::int64_t j = 0; j < n; ++j) at(6, j) = j % 97 == 0 ? -200.0 : -kInf;
      StridedDeviceBuffer d_x(dt, l, &x), d_y(dt, l);
      softmax_forward(d_x.view(), d_y.view());
      EXPECT_TRUE(test::matches_reference(d_y.values(), reference_forward(dt, x, l), test::tolerance(dt)));
    }
  }
}

void check_backward(DType dt, const Layout& l, bool in_place, SoftmaxFeed feed = SoftmaxFeed::kAuto) {
  SCOPED_TRACE(test::describe(dt, l) + (in_place ? " in place" : ""));
  const std::int64_t n = l.rows * l.cols;
  // y: a softmax output (probabilities) as the kernel's dtype holds it.
  const Values logits = test::random_inputs(dt, n, 0, -4, 4, false);
  const Values y = reference_forward(dt, logits, l);
  const Values dy = test::random_inputs(dt, n, 1, -1, 1, false);
  StridedDeviceBuffer d_dy(dt, l, &dy), d_y(dt, l, &y), d_dx(dt, l);
  const StridedDeviceBuffer& out = in_place ? d_dy : d_dx;
  if (feed == SoftmaxFeed::kAuto) {
    softmax_backward(d_dy.view(), d_y.view(), out.view());
  } else {
    ops::softmax::softmax_backward_cuda(d_dy.view(), d_y.view(), out.view(), nullptr, feed);
  }
  auto dy64 = test::as_f64(dy, l.rows, l.cols), y64 = test::as_f64(y, l.rows, l.cols);
  HostTensor dx64(DType::kFloat64, {l.rows, l.cols});
  softmax_backward(dy64.view(), y64.view(), dx64.view());
  EXPECT_TRUE(test::matches_reference(out.values(), test::rounded(dt, dx64), test::tolerance(dt)));
  EXPECT_TRUE(out.padding_untouched());
}

TEST(SoftmaxCuda, BackwardMatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Layout& l : layouts()) check_backward(dt, l, false);
}

TEST(SoftmaxCuda, BackwardInPlace) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (const Layout& l : {Layout{33, 1000, 0, false}, Layout{2, 131072, 0, false},
                            Layout{5, 777, 5, true}})
      check_backward(dt, l, true);
}

// x at 16 bytes in whole slots, y not (another stride and phase): the rows' layout of every
// tensor decides the aligned kernels, so y moves element by element.
TEST(SoftmaxCuda, ForwardMixedLayouts) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes) {
    const Layout lx{7, 3000, 0, false}, ly{7, 3000, 1, true};
    SCOPED_TRACE(test::describe(dt, ly));
    const Values x = test::random_inputs(dt, lx.rows * lx.cols, 0, -8, 8, false);
    StridedDeviceBuffer d_x(dt, lx, &x), d_y(dt, ly);
    softmax_forward(d_x.view(), d_y.view());
    EXPECT_TRUE(test::matches_reference(d_y.values(), reference_forward(dt, x, lx), test::tolerance(dt)));
    EXPECT_TRUE(d_y.padding_untouched());
  }
}

// y and dx with other strides than dy (other 16-byte phases): element accesses where they differ.
TEST(SoftmaxCuda, BackwardMixedLayouts) {
  TS_REQUIRE_GPU();
  const DType dt = DType::kBFloat16;
  const Layout ldy{7, 3000, 0, false}, ly{7, 3000, 3, false}, ldx{7, 3000, 1, true};
  const std::int64_t n = ldy.rows * ldy.cols;
  const Values y = test::random_inputs(dt, n, 0, 0, 0.01, false);
  const Values dy = test::random_inputs(dt, n, 1, -1, 1, false);
  StridedDeviceBuffer d_dy(dt, ldy, &dy), d_y(dt, ly, &y), d_dx(dt, ldx);
  softmax_backward(d_dy.view(), d_y.view(), d_dx.view());
  auto dy64 = test::as_f64(dy, ldy.rows, ldy.cols), y64 = test::as_f64(y, ldy.rows, ldy.cols);
  HostTensor dx64(DType::kFloat64, {ldy.rows, ldy.cols});
  softmax_backward(dy64.view(), y64.view(), dx64.view());
  EXPECT_TRUE(test::matches_reference(d_dx.values(), test::rounded(dt, dx64), test::tolerance(dt)));
  EXPECT_TRUE(d_dx.padding_untouched());
}

// Many rows of 256 16-byte slots (bf16 N 2048, fp32 1024) take the forward's dense feed (one
// block per row, no ring), plain and strided, in place too; rows whose length leaves the
// backward's 2-slot split slots empty (bf16 N 6144) its sparse occupancy.
TEST(SoftmaxCuda, DenseFeedAndSparseSplitRows) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes) {
    const auto v = static_cast<std::int64_t>(16 / dtype_size(dt));
    check_forward(dt, {16384, 256 * v, 0, false}, false);
    check_forward(dt, {16384, 256 * v, v, false}, true);
    check_backward(dt, {16384, 256 * v, 0, false}, false);
    check_backward(dt, {40, 768 * v, 0, false}, false);
    check_backward(dt, {9, 768 * v - 5, 3, true}, true);
  }
}

// More long rows than the persistent grid has blocks (clusters), so each block takes several
// rows through its ring, each next row's copies landing while the one before is reduced and
// written: rows of 2048 16-byte slots (512 threads), shifted and strided in place, and of 8192
// (a cluster of 2).
TEST(SoftmaxCuda, LongRowsThroughTheRing) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes) {
    const auto v = static_cast<std::int64_t>(16 / dtype_size(dt));
    for (const Layout& l : {Layout{700, 2048 * v, 0, false}, Layout{600, 2048 * v - 3, 5, true},
                            Layout{300, 8192 * v, 0, false}}) {
      check_forward(dt, l, l.shift);
      check_backward(dt, l, l.shift);
    }
  }
}

// The direct feed forced (rows of 129-32768 slots at 16 bytes, a block of 64 (four rows to a
// block) to 1024 threads each, clusters of 2, 4 or 8 blocks beyond 4096 slots): at every split,
// strided by whole slots, in place, M = 0; other rows throw.
TEST(SoftmaxCuda, DirectFeedRows) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes) {
    const auto v = static_cast<std::int64_t>(16 / dtype_size(dt));
    for (const Layout& l : {Layout{301, 129 * v, 0, false}, Layout{70, 300 * v, v, false},
                            Layout{50, 1024 * v, 0, false}, Layout{300, 1025 * v, 0, false},
                            Layout{257, 2048 * v, v, false},
                            Layout{40, 4096 * v, 0, false}, Layout{33, 3000 * v, 0, false},
                            Layout{0, 2048 * v, 0, false}, Layout{21, 4097 * v, 0, false},
                            Layout{9, 8192 * v, v, false}, Layout{6, 12000 * v, 0, false},
                            Layout{3, 32768 * v, 0, false}}) {
      check_forward(dt, l, false, SoftmaxFeed::kDirect);
      check_forward(dt, l, true, SoftmaxFeed::kDirect);
      check_backward(dt, l, false, SoftmaxFeed::kDirect);
      check_backward(dt, l, true, SoftmaxFeed::kDirect);
    }
    for (const Layout& l : {Layout{4, 128 * v, 0, false}, Layout{4, 32769 * v, 0, false},
                            Layout{4, 2048 * v, 0, true}, Layout{4, 2048 * v - 1, 0, false}}) {
      SCOPED_TRACE(test::describe(dt, l));
      StridedDeviceBuffer d_x(dt, l), d_y(dt, l);
      EXPECT_THROW(ops::softmax::softmax_forward_cuda(d_x.view(), d_y.view(), nullptr, SoftmaxFeed::kDirect),
                   UnsupportedVariantError);
      EXPECT_THROW(ops::softmax::softmax_backward_cuda(d_x.view(), d_x.view(), d_y.view(), nullptr,
                                                       SoftmaxFeed::kDirect),
                   UnsupportedVariantError);
    }
  }
}

// kAuto takes the direct feed for aligned rows of 129 slots and more over 4096 rows or more,
// up to 16384 slots forward (clusters of 4) and 32768 backward (clusters of 8).
TEST(SoftmaxCuda, DirectFeedIsChosenForAlignedRowsOver4096Rows) {
  using ops::softmax::direct_feed_default;
  for (const bool forward : {true, false}) {
    EXPECT_TRUE(direct_feed_default(true, 129, 4096, forward));
    EXPECT_TRUE(direct_feed_default(true, 1024, 32768, forward));
    EXPECT_TRUE(direct_feed_default(true, 16384, 4096, forward));
    EXPECT_FALSE(direct_feed_default(false, 2048, 32768, forward));
    EXPECT_FALSE(direct_feed_default(true, 128, 32768, forward));
    EXPECT_FALSE(direct_feed_default(true, 2048, 4095, forward));
    EXPECT_FALSE(direct_feed_default(true, 32769, 32768, forward));
  }
  EXPECT_FALSE(direct_feed_default(true, 16385, 32768, true));
  EXPECT_TRUE(direct_feed_default(true, 32768, 32768, false));
}

TEST(SoftmaxCuda, RowsLongerThanSupportedThrow) {
  TS_REQUIRE_GPU();
  const DType dt = DType::kFloat32;
  const std::int64_t n = detail::max_row_cols(4) + 4;
  const Layout l{1, n, 0, false};
  StridedDeviceBuffer d_x(dt, l), d_y(dt, l);
  TS_EXPECT_ERROR(softmax_forward(d_x.view(), d_y.view()), "softmax_forward", "longer");
  TS_EXPECT_ERROR(softmax_backward(d_x.view(), d_x.view(), d_y.view()), "softmax_backward", "longer");
}

}  // namespace
}  // namespace trainscale
