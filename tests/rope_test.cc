#include "trainscale/rope.h"

#include <cmath>
#include <complex>

#include "util/gpu_util.h"
#include "util/test_util.h"

namespace trainscale {
namespace {

using test::HostTensor;

constexpr auto kForwardDtypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                                 DType::kFloat64};
constexpr auto kStyles = {RopeStyle::kNeox, RopeStyle::kGptJ};

std::int64_t index4(const std::vector<std::int64_t>& shape, std::int64_t b, std::int64_t s,
                    std::int64_t h, std::int64_t d) {
  return ((b * shape[1] + s) * shape[2] + h) * shape[3] + d;
}

// Independent reference: each pair as a complex number multiplied by e^{i angle}.
std::vector<double> complex_rotation(const HostTensor& x, RopeStyle style, std::int64_t rotary_dim,
                                     double theta, const std::vector<std::int64_t>& offsets,
                                     double direction = 1.0) {
  const auto& sh = x.shape();
  std::vector<double> out = x.values();
  const std::int64_t half = rotary_dim / 2;
  for (std::int64_t b = 0; b < sh[0]; ++b) {
    for (std::int64_t s = 0; s < sh[1]; ++s) {
      const double position = static_cast<double>(s + (offsets.empty() ? 0 : offsets[b]));
      for (std::int64_t h = 0; h < sh[2]; ++h) {
        for (std::int64_t i = 0; i < half; ++i) {
          const std::int64_t re = style == RopeStyle::kNeox ? i : 2 * i;
          const std::int64_t im = style == RopeStyle::kNeox ? i + half : 2 * i + 1;
          const double angle =
              direction * position * std::exp(-std::log(theta) * 2.0 * i / rotary_dim);
          const std::complex<double> z(x.at(index4(sh, b, s, h, re)),
                                       x.at(index4(sh, b, s, h, im)));
          const std::complex<double> r = z * std::polar(1.0, angle);
          out[index4(sh, b, s, h, re)] = r.real();
          out[index4(sh, b, s, h, im)] = r.imag();
        }
      }
    }
  }
  return out;
}

// cos / sin tables [positions, rotary_dim / 2] of the theta angles.
std::pair<HostTensor, HostTensor> make_tables(DType dtype, std::int64_t positions,
                                              std::int64_t rotary_dim, double theta) {
  HostTensor cos(dtype, {positions, rotary_dim / 2}), sin(dtype, {positions, rotary_dim / 2});
  for (std::int64_t p = 0; p < positions; ++p) {
    for (std::int64_t i = 0; i < rotary_dim / 2; ++i) {
      const double angle = static_cast<double>(p) * std::pow(theta, -2.0 * i / rotary_dim);
      cos.set(p * (rotary_dim / 2) + i, std::cos(angle));
      sin.set(p * (rotary_dim / 2) + i, std::sin(angle));
    }
  }
  return {std::move(cos), std::move(sin)};
}

HostTensor offsets_tensor(DType dtype, const std::vector<std::int64_t>& offsets) {
  std::vector<double> values(offsets.begin(), offsets.end());
  return HostTensor::from_values(dtype, {static_cast<std::int64_t>(offsets.size())}, values);
}

TEST(Rope, ForwardMatchesComplexRotationEveryDtypeAndStyle) {
  const std::int64_t B = 2, S = 5, Hq = 3, Hk = 1, D = 12;
  const std::vector<std::int64_t> offsets = {7, 2};
  const auto offs = offsets_tensor(DType::kInt32, offsets);
  for (DType dt : kForwardDtypes) {
    for (RopeStyle style : kStyles) {
      for (std::int64_t rotary_dim : {-1, 8}) {
        const RopeOptions opt{style, rotary_dim, 500.0};
        const std::int64_t r = rotary_dim < 0 ? D : rotary_dim;
        // Padded head dims make every stride above the last one non-contiguous.
        auto q = HostTensor::random(dt, {B, S, Hq, D}, -2, 2, /*row_pad=*/3);
        auto k = HostTensor::random(dt, {B, S, Hk, D}, -2, 2);
        HostTensor q_out(dt, {B, S, Hq, D}), k_out(dt, {B, S, Hk, D}, /*row_pad=*/1);
        rope_forward(q.view(), k.view(), q_out.view(), k_out.view(), {}, {}, offs.view(), opt);
        const auto what =
            std::string(dtype_name(dt)) + " " + rope_style_name(style) + " r=" + std::to_string(r);
        EXPECT_TRUE(test::matches_reference(
            q_out.values(), complex_rotation(q, style, r, 500.0, offsets), test::tolerance(dt)))
            << what;
        EXPECT_TRUE(test::matches_reference(
            k_out.values(), complex_rotation(k, style, r, 500.0, offsets), test::tolerance(dt)))
            << what;
      }
    }
  }
}

TEST(Rope, NeoxAndGptjPairingOnAHandExample) {
  // Position 1 rotates pair 0 by 90 degrees and pair 1 by 180 degrees; position 0 not at all.
  const auto cos = HostTensor::from_values(DType::kFloat64, {2, 2}, {1, 1, 0, -1});
  const auto sin = HostTensor::from_values(DType::kFloat64, {2, 2}, {0, 0, 1, 0});
  const auto q = HostTensor::from_values(DType::kFloat64, {1, 2, 1, 4}, {1, 2, 3, 4, 1, 2, 3, 4});
  HostTensor out(DType::kFloat64, {1, 2, 1, 4});
  rope_forward(q.view(), {}, out.view(), {}, cos.view(), sin.view(), {}, {RopeStyle::kNeox});
  // NeoX pairs (0, 2), (1, 3): (1, 3) -> (-3, 1); (2, 4) -> (-2, -4).
  EXPECT_EQ(out.values(), (std::vector<double>{1, 2, 3, 4, -3, -2, 1, -4}));
  rope_forward(q.view(), {}, out.view(), {}, cos.view(), sin.view(), {}, {RopeStyle::kGptJ});
  // GPT-J pairs (0, 1), (2, 3): (1, 2) -> (-2, 1); (3, 4) -> (-3, -4).
  EXPECT_EQ(out.values(), (std::vector<double>{1, 2, 3, 4, -2, 1, -3, -4}));
}

TEST(Rope, PreservesTheNormOfEveryPairAndLeavesTheTailUnchanged) {
  const std::int64_t B = 2, S = 3, H = 2, D = 10, R = 6;
  for (RopeStyle style : kStyles) {
    auto q = HostTensor::random(DType::kFloat64, {B, S, H, D});
    HostTensor out(DType::kFloat64, {B, S, H, D});
    rope_forward(q.view(), {}, out.view(), {}, {}, {}, {}, {style, R});
    for (std::int64_t t = 0; t < B * S * H; ++t) {
      for (std::int64_t i = 0; i < R / 2; ++i) {
        const std::int64_t d0 = style == RopeStyle::kNeox ? i : 2 * i;
        const std::int64_t d1 = style == RopeStyle::kNeox ? i + R / 2 : 2 * i + 1;
        EXPECT_NEAR(std::hypot(out.at(t * D + d0), out.at(t * D + d1)),
                    std::hypot(q.at(t * D + d0), q.at(t * D + d1)), 1e-14);
      }
    }
    // The tail is bit-identical even in bfloat16.
    auto q16 = HostTensor::random(DType::kBFloat16, {B, S, H, D});
    HostTensor out16(DType::kBFloat16, {B, S, H, D});
    rope_forward(q16.view(), {}, out16.view(), {}, {}, {}, {}, {style, R});
    for (std::int64_t t = 0; t < B * S * H; ++t) {
      for (std::int64_t d = R; d < D; ++d) EXPECT_EQ(out16.at(t * D + d), q16.at(t * D + d));
    }
  }
}

TEST(Rope, BackwardInvertsForward) {
  const auto offs = offsets_tensor(DType::kInt64, {0, 11, 3});
  for (RopeStyle style : kStyles) {
    for (DType dt : {DType::kFloat64, DType::kFloat32}) {
      auto q = HostTensor::random(dt, {3, 4, 5, 6}), k = HostTensor::random(dt, {3, 4, 2, 6});
      HostTensor q_rot(dt, {3, 4, 5, 6}), k_rot(dt, {3, 4, 2, 6}), q_back(dt, {3, 4, 5, 6}),
          k_back(dt, {3, 4, 2, 6});
      const RopeOptions opt{style, 4, 10000.0};
      rope_forward(q.view(), k.view(), q_rot.view(), k_rot.view(), {}, {}, offs.view(), opt);
      rope_backward(q_rot.view(), k_rot.view(), q_back.view(), k_back.view(), {}, {}, offs.view(),
                    opt);
      const double tol = dt == DType::kFloat64 ? 1e-14 : 1e-6;
      EXPECT_TRUE(test::matches_reference(q_back.values(), q.values(), tol));
      EXPECT_TRUE(test::matches_reference(k_back.values(), k.values(), tol));
      EXPECT_TRUE(test::matches_reference(
          q_back.values(), complex_rotation(q_rot, style, 4, 10000.0, {0, 11, 3}, -1.0), tol));
    }
  }
}

// Forward with tables in fp64 (the linear map R) and its backward (R^T).
struct RopeCase {
  std::vector<std::int64_t> q_shape = {2, 3, 2, 6}, k_shape = {2, 3, 1, 6};
  RopeOptions opt;
  HostTensor cos, sin, offsets = offsets_tensor(DType::kInt32, {1, 4});

