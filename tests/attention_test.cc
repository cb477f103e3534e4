#include "trainscale/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/host_dtype.h"
#include "util/gpu_util.h"

namespace trainscale {
namespace {

using test::HostTensor;

constexpr DType kFloatTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                                 DType::kFloat64};
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Shape {
  std::int64_t batch, q_len, kv_len, q_heads, kv_heads, head_dim;
};

struct Inputs {
  HostTensor q, k, v;
};

Inputs random_inputs(DType dtype, const Shape& s, std::int64_t row_pad = 0) {
  return {HostTensor::random(dtype, {s.batch, s.q_len, s.q_heads, s.head_dim}, -1, 1, row_pad),
          HostTensor::random(dtype, {s.batch, s.kv_len, s.kv_heads, s.head_dim}, -1, 1, row_pad),
          HostTensor::random(dtype, {s.batch, s.kv_len, s.kv_heads, s.head_dim}, -1, 1, row_pad)};
}

// The same values in another dtype (float64 to see what the rounded inputs stand for).
HostTensor converted(const HostTensor& t, DType dtype) {
  return HostTensor::from_values(dtype, t.shape(), t.values());
}

struct Forward {
  HostTensor out, lse;
};

Forward forward(const Inputs& in, const AttentionOptions& options = {},
                DType lse_dtype = DType::kFloat32) {
  const auto& qs = in.q.shape();
  Forward f{HostTensor(in.q.dtype(), qs), HostTensor(lse_dtype, {qs[0], qs[2], qs[1]})};
  attention_forward(in.q.view(), in.k.view(), in.v.view(), f.out.view(), f.lse.view(), options);
  return f;
}

struct Grads {
  HostTensor dq, dk, dv;
};

Grads backward(const Inputs& in, const Forward& f, const HostTensor& dout,
               const AttentionOptions& options = {}) {
  Grads g{HostTensor(in.q.dtype(), in.q.shape()), HostTensor(in.k.dtype(), in.k.shape()),
          HostTensor(in.v.dtype(), in.v.shape())};
  attention_backward({.dout = dout.view(), .q = in.q.view(), .k = in.k.view(), .v = in.v.view(),
                      .out = f.out.view(), .lse = f.lse.view(), .dq = g.dq.view(),
                      .dk = g.dk.view(), .dv = g.dv.view()}, options);
  return g;
}

// Row-major logical values of any view.
std::vector<double> logical_values(const TensorView& t) {
  std::vector<double> values(t.numel());
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    std::int64_t offset = 0, rest = i;
    for (int d = t.ndim - 1; d >= 0; --d) {
      offset += rest % t.shape[d] * t.strides[d];
      rest /= t.shape[d];
    }
    values[i] = detail::load_as_double(t.dtype, t.data, offset);
  }
  return values;
}

// View of `t` restricted to [begin, begin + length) along dim `dim`.
TensorView narrow(TensorView t, int dim, std::int64_t begin, std::int64_t length) {
  t.data = static_cast<char*>(t.data) +
           begin * t.strides[dim] * static_cast<std::int64_t>(t.element_size());
  t.shape[dim] = length;
  return t;
}

double scale_of(const AttentionOptions& options, std::int64_t head_dim) {
  return options.scale != 0 ? options.scale : 1 / std::sqrt(static_cast<double>(head_dim));
}

TEST(Attention, OneKeyReturnsItsValueEveryDtype) {
  const Shape s{2, 5, 1, 6, 3, 7};
  const std::int64_t group = s.q_heads / s.kv_heads;
  const double scale = 1 / std::sqrt(static_cast<double>(s.head_dim));
  for (DType dt : kFloatTypes) {
    for (bool causal : {false, true}) {
      auto in = random_inputs(dt, s);
      auto f = forward(in, {.causal = causal});
      std::vector<double> want_out(in.q.numel()), want_lse(f.lse.numel());
      const auto q = in.q.values(), k = in.k.values(), v = in.v.values();
      for (std::int64_t b = 0; b < s.batch; ++b) {
        for (std::int64_t i = 0; i < s.q_len; ++i) {
          for (std::int64_t h = 0; h < s.q_heads; ++h) {
            const std::int64_t kv = (b * s.kv_heads + h / group) * s.head_dim;
            const std::int64_t row = ((b * s.q_len + i) * s.q_heads + h) * s.head_dim;
            const bool sees_key = !causal || i == s.q_len - 1;  // bottom-right: only the last
            double score = 0;
            for (std::int64_t d = 0; d < s.head_dim; ++d) {
              want_out[row + d] = sees_key ? v[kv + d] : 0.0;
              score += q[row + d] * k[kv + d];
            }
            want_lse[(b * s.q_heads + h) * s.q_len + i] = sees_key ? score * scale : -kInf;
          }
        }
      }
      EXPECT_TRUE(test::matches_reference(f.out.values(), want_out, test::tolerance(dt)))
          << dtype_name(dt) << " causal " << causal;
      EXPECT_TRUE(test::matches_reference(f.lse.values(), want_lse, 1e-6)) << dtype_name(dt);
    }
  }
}

TEST(Attention, IdenticalKeysAverageTheValuesEveryDtype) {
  const Shape s{2, 3, 9, 4, 2, 5};
  const std::int64_t group = s.q_heads / s.kv_heads;
  const double scale = 1 / std::sqrt(static_cast<double>(s.head_dim));
  const auto kv_len = static_cast<double>(s.kv_len);
  for (DType dt : kFloatTypes) {
    auto in = random_inputs(dt, s);
    // Every key of a (batch, kv head) equals its first: all scores of a query tie.
    for (std::int64_t i = 0; i < in.k.numel(); ++i) {
      const std::int64_t d = i % s.head_dim, h = i / s.head_dim % s.kv_heads;
      const std::int64_t b = i / (s.head_dim * s.kv_heads * s.kv_len);
      in.k.set(i, in.k.at((b * s.kv_len * s.kv_heads + h) * s.head_dim + d));
    }
    auto f = forward(in);
    const auto q = in.q.values(), k = in.k.values(), v = in.v.values();
    std::vector<double> want_out(in.q.numel(), 0.0), want_lse(f.lse.numel());
    for (std::int64_t b = 0; b < s.batch; ++b) {
      for (std::int64_t i = 0; i < s.q_len; ++i) {
        for (std::int64_t h = 0; h < s.q_heads; ++h) {
          const std::int64_t row = ((b * s.q_len + i) * s.q_heads + h) * s.head_dim;
          double score = 0;
          for (std::int64_t d = 0; d < s.head_dim; ++d) {
            score += q[row + d] * k[(b * s.kv_len * s.kv_heads + h / group) * s.head_dim + d];
            for (std::int64_t j = 0; j < s.kv_len; ++j) {
              want_out[row + d] +=
                  v[((b * s.kv_len + j) * s.kv_heads + h / group) * s.head_dim + d] / kv_len;
            }
          }
          want_lse[(b * s.q_heads + h) * s.q_len + i] = score * scale + std::log(kv_len);
        }
      }
    }
    EXPECT_TRUE(test::matches_reference(f.out.values(), want_out, test::tolerance(dt)))
        << dtype_name(dt);
    EXPECT_TRUE(test::matches_reference(f.lse.values(), want_lse, 1e-6)) << dtype_name(dt);
  }
}

