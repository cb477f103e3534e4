// Tensors of more than 2^31 elements (and, in 16-bit dtypes, 2^32 bytes; for softmax also more
// than 2^31 rows) through the public entry points of every row-wise and elementwise family and
// attention: rows sampled at the start, around element 2^31, byte 2^32 and row 2^31, and at the
// end, against the fp64 CPU reference of their pattern (util/repeated_rows.h: row r holds pattern
// r % 61, filled on the device). Reductions over every row (the norm's weight gradient, the mean
// cross-entropy, the MSE sum, the embedding's table gradient) are checked whole, from each
// pattern's row count. Each test needs 9-17 GB of device memory (attention 46 GB) and skips where
// less is free.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "trainscale/activation.h"
#include "trainscale/attention.h"
#include "trainscale/embedding.h"
#include "trainscale/fp8.h"
#include "trainscale/loss.h"
#include "trainscale/norm.h"
#include "trainscale/rope.h"
#include "trainscale/softmax.h"
#include "util/gpu_util.h"
#include "util/repeated_rows.h"

namespace trainscale {
namespace {

using test::DeviceTensor;
using test::HostTensor;
using test::kPatternRows;
using test::RepeatedRows;
using Values = std::vector<double>;

constexpr DType kBf16 = DType::kBFloat16;
constexpr double kBf16Tol = 1e-2;  // docs/contract.md

// kPatternRows random rows of `cols`, rounded to dt.
Values patterns(DType dt, std::int64_t cols, double lo = -4, double hi = 4) {
  Values v = test::random_values(kPatternRows * cols, lo, hi);
  for (double& x : v) x = detail::round_to(dt, x);
  return v;
}

HostTensor f64(const Values& v, std::vector<std::int64_t> shape) {
  return HostTensor::from_values(DType::kFloat64, std::move(shape), v);
}

// Row p of a row-major [*, cols] host matrix, rounded to dt (dt = kFloat64: as is).
Values row_of(const HostTensor& t, std::int64_t p, std::int64_t cols, DType dt = DType::kFloat64) {
  Values out(static_cast<std::size_t>(cols));
  for (std::int64_t j = 0; j < cols; ++j) out[j] = detail::round_to(dt, t.at(p * cols + j));
  return out;
}

Values host_values(const DeviceTensor& d) { return d.to_host().values(); }

::testing::AssertionResult close(double got, double want, double rel) {
  if (std::abs(got - want) <= rel * std::abs(want)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << got << " against " << want << " (relative " << rel << ")";
}

// Every probed row r of `got` (bf16) against row r % kPatternRows of the float64 reference.
void expect_probed_rows(const RepeatedRows& got, const HostTensor& pattern_reference, const std::string& what) {
  for (const std::int64_t r : test::probe_rows(got.rows(), got.cols(), 2)) {
    SCOPED_TRACE(what + " row " + std::to_string(r));
    EXPECT_TRUE(test::matches_reference(got.row(r), row_of(pattern_reference, r % kPatternRows, got.cols(), kBf16),
                                        kBf16Tol));
  }
}

TEST(LargeTensorCuda, RmsNormForwardAndBackward) {
  TS_REQUIRE_GPU();
  const std::int64_t cols = 4096, rows = test::rows_past_int32(cols);
  TS_REQUIRE_DEVICE_MEMORY(2 * rows * cols * 2);
  const Values xp = patterns(kBf16, cols), dyp = patterns(kBf16, cols);
  const HostTensor w = HostTensor::random(kBf16, {cols}, 0.5, 1.5);
  DeviceTensor d_w(w), d_rstd(HostTensor(DType::kFloat32, {rows}), false);
  RepeatedRows x(kBf16, rows, cols, xp);

  const HostTensor x64 = f64(xp, {kPatternRows, cols}), w64 = f64(w.values(), {cols});
  HostTensor y64(DType::kFloat64, {kPatternRows, cols}), rstd64(DType::kFloat64, {kPatternRows});
  rmsnorm_forward(x64.view(), w64.view(), y64.view(), rstd64.view());
  {
    RepeatedRows y(kBf16, rows, cols);
    rmsnorm_forward(x.view(), d_w.view(), y.view(), d_rstd.view());
    const Values rstd = host_values(d_rstd);
    expect_probed_rows(y, y64, "y");
    for (const std::int64_t r : test::probe_rows(rows, cols, 2)) {
      EXPECT_TRUE(close(rstd[r], rstd64.at(r % kPatternRows), 1e-5)) << "rstd row " << r;
    }
  }

  // dx in place over dy; dw sums every row: pattern p's rows weigh count[p].
  RepeatedRows dy(kBf16, rows, cols, dyp);
  DeviceTensor d_dw(HostTensor(kBf16, {cols}), false);
  const std::size_t ws = norm_backward_workspace_bytes(rows, cols, kBf16, Device::cuda(0));
  DeviceTensor d_ws(HostTensor(DType::kFloat32, {static_cast<std::int64_t>(ws / 4 + 4)}), false);
  rmsnorm_backward(dy.view(), x.view(), d_w.view(), d_rstd.view(), dy.view(), d_dw.view(), d_ws.view());

  const Values count = test::pattern_counts(rows);
  Values dy_weighted = dyp;
  for (std::int64_t e = 0; e < kPatternRows * cols; ++e) dy_weighted[e] *= count[e / cols];
  HostTensor dx64(DType::kFloat64, {kPatternRows, cols}), dw64(DType::kFloat64, {cols});
  HostTensor unused_dx(DType::kFloat64, {kPatternRows, cols}), unused_dw(DType::kFloat64, {cols});
  const HostTensor dy64 = f64(dyp, {kPatternRows, cols}), dyw64 = f64(dy_weighted, {kPatternRows, cols});
  rmsnorm_backward(dy64.view(), x64.view(), w64.view(), rstd64.view(), dx64.view(), unused_dw.view(), {});
  rmsnorm_backward(dyw64.view(), x64.view(), w64.view(), rstd64.view(), unused_dx.view(), dw64.view(), {});
  expect_probed_rows(dy, dx64, "dx");
  EXPECT_TRUE(test::matches_reference(host_values(d_dw), row_of(dw64, 0, cols, kBf16), kBf16Tol));
}

// Out of place: the sum goes to residual_out and the normalized rows to y, four tensors past 2^31
// elements; x and the residual stay as they were.
TEST(LargeTensorCuda, FusedAddRmsNormOutOfPlace) {
  TS_REQUIRE_GPU();
  const std::int64_t cols = 4096, rows = test::rows_past_int32(cols);
  TS_REQUIRE_DEVICE_MEMORY(4 * rows * cols * 2);
  const Values xp = patterns(kBf16, cols), rp = patterns(kBf16, cols);
  const HostTensor w = HostTensor::random(kBf16, {cols}, 0.5, 1.5);
  DeviceTensor d_w(w), d_rstd(HostTensor(DType::kFloat32, {rows}), false);
  RepeatedRows x(kBf16, rows, cols, xp), residual(kBf16, rows, cols, rp);
  RepeatedRows y(kBf16, rows, cols), residual_out(kBf16, rows, cols);
  fused_add_rmsnorm_forward(x.view(), residual.view(), d_w.view(), y.view(), residual_out.view(),
                            d_rstd.view());

  // The sum as stored (rounded to bf16), then its RMSNorm in fp64.
  Values sum(xp.size());
  for (std::size_t e = 0; e < sum.size(); ++e) sum[e] = detail::round_to(kBf16, xp[e] + rp[e]);
  const HostTensor sum64 = f64(sum, {kPatternRows, cols}), w64 = f64(w.values(), {cols});
  HostTensor y64(DType::kFloat64, {kPatternRows, cols}), rstd64(DType::kFloat64, {kPatternRows});
  rmsnorm_forward(sum64.view(), w64.view(), y64.view(), rstd64.view());
  expect_probed_rows(residual_out, sum64, "residual_out");
  expect_probed_rows(y, y64, "y");
  expect_probed_rows(x, f64(xp, {kPatternRows, cols}), "x (unchanged)");
  expect_probed_rows(residual, f64(rp, {kPatternRows, cols}), "residual (unchanged)");
  const Values rstd = host_values(d_rstd);
  for (const std::int64_t r : test::probe_rows(rows, cols, 2)) {
    EXPECT_TRUE(close(rstd[r], rstd64.at(r % kPatternRows), 1e-5)) << "rstd row " << r;
  }
}
TEST(LargeTensorCuda, SoftmaxForwardAndBackward) {
  TS_REQUIRE_GPU();
  const std::int64_t cols = 4096, rows = test::rows_past_int32(cols);
  TS_REQUIRE_DEVICE_MEMORY(3 * rows * cols * 2);
  const Values xp = patterns(kBf16, cols, -8, 8), dyp = patterns(kBf16, cols);
  const HostTensor x64 = f64(xp, {kPatternRows, cols});
  HostTensor y64(DType::kFloat64, {kPatternRows, cols});
  softmax_forward(x64.view(), y64.view());
  Values yp = y64.values();
  for (double& v : yp) v = detail::round_to(kBf16, v);
  {
    RepeatedRows x(kBf16, rows, cols, xp), y(kBf16, rows, cols);
    softmax_forward(x.view(), y.view());
    expect_probed_rows(y, y64, "y");
  }
  // The backward reads y as the reference rounded it, independent of the forward's bits.
  RepeatedRows y(kBf16, rows, cols, yp), dy(kBf16, rows, cols, dyp), dx(kBf16, rows, cols);
  softmax_backward(dy.view(), y.view(), dx.view());
  HostTensor dx64(DType::kFloat64, {kPatternRows, cols});
  softmax_backward(f64(dyp, {kPatternRows, cols}).view(), f64(yp, {kPatternRows, cols}).view(), dx64.view());
  expect_probed_rows(dx, dx64, "dx");
}

// More than 2^31 rows (of 2 elements): a row index or a row count held in 32 bits.
TEST(LargeTensorCuda, SoftmaxRowsPastInt32) {
  TS_REQUIRE_GPU();
  const std::int64_t cols = 2, rows = (std::int64_t{1} << 31) + 64;
  TS_REQUIRE_DEVICE_MEMORY(2 * rows * cols * 2);
  const Values xp = patterns(kBf16, cols, -8, 8);
  RepeatedRows x(kBf16, rows, cols, xp), y(kBf16, rows, cols);
  softmax_forward(x.view(), y.view());
  HostTensor y64(DType::kFloat64, {kPatternRows, cols});
  softmax_forward(f64(xp, {kPatternRows, cols}).view(), y64.view());
  expect_probed_rows(y, y64, "y");
}

TEST(LargeTensorCuda, CrossEntropyWithGradientAndMean) {
  TS_REQUIRE_GPU();
  const std::int64_t vocab = 128256, rows = test::rows_past_int32(vocab);
  TS_REQUIRE_DEVICE_MEMORY(2 * rows * vocab * 2);
  const Values xp = patterns(kBf16, vocab, -8, 8);
  HostTensor targets(DType::kInt64, {rows});
  std::int64_t counted = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const bool ignored = r % 997 == 5;
    targets.set(r, ignored ? -100 : static_cast<double>(test::rng()() % vocab));
    counted += ignored ? 0 : 1;
  }
  // Each pattern's lse from the CPU reference; a row's loss is lse - x[target].
  const HostTensor x64 = f64(xp, {kPatternRows, vocab});
  HostTensor zero_targets(DType::kInt64, {kPatternRows}), loss64(DType::kFloat64, {kPatternRows}),
      lse64(DType::kFloat64, {kPatternRows});
  for (std::int64_t r = 0; r < kPatternRows; ++r) zero_targets.set(r, 0);  // HostTensor is poisoned
  cross_entropy_forward(x64.view(), zero_targets.view(), loss64.view(), lse64.view(), {},
                        {.reduction = Reduction::kNone});
  auto row_loss = [&](std::int64_t r) {
    const std::int64_t t = static_cast<std::int64_t>(targets.at(r));
    return t < 0 ? 0.0 : lse64.at(r % kPatternRows) - xp[(r % kPatternRows) * vocab + t];
  };

  RepeatedRows x(kBf16, rows, vocab, xp), grad(kBf16, rows, vocab);
  DeviceTensor d_targets(targets), d_loss(HostTensor(DType::kFloat32, {rows}), false),
      d_lse(HostTensor(DType::kFloat32, {rows}), false);
  cross_entropy_forward(x.view(), d_targets.view(), d_loss.view(), d_lse.view(), grad.view(),
                        {.reduction = Reduction::kNone});
  const Values loss = host_values(d_loss), lse = host_values(d_lse);
  for (const std::int64_t r : test::probe_rows(rows, vocab, 2)) {
    SCOPED_TRACE("row " + std::to_string(r));
    EXPECT_TRUE(close(loss[r], row_loss(r), 1e-4));
    EXPECT_TRUE(close(lse[r], lse64.at(r % kPatternRows), 1e-5));
    const std::int64_t p = r % kPatternRows, t = static_cast<std::int64_t>(targets.at(r));
    Values want(static_cast<std::size_t>(vocab), 0.0);
    for (std::int64_t j = 0; t >= 0 && j < vocab; ++j) {
      want[j] = detail::round_to(kBf16, std::exp(xp[p * vocab + j] - lse64.at(p)) - (j == t ? 1.0 : 0.0));
    }
    EXPECT_TRUE(test::matches_reference(grad.row(r), want, kBf16Tol));
  }

  DeviceTensor d_mean(HostTensor(DType::kFloat32, {1}), false);
  cross_entropy_forward(x.view(), d_targets.view(), d_mean.view(), {}, {}, {.reduction = Reduction::kMean});
  double sum = 0;
  for (std::int64_t r = 0; r < rows; ++r) sum += row_loss(r);
  EXPECT_TRUE(close(host_values(d_mean)[0], sum / static_cast<double>(counted), 1e-4));
}

TEST(LargeTensorCuda, SwigluForward) {
  TS_REQUIRE_GPU();
  const std::int64_t cols = 14336, rows = test::rows_past_int32(cols);
  TS_REQUIRE_DEVICE_MEMORY(3 * rows * cols * 2);
  const Values ap = patterns(kBf16, cols), bp = patterns(kBf16, cols);
  RepeatedRows a(kBf16, rows, cols, ap), b(kBf16, rows, cols, bp), y(kBf16, rows, cols);
  swiglu_forward(a.view(), b.view(), y.view());
  HostTensor y64(DType::kFloat64, {kPatternRows, cols});
  swiglu_forward(f64(ap, {kPatternRows, cols}).view(), f64(bp, {kPatternRows, cols}).view(), y64.view());
  expect_probed_rows(y, y64, "y");
}

TEST(LargeTensorCuda, MseSumAndMean) {
  TS_REQUIRE_GPU();
  const std::int64_t cols = 4096, rows = test::rows_past_int32(cols);
  TS_REQUIRE_DEVICE_MEMORY(2 * rows * cols * 2);
  const Values ap = patterns(kBf16, cols), bp = patterns(kBf16, cols);
  RepeatedRows a(kBf16, rows, cols, ap), b(kBf16, rows, cols, bp);
  const Values count = test::pattern_counts(rows);
  double sum = 0;
  for (std::int64_t e = 0; e < kPatternRows * cols; ++e) sum += count[e / cols] * (ap[e] - bp[e]) * (ap[e] - bp[e]);
  DeviceTensor d_out(HostTensor(DType::kFloat32, {1}), false);
  // float32 partial sums of 2^31 terms: 1e-3 allows their rounding, not a lost or doubled row.
  mse_forward(a.view(), b.view(), d_out.view(), Reduction::kSum);
  EXPECT_TRUE(close(host_values(d_out)[0], sum, 1e-3));
  mse_forward(a.view(), b.view(), d_out.view(), Reduction::kMean);
  EXPECT_TRUE(close(host_values(d_out)[0], sum / static_cast<double>(rows * cols), 1e-3));
}

// The fp8 contract is bit-exact: codes and scales equal the CPU reference's.
TEST(LargeTensorCuda, Fp8QuantizePerRowAndTilesWithTransposedCopy) {
  TS_REQUIRE_GPU();
  const std::int64_t cols = 4096, rows = test::rows_past_int32(cols);
  TS_REQUIRE_DEVICE_MEMORY(rows * cols * 4);
  const DType fp8 = DType::kFloat8E4M3;
  const Values xp = patterns(kBf16, cols, -300, 300);
  RepeatedRows x(kBf16, rows, cols, xp);
  const HostTensor xh = HostTensor::from_values(kBf16, {kPatternRows, cols}, xp);
  {
    RepeatedRows q(fp8, rows, cols);
    DeviceTensor d_scales(HostTensor(DType::kFloat32, {rows}), false);
    fp8_quantize(x.view(), q.view(), d_scales.view(), {}, {}, {.granularity = Fp8Granularity::kRow});
    HostTensor q_ref(fp8, {kPatternRows, cols}), s_ref(DType::kFloat32, {kPatternRows});
    fp8_quantize(xh.view(), q_ref.view(), s_ref.view(), {}, {}, {.granularity = Fp8Granularity::kRow});
    const Values scales = host_values(d_scales);
    for (const std::int64_t r : test::probe_rows(rows, cols, 2)) {
      SCOPED_TRACE("per row, row " + std::to_string(r));
      EXPECT_EQ(q.row(r), row_of(q_ref, r % kPatternRows, cols));
      EXPECT_EQ(scales[r], s_ref.at(r % kPatternRows));
    }
  }
  // 1x128 tiles of x, and the transposed copy's 128x1 tiles: q_t [cols, rows] spans every
  // pattern, so each probed row's block of 128 rows is quantized whole on the host.
  const Fp8QuantizeOptions tiles{.granularity = Fp8Granularity::kTile1x128};
  const std::int64_t col_tiles = cols / 128, row_tiles = (rows + 127) / 128;
  RepeatedRows q(fp8, rows, cols), q_t(fp8, cols, rows);
  DeviceTensor d_scales(HostTensor(DType::kFloat32, {rows, col_tiles}), false),
      d_scales_t(HostTensor(DType::kFloat32, {cols, row_tiles}), false);
  fp8_quantize(x.view(), q.view(), d_scales.view(), q_t.view(), d_scales_t.view(), tiles);
  const Values scales = host_values(d_scales), scales_t = host_values(d_scales_t);
  for (const std::int64_t r : test::probe_rows(rows, cols, 2)) {
    SCOPED_TRACE("1x128 with the transposed copy, row " + std::to_string(r));
    const std::int64_t first = r / 128 * 128, m = std::min<std::int64_t>(128, rows - first);
    Values block(static_cast<std::size_t>(m * cols));
    for (std::int64_t i = 0; i < m; ++i) {
      std::memcpy(&block[i * cols], &xp[(first + i) % kPatternRows * cols], cols * sizeof(double));
    }
    HostTensor qb(fp8, {m, cols}), sb(DType::kFloat32, {m, col_tiles}), qtb(fp8, {cols, m}),
        stb(DType::kFloat32, {cols, 1});
    const HostTensor xb = HostTensor::from_values(kBf16, {m, cols}, block);
    fp8_quantize(xb.view(), qb.view(), sb.view(), qtb.view(), stb.view(), tiles);
    EXPECT_EQ(q.row(r), row_of(qb, r - first, cols));
    for (std::int64_t t = 0; t < col_tiles; ++t) {
      EXPECT_EQ(scales[r * col_tiles + t], sb.at((r - first) * col_tiles + t));
    }
    HostTensor got_t(fp8, {cols, m});
    test::device_synchronize();
    ASSERT_EQ(cudaMemcpy2D(got_t.data(), m, static_cast<const char*>(q_t.data()) + first, rows, m, cols,
                           cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(got_t.values(), qtb.values());
    for (std::int64_t j = 0; j < cols; ++j) EXPECT_EQ(scales_t[j * row_tiles + first / 128], stb.at(j));
  }
}

TEST(LargeTensorCuda, EmbeddingForwardAndBackward) {
  TS_REQUIRE_GPU();
  const std::int64_t hidden = 4096, tokens = test::rows_past_int32(hidden), vocab = 1000;
  TS_REQUIRE_DEVICE_MEMORY(tokens * hidden * 2);
  const HostTensor table = HostTensor::random(kBf16, {vocab, hidden}, -2, 2);
  HostTensor ids(DType::kInt64, {tokens});
  for (std::int64_t t = 0; t < tokens; ++t) ids.set(t, static_cast<double>(test::rng()() % vocab));
  DeviceTensor d_table(table), d_ids(ids);
  {
    RepeatedRows out(kBf16, tokens, hidden);
    embedding_forward(d_table.view(), d_ids.view(), out.view());
    for (const std::int64_t t : test::probe_rows(tokens, hidden, 2)) {
      SCOPED_TRACE("token " + std::to_string(t));
      EXPECT_EQ(out.row(t), row_of(table, static_cast<std::int64_t>(ids.at(t)), hidden));
    }
  }
  // The table's gradient: row v sums the gradient rows of the tokens with id v.
  const Values gp = patterns(kBf16, hidden);
  RepeatedRows grad_out(kBf16, tokens, hidden, gp);
  DeviceTensor d_grad(HostTensor(kBf16, {vocab, hidden}), false);
  const std::size_t ws = embedding_backward_workspace_bytes(tokens);
  DeviceTensor d_ws(HostTensor(DType::kFloat32, {static_cast<std::int64_t>(ws / 4 + 4)}), false);
  embedding_backward(grad_out.view(), d_ids.view(), d_grad.view(), -1, d_ws.view());
  Values count(static_cast<std::size_t>(vocab * kPatternRows), 0.0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    count[static_cast<std::int64_t>(ids.at(t)) * kPatternRows + t % kPatternRows] += 1;
  }
  Values want(static_cast<std::size_t>(vocab * hidden), 0.0);
  for (std::int64_t v = 0; v < vocab; ++v) {
    for (std::int64_t p = 0; p < kPatternRows; ++p) {
      const double c = count[v * kPatternRows + p];
      for (std::int64_t j = 0; c != 0 && j < hidden; ++j) want[v * hidden + j] += c * gp[p * hidden + j];
    }
  }
  for (double& w : want) w = detail::round_to(kBf16, w);
  EXPECT_TRUE(test::matches_reference(host_values(d_grad), want, kBf16Tol));
}

TEST(LargeTensorCuda, RopeForward) {
  TS_REQUIRE_GPU();
  const std::int64_t batch = 65, seq = 8192, heads = 32, dim = 128;
  const std::int64_t rows = batch * seq * heads;  // one head vector per row
  TS_REQUIRE_DEVICE_MEMORY(2 * rows * dim * 2);
  const Values qp = patterns(kBf16, dim);
  RepeatedRows q(kBf16, rows, dim, qp), out(kBf16, rows, dim);
  rope_forward(q.view({batch, seq, heads, dim}), {}, out.view({batch, seq, heads, dim}), {}, {}, {}, {});
  for (const std::int64_t r : test::probe_rows(rows, dim, 2)) {
    SCOPED_TRACE("head vector " + std::to_string(r));
    const std::int64_t s = r / heads % seq;
    const HostTensor one = f64(row_of(f64(qp, {kPatternRows, dim}), r % kPatternRows, dim), {1, 1, 1, dim});
    HostTensor position(DType::kInt64, {1}), want(DType::kFloat64, {1, 1, 1, dim});
    position.set(0, static_cast<double>(s));
    rope_forward(one.view(), {}, want.view(), {}, {}, {}, position.view());
    Values rounded = want.values();
    for (double& v : rounded) v = detail::round_to(kBf16, v);
    EXPECT_TRUE(test::matches_reference(out.row(r), rounded, kBf16Tol));
  }
}

// Causal MHA over [65, 8192, 32, 128]: batch 64 starts at element 2^31 of q, k, v, out and their
// gradients, and dQ's fp32 accumulator spans 8.7 GB. Probed: outputs and dq of queries there
// (and in batch 0), dk / dv of the last two keys of a head (which only the last two queries see,
// so their reference is two queries against the whole sequence).
TEST(LargeTensorCuda, AttentionCausalForwardAndBackward) {
  TS_REQUIRE_GPU();
  const std::int64_t batch = 65, seq = 8192, heads = 32, dim = 128;
  const std::int64_t rows = batch * seq * heads;  // one head vector per row
  const std::vector<std::int64_t> shape = {batch, seq, heads, dim};
  const std::int64_t tensor_bytes = rows * dim * 2;
  TS_REQUIRE_DEVICE_MEMORY(8 * tensor_bytes + 2 * tensor_bytes + rows * 4);
  const Values qp = patterns(kBf16, dim, -1, 1), kp = patterns(kBf16, dim, -1, 1),
               vp = patterns(kBf16, dim, -1, 1), dop = patterns(kBf16, dim, -1, 1);
  RepeatedRows q(kBf16, rows, dim, qp), k(kBf16, rows, dim, kp), v(kBf16, rows, dim, vp),
      dout(kBf16, rows, dim, dop), out(kBf16, rows, dim), dq(kBf16, rows, dim), dk(kBf16, rows, dim),
      dv(kBf16, rows, dim);
  DeviceTensor d_lse(HostTensor(DType::kFloat32, {batch, heads, seq}), false);
  const AttentionOptions causal{.causal = true};
  attention_forward(q.view(shape), k.view(shape), v.view(shape), out.view(shape), d_lse.view(), causal);
  const std::int64_t ws = static_cast<std::int64_t>(attention_backward_workspace_bytes(q.view(shape)));
  RepeatedRows workspace(DType::kFloat32, (ws / 4 + 1023) / 1024, 1024);
  attention_backward({.dout = dout.view(shape), .q = q.view(shape), .k = k.view(shape), .v = v.view(shape),
                      .out = out.view(shape), .lse = d_lse.view(), .dq = dq.view(shape), .dk = dk.view(shape),
                      .dv = dv.view(shape), .workspace = workspace.view()},
                     causal);
  const Values lse = host_values(d_lse);

  // Rows [first, last] of one head's sequence as a host [1, n, 1, dim] float64 tensor.
  const auto row_index = [&](std::int64_t b, std::int64_t s, std::int64_t h) { return (b * seq + s) * heads + h; };
  const auto sequence = [&](const Values& p, std::int64_t b, std::int64_t h, std::int64_t first, std::int64_t last) {
    Values vectors((last - first + 1) * dim);
    for (std::int64_t s = first; s <= last; ++s) {
      std::memcpy(&vectors[(s - first) * dim], &p[row_index(b, s, h) % kPatternRows * dim], dim * sizeof(double));
    }
    return f64(vectors, {1, last - first + 1, 1, dim});
  };
  // The reference of queries [first, last] of head (b, h) against all keys up to them (causal,
  // bottom-right aligned: query i sees keys <= i): out, lse, dq, dk, dv. Its backward takes the
  // kernel's own bf16 out (an input of the backward, through delta = rowsum(dout * out)), as
  // docs/contract.md has every reference see the inputs the kernel saw. With the exact out the
  // reference's dS = P (dP - delta) moves by the out's rounding wherever delta nearly cancels dP:
  // up to 20 % on a query of two keys (1.0 % at query 1 and 1.4 % at the last key's dk here).
  struct Reference {
    HostTensor out, lse, dq, dk, dv;
  };
  const auto reference = [&](std::int64_t b, std::int64_t h, std::int64_t first, std::int64_t last) {
    const std::int64_t n = last - first + 1;
    const HostTensor q64 = sequence(qp, b, h, first, last), k64 = sequence(kp, b, h, 0, last),
                     v64 = sequence(vp, b, h, 0, last), do64 = sequence(dop, b, h, first, last);
    Reference r{HostTensor(DType::kFloat64, {1, n, 1, dim}), HostTensor(DType::kFloat64, {1, 1, n}),
                HostTensor(DType::kFloat64, {1, n, 1, dim}), HostTensor(DType::kFloat64, {1, last + 1, 1, dim}),
                HostTensor(DType::kFloat64, {1, last + 1, 1, dim})};
    attention_forward(q64.view(), k64.view(), v64.view(), r.out.view(), r.lse.view(), causal);
    Values seen_out(n * dim);
    for (std::int64_t s = first; s <= last; ++s) {
      const Values row = out.row(row_index(b, s, h));
      std::copy(row.begin(), row.end(), seen_out.begin() + (s - first) * dim);
    }
    const HostTensor out64 = f64(seen_out, {1, n, 1, dim});
    attention_backward({.dout = do64.view(), .q = q64.view(), .k = k64.view(), .v = v64.view(), .out = out64.view(),
                        .lse = r.lse.view(), .dq = r.dq.view(), .dk = r.dk.view(), .dv = r.dv.view()},
                       causal);
    return r;
  };
  const auto rounded_row = [&](const HostTensor& t, std::int64_t i) { return row_of(t, i, dim, kBf16); };
  for (const std::int64_t b : {std::int64_t{0}, batch - 1}) {
    for (const std::int64_t h : {std::int64_t{0}, heads - 1}) {
      for (const std::int64_t s : {std::int64_t{0}, std::int64_t{1}, seq / 2, seq - 1}) {
        SCOPED_TRACE("query (" + std::to_string(b) + ", " + std::to_string(s) + ", " + std::to_string(h) + ")");
        const Reference r = reference(b, h, s, s);
        const std::int64_t at = row_index(b, s, h);
        EXPECT_TRUE(test::matches_reference(out.row(at), rounded_row(r.out, 0), kBf16Tol));
        EXPECT_TRUE(test::matches_reference(dq.row(at), rounded_row(r.dq, 0), kBf16Tol));
        EXPECT_TRUE(close(lse[(b * heads + h) * seq + s], r.lse.at(0), 1e-4));
      }
      // The last two keys: only the last two queries see them.
      const Reference r = reference(b, h, seq - 2, seq - 1);
      for (const std::int64_t j : {seq - 2, seq - 1}) {
        SCOPED_TRACE("key (" + std::to_string(b) + ", " + std::to_string(j) + ", " + std::to_string(h) + ")");
        EXPECT_TRUE(test::matches_reference(dk.row(row_index(b, j, h)), rounded_row(r.dk, j), kBf16Tol));
        EXPECT_TRUE(test::matches_reference(dv.row(row_index(b, j, h)), rounded_row(r.dv, j), kBf16Tol));
      }
    }
  }
}

}  // namespace
}  // namespace trainscale