  explicit RopeCase(RopeStyle style) : opt{style, 4, 10000.0} {
    std::tie(cos, sin) = make_tables(DType::kFloat64, 8, 4, 77.0);
  }
  std::pair<std::vector<double>, std::vector<double>> apply(const std::vector<double>& qv,
                                                            const std::vector<double>& kv,
                                                            bool backward) const {
    const auto q = HostTensor::from_values(DType::kFloat64, q_shape, qv);
    const auto k = HostTensor::from_values(DType::kFloat64, k_shape, kv);
    HostTensor q_out(DType::kFloat64, q_shape), k_out(DType::kFloat64, k_shape);
    (backward ? rope_backward : rope_forward)(q.view(), k.view(), q_out.view(), k_out.view(),
                                              cos.view(), sin.view(), offsets.view(), opt, nullptr);
    return {q_out.values(), k_out.values()};
  }
};

TEST(Rope, BackwardIsTheTransposeOfForward) {
  for (RopeStyle style : kStyles) {
    const RopeCase rc(style);
    const auto q = test::random_values(72), k = test::random_values(36);
    const auto dq_out = test::random_values(72), dk_out = test::random_values(36);
    const auto [q_out, k_out] = rc.apply(q, k, false);
    const auto [dq, dk] = rc.apply(dq_out, dk_out, true);
    const double lhs = test::dot(dq_out, q_out) + test::dot(dk_out, k_out);
    const double rhs = test::dot(dq, q) + test::dot(dk, k);
    EXPECT_NEAR(lhs, rhs, 1e-13 * (std::fabs(lhs) + 1.0)) << rope_style_name(style);

    // And against finite differences of <dy, forward(x)>.
    auto loss = [&](const std::vector<double>& qv, const std::vector<double>& kv) {
      const auto [qo, ko] = rc.apply(qv, kv, false);
      return test::dot(dq_out, qo) + test::dot(dk_out, ko);
    };
    EXPECT_TRUE(test::matches_reference(
        dq, test::numeric_gradient(q, [&](const auto& v) { return loss(v, k); }), 1e-7));
    EXPECT_TRUE(test::matches_reference(
        dk, test::numeric_gradient(k, [&](const auto& v) { return loss(q, v); }), 1e-7));
  }
}

TEST(Rope, TablesGiveTheSameResultAsTheta) {
  for (RopeStyle style : kStyles) {
    const RopeOptions opt{style, 6, 321.0};
    for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
      auto q = HostTensor::random(dt, {2, 5, 3, 8});
      HostTensor from_theta(dt, {2, 5, 3, 8});
      const auto offs = offsets_tensor(DType::kInt64, {3, 9});
      rope_forward(q.view(), {}, from_theta.view(), {}, {}, {}, offs.view(), opt);
      // float32 tables or tables in q's dtype.
      for (DType table_dtype : {DType::kFloat32, dt}) {
        const auto [cos, sin] = make_tables(table_dtype, 14, 6, 321.0);
        HostTensor from_tables(dt, {2, 5, 3, 8});
        rope_forward(q.view(), {}, from_tables.view(), {}, cos.view(), sin.view(), offs.view(),
                     opt);
        const double tol = std::max(test::tolerance(dt), test::tolerance(table_dtype));
        EXPECT_TRUE(test::matches_reference(from_tables.values(), from_theta.values(), tol))
            << dtype_name(dt) << " tables " << dtype_name(table_dtype);
      }
    }
  }
}

