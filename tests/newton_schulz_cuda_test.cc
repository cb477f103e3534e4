// Newton-Schulz on the GPU against the fp64 CPU reference on float64 copies of the same rounded
// input: every dtype, wide and tall (transposed) matrices, odd and tiny shapes, padded rows,
// 0, 1 and 5 steps and per-step coefficients, NaN input, bit-identical results run to run,
// batches bit-identical to one call per matrix, the Gram method, and the workspace's errors.
// The CUDA path stores X and the Gram products in the input's dtype between its products, so
// its error is that of several roundings per step (tolerance()).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "ops/newton_schulz/newton_schulz_internal.h"
#include "trainscale/newton_schulz.h"
#include "util/strided_device_buffer.h"

namespace trainscale {
namespace {

using test::DeviceTensor;
using test::HostTensor;
using test::Layout;
using test::StridedDeviceBuffer;
using Values = std::vector<double>;

// Relative L2 error against the fp64 result: five steps, each rounding X, A = X X^T and
// B = b A + c A A to the dtype.
double tolerance(DType dt) {
  switch (dt) {
    case DType::kBFloat16: return 5e-2;
    case DType::kFloat16: return 1e-2;
    default: return 1e-4;
  }
}

Values run_device(DType dt, const Layout& l, const Values& x, const NewtonSchulzOptions& o) {
  StridedDeviceBuffer d_g(dt, l, &x), d_out(dt, l);
  const std::size_t bytes = newton_schulz_workspace_bytes(d_g.view());
  DeviceTensor ws(HostTensor(DType::kInt64, {static_cast<std::int64_t>(bytes / 8 + 1)}), false);
  ws.poison();
  newton_schulz(d_g.view(), d_out.view(), o, ws.view());
  EXPECT_TRUE(d_out.padding_untouched());
  return d_out.values();
}

Values run_reference(DType dt, const Layout& l, const Values& x, const NewtonSchulzOptions& o) {
  HostTensor g = test::as_f64(x, l.rows, l.cols), out(DType::kFloat64, {l.rows, l.cols});
  newton_schulz(g.view(), out.view(), o);
  return test::rounded(dt, out);
}

void check(DType dt, const Layout& l, const NewtonSchulzOptions& o = {}) {
  const std::string what = test::describe(dt, l) + " steps " + std::to_string(o.steps);
  SCOPED_TRACE(what);
  const Values x = test::random_inputs(dt, l.rows * l.cols, 0, -1, 1, false);
  const Values got = run_device(dt, l, x, o), ref = run_reference(dt, l, x, o);
  std::cout << "[newton_schulz] " << what << ": relative L2 error " << test::rel_l2(got, ref) << '\n';
  EXPECT_TRUE(test::matches_reference(got, ref, tolerance(dt)));
}

TEST(NewtonSchulzCuda, MatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (const Layout& l : {Layout{64, 128, 0, false}, Layout{128, 64, 0, false}, Layout{256, 1024, 0, false},
                            Layout{1024, 256, 0, false}, Layout{512, 512, 0, false}}) {
      check(dt, l);
    }
  }
}

TEST(NewtonSchulzCuda, OddTinyAndPaddedShapes) {
  TS_REQUIRE_GPU();
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    for (const Layout& l : {Layout{1, 1, 0, false}, Layout{1, 9, 0, false}, Layout{9, 1, 0, false},
                            Layout{3, 7, 0, false}, Layout{33, 65, 0, false}, Layout{65, 33, 3, false},
                            Layout{100, 300, 5, true}}) {
      check(dt, l);
    }
  }
}

TEST(NewtonSchulzCuda, StepsAndCoefficients) {
  TS_REQUIRE_GPU();
  for (int steps : {0, 1, 3}) {
    NewtonSchulzOptions o;
    o.steps = steps;
    check(DType::kFloat32, {96, 160, 0, false}, o);
  }
  NewtonSchulzOptions o;
  o.steps = 2;
  o.per_step = {{{3.0, -3.2, 1.2}}, {{2.0, -1.5, 0.5}}};
  check(DType::kBFloat16, {96, 160, 0, false}, o);
}