// Causal attention of query i equals plain attention over the keys it may see, run on views
// of the same memory; a query that sees none gives 0 and lse = -inf.
void expect_causal_equals_prefix_attention(const Shape& s) {
  SCOPED_TRACE(testing::Message() << "Sq " << s.q_len << " Sk " << s.kv_len);
  auto in = random_inputs(DType::kFloat64, s);
  auto causal = forward(in, {.causal = true}, DType::kFloat64);
  HostTensor out(DType::kFloat64, in.q.shape());
  HostTensor lse(DType::kFloat64, {s.batch, s.q_heads, s.q_len});
  for (std::int64_t i = 0; i < s.q_len; ++i) {
    const std::int64_t keys = std::clamp<std::int64_t>(i + s.kv_len - s.q_len + 1, 0, s.kv_len);
    const TensorView q_i = narrow(in.q.view(), 1, i, 1), out_i = narrow(out.view(), 1, i, 1);
    const TensorView lse_i = narrow(lse.view(), 2, i, 1);
    HostTensor lse_prefix(DType::kFloat64, {s.batch, s.q_heads, 1});
    attention_forward(q_i, narrow(in.k.view(), 1, 0, keys), narrow(in.v.view(), 1, 0, keys), out_i,
                      lse_prefix.view());
    for (std::int64_t bh = 0; bh < s.batch * s.q_heads; ++bh) {
      detail::store_from_double(DType::kFloat64, lse_i.data, bh * s.q_len, lse_prefix.at(bh));
    }
    if (keys == 0) {
      for (double x : logical_values(out_i)) EXPECT_EQ(x, 0.0);
      for (double x : lse_prefix.values()) EXPECT_EQ(x, -kInf);
    }
  }
  EXPECT_TRUE(test::matches_reference(causal.out.values(), out.values(), 1e-14));
  EXPECT_TRUE(test::matches_reference(causal.lse.values(), lse.values(), 1e-14));
}

TEST(Attention, CausalSquareEqualsPrefixAttention) {
  expect_causal_equals_prefix_attention({2, 7, 7, 4, 2, 5});
}

TEST(Attention, CausalAlignsBottomRight) {
  expect_causal_equals_prefix_attention({2, 3, 8, 2, 1, 4});   // Sq < Sk: the last query sees all
  expect_causal_equals_prefix_attention({1, 9, 4, 3, 3, 6});   // Sq > Sk: first rows see none
  expect_causal_equals_prefix_attention({1, 1, 11, 2, 2, 3});  // one query: sees every key
}

// A [B, S, Hkv, D] tensor with every kv head repeated `group` times, as MHA would see it.
HostTensor repeat_heads(const HostTensor& t, std::int64_t group) {
  auto shape = t.shape();
  const std::int64_t kv_heads = shape[2], D = shape[3];
  shape[2] *= group;
  HostTensor r(t.dtype(), shape);
  for (std::int64_t i = 0; i < r.numel(); ++i) {
    const std::int64_t d = i % D, h = i / D % shape[2], bs = i / D / shape[2];
    r.set(i, t.at((bs * kv_heads + h / group) * D + d));
  }
  return r;
}

// Sums the gradient of every repeated head back onto its kv head.
std::vector<double> sum_repeated_heads(const HostTensor& grad, std::int64_t group) {
  const auto& shape = grad.shape();
  const std::int64_t q_heads = shape[2], D = shape[3];
  std::vector<double> sum(grad.numel() / group, 0.0);
  for (std::int64_t i = 0; i < grad.numel(); ++i) {
    const std::int64_t d = i % D, h = i / D % q_heads, bs = i / D / q_heads;
    sum[(bs * (q_heads / group) + h / group) * D + d] += grad.at(i);
  }
  return sum;
}

TEST(Attention, GroupedQueryEqualsRepeatedKvHeads) {
  for (std::int64_t kv_heads : {1, 2, 3}) {
    const Shape s{2, 5, 6, 6, kv_heads, 4};
    const std::int64_t group = s.q_heads / kv_heads;
    for (bool causal : {false, true}) {
      const AttentionOptions options{.causal = causal};
      auto gqa = random_inputs(DType::kFloat64, s);
      Inputs mha{gqa.q, repeat_heads(gqa.k, group), repeat_heads(gqa.v, group)};
      auto f_gqa = forward(gqa, options, DType::kFloat64),
           f_mha = forward(mha, options, DType::kFloat64);
      EXPECT_TRUE(test::matches_reference(f_gqa.out.values(), f_mha.out.values(), 1e-14));
      EXPECT_TRUE(test::matches_reference(f_gqa.lse.values(), f_mha.lse.values(), 1e-14));
      auto dout = HostTensor::random(DType::kFloat64, gqa.q.shape());
      auto g_gqa = backward(gqa, f_gqa, dout, options), g_mha = backward(mha, f_mha, dout, options);
      EXPECT_TRUE(test::matches_reference(g_gqa.dq.values(), g_mha.dq.values(), 1e-13));
      EXPECT_TRUE(
          test::matches_reference(g_gqa.dk.values(), sum_repeated_heads(g_mha.dk, group), 1e-13));
      EXPECT_TRUE(
          test::matches_reference(g_gqa.dv.values(), sum_repeated_heads(g_mha.dv, group), 1e-13));
    }
  }
}

TEST(Attention, LseIsLogSumExpOfScaledScores) {
  const Shape s{1, 4, 6, 2, 1, 3};
  auto in = random_inputs(DType::kFloat64, s);
  for (double scale : {0.0, 0.37, -1.5}) {
    const AttentionOptions options{.causal = true, .scale = scale};
    auto f = forward(in, options);
    const auto q = in.q.values(), k = in.k.values();
    std::vector<double> want(f.lse.numel());
    for (std::int64_t h = 0; h < s.q_heads; ++h) {
      for (std::int64_t i = 0; i < s.q_len; ++i) {
        double sum = 0;
        for (std::int64_t j = 0; j <= i + s.kv_len - s.q_len; ++j) {
          double score = 0;
          for (std::int64_t d = 0; d < s.head_dim; ++d) {
            score += q[(i * s.q_heads + h) * s.head_dim + d] * k[j * s.head_dim + d];
          }
          sum += std::exp(score * scale_of(options, s.head_dim));
        }
        want[h * s.q_len + i] = std::log(sum);
      }
    }
    EXPECT_TRUE(test::matches_reference(f.lse.values(), want, test::tolerance(DType::kFloat32)))
        << "scale " << scale;
  }
}

// Each dtype's result is the fp64 result on the same (rounded) inputs, rounded once.
TEST(Attention, EveryDtypeMatchesFloat64OnItsInputs) {
  const Shape s{2, 7, 9, 4, 2, 8};
  for (DType dt : kFloatTypes) {
    for (bool causal : {false, true}) {
      const AttentionOptions options{.causal = causal};
      auto in = random_inputs(dt, s, /*row_pad=*/3);
      auto f = forward(in, options);
      auto dout = HostTensor::random(dt, in.q.shape(), -1, 1, 1);
      auto g = backward(in, f, dout, options);
      Inputs in64{converted(in.q, DType::kFloat64), converted(in.k, DType::kFloat64),
                  converted(in.v, DType::kFloat64)};
      auto f64 = forward(in64, options, DType::kFloat64);
      // The backward's reference reads the out and lse this dtype's forward stored.
      Forward stored{converted(f.out, DType::kFloat64), converted(f.lse, DType::kFloat64)};
      auto g64 = backward(in64, stored, converted(dout, DType::kFloat64), options);
      SCOPED_TRACE(testing::Message() << dtype_name(dt) << " causal " << causal);
      const double tol = test::tolerance(dt);
      EXPECT_TRUE(test::matches_reference(f.out.values(), f64.out.values(), tol));
      EXPECT_TRUE(test::matches_reference(f.lse.values(), f64.lse.values(), 1e-7));
      EXPECT_TRUE(test::matches_reference(g.dq.values(), g64.dq.values(), tol));
      EXPECT_TRUE(test::matches_reference(g.dk.values(), g64.dk.values(), tol));
      EXPECT_TRUE(test::matches_reference(g.dv.values(), g64.dv.values(), tol));
    }
  }
}