TEST(Rope, OffsetsShiftPositions) {
  // Batch 0 with offset 3 sees the rotation tokens 3.. get in a run without offsets.
  const std::int64_t S = 4, H = 2, D = 6;
  auto long_seq = HostTensor::random(DType::kFloat32, {1, S + 3, H, D});
  HostTensor long_out(DType::kFloat32, {1, S + 3, H, D});
  rope_forward(long_seq.view(), {}, long_out.view(), {}, {}, {}, {}, {});
  TensorView tail = long_seq.view();
  tail.shape[1] = S;
  tail.data = static_cast<float*>(tail.data) + 3 * tail.strides[1];
  HostTensor tail_out(DType::kFloat32, {1, S, H, D});
  for (DType offset_dtype : {DType::kInt32, DType::kInt64}) {
    const auto offs = offsets_tensor(offset_dtype, {3});
    rope_forward(tail, {}, tail_out.view(), {}, {}, {}, offs.view(), {});
    for (std::int64_t i = 0; i < tail_out.numel(); ++i) {
      EXPECT_EQ(tail_out.at(i), long_out.at(3 * H * D + i));
    }
  }
}

TEST(Rope, BhsdStridedEqualsBshdContiguous) {
  const std::int64_t B = 2, S = 5, H = 3, D = 8;
  for (RopeStyle style : kStyles) {
    auto bshd = HostTensor::random(DType::kFloat16, {B, S, H, D});
    HostTensor bhsd_storage(DType::kFloat16, {B, H, S, D}),
        bhsd_out_storage(DType::kFloat16, {B, H, S, D});
    const TensorView bhsd(bhsd_storage.data(), DType::kFloat16, {B, S, H, D},
                          {H * S * D, D, S * D, 1});
    const TensorView bhsd_out(bhsd_out_storage.data(), DType::kFloat16, {B, S, H, D},
                              {H * S * D, D, S * D, 1});
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t s = 0; s < S; ++s)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t d = 0; d < D; ++d)
            bhsd_storage.set(((b * H + h) * S + s) * D + d, bshd.at(((b * S + s) * H + h) * D + d));
    HostTensor bshd_out(DType::kFloat16, {B, S, H, D});
    const RopeOptions opt{style, -1, 10000.0};
    rope_forward(bshd.view(), {}, bshd_out.view(), {}, {}, {}, {}, opt);
    rope_forward(bhsd, {}, bhsd_out, {}, {}, {}, {}, opt);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t s = 0; s < S; ++s)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t d = 0; d < D; ++d)
            EXPECT_EQ(bhsd_out_storage.at(((b * H + h) * S + s) * D + d),
                      bshd_out.at(((b * S + s) * H + h) * D + d));
  }
}