TEST(NewtonSchulzCuda, NanPropagatesAndResultsAreBitIdentical) {
  TS_REQUIRE_GPU();
  const Layout l{48, 80, 0, false};
  Values x = test::random_inputs(DType::kBFloat16, l.rows * l.cols, 0, -1, 1, false);
  const Values a = run_device(DType::kBFloat16, l, x, {}), b = run_device(DType::kBFloat16, l, x, {});
  EXPECT_EQ(a, b);
  x[5] = std::nan("");
  for (double v : run_device(DType::kBFloat16, l, x, {})) EXPECT_TRUE(std::isnan(v));
}

// A batch [N, R, C] (rows of one padded stride) through one call: each matrix the bits of a
// call on it alone, and the fp64 reference's values.
TEST(NewtonSchulzCuda, BatchEqualsOneCallPerMatrix) {
  TS_REQUIRE_GPU();
  struct Case {
    std::int64_t count;
    Layout l;
  };
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    for (const Case& k : {Case{4, {48, 80, 0, false}}, Case{3, {80, 48, 0, false}}, Case{5, {33, 65, 3, false}},
                          Case{2, {1, 9, 0, false}}, Case{3, {9, 1, 1, false}}, Case{33, {16, 24, 0, false}}}) {
      const Layout& l = k.l;
      SCOPED_TRACE(test::describe(dt, l) + " x " + std::to_string(k.count));
      const Layout all{k.count * l.rows, l.cols, l.pad, false};
      const Values x = test::random_inputs(dt, all.rows * l.cols, 0, -1, 1, false);
      StridedDeviceBuffer d_g(dt, all, &x), d_out(dt, all);
      const auto batch = [&](const StridedDeviceBuffer& b) {
        TensorView v = b.view();
        v.ndim = 3;
        v.shape = {k.count, l.rows, l.cols};
        v.strides = {l.rows * (l.cols + l.pad), l.cols + l.pad, 1};
        return v;
      };
      const std::size_t bytes = newton_schulz_workspace_bytes(batch(d_g));
      DeviceTensor ws(HostTensor(DType::kInt64, {static_cast<std::int64_t>(bytes / 8 + 1)}), false);
      ws.poison();
      newton_schulz(batch(d_g), batch(d_out), {}, ws.view());
      EXPECT_TRUE(d_out.padding_untouched());
      const Values got = d_out.values();
      const std::int64_t n_elems = l.rows * l.cols;
      for (std::int64_t n = 0; n < k.count; ++n) {
        const Values one(x.begin() + n * n_elems, x.begin() + (n + 1) * n_elems);
        const Values want = run_device(dt, l, one, {}), ref = run_reference(dt, l, one, {});
        EXPECT_TRUE(std::equal(want.begin(), want.end(), got.begin() + n * n_elems)) << "matrix " << n;
        EXPECT_TRUE(test::matches_reference(want, ref, tolerance(dt))) << "matrix " << n;
      }
    }
  }
}

// `count` matrices [l.rows, l.cols] (one call; a batch when count > 1) through newton_schulz_cuda
// with gram_split k.
Values run_split(DType dt, std::int64_t count, const Layout& l, const Values& x, int k,
                 const NewtonSchulzOptions& o = {}) {
  const Layout all{count * l.rows, l.cols, l.pad, false};
  StridedDeviceBuffer d_g(dt, all, &x), d_out(dt, all);
  const auto batch = [&](const StridedDeviceBuffer& b) {
    TensorView v = b.view();
    if (count > 1) {
      v.ndim = 3;
      v.shape = {count, l.rows, l.cols};
      v.strides = {l.rows * (l.cols + l.pad), l.cols + l.pad, 1};
    }
    return v;
  };
  const std::size_t bytes = newton_schulz_workspace_bytes(batch(d_g));
  DeviceTensor ws(HostTensor(DType::kInt64, {static_cast<std::int64_t>(bytes / 8 + 1)}), false);
  ws.poison();
  ops::newton_schulz::newton_schulz_cuda(batch(d_g), batch(d_out), o, ws.view(), nullptr, k);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(d_out.padding_untouched());
  return d_out.values();
}