struct GradCase {
  const char* name;
  Shape shape;
  AttentionOptions options;
};

class AttentionGrad : public ::testing::TestWithParam<GradCase> {};

TEST_P(AttentionGrad, BackwardMatchesFiniteDifferences) {
  const auto& [name, s, options] = GetParam();
  auto in = random_inputs(DType::kFloat64, s);
  const auto w = test::random_values(in.q.numel());
  auto loss = [&](const std::vector<double>& q, const std::vector<double>& k,
                  const std::vector<double>& v) {
    Inputs x{HostTensor::from_values(DType::kFloat64, in.q.shape(), q),
             HostTensor::from_values(DType::kFloat64, in.k.shape(), k),
             HostTensor::from_values(DType::kFloat64, in.v.shape(), v)};
    return test::dot(w, forward(x, options, DType::kFloat64).out.values());
  };
  const auto q = in.q.values(), k = in.k.values(), v = in.v.values();
  auto f = forward(in, options, DType::kFloat64);
  auto g = backward(in, f, HostTensor::from_values(DType::kFloat64, in.q.shape(), w), options);
  const double tol = 1e-7;
  EXPECT_TRUE(test::matches_reference(
      g.dq.values(), test::numeric_gradient(q, [&](const auto& x) { return loss(x, k, v); }), tol));
  EXPECT_TRUE(test::matches_reference(
      g.dk.values(), test::numeric_gradient(k, [&](const auto& x) { return loss(q, x, v); }), tol));
  EXPECT_TRUE(test::matches_reference(
      g.dv.values(), test::numeric_gradient(v, [&](const auto& x) { return loss(q, k, x); }), tol));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionGrad,
    ::testing::Values(
        GradCase{"Mha", {2, 3, 4, 2, 2, 3}, {}},
        GradCase{"GqaCausalShortQueries", {1, 4, 6, 4, 2, 3}, {.causal = true}},
        GradCase{"CausalRowsSeeingNoKey", {2, 5, 3, 3, 1, 2}, {.causal = true, .scale = 0.7}},
        GradCase{"MqaCausalSquare", {1, 5, 5, 2, 1, 5}, {.causal = true}},
        GradCase{"Window", {1, 6, 7, 2, 1, 3}, {.window_left = 2, .window_right = 1}},
        GradCase{"CausalWindowSoftcap", {2, 5, 5, 2, 2, 4}, {.causal = true, .window_left = 1, .softcap = 0.5}},
        GradCase{"Softcap", {1, 3, 4, 2, 1, 3}, {.scale = 2.0, .softcap = 1.5}}),
    [](const auto& param_info) { return std::string(param_info.param.name); });

// A [B, H, S, D] buffer seen as [B, S, H, D]: the layout of a transposed projection.
struct BhsdTensor {
  HostTensor storage;  // [B, H, S, D]
  TensorView view;     // [B, S, H, D]
};

BhsdTensor to_bhsd(const HostTensor& bshd, bool copy_values = true) {
  const auto& s = bshd.shape();  // B, S, H, D
  BhsdTensor t{HostTensor(bshd.dtype(), {s[0], s[2], s[1], s[3]}), {}};
  t.view = TensorView(t.storage.data(), bshd.dtype(), {s[0], s[1], s[2], s[3]},
                      {s[2] * s[1] * s[3], s[3], s[1] * s[3], 1});
  for (std::int64_t i = 0; copy_values && i < bshd.numel(); ++i) {
    const std::int64_t d = i % s[3], h = i / s[3] % s[2], q = i / s[3] / s[2] % s[1],
                       b = i / (s[3] * s[2] * s[1]);
    t.storage.set(((b * s[2] + h) * s[1] + q) * s[3] + d, bshd.at(i));
  }
  return t;
}

TEST(Attention, BhsdStridedTensorsEqualContiguousOnes) {
  const Shape s{2, 5, 7, 4, 2, 6};
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    const AttentionOptions options{.causal = true};
    auto in = random_inputs(dt, s);
    auto f = forward(in, options);
    auto dout = HostTensor::random(dt, in.q.shape());
    auto g = backward(in, f, dout, options);
    auto q = to_bhsd(in.q), k = to_bhsd(in.k), v = to_bhsd(in.v), dout_t = to_bhsd(dout);
    auto out = to_bhsd(f.out, false), dq = to_bhsd(g.dq, false), dk = to_bhsd(g.dk, false),
         dv = to_bhsd(g.dv, false);
    HostTensor lse(DType::kFloat32, f.lse.shape());
    attention_forward(q.view, k.view, v.view, out.view, lse.view(), options);
    attention_backward({.dout = dout_t.view, .q = q.view, .k = k.view, .v = v.view,
                        .out = out.view, .lse = lse.view(), .dq = dq.view, .dk = dk.view,
                        .dv = dv.view}, options);
    EXPECT_EQ(logical_values(out.view), f.out.values()) << dtype_name(dt);
    EXPECT_EQ(lse.values(), f.lse.values());
    EXPECT_EQ(logical_values(dq.view), g.dq.values());
    EXPECT_EQ(logical_values(dk.view), g.dk.values());
    EXPECT_EQ(logical_values(dv.view), g.dv.values());
  }
}

TEST(Attention, LseIsOptionalInTheForward) {
  auto in = random_inputs(DType::kFloat16, {1, 3, 4, 2, 2, 8});
  auto f = forward(in);
  HostTensor out(DType::kFloat16, in.q.shape());
  attention_forward(in.q.view(), in.k.view(), in.v.view(), out.view(), TensorView{});
  EXPECT_EQ(out.values(), f.out.values());
}

TEST(Attention, EmptyTensors) {
  for (const Shape& s : {Shape{0, 3, 4, 2, 1, 4}, Shape{2, 0, 4, 2, 1, 4}, Shape{2, 3, 4, 0, 1, 4},
                         Shape{2, 3, 0, 2, 1, 4}}) {
    for (bool causal : {false, true}) {
      auto in = random_inputs(DType::kFloat32, s);
      auto f = forward(in, {.causal = causal});
      for (double x : f.out.values()) EXPECT_EQ(x, 0.0);  // no key seen (Sk == 0)
      for (double x : f.lse.values()) EXPECT_EQ(x, -kInf);
      auto g =
          backward(in, f, HostTensor::random(DType::kFloat32, in.q.shape()), {.causal = causal});
      for (const auto* grad : {&g.dq, &g.dk, &g.dv}) {
        for (double x : grad->values()) EXPECT_EQ(x, 0.0);  // no query (Sq == 0) or no key
      }
    }
  }
}