TEST(Rope, InPlaceEqualsOutOfPlaceIncludingFusedQkv) {
  const std::int64_t B = 2, S = 3, Hq = 4, Hk = 2, D = 6;
  const auto offs = offsets_tensor(DType::kInt32, {5, 1});
  const RopeOptions opt{RopeStyle::kGptJ, -1, 10000.0};
  auto q = HostTensor::random(DType::kBFloat16, {B, S, Hq, D}),
       k = HostTensor::random(DType::kBFloat16, {B, S, Hk, D});
  HostTensor q_out(DType::kBFloat16, {B, S, Hq, D}), k_out(DType::kBFloat16, {B, S, Hk, D});
  rope_forward(q.view(), k.view(), q_out.view(), k_out.view(), {}, {}, offs.view(), opt);
  HostTensor q_in_place = q, k_in_place = k;
  rope_forward(q_in_place.view(), k_in_place.view(), q_in_place.view(), k_in_place.view(), {}, {},
               offs.view(), opt);
  EXPECT_EQ(q_in_place.values(), q_out.values());
  EXPECT_EQ(k_in_place.values(), k_out.values());

  // q and k as head slices of one [B, S, Hq + 2 Hk, D] QKV buffer: byte ranges interleave,
  // elements do not.
  HostTensor qkv(DType::kBFloat16, {B, S, Hq + 2 * Hk, D});
  const std::int64_t H = Hq + 2 * Hk;
  for (std::int64_t t = 0; t < B * S; ++t) {
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t d = 0; d < D; ++d) {
        const double v = h < Hq        ? q.at((t * Hq + h) * D + d)
                         : h < Hq + Hk ? k.at((t * Hk + h - Hq) * D + d)
                                       : 0.5;
        qkv.set((t * H + h) * D + d, v);
      }
    }
  }
  const std::initializer_list<std::int64_t> strides = {S * H * D, H * D, D, 1};
  const TensorView q_slice(qkv.data(), DType::kBFloat16, {B, S, Hq, D}, strides);
  const TensorView k_slice(static_cast<std::uint16_t*>(qkv.data()) + Hq * D, DType::kBFloat16,
                           {B, S, Hk, D}, strides);
  rope_backward(q_slice, k_slice, q_slice, k_slice, {}, {}, offs.view(), opt);
  HostTensor dq(DType::kBFloat16, {B, S, Hq, D}), dk(DType::kBFloat16, {B, S, Hk, D});
  rope_backward(q.view(), k.view(), dq.view(), dk.view(), {}, {}, offs.view(), opt);
  for (std::int64_t t = 0; t < B * S; ++t) {
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t d = 0; d < D; ++d) {
        const double expected = h < Hq        ? dq.at((t * Hq + h) * D + d)
                                : h < Hq + Hk ? dk.at((t * Hk + h - Hq) * D + d)
                                              : 0.5;
        EXPECT_EQ(qkv.at((t * H + h) * D + d), expected) << t << " " << h << " " << d;
      }
    }
  }
  // Head ranges that intersect are an overlap, not two slices.
  const TensorView k_overlapping(static_cast<std::uint16_t*>(qkv.data()) + (Hq - 1) * D,
                                 DType::kBFloat16, {B, S, Hk, D}, strides);
  TS_EXPECT_ERROR(rope_forward(q_slice, k_overlapping, q_slice, k_overlapping, {}, {}, {}, opt),
                  "rope_forward", "argument 'q_out'", "disjoint from 'k'");
}