// gram_split k for `count` matrices of l, in one call.
struct SplitCase {
  int k;
  std::int64_t count;
  Layout l;
};

// c through newton_schulz_cuda with options o against the fp64 reference, and for a batch each
// matrix's bits against a call on it alone.
void check_split(DType dt, const SplitCase& c, const NewtonSchulzOptions& o, const char* label) {
  const Layout& l = c.l;
  const Values x = test::random_inputs(dt, c.count * l.rows * l.cols, 0, -1, 1, false);
  const Values got = run_split(dt, c.count, l, x, c.k, o);
  const std::int64_t n_elems = l.rows * l.cols;
  for (std::int64_t n = 0; n < c.count; ++n) {
    const Values one(x.begin() + n * n_elems, x.begin() + (n + 1) * n_elems);
    const Values ref = run_reference(dt, l, one, o);
    const Values mine(got.begin() + n * n_elems, got.begin() + (n + 1) * n_elems);
    std::cout << "[newton_schulz " << label << "] matrix " << n << ": relative L2 error " << test::rel_l2(mine, ref)
              << '\n';
    EXPECT_TRUE(test::matches_reference(mine, ref, tolerance(dt))) << "matrix " << n;
    if (c.count > 1) {
      EXPECT_EQ(run_split(dt, 1, l, one, c.k, o), mine) << "matrix " << n;
    }
  }
}

// The Gram products by blocks (only the lower block triangle computed, then mirrored) and by
// the tile triangle in one launch (bf16), forced at sizes whose fp64 reference is cheap
// (newton_schulz takes the blocks only from p = 4096, gram_blocks): against the reference,
// wide and tall, and a batch (blocks: a call per block over the matrices; the triangle: the
// GEMM's batch mode) bit-identical to one call per matrix.
TEST(NewtonSchulzCuda, BlockedGramProductsMatchReferenceAndBatchBits) {
  TS_REQUIRE_GPU();
  using ops::newton_schulz::kGramTriangle;
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    for (const SplitCase& c :
         {SplitCase{2, 1, {64, 96, 0, false}}, SplitCase{4, 1, {256, 384, 0, false}},
          SplitCase{4, 1, {384, 256, 3, false}}, SplitCase{2, 1, {192, 192, 0, false}},
          SplitCase{4, 3, {128, 160, 0, false}}, SplitCase{2, 2, {160, 64, 0, false}},
          SplitCase{kGramTriangle, 1, {256, 384, 0, false}}, SplitCase{kGramTriangle, 1, {520, 512, 0, false}},
          SplitCase{kGramTriangle, 3, {256, 264, 0, false}}, SplitCase{kGramTriangle, 2, {512, 768, 0, false}}}) {
      const Layout& l = c.l;
      if (c.k == kGramTriangle) {
        int major = 0, minor = 0;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
        if (dt != DType::kBFloat16 || major != 9 || minor != 0) continue;  // Hopper's bf16 kernel
        // Else newton_schulz_cuda would fall back to the blocks, and this case test them again.
        ASSERT_TRUE(ops::newton_schulz::gram_triangle_applies(dt, std::min(l.rows, l.cols), std::max(l.rows, l.cols)))
            << "the tile triangle needs a build with CUTLASS and sm_90a";
      }
      SCOPED_TRACE(test::describe(dt, l) + " x " + std::to_string(c.count) + " blocks " + std::to_string(c.k));
      check_split(dt, c, {}, "blocked");
    }
  }
}