TEST(Attention, NaNPropagates) {
  const Shape s{1, 3, 4, 2, 1, 5};
  auto in = random_inputs(DType::kFloat32, s);
  in.q.set(((0 * s.q_len + 1) * s.q_heads + 1) * s.head_dim + 2, NAN);  // query (i 1, h 1)
  auto f = forward(in);
  for (std::int64_t i = 0; i < in.q.numel(); ++i) {
    const bool poisoned_row = i / s.head_dim == 1 * s.q_heads + 1;
    EXPECT_EQ(std::isnan(f.out.at(i)), poisoned_row) << i;
  }
  for (std::int64_t i = 0; i < f.lse.numel(); ++i)
    EXPECT_EQ(std::isnan(f.lse.at(i)), i == 1 * s.q_len + 1);
  // A NaN value element poisons its column of every output: every query sees that key.
  auto clean = random_inputs(DType::kFloat32, s);
  clean.v.set(7, NAN);
  auto fv = forward(clean);
  auto dout = HostTensor::random(DType::kFloat32, clean.q.shape());
  auto g = backward(clean, fv, dout);
  for (std::int64_t i = 0; i < clean.q.numel(); ++i)
    EXPECT_EQ(std::isnan(fv.out.at(i)), i % s.head_dim == 2);
  for (double x : g.dq.values()) EXPECT_TRUE(std::isnan(x));
  for (double x : g.dk.values()) EXPECT_TRUE(std::isnan(x));
}

// Attention evaluated straight from its definition, one (b, h, i, j) at a time, in fp64:
// the independent check of the blocked reference.
struct Direct {
  std::vector<double> out, lse, dq, dk, dv;
};

Direct direct_attention(const Inputs& in, const std::vector<double>& dout_values,
                        const AttentionOptions& options) {
  const auto& qs = in.q.shape();
  const std::int64_t B = qs[0], Sq = qs[1], Hq = qs[2], D = qs[3];
  const std::int64_t Sk = in.k.shape()[1], Hkv = in.k.shape()[2], group = Hq / Hkv;
  const double scale = scale_of(options, D);
  const auto q = in.q.values(), k = in.k.values(), v = in.v.values();
  auto q_at = [&](std::int64_t b, std::int64_t i, std::int64_t h) {
    return &q[((b * Sq + i) * Hq + h) * D];
  };
  auto kv_at = [&](std::int64_t b, std::int64_t j, std::int64_t h) {
    return ((b * Sk + j) * Hkv + h) * D;
  };
  auto dot = [&](const double* a, const double* c) {
    double sum = 0;
    for (std::int64_t d = 0; d < D; ++d) sum += a[d] * c[d];
    return sum;
  };
  Direct r{std::vector<double>(q.size(), 0.0), std::vector<double>(B * Hq * Sq, -kInf),
           std::vector<double>(q.size(), 0.0), std::vector<double>(k.size(), 0.0),
           std::vector<double>(v.size(), 0.0)};
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t kvh = h / group;
      for (std::int64_t i = 0; i < Sq; ++i) {
        // Query i sits at key position i + Sk - Sq; causal and the window bound j around it.
        const std::int64_t at = i + Sk - Sq;
        const std::int64_t right = options.causal ? 0 : options.window_right;
        std::vector<std::int64_t> keys;
        for (std::int64_t j = 0; j < Sk; ++j) {
          if ((options.window_left < 0 || j >= at - options.window_left) && (right < 0 || j <= at + right))
            keys.push_back(j);
        }
        if (keys.empty()) continue;
        const std::int64_t row = ((b * Sq + i) * Hq + h) * D;
        const std::size_t n = keys.size();
        std::vector<double> p(n), dp(n), slope(n, scale);
        double max_score = -kInf, sum = 0, p_dot_dp = 0;
        for (std::size_t t = 0; t < n; ++t) {
          p[t] = scale * dot(q_at(b, i, h), &k[kv_at(b, keys[t], kvh)]);
          if (options.softcap > 0) {
            const double th = std::tanh(p[t] / options.softcap);
            p[t] = options.softcap * th;
            slope[t] = scale * (1 - th * th);
          }
          max_score = std::max(max_score, p[t]);
        }
        for (std::size_t t = 0; t < n; ++t) sum += p[t] = std::exp(p[t] - max_score);
        r.lse[(b * Hq + h) * Sq + i] = max_score + std::log(sum);
        for (std::size_t t = 0; t < n; ++t) {
          const std::int64_t j = keys[t];
          p[t] /= sum;
          dp[t] = dot(&dout_values[row], &v[kv_at(b, j, kvh)]);
          p_dot_dp += p[t] * dp[t];
          for (std::int64_t d = 0; d < D; ++d) {
            r.out[row + d] += p[t] * v[kv_at(b, j, kvh) + d];
            r.dv[kv_at(b, j, kvh) + d] += p[t] * dout_values[row + d];
          }
        }
        for (std::size_t t = 0; t < n; ++t) {
          const std::int64_t j = keys[t];
          const double dscore = slope[t] * p[t] * (dp[t] - p_dot_dp);
          for (std::int64_t d = 0; d < D; ++d) {
            r.dq[row + d] += dscore * k[kv_at(b, j, kvh) + d];
            r.dk[kv_at(b, j, kvh) + d] += dscore * q[row + d];
          }
        }
      }
    }
  }
  return r;
}

// Shapes that span several of the reference's 64-row blocks with ragged tails, causal masks and
// windows cutting blocks at every offset, GQA groups and odd head dims.
TEST(Attention, BlockedReferenceMatchesDirectEvaluation) {
  const Shape shapes[] = {{1, 130, 130, 4, 2, 33}, {2, 67, 200, 3, 1, 5}, {1, 200, 67, 2, 2, 17},
                          {1, 1, 129, 2, 1, 8},    {2, 65, 64, 6, 3, 1},  {1, 129, 1, 1, 1, 64}};
  const AttentionOptions modes[] = {
      {},
      {.causal = true, .scale = 0.3},
      {.window_left = 70, .window_right = 3},             // a band crossing block edges
      {.causal = true, .window_left = 17},                // causal local attention
      {.window_left = 0, .window_right = 0},              // each query sees one key position
      {.window_left = 5},                                 // bounded on the left only
      {.causal = true, .scale = 0.9, .softcap = 2.0},     // softcap saturates the tanh
      {.window_left = 40, .window_right = 90, .softcap = 30.0}};
  for (const Shape& s : shapes) {
    for (const AttentionOptions& options : modes) {
      const bool causal = options.causal;
      auto in = random_inputs(DType::kFloat64, s, /*row_pad=*/s.head_dim % 2);
      auto f = forward(in, options, DType::kFloat64);
      auto dout = HostTensor::random(DType::kFloat64, in.q.shape());
      auto g = backward(in, f, dout, options);
      const Direct want = direct_attention(in, dout.values(), options);
      SCOPED_TRACE(testing::Message() << "B " << s.batch << " Sq " << s.q_len << " Sk " << s.kv_len
                                      << " Hq " << s.q_heads << " Hkv " << s.kv_heads << " D "
                                      << s.head_dim << " causal " << causal << " window "
                                      << options.window_left << "/" << options.window_right
                                      << " softcap " << options.softcap);
      EXPECT_TRUE(test::matches_reference(f.out.values(), want.out, 1e-13));
      EXPECT_TRUE(test::matches_reference(f.lse.values(), want.lse, 1e-13));
      EXPECT_TRUE(test::matches_reference(g.dq.values(), want.dq, 1e-13));
      EXPECT_TRUE(test::matches_reference(g.dk.values(), want.dk, 1e-13));
      EXPECT_TRUE(test::matches_reference(g.dv.values(), want.dv, 1e-13));
    }
  }
}

// --- variable-length (packed) sequences ----------------------------------------------------------