TEST(Rope, EmptyTensorsAndNaNPropagation) {
  for (std::vector<std::int64_t> shape :
       {std::vector<std::int64_t>{0, 3, 2, 4}, {2, 0, 2, 4}, {2, 3, 0, 4}, {2, 3, 2, 0}}) {
    HostTensor q(DType::kFloat32, shape), out(DType::kFloat32, shape);
    rope_forward(q.view(), q.view(), out.view(), q.view(), {}, {}, {}, {});
    rope_backward(q.view(), {}, out.view(), {}, {}, {}, {}, {});
  }
  for (RopeStyle style : kStyles) {
    auto q = HostTensor::random(DType::kFloat32, {1, 2, 1, 8});
    q.set(8 + 1, NAN);  // token 1, dim 1: in a rotated pair
    q.set(8 + 7, NAN);  // token 1, dim 7: in the tail
    HostTensor out(DType::kFloat32, {1, 2, 1, 8});
    rope_forward(q.view(), {}, out.view(), {}, {}, {}, {}, {style, 6});
    const std::int64_t partner = style == RopeStyle::kNeox ? 4 : 0;
    for (std::int64_t i = 0; i < 16; ++i) {
      const bool expect_nan = i == 9 || i == 15 || i == 8 + partner;
      EXPECT_EQ(std::isnan(out.at(i)), expect_nan) << rope_style_name(style) << " " << i;
    }
  }
}

TEST(Rope, StyleNames) {
  EXPECT_STREQ(rope_style_name(RopeStyle::kNeox), "neox");
  EXPECT_STREQ(rope_style_name(RopeStyle::kGptJ), "gptj");
  EXPECT_STREQ(rope_style_name(static_cast<RopeStyle>(5)), "unknown");
}

TensorView on_cuda(TensorView t) {
  t.device = Device::cuda(0);
  return t;
}