// NewtonSchulzMethod::kGram (the steps on [p, p] matrices, restarted after the second): against
// the fp64 reference of the standard iteration (equal in exact arithmetic) in every dtype, wide
// and tall, 1 to 5 steps (one phase, the restart, a phase of three), the products dense, by
// blocks and (bf16 on Hopper) by the tile triangle; a batch bit-identical to one call per
// matrix; a spectrum spread over about 500x; and where q < 3 p the standard steps' bits.
TEST(NewtonSchulzCuda, GramMethodMatchesReferenceAndBatchBits) {
  TS_REQUIRE_GPU();
  using ops::newton_schulz::kGramTriangle;
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (SplitCase c : {SplitCase{1, 1, {64, 200, 0, false}}, SplitCase{1, 1, {200, 64, 3, false}},
                        SplitCase{2, 1, {128, 384, 0, false}}, SplitCase{4, 3, {128, 512, 0, false}},
                        SplitCase{1, 2, {96, 300, 5, false}}, SplitCase{kGramTriangle, 2, {256, 768, 0, false}}}) {
      if (c.k == kGramTriangle &&
          !ops::newton_schulz::gram_triangle_applies(dt, std::min(c.l.rows, c.l.cols), std::max(c.l.rows, c.l.cols))) {
        c.k = 2;
      }
      for (int steps : {5, 1, 2, 3}) {
        SCOPED_TRACE(test::describe(dt, c.l) + " x " + std::to_string(c.count) + " blocks " + std::to_string(c.k) +
                     " steps " + std::to_string(steps));
        check_split(dt, c, {.steps = steps, .method = NewtonSchulzMethod::kGram}, "gram");
      }
    }
  }
  // Singular values spread over about 500x (row k of a random matrix scaled by exp(-6 k / rows);
  // a gradient's spectrum is far from flat), where rounding drifts the Gram iterates most: both
  // methods within the tolerance.
  const Layout wide{128, 448, 0, false};
  Values spread = test::random_values(wide.rows * wide.cols);
  for (std::int64_t r = 0; r < wide.rows; ++r) {
    const double scale = std::exp(-6.0 * static_cast<double>(r) / static_cast<double>(wide.rows));
    for (std::int64_t c = 0; c < wide.cols; ++c) spread[r * wide.cols + c] *= scale;
  }
  for (double& e : spread) e = detail::round_to(DType::kBFloat16, e);
  const Values want = run_reference(DType::kBFloat16, wide, spread, {});
  for (NewtonSchulzMethod method : {NewtonSchulzMethod::kStandard, NewtonSchulzMethod::kGram}) {
    const Values got = run_split(DType::kBFloat16, 1, wide, spread, 1, {.method = method});
    std::cout << "[newton_schulz spread spectrum] method " << static_cast<int>(method) << ": relative L2 error "
              << test::rel_l2(got, want) << '\n';
    EXPECT_TRUE(test::matches_reference(got, want, tolerance(DType::kBFloat16))) << static_cast<int>(method);
  }
  // q < 3 p: the standard steps.
  const Layout square{96, 160, 0, false};
  const Values x = test::random_inputs(DType::kBFloat16, square.rows * square.cols, 0, -1, 1, false);
  EXPECT_EQ(run_split(DType::kBFloat16, 1, square, x, 1, {.method = NewtonSchulzMethod::kGram}),
            run_split(DType::kBFloat16, 1, square, x, 1));
}

TEST(NewtonSchulzCuda, WorkspaceErrors) {
  TS_REQUIRE_GPU();
  const Layout l{32, 64, 0, false};
  StridedDeviceBuffer d_g(DType::kBFloat16, l), d_out(DType::kBFloat16, l);
  TS_EXPECT_ERROR(newton_schulz(d_g.view(), d_out.view()), "newton_schulz", "workspace",
                  "newton_schulz_workspace_bytes");
  const std::size_t bytes = newton_schulz_workspace_bytes(d_g.view());
  DeviceTensor ws(HostTensor(DType::kInt64, {static_cast<std::int64_t>(bytes / 8)}), false);
  TensorView short_ws = ws.view();
  short_ws.shape[0] -= 1;
  const std::string need = std::to_string(bytes);
  TS_EXPECT_ERROR(newton_schulz(d_g.view(), d_out.view(), {}, short_ws), "newton_schulz", "workspace", need.c_str());
}

}  // namespace
}  // namespace trainscale