struct Packed {
  std::vector<std::int32_t> cu_q, cu_k;
  HostTensor cu_q_t, cu_k_t;
  Inputs in;  // q [Tq, Hq, D], k / v [Tk, Hkv, D]
  AttentionSequences sequences() const {
    std::int64_t max_q = 0, max_k = 0;
    for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
      max_q = std::max<std::int64_t>(max_q, cu_q[b + 1] - cu_q[b]);
      max_k = std::max<std::int64_t>(max_k, cu_k[b + 1] - cu_k[b]);
    }
    return {cu_q_t.view(), cu_k_t.view(), max_q, max_k};
  }
};

HostTensor offsets_tensor(const std::vector<std::int32_t>& offsets) {
  HostTensor t(DType::kInt32, {static_cast<std::int64_t>(offsets.size())});
  std::copy(offsets.begin(), offsets.end(), static_cast<std::int32_t*>(t.data()));
  return t;
}

Packed random_packed(DType dtype, const std::vector<std::int32_t>& q_lens, const std::vector<std::int32_t>& k_lens,
                     std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim) {
  Packed p;
  p.cu_q = {0};
  p.cu_k = {0};
  for (std::size_t b = 0; b < q_lens.size(); ++b) {
    p.cu_q.push_back(p.cu_q.back() + q_lens[b]);
    p.cu_k.push_back(p.cu_k.back() + k_lens[b]);
  }
  p.cu_q_t = offsets_tensor(p.cu_q);
  p.cu_k_t = offsets_tensor(p.cu_k);
  p.in = {HostTensor::random(dtype, {p.cu_q.back(), q_heads, head_dim}),
          HostTensor::random(dtype, {p.cu_k.back(), kv_heads, head_dim}),
          HostTensor::random(dtype, {p.cu_k.back(), kv_heads, head_dim})};
  return p;
}

// Rows [begin, end) of a packed [T, H, D] tensor as a dense [1, end - begin, H, D] one.
HostTensor sequence_copy(const HostTensor& packed, std::int64_t begin, std::int64_t end) {
  const auto& s = packed.shape();
  const std::int64_t row = s[1] * s[2];
  const auto values = packed.values();
  return HostTensor::from_values(packed.dtype(), {1, end - begin, s[1], s[2]},
                                 std::vector<double>(values.begin() + begin * row, values.begin() + end * row));
}

// Every sequence of a packed call equals attention_forward / attention_backward on that sequence
// alone (empty sequences, Sq != Sk, GQA, and each masking option included).
TEST(Attention, VarlenEqualsEachSequenceAlone) {
  const AttentionOptions modes[] = {{}, {.causal = true}, {.causal = true, .window_left = 3, .softcap = 2.0},
                                    {.window_left = 2, .window_right = 4}};
  for (const AttentionOptions& options : modes) {
    auto p = random_packed(DType::kFloat64, {5, 0, 70, 1, 3}, {7, 4, 66, 1, 0}, 4, 2, 6);
    const auto& in = p.in;
    HostTensor out(DType::kFloat64, in.q.shape()), lse(DType::kFloat64, {4, in.q.shape()[0]});
    out.fill_nan();
    lse.fill_nan();
    attention_varlen_forward(in.q.view(), in.k.view(), in.v.view(), p.sequences(), out.view(), lse.view(), options);
    auto dout = HostTensor::random(DType::kFloat64, in.q.shape());
    HostTensor dq(DType::kFloat64, in.q.shape()), dk(DType::kFloat64, in.k.shape()), dv(DType::kFloat64, in.v.shape());
    for (HostTensor* t : {&dq, &dk, &dv}) t->fill_nan();
    attention_varlen_backward({.dout = dout.view(), .q = in.q.view(), .k = in.k.view(), .v = in.v.view(),
                               .out = out.view(), .lse = lse.view(), .dq = dq.view(), .dk = dk.view(),
                               .dv = dv.view()},
                              p.sequences(), options);
    const std::int64_t tq = in.q.shape()[0];
    for (std::size_t b = 0; b + 1 < p.cu_q.size(); ++b) {
      SCOPED_TRACE(testing::Message() << "sequence " << b << " causal " << options.causal << " window "
                                      << options.window_left << "/" << options.window_right);
      const std::int64_t qb = p.cu_q[b], qe = p.cu_q[b + 1], kb = p.cu_k[b], ke = p.cu_k[b + 1];
      Inputs one{sequence_copy(in.q, qb, qe), sequence_copy(in.k, kb, ke), sequence_copy(in.v, kb, ke)};
      auto f = forward(one, options, DType::kFloat64);
      auto g = backward(one, f, sequence_copy(dout, qb, qe), options);
      EXPECT_EQ(sequence_copy(out, qb, qe).values(), f.out.values());
      for (std::int64_t h = 0; h < 4; ++h) {
        for (std::int64_t i = 0; i < qe - qb; ++i)
          EXPECT_EQ(lse.at(h * tq + qb + i), f.lse.at(h * (qe - qb) + i));
      }
      EXPECT_EQ(sequence_copy(dq, qb, qe).values(), g.dq.values());
      EXPECT_EQ(sequence_copy(dk, kb, ke).values(), g.dk.values());
      EXPECT_EQ(sequence_copy(dv, kb, ke).values(), g.dv.values());
    }
  }
}