TEST(Rope, OptionAndShapeErrors) {
  auto q = HostTensor::random(DType::kFloat32, {2, 3, 4, 8}),
       k = HostTensor::random(DType::kFloat32, {2, 3, 2, 8});
  HostTensor q_out(DType::kFloat32, {2, 3, 4, 8}), k_out(DType::kFloat32, {2, 3, 2, 8});
  auto q7 = HostTensor::random(DType::kFloat32, {2, 3, 4, 7});
  HostTensor q7_out(DType::kFloat32, {2, 3, 4, 7});
  auto q16 = HostTensor::random(DType::kFloat16, {2, 3, 4, 8});
  HostTensor ints(DType::kInt32, {2, 3, 4, 8}), q3(DType::kFloat32, {2, 3, 32});
  const TensorView qv = q.view(), kv = k.view();
  const TensorView column_major(q.data(), DType::kFloat32, {2, 3, 4, 8}, {1, 2, 6, 24});
  auto fwd = [&](const TensorView& qq, const TensorView& kk, TensorView qo, TensorView ko,
                 const RopeOptions& opt = {}) { rope_forward(qq, kk, qo, ko, {}, {}, {}, opt); };

  TS_EXPECT_ERROR(fwd(qv, {}, q_out.view(), {}, {static_cast<RopeStyle>(4)}), "rope_forward",
                  "argument 'options.style'", "kNeox or kGptJ", "4");
  TS_EXPECT_ERROR(fwd(qv, {}, q_out.view(), {}, {RopeStyle::kNeox, -1, 0.0}), "rope_forward",
                  "argument 'options.theta'", "> 0");
  TS_EXPECT_ERROR(fwd(qv, {}, q_out.view(), {}, {RopeStyle::kNeox, -1, NAN}),
                  "argument 'options.theta'", "finite");
  TS_EXPECT_ERROR(fwd(qv, {}, q_out.view(), {}, {RopeStyle::kNeox, 5}), "rope_forward",
                  "argument 'options.rotary_dim'", "even number in [0, 8]", "got 5");
  TS_EXPECT_ERROR(fwd(qv, {}, q_out.view(), {}, {RopeStyle::kNeox, 10}),
                  "argument 'options.rotary_dim'", "got 10");
  TS_EXPECT_ERROR(fwd(qv, {}, q_out.view(), {}, {RopeStyle::kNeox, -2}),
                  "argument 'options.rotary_dim'", "got -2");
  TS_EXPECT_ERROR(fwd(q7.view(), {}, q7_out.view(), {}), "argument 'options.rotary_dim'",
                  "got -1 with the odd head dim 7");

  TS_EXPECT_ERROR(fwd({}, {}, q_out.view(), {}), "rope_forward", "argument 'q'", "none");
  TS_EXPECT_ERROR(fwd(ints.view(), {}, q_out.view(), {}), "argument 'q'", "int32");
  TS_EXPECT_ERROR(fwd(q3.view(), {}, q_out.view(), {}), "argument 'q'", "4 dimensions", "3");
  TS_EXPECT_ERROR(fwd(column_major, {}, q_out.view(), {}), "argument 'q'", "stride 1");
  TS_EXPECT_ERROR(fwd(qv, {}, {}, {}), "argument 'q_out'", "none");
  TS_EXPECT_ERROR(fwd(qv, {}, q16.view(), {}), "argument 'q_out'", "float16");
  TS_EXPECT_ERROR(fwd(qv, {}, k_out.view(), {}), "argument 'q_out'", "[2, 3, 4, 8]",
                  "[2, 3, 2, 8]");
  TS_EXPECT_ERROR(fwd(qv, {}, column_major, {}), "argument 'q_out'", "stride 1");

  TS_EXPECT_ERROR(fwd(qv, kv, q_out.view(), {}), "argument 'k_out'", "both given or both absent");
  TS_EXPECT_ERROR(fwd(qv, {}, q_out.view(), k_out.view()), "argument 'k'",
                  "both given or both absent");
  TS_EXPECT_ERROR(fwd(qv, q16.view(), q_out.view(), k_out.view()), "argument 'k'", "float16");
  TS_EXPECT_ERROR(fwd(qv, q3.view(), q_out.view(), k_out.view()), "argument 'k'", "4 dimensions");
  HostTensor k_b(DType::kFloat32, {1, 3, 2, 8}), k_s(DType::kFloat32, {2, 4, 2, 8}),
      k_d(DType::kFloat32, {2, 3, 2, 6});
  TS_EXPECT_ERROR(fwd(qv, k_b.view(), q_out.view(), k_out.view()), "argument 'k'",
                  "the batch size of 'q'");
  TS_EXPECT_ERROR(fwd(qv, k_s.view(), q_out.view(), k_out.view()), "argument 'k'",
                  "the sequence length of 'q'");
  TS_EXPECT_ERROR(fwd(qv, k_d.view(), q_out.view(), k_out.view()), "argument 'k'",
                  "the head dim of 'q'");
  const TensorView k_column_major(k.data(), DType::kFloat32, {2, 3, 2, 8}, {1, 2, 6, 12});
  TS_EXPECT_ERROR(fwd(qv, k_column_major, q_out.view(), k_out.view()), "argument 'k'", "stride 1");
  TS_EXPECT_ERROR(fwd(qv, kv, q_out.view(), q16.view()), "argument 'k_out'", "float16");
  TS_EXPECT_ERROR(fwd(qv, kv, q_out.view(), q_out.view()), "argument 'k_out'", "[2, 3, 2, 8]");
  TS_EXPECT_ERROR(fwd(qv, kv, q_out.view(), k_column_major), "argument 'k_out'", "stride 1");

  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    TS_EXPECT_ERROR(fwd(on_cuda(qv), {}, on_cuda(q_out.view()), {}), "rope_forward", "CUDA");
    TS_EXPECT_ERROR(rope_backward(on_cuda(qv), on_cuda(kv), on_cuda(q_out.view()),
                                  on_cuda(k_out.view()), {}, {}, {}, {}),
                    "rope_backward", "CUDA");
  }
  TS_EXPECT_ERROR(fwd(qv, {}, on_cuda(q_out.view()), {}), "argument 'q_out'", "cuda:0");
  TS_EXPECT_ERROR(rope_backward(qv, kv, q_out.view(), {}, {}, {}, {}, {}), "rope_backward",
                  "argument 'dk'", "'dk_out' and 'dk'");
  TS_EXPECT_ERROR(rope_backward(qv, k_b.view(), q_out.view(), k_out.view(), {}, {}, {}, {}),
                  "rope_backward", "argument 'dk_out'", "the batch size of 'dq_out'");
}