TEST(Attention, VarlenArgumentErrors) {
  auto p = random_packed(DType::kFloat32, {3, 2}, {3, 4}, 2, 1, 8);
  const auto& in = p.in;
  HostTensor out(DType::kFloat32, in.q.shape()), lse(DType::kFloat32, {2, 5});
  auto fwd = [&](const AttentionSequences& s, TensorView q, TensorView lse_ = {}) {
    attention_varlen_forward(q, in.k.view(), in.v.view(), s, out.view(), lse_);
  };
  const char* op = "attention_varlen_forward";
  fwd(p.sequences(), in.q.view(), lse.view());  // valid
  auto with = [&](auto edit) {
    AttentionSequences s = p.sequences();
    edit(s);
    return s;
  };
  TS_EXPECT_ERROR(fwd(p.sequences(), test::HostTensor::random(DType::kFloat32, {1, 5, 2, 8}).view()), op, "'q'",
                  "3 dimensions");
  HostTensor lse_t(DType::kFloat32, {5, 2});
  TS_EXPECT_ERROR(fwd(p.sequences(), in.q.view(), lse_t.view()), op, "'lse'", "Hq of 'q'");
  TS_EXPECT_ERROR(fwd(with([](AttentionSequences& s) { s.cu_seqlens_q = {}; }), in.q.view()), op,
                  "'cu_seqlens_q'", "a tensor");
  HostTensor offsets64(DType::kInt64, {3});
  TS_EXPECT_ERROR(fwd(with([&](AttentionSequences& s) { s.cu_seqlens_k = offsets64.view(); }), in.q.view()), op,
                  "'cu_seqlens_k'", "int32", "int64");
  auto short_k = offsets_tensor({0, 7});
  TS_EXPECT_ERROR(fwd(with([&](AttentionSequences& s) { s.cu_seqlens_k = short_k.view(); }), in.q.view()), op,
                  "'cu_seqlens_k'", "B + 1 of 'cu_seqlens_q'");
  auto late_start = offsets_tensor({1, 3, 5});
  TS_EXPECT_ERROR(fwd(with([&](AttentionSequences& s) { s.cu_seqlens_q = late_start.view(); }), in.q.view()), op,
                  "'cu_seqlens_q'", "from 0 to the 5 tokens", "from 1 to 5");
  auto decreasing = offsets_tensor({0, 6, 5});
  TS_EXPECT_ERROR(fwd(with([&](AttentionSequences& s) {
                        s.cu_seqlens_q = decreasing.view();
                        s.max_seqlen_q = 6;
                      }),
                      in.q.view()),
                  op, "'cu_seqlens_q'", "non-decreasing", "6 then 5");
  TS_EXPECT_ERROR(fwd(with([](AttentionSequences& s) { s.max_seqlen_k = 3; }), in.q.view()), op, "'cu_seqlens_k'",
                  "no longer than max_seqlen_k = 3", "sequence 1 of 4");
  TS_EXPECT_ERROR(fwd(with([](AttentionSequences& s) { s.max_seqlen_q = -1; }), in.q.view()), op,
                  "'max_seqlen_q'", ">= 0");
  TS_EXPECT_ERROR(attention_varlen_forward(in.q.view(), in.k.view(), in.v.view(), p.sequences(), out.view(), {},
                                           {.causal = true, .window_right = 2}),
                  op, "'options.window_right'");
  auto on_cuda = [](TensorView t) {
    t.device = Device::cuda(0);
    return t;
  };
  AttentionSequences cuda_sequences = p.sequences();
  cuda_sequences.cu_seqlens_q = on_cuda(cuda_sequences.cu_seqlens_q);
  cuda_sequences.cu_seqlens_k = on_cuda(cuda_sequences.cu_seqlens_k);
  // CUDA views (of host memory: they never reach a GPU) meet the kernels' checks first, as
  // batches of one: float32 has no kernel.
  const char* no_kernel = TRAINSCALE_HAVE_CUDA ? (TRAINSCALE_HAVE_CUTLASS ? "float32" : "CUTLASS") : "no CUDA support";
  TS_EXPECT_ERROR(attention_varlen_forward(on_cuda(in.q.view()), on_cuda(in.k.view()), on_cuda(in.v.view()),
                                           cuda_sequences, on_cuda(out.view()), {}),
                  op, no_kernel);
  HostTensor lse_packed(DType::kFloat32, {2, 5}), dq(DType::kFloat32, in.q.shape()), dk(DType::kFloat32, in.k.shape()),
      dv(DType::kFloat32, in.v.shape());
  TS_EXPECT_ERROR(attention_varlen_backward({.dout = on_cuda(out.view()), .q = on_cuda(in.q.view()),
                                             .k = on_cuda(in.k.view()), .v = on_cuda(in.v.view()),
                                             .out = on_cuda(out.view()), .lse = on_cuda(lse_packed.view()),
                                             .dq = on_cuda(dq.view()), .dk = on_cuda(dk.view()),
                                             .dv = on_cuda(dv.view())},
                                            cuda_sequences),
                  "attention_varlen_backward", no_kernel);
}

TEST(Attention, ForwardArgumentErrors) {
  const Shape s{2, 3, 4, 4, 2, 8};
  auto in = random_inputs(DType::kFloat32, s);
  HostTensor out(DType::kFloat32, in.q.shape()), lse(DType::kFloat32, {2, 4, 3});
  const TensorView q = in.q.view(), k = in.k.view(), v = in.v.view();
  auto fwd = [&](TensorView q_, TensorView k_, TensorView v_, TensorView out_, TensorView lse_,
                 AttentionOptions options = {}) {
    attention_forward(q_, k_, v_, out_, lse_, options);
  };
  const char* op = "attention_forward";
  TS_EXPECT_ERROR(fwd({}, k, v, out.view(), lse.view()), op, "argument 'q'", "a tensor", "none");
  HostTensor ints(DType::kInt32, in.q.shape());
  TS_EXPECT_ERROR(fwd(ints.view(), k, v, out.view(), lse.view()), op, "'q'", "int32");
  HostTensor q3(DType::kFloat32, {2, 3, 32});
  TS_EXPECT_ERROR(fwd(q3.view(), k, v, out.view(), lse.view()), op, "'q'", "4 dimensions", "3");
  TensorView q_col = q;
  q_col.strides = {96, 32, 1, 4};
  TS_EXPECT_ERROR(fwd(q_col, k, v, out.view(), lse.view()), op, "'q'", "stride 1 in the last");
  HostTensor q_d0(DType::kFloat32, {2, 3, 4, 0});
  TS_EXPECT_ERROR(fwd(q_d0.view(), k, v, out.view(), lse.view()), op, "'q'", "head dim D >= 1");
  auto k16 = HostTensor::random(DType::kFloat16, in.k.shape());
  TS_EXPECT_ERROR(fwd(q, k16.view(), v, out.view(), lse.view()), op, "'k'", "float32", "float16");
  auto k_batch = HostTensor::random(DType::kFloat32, {1, 4, 2, 8});
  TS_EXPECT_ERROR(fwd(q, k_batch.view(), v, out.view(), lse.view()), op, "'k'", "batch size");
  auto k_dim = HostTensor::random(DType::kFloat32, {2, 4, 2, 6});
  TS_EXPECT_ERROR(fwd(q, k_dim.view(), v, out.view(), lse.view()), op, "'k'", "head dim");
  auto k_heads = HostTensor::random(DType::kFloat32, {2, 4, 3, 8});
  TS_EXPECT_ERROR(fwd(q, k_heads.view(), k_heads.view(), out.view(), lse.view()), op, "'k'",
                  "divides the 4 heads", "3 heads");
  auto k_none = HostTensor::random(DType::kFloat32, {2, 4, 0, 8});
  TS_EXPECT_ERROR(fwd(q, k_none.view(), k_none.view(), out.view(), lse.view()), op, "'k'",
                  "0 heads");
  auto v_len = HostTensor::random(DType::kFloat32, {2, 5, 2, 8});
  TS_EXPECT_ERROR(fwd(q, k, v_len.view(), out.view(), lse.view()), op, "'v'", "[2, 4, 2, 8]",
                  "[2, 5, 2, 8]");
  auto v16 = HostTensor::random(DType::kBFloat16, in.v.shape());
  TS_EXPECT_ERROR(fwd(q, k, v16.view(), out.view(), lse.view()), op, "'v'", "bfloat16");
  HostTensor out16(DType::kFloat16, in.q.shape()), out_short(DType::kFloat32, {2, 3, 4, 7});
  TS_EXPECT_ERROR(fwd(q, k, v, out16.view(), lse.view()), op, "'out'", "float16");
  TS_EXPECT_ERROR(fwd(q, k, v, out_short.view(), lse.view()), op, "'out'", "[2, 3, 4, 8]");
  TensorView out_aliased = out.view();
  out_aliased.strides[1] = 0;  // every query row writes the same memory
  TS_EXPECT_ERROR(fwd(q, k, v, out_aliased, lse.view()), op, "'out'",
                  "no two elements share memory");
  TensorView out_overlapping = out.view();
  out_overlapping.strides[2] = 4;  // heads 8 wide stored 4 apart
  TS_EXPECT_ERROR(fwd(q, k, v, out_overlapping, lse.view()), op, "'out'", "no two elements");
  HostTensor lse16(DType::kFloat16, {2, 4, 3}), lse_bsh(DType::kFloat32, {2, 3, 4}),
      lse2(DType::kFloat32, {8, 3});
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), lse16.view()), op, "'lse'", "float32", "float16");
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), lse2.view()), op, "'lse'", "3 dimensions");
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), lse_bsh.view()), op, "'lse'", "Hq of 'q'");
  HostTensor lse_b(DType::kFloat32, {1, 4, 3}), lse_s(DType::kFloat32, {2, 4, 4});
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), lse_b.view()), op, "'lse'", "B of 'q'");
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), lse_s.view()), op, "'lse'", "Sq of 'q'");
  HostTensor lse_padded(DType::kFloat32, {2, 4, 3}, /*row_pad=*/1);
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), lse_padded.view()), op, "'lse'", "contiguous");
  TS_EXPECT_ERROR(fwd(q, k, v, q, lse.view()), op, "'out'", "disjoint from 'q'");
  // One buffer holding k at [0, 128), v at [300, 428) and outputs placed over either.
  HostTensor buffer(DType::kFloat32, {500});
  auto at = [&](std::int64_t element, std::initializer_list<std::int64_t> shape) {
    return TensorView(static_cast<float*>(buffer.data()) + element, DType::kFloat32, shape);
  };
  const TensorView k_in = at(0, {2, 4, 2, 8}), v_in = at(300, {2, 4, 2, 8});
  TS_EXPECT_ERROR(fwd(q, k_in, v_in, at(100, {2, 3, 4, 8}), lse.view()), op, "'out'",
                  "disjoint from 'k'");
  TS_EXPECT_ERROR(fwd(q, k_in, v_in, at(250, {2, 3, 4, 8}), lse.view()), op, "'out'",
                  "disjoint from 'v'");
  TS_EXPECT_ERROR(fwd(q, k_in, v_in, out.view(), at(120, {2, 4, 3})), op, "'lse'",
                  "disjoint from 'k'");
  TS_EXPECT_ERROR(fwd(q, k_in, v_in, out.view(), at(400, {2, 4, 3})), op, "'lse'",
                  "disjoint from 'v'");
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), TensorView(q.data, DType::kFloat32, {2, 4, 3})), op,
                  "'lse'", "disjoint from 'q'");
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), TensorView(out.data(), DType::kFloat32, {2, 4, 3})), op,
                  "'lse'", "disjoint from 'out'");
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), lse.view(), {.scale = NAN}), op, "'options.scale'",
                  "finite");
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), lse.view(), {.window_left = -2}), op,
                  "'options.window_left'", "-1 (unbounded)", "-2");
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), lse.view(), {.window_right = -5}), op,
                  "'options.window_right'", "-5");
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), lse.view(), {.causal = true, .window_right = 3}), op,
                  "'options.window_right'", "-1 or 0 with causal", "3");
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), lse.view(), {.softcap = -1.0}), op, "'options.softcap'",
                  "0 (off) or a finite value > 0");
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), lse.view(), {.softcap = NAN}), op, "'options.softcap'",
                  "> 0");
  TS_EXPECT_ERROR(fwd(q, k, v, out.view(), lse.view(), {.scale = kInf}), op, "'options.scale'",
                  "inf");
  TensorView null_k = k;
  null_k.data = nullptr;
  TS_EXPECT_ERROR(fwd(q, null_k, v, out.view(), lse.view()), op, "'k'", "non-null");
  TensorView cuda_v = v;
  cuda_v.device = Device::cuda(0);
  TS_EXPECT_ERROR(fwd(q, k, cuda_v, out.view(), lse.view()), op, "'v'", "cuda:0");
}