TEST(Rope, TableOffsetAndAliasingErrors) {
  auto q = HostTensor::random(DType::kBFloat16, {2, 3, 4, 8}),
       k = HostTensor::random(DType::kBFloat16, {2, 3, 2, 8});
  HostTensor q_out(DType::kBFloat16, {2, 3, 4, 8}), k_out(DType::kBFloat16, {2, 3, 2, 8});
  const auto [cos, sin] = make_tables(DType::kFloat32, 6, 8, 10000.0);
  const auto [cos_bf, sin_bf] = make_tables(DType::kBFloat16, 6, 8, 10000.0);
  const auto [cos_short, sin_short] = make_tables(DType::kFloat32, 2, 8, 10000.0);
  const auto [cos_narrow, sin_narrow] = make_tables(DType::kFloat32, 6, 6, 10000.0);
  const auto [cos64, sin64] = make_tables(DType::kFloat64, 6, 8, 10000.0);
  HostTensor cos3(DType::kFloat32, {6, 4, 1});
  const TensorView cos_column_major(cos.data(), DType::kFloat32, {6, 4}, {1, 6});
  const TensorView qv = q.view(), kv = k.view(), qo = q_out.view(), ko = k_out.view();
  auto fwd = [&](const TensorView& c, const TensorView& s, const TensorView& offs = {},
                 TensorView q_o = {}, TensorView k_o = {}) {
    rope_forward(qv, kv, q_o.defined() ? q_o : qo, k_o.defined() ? k_o : ko, c, s, offs, {});
  };

  TS_EXPECT_ERROR(fwd(cos.view(), {}), "rope_forward", "argument 'sin'",
                  "both given or both absent");
  TS_EXPECT_ERROR(fwd({}, sin.view()), "argument 'cos'", "both given or both absent");
  TS_EXPECT_ERROR(fwd(cos64.view(), sin64.view()), "argument 'cos'", "float32, bfloat16",
                  "float64");
  TS_EXPECT_ERROR(fwd(cos3.view(), cos3.view()), "argument 'cos'", "2 dimensions");
  TS_EXPECT_ERROR(fwd(cos_narrow.view(), sin_narrow.view()), "argument 'cos'", "size 4 in dim 1",
                  "rotary_dim / 2");
  TS_EXPECT_ERROR(fwd(cos_column_major, sin.view()), "argument 'cos'", "stride 1");
  TS_EXPECT_ERROR(fwd(cos.view(), sin_bf.view()), "argument 'sin'", "float32", "bfloat16");
  TS_EXPECT_ERROR(fwd(cos.view(), sin_short.view()), "argument 'sin'", "[6, 4]", "[2, 4]");
  const TensorView sin_column_major(sin.data(), DType::kFloat32, {6, 4}, {1, 6});
  TS_EXPECT_ERROR(fwd(cos.view(), sin_column_major), "argument 'sin'", "stride 1");
  TS_EXPECT_ERROR(fwd(cos_short.view(), sin_short.view()), "argument 'cos'", "at least 3 positions",
                  "2 rows");
  fwd(cos_bf.view(), sin_bf.view());  // q's dtype is accepted too

  const auto offs_ok = offsets_tensor(DType::kInt64, {3, 0});
  fwd(cos.view(), sin.view(), offs_ok.view());
  const auto offs_far = offsets_tensor(DType::kInt64, {0, 4});
  TS_EXPECT_ERROR(fwd(cos.view(), sin.view(), offs_far.view()), "argument 'position_offsets'",
                  "offset + 3 <= 6", "offset 4 for batch 1");
  const auto offs_negative = offsets_tensor(DType::kInt32, {-1, 0});
  TS_EXPECT_ERROR(fwd({}, {}, offs_negative.view()), "argument 'position_offsets'", "offsets >= 0",
                  "offset -1 for batch 0");
  const auto offs_float = HostTensor::random(DType::kFloat32, {2});
  TS_EXPECT_ERROR(fwd({}, {}, offs_float.view()), "argument 'position_offsets'", "int32, int64",
                  "float32");
  const HostTensor offs_2d(DType::kInt32, {2, 1}), offs_3(DType::kInt32, {3});
  TS_EXPECT_ERROR(fwd({}, {}, offs_2d.view()), "argument 'position_offsets'", "1 dimensions");
  TS_EXPECT_ERROR(fwd({}, {}, offs_3.view()), "argument 'position_offsets'",
                  "the batch size of 'q'");
  // On CUDA the offsets' values are not read, but their shape still is.
  // Host memory labelled as CUDA: only safe to pass where no GPU can run it.
  if (!test::cuda_available()) {
    const auto far_on_cuda = on_cuda(offs_far.view());
    TS_EXPECT_ERROR(rope_forward(on_cuda(qv), {}, on_cuda(qo), {}, on_cuda(cos.view()),
                                 on_cuda(sin.view()), far_on_cuda, {}),
                    "rope_forward", "CUDA");
  }
  TS_EXPECT_ERROR(
      rope_forward(on_cuda(qv), {}, on_cuda(qo), {}, {}, {}, on_cuda(offs_3.view()), {}),
      "argument 'position_offsets'", "the batch size");

  // Aliasing: partial overlap with the input, outputs over other inputs / each other / tables.
  TensorView q_shifted = qv;
  q_shifted.data = static_cast<std::uint16_t*>(q_shifted.data) + 1;
  TS_EXPECT_ERROR(fwd({}, {}, {}, q_shifted), "argument 'q_out'",
                  "disjoint from 'q' or exactly its view");
  TensorView k_over_k_out = ko;
  k_over_k_out.data = static_cast<std::uint16_t*>(k_over_k_out.data) + 2;
  TS_EXPECT_ERROR(rope_forward(qv, k_over_k_out, qo, ko, {}, {}, {}, {}), "argument 'k_out'",
                  "disjoint from 'k' or exactly its view");
  TensorView q_out_over_k(k.data(), DType::kBFloat16, {2, 3, 4, 8});
  TS_EXPECT_ERROR(fwd({}, {}, {}, q_out_over_k), "argument 'q_out'", "disjoint from 'k'");
  TensorView k_out_over_q(q.data(), DType::kBFloat16, {2, 3, 2, 8});
  TS_EXPECT_ERROR(fwd({}, {}, {}, {}, k_out_over_q), "argument 'k_out'", "disjoint from 'q'");
  TensorView k_out_over_q_out(q_out.data(), DType::kBFloat16, {2, 3, 2, 8});
  TS_EXPECT_ERROR(fwd({}, {}, {}, {}, k_out_over_q_out), "argument 'q_out'",
                  "disjoint from 'k_out'");
  HostTensor big_table(DType::kBFloat16, {6, 4}, /*row_pad=*/200);
  big_table.fill_random(-1, 1);
  TensorView q_out_over_table(big_table.data(), DType::kBFloat16, {2, 3, 4, 8});
  TS_EXPECT_ERROR(fwd(big_table.view(), sin_bf.view(), {}, q_out_over_table), "argument 'q_out'",
                  "disjoint from 'cos'");
  TS_EXPECT_ERROR(fwd(cos_bf.view(), big_table.view(), {}, q_out_over_table), "argument 'q_out'",
                  "disjoint from 'sin'");
  HostTensor offs_storage(DType::kInt64, {64});
  offs_storage.fill_random(0, 1);
  TensorView offs_in_k_out = offs_storage.view();
  offs_in_k_out.shape[0] = 2;
  TensorView k_out_over_offs(offs_storage.data(), DType::kBFloat16, {2, 3, 2, 8});
  TS_EXPECT_ERROR(fwd({}, {}, offs_in_k_out, {}, k_out_over_offs), "argument 'k_out'",
                  "disjoint from 'position_offsets'");
}

}  // namespace
}  // namespace trainscale