TEST(Attention, BackwardArgumentErrors) {
  const Shape s{2, 3, 4, 4, 2, 8};
  auto in = random_inputs(DType::kFloat32, s);
  auto f = forward(in);
  auto dout = HostTensor::random(DType::kFloat32, in.q.shape());
  HostTensor dq(DType::kFloat32, in.q.shape()), dk(DType::kFloat32, in.k.shape()),
      dv(DType::kFloat32, in.v.shape());
  struct Args {
    TensorView dout, q, k, v, out, lse, dq, dk, dv;
    AttentionOptions options;
  };
  const Args good{dout.view(),  in.q.view(), in.k.view(), in.v.view(), f.out.view(),
                  f.lse.view(), dq.view(),   dk.view(),   dv.view(),   {}};
  auto bwd = [](const Args& a) {
    attention_backward({.dout = a.dout, .q = a.q, .k = a.k, .v = a.v, .out = a.out, .lse = a.lse,
                        .dq = a.dq, .dk = a.dk, .dv = a.dv}, a.options);
  };
  auto with = [&](auto edit) {
    Args a = good;
    edit(a);
    return a;
  };
  const char* op = "attention_backward";
  bwd(good);
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.q = {}; })), op, "'q'", "none");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.k.shape[2] = 3; })), op, "'k'", "divides");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.options.scale = NAN; })), op, "'options.scale'");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.out = {}; })), op, "'out'", "none");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.out.dtype = DType::kFloat16; })), op, "'out'",
                  "float16");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.dout.shape[1] = 2; })), op, "'dout'", "[2, 3, 4, 8]",
                  "[2, 2, 4, 8]");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.dout.strides[3] = 2; })), op, "'dout'", "stride 1");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.lse = {}; })), op, "'lse'", "a tensor", "none");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.lse.shape[2] = 2; })), op, "'lse'", "Sq of 'q'");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.dq = {}; })), op, "'dq'", "none");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.dq.dtype = DType::kBFloat16; })), op, "'dq'",
                  "bfloat16");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.dk.shape[1] = 3; })), op, "'dk'", "the shape of 'k'");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.dv.ndim = 3; })), op, "'dv'", "4 dimensions");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.dv.strides[0] = 0; })), op, "'dv'", "no two elements");
  TS_EXPECT_ERROR(bwd(with([&](Args& a) { a.dq = a.dout; })), op, "'dq'", "disjoint from 'dout'");
  TS_EXPECT_ERROR(bwd(with([&](Args& a) { a.dq = a.out; })), op, "'dq'", "disjoint from 'out'");
  TS_EXPECT_ERROR(bwd(with([&](Args& a) { a.dk = a.k; })), op, "'dk'", "disjoint from 'k'");
  TS_EXPECT_ERROR(bwd(with([&](Args& a) { a.dv = a.v; })), op, "'dv'", "disjoint from 'v'");
  TS_EXPECT_ERROR(bwd(with([&](Args& a) { a.dk = a.dv; })), op, "'dk'", "disjoint from 'dv'");
  // One buffer for outputs placed over each other or over lse.
  HostTensor buffer(DType::kFloat32, {400});
  auto at = [&](std::int64_t element, std::initializer_list<std::int64_t> shape) {
    return TensorView(static_cast<float*>(buffer.data()) + element, DType::kFloat32, shape);
  };
  TS_EXPECT_ERROR(bwd(with([&](Args& a) {
                    a.dq = at(100, {2, 3, 4, 8});
                    a.dv = at(250, {2, 4, 2, 8});
                  })),
                  op, "'dq'", "disjoint from 'dv'");
  TS_EXPECT_ERROR(bwd(with([&](Args& a) {
                    a.dq = at(100, {2, 3, 4, 8});
                    a.dk = at(0, {2, 4, 2, 8});
                  })),
                  op, "'dq'", "disjoint from 'dk'");
  const TensorView lse_in_buffer = at(0, {2, 4, 3});
  for (std::int64_t i = 0; i < f.lse.numel(); ++i)
    static_cast<float*>(buffer.data())[i] = static_cast<float>(f.lse.at(i));
  TS_EXPECT_ERROR(bwd(with([&](Args& a) {
                    a.lse = lse_in_buffer;
                    a.dv = at(10, {2, 4, 2, 8});
                  })),
                  op, "'dv'", "disjoint from 'lse'");
  TS_EXPECT_ERROR(bwd(with([&](Args& a) {
                    a.dk = TensorView(a.q.data, DType::kFloat32, {2, 4, 2, 8});
                  })),
                  op, "'dk'", "disjoint from 'q'");
  TS_EXPECT_ERROR(bwd(with([](Args& a) { a.dv.device = Device::cuda(0); })), op, "'dv'",
                  "on cuda:0");
}

// CUDA tensors: the kernels take bf16/fp16, head dims 64/128/256 and 16-byte aligned layouts
// (TMA-compatible for the forward), checked before anything touches a GPU (these views point to
// host memory and never reach one).
TEST(Attention, CudaTensorsReachTheirChecks) {
  auto in = random_inputs(DType::kBFloat16, {1, 2, 2, 2, 1, 8});
  auto f = forward(in);
  HostTensor dq(DType::kBFloat16, in.q.shape()), dk(DType::kBFloat16, in.k.shape()),
      dv(DType::kBFloat16, in.v.shape());
  auto on_cuda = [](TensorView t) {
    t.device = Device::cuda(0);
    return t;
  };
  const char* no_kernel = TRAINSCALE_HAVE_CUDA ? (TRAINSCALE_HAVE_CUTLASS ? "64, 128 or 256" : "CUTLASS")
                                               : "no CUDA support";
  TS_EXPECT_ERROR(
      attention_forward(on_cuda(in.q.view()), on_cuda(in.k.view()), on_cuda(in.v.view()),
                        on_cuda(f.out.view()), on_cuda(f.lse.view())),
      "attention_forward", no_kernel);
  TS_EXPECT_ERROR(
      attention_backward({.dout = on_cuda(f.out.view()), .q = on_cuda(in.q.view()),
                          .k = on_cuda(in.k.view()), .v = on_cuda(in.v.view()),
                          .out = on_cuda(in.q.view()), .lse = on_cuda(f.lse.view()),
                          .dq = on_cuda(dq.view()), .dk = on_cuda(dk.view()),
                          .dv = on_cuda(dv.view())}),
      "attention_backward", no_kernel);
  auto in64 = random_inputs(DType::kFloat64, {1, 2, 2, 2, 1, 8});
  HostTensor out64(DType::kFloat64, in64.q.shape());
  TS_EXPECT_ERROR(attention_forward(on_cuda(in64.q.view()), on_cuda(in64.k.view()),
                                    on_cuda(in64.v.view()), on_cuda(out64.view()), TensorView{}),
                  "attention_forward", "'q'", "float64 tensors on the CPU only");
}

TEST(Attention, CudaForwardRejectsWhatItsKernelCannotRead) {
  if (!TRAINSCALE_HAVE_CUDA || !TRAINSCALE_HAVE_CUTLASS) GTEST_SKIP() << "no CUDA attention kernel in this build";
  auto on_cuda = [](TensorView t) {
    t.device = Device::cuda(0);
    return t;
  };
  const char* op = "attention_forward";
  auto call = [&](const Inputs& in, TensorView q, TensorView k, TensorView v) {
    HostTensor out(in.q.dtype(), {q.size(0), q.size(1), q.size(2), q.size(3)});
    attention_forward(on_cuda(q), on_cuda(k), on_cuda(v), on_cuda(out.view()), TensorView{});
  };
  // Head dims without a kernel.
  for (std::int64_t d : {32, 96, 512}) {
    auto in = random_inputs(DType::kBFloat16, {1, 4, 4, 2, 1, d});
    const std::string shape = "[1, 4, 2, " + std::to_string(d) + "]";
    TS_EXPECT_ERROR(call(in, in.q.view(), in.k.view(), in.v.view()), op, "'q'", "64, 128 or 256",
                    shape.c_str());
  }
  // float32 has no CUDA kernel.
  {
    auto in = random_inputs(DType::kFloat32, {1, 4, 4, 2, 1, 64});
    TS_EXPECT_ERROR(call(in, in.q.view(), in.k.view(), in.v.view()), op, "'q'", "float32");
  }
  // A head stride of 68 elements (136 bytes) is no multiple of 16 bytes.
  {
    auto in = random_inputs(DType::kFloat16, {1, 4, 4, 2, 2, 64}, /*row_pad=*/4);
    TS_EXPECT_ERROR(call(in, in.q.view(), in.k.view(), in.v.view()), op, "'q'", "16-byte", "68");
  }
  // A start one element past a 16-byte boundary (k only).
  {
    auto in = random_inputs(DType::kBFloat16, {1, 4, 4, 2, 2, 64}, /*row_pad=*/8);
    TensorView k = in.k.view();
    k.data = static_cast<char*>(k.data) + 2;
    TS_EXPECT_ERROR(call(in, in.q.view(), k, in.v.view()), op, "'k'", "16-byte aligned");
  }
}

// The CUDA backward's own requirements: the workspace (named with the bytes it needs and was
// given) and 16-byte aligned outputs, checked before anything touches a GPU.
TEST(Attention, CudaBackwardRejectsWhatItsKernelCannotTake) {
  if (!TRAINSCALE_HAVE_CUDA || !TRAINSCALE_HAVE_CUTLASS) GTEST_SKIP() << "no CUDA attention kernel in this build";
  auto on_cuda = [](TensorView t) {
    t.device = Device::cuda(0);
    return t;
  };
  auto in = random_inputs(DType::kBFloat16, {2, 8, 8, 2, 1, 64});
  HostTensor out(DType::kBFloat16, in.q.shape()), dout(DType::kBFloat16, in.q.shape());
  HostTensor lse(DType::kFloat32, {2, 2, 8});
  HostTensor dq(DType::kBFloat16, in.q.shape()), dk(DType::kBFloat16, in.k.shape()),
      dv(DType::kBFloat16, in.v.shape());
  const std::size_t bytes = attention_backward_workspace_bytes(in.q.view());
  // Sq 8 -> one 128-row query block (head dim 64) of 2 x 2 heads: delta and lse * log2(e) (2048
  // bytes each), 4 counters (256 after alignment) and dQ's 4 * 128 * 64 floats.
  EXPECT_EQ(bytes, 2048u + 2048u + 256u + 131072u);
  HostTensor small(DType::kFloat32, {16});
  auto call = [&](TensorView workspace, TensorView dq_view) {
    attention_backward({.dout = on_cuda(dout.view()), .q = on_cuda(in.q.view()), .k = on_cuda(in.k.view()),
                        .v = on_cuda(in.v.view()), .out = on_cuda(out.view()), .lse = on_cuda(lse.view()),
                        .dq = on_cuda(dq_view), .dk = on_cuda(dk.view()), .dv = on_cuda(dv.view()),
                        .workspace = workspace.defined() ? on_cuda(workspace) : workspace});
  };
  const char* op = "attention_backward";
  TS_EXPECT_ERROR(call(TensorView{}, dq.view()), op, "'workspace'", "at least 135424 bytes",
                  "attention_backward_workspace_bytes", "0 bytes");
  TS_EXPECT_ERROR(call(small.view(), dq.view()), op, "'workspace'", "at least 135424 bytes", "64 bytes");
  TensorView dq_shifted = dq.view();
  dq_shifted.data = static_cast<char*>(dq_shifted.data) + 2;
  TS_EXPECT_ERROR(call(TensorView{}, dq_shifted), op, "'dq'", "16-byte aligned");
}

}  // namespace
}  // namespace trainscale
