// The Hopper attention forward against the fp64 CPU reference run on float64 copies of the same
// rounded inputs. Inputs are fresh random values (seed printed; TRAINSCALE_TEST_SEED repeats), the
// outputs start NaN-poisoned, so an element the kernel does not write fails. On a mismatch the
// test prints the largest errors and where they sit, so a GPU log alone is enough to debug it.
//
// Tolerances (absolute; outputs are averages of values in [-1, 1], so O(1)): bf16 2e-2, fp16 4e-3.
// The kernel rounds the probabilities to the input dtype before the PV GEMM (8 bits of mantissa
// for bf16, 11 for fp16) and the output once more on store; each is a relative error of at most
// 2^-8 / 2^-11 on terms that sum to at most 1 in magnitude, so a few units of 4e-3 (bf16) and
// 5e-4 (fp16) bound them with room. lse (fp32 sums of exact fp32 scores): 1e-3 absolute.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "core/host_dtype.h"
#include "trainscale/attention.h"
#include "util/gpu_util.h"

namespace trainscale {
namespace {

using test::DeviceTensor;
using test::HostTensor;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double out_tolerance(DType dtype) { return dtype == DType::kBFloat16 ? 2e-2 : 4e-3; }
constexpr double kLseTolerance = 1e-3;

struct Config {
  DType dtype = DType::kBFloat16;
  std::int64_t batch = 1, q_len = 1, kv_len = 1, q_heads = 1, kv_heads = 1, head_dim = 64;
  bool causal = false;
  double scale = 0.0;
  std::int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  bool packed = false;     // q, k, v: head slices of one [B, S, Hq + 2 Hkv, D] buffer (Sq == Sk)
  bool with_lse = true;
  std::int64_t out_pad = 0;  // out lives in a [B, Sq, Hq, D + out_pad] buffer
  // NaN planted at (b, s, h, d) of one input: 'q', 'k' or 'v'; 0 for none.
  char nan_in = 0;
  std::int64_t nan_at[4] = {0, 0, 0, 0};
  AttentionSchedule schedule = AttentionSchedule::kAuto;

  std::string str() const {
    std::ostringstream s;
    s << dtype_name(dtype) << " B=" << batch << " Sq=" << q_len << " Sk=" << kv_len << " Hq=" << q_heads
      << " Hkv=" << kv_heads << " D=" << head_dim << (causal ? " causal" : "") << " scale=" << scale
      << " window=(" << window_left << ", " << window_right << ") softcap=" << softcap
      << (packed ? " packed-qkv" : "") << (with_lse ? "" : " no-lse") << " out_pad=" << out_pad
      << (schedule == AttentionSchedule::kDynamic ? " dynamic" : "");
    if (nan_in) s << " NaN in " << nan_in;
    return s.str();
  }
};

// A [B, S, H, D] view of heads [h0, h0 + n) of a [B, S, Hall, D + pad] tensor.
TensorView head_slice(TensorView all, std::int64_t h0, std::int64_t n, std::int64_t d) {
  TensorView t = all;
  t.data = static_cast<char*>(t.data) + h0 * all.strides[2] * static_cast<std::int64_t>(dtype_size(all.dtype));
  t.shape[2] = n;
  t.shape[3] = d;
  return t;
}

// Element offset of logical (b, s, h, d).
std::int64_t offset_of(const TensorView& t, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d) {
  return b * t.strides[0] + s * t.strides[1] + h * t.strides[2] + d * t.strides[3];
}

void set_element(const TensorView& t, const std::int64_t (&at)[4], double value, HostTensor& storage) {
  const std::int64_t base =
      (static_cast<const char*>(t.data) - static_cast<const char*>(storage.data())) /
      static_cast<std::int64_t>(dtype_size(t.dtype));
  storage.set(base + offset_of(t, at[0], at[1], at[2], at[3]), value);
}

// The same values in float64 (what the reference reads).
HostTensor to64(const HostTensor& h) { return HostTensor::from_values(DType::kFloat64, h.shape(), h.values()); }

// The view `t` of `from`'s storage moved onto `to`'s: the same elements, in `to`'s dtype.
TensorView rebase(TensorView t, const HostTensor& from, const HostTensor& to) {
  const std::int64_t elem = (static_cast<const char*>(t.data) - static_cast<const char*>(from.data())) /
                            static_cast<std::int64_t>(dtype_size(t.dtype));
  t.data = static_cast<char*>(to.data()) + elem * static_cast<std::int64_t>(dtype_size(to.dtype()));
  t.dtype = to.dtype();
  return t;
}

// The view `t` of `host`'s storage moved onto its device copy.
TensorView on_device(TensorView t, const HostTensor& host, const DeviceTensor& dev) {
  const std::int64_t bytes = static_cast<const char*>(t.data) - static_cast<const char*>(host.data());
  t.data = static_cast<char*>(dev.view().data) + bytes;
  t.device = Device::cuda(0);
  return t;
}

// Compares a [B, S, H, D] (or [B, H, S] for lse) result against the reference, element by
// element: NaN/Inf must sit where the reference has them, finite values within `tol`.
::testing::AssertionResult compare(const char* what, const TensorView& got, const TensorView& ref,
                                   double tol) {
  const std::int64_t n = got.numel();
  double worst = 0;
  std::int64_t worst_i = -1, mismatched_nonfinite = 0, first_nonfinite = -1, bad = 0;
  std::vector<std::int64_t> index(got.ndim);
  auto element = [&](const TensorView& t, std::int64_t i) {
    std::int64_t off = 0, rest = i;
    for (int d = t.ndim - 1; d >= 0; --d) {
      off += rest % t.shape[d] * t.strides[d];
      rest /= t.shape[d];
    }
    return detail::load_as_double(t.dtype, t.data, off);
  };
  for (std::int64_t i = 0; i < n; ++i) {
    const double g = element(got, i), r = element(ref, i);
    if (!std::isfinite(r) || !std::isfinite(g)) {
      const bool same = (std::isnan(r) && std::isnan(g)) || g == r;
      if (!same) {
        ++mismatched_nonfinite;
        if (first_nonfinite < 0) first_nonfinite = i;
      }
      continue;
    }
    const double e = std::fabs(g - r);
    if (e > tol) ++bad;
    if (e > worst) {
      worst = e;
      worst_i = i;
    }
  }
  auto where = [&](std::int64_t i) {
    std::string s = "[";
    std::int64_t rest = i;
    std::vector<std::int64_t> idx(got.ndim);
    for (int d = got.ndim - 1; d >= 0; --d) {
      idx[d] = rest % got.shape[d];
      rest /= got.shape[d];
    }
    for (int d = 0; d < got.ndim; ++d) {
      if (d) s.append(", ");
      s.append(std::to_string(idx[d]));
    }
    s.append("] got ").append(std::to_string(element(got, i)));
    s.append(" want ").append(std::to_string(element(ref, i)));
    return s;
  };
  std::ostringstream msg;
  msg << what << ": max abs error " << worst << (worst_i >= 0 ? " at " + where(worst_i) : "") << " (tolerance "
      << tol << ", " << bad << " of " << n << " over); " << mismatched_nonfinite << " NaN/Inf mismatches"
      << (first_nonfinite >= 0 ? ", first at " + where(first_nonfinite) : "");
  std::fprintf(stderr, "  %s\n", msg.str().c_str());
  if (bad == 0 && mismatched_nonfinite == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << msg.str();
}

// Runs the CUDA forward and the fp64 reference on the same rounded inputs and compares.
void check(const Config& c) {
  SCOPED_TRACE(c.str());
  std::fprintf(stderr, "[attention_cuda] %s\n", c.str().c_str());
  const std::int64_t B = c.batch, D = c.head_dim;
  HostTensor q_buf, k_buf, v_buf;
  TensorView q, k, v;
  if (c.packed) {
    EXPECT_EQ(c.q_len, c.kv_len);
    q_buf = HostTensor::random(c.dtype, {B, c.q_len, c.q_heads + 2 * c.kv_heads, D});
    q = head_slice(q_buf.view(), 0, c.q_heads, D);
    k = head_slice(q_buf.view(), c.q_heads, c.kv_heads, D);
    v = head_slice(q_buf.view(), c.q_heads + c.kv_heads, c.kv_heads, D);
  } else {
    q_buf = HostTensor::random(c.dtype, {B, c.q_len, c.q_heads, D});
    k_buf = HostTensor::random(c.dtype, {B, c.kv_len, c.kv_heads, D});
    v_buf = HostTensor::random(c.dtype, {B, c.kv_len, c.kv_heads, D});
    q = q_buf.view();
    k = k_buf.view();
    v = v_buf.view();
  }
  if (c.nan_in) {
    const TensorView& t = c.nan_in == 'q' ? q : c.nan_in == 'k' ? k : v;
    HostTensor& storage = c.packed || c.nan_in == 'q' ? q_buf : c.nan_in == 'k' ? k_buf : v_buf;
    set_element(t, c.nan_at, kNaN, storage);
  }
  // float64 copies of the same values, viewed the same way.
  const HostTensor q64 = to64(q_buf);
  const HostTensor k64 = c.packed ? HostTensor() : to64(k_buf);
  const HostTensor v64 = c.packed ? HostTensor() : to64(v_buf);
  const TensorView q_ref = rebase(q, q_buf, q64);
  const TensorView k_ref = c.packed ? rebase(k, q_buf, q64) : rebase(k, k_buf, k64);
  const TensorView v_ref = c.packed ? rebase(v, q_buf, q64) : rebase(v, v_buf, v64);
  HostTensor out_ref(DType::kFloat64, {B, c.q_len, c.q_heads, D});
  HostTensor lse_ref(DType::kFloat64, {B, c.q_heads, c.q_len});
  AttentionOptions options{.causal = c.causal, .scale = c.scale, .window_left = c.window_left,
                           .window_right = c.window_right, .softcap = c.softcap};
  attention_forward(q_ref, k_ref, v_ref, out_ref.view(), lse_ref.view(), options);

  // Device copies (same layouts), outputs poisoned.
  DeviceTensor dq(q_buf);
  std::unique_ptr<DeviceTensor> dk, dv;
  TensorView k_dev, v_dev;
  const TensorView q_dev = on_device(q, q_buf, dq);
  if (c.packed) {
    k_dev = on_device(k, q_buf, dq);
    v_dev = on_device(v, q_buf, dq);
  } else {
    dk = std::make_unique<DeviceTensor>(k_buf);
    dv = std::make_unique<DeviceTensor>(v_buf);
    k_dev = on_device(k, k_buf, *dk);
    v_dev = on_device(v, v_buf, *dv);
  }
  HostTensor out_host(c.dtype, {B, c.q_len, c.q_heads, D + c.out_pad});
  DeviceTensor dout(out_host, /*copy=*/false);
  TensorView out_dev = head_slice(dout.view(), 0, c.q_heads, D);
  HostTensor lse_host(DType::kFloat32, {B, c.q_heads, c.q_len});
  DeviceTensor dlse(lse_host, /*copy=*/false);
  AttentionOptions device_options = options;
  device_options.schedule = c.schedule;
  attention_forward(q_dev, k_dev, v_dev, out_dev, c.with_lse ? dlse.view() : TensorView{}, device_options);
  test::device_synchronize();
  dout.copy_to(out_host);
  dlse.copy_to(lse_host);

  EXPECT_TRUE(compare("out", head_slice(out_host.view(), 0, c.q_heads, D), out_ref.view(),
                      out_tolerance(c.dtype)));
  if (c.with_lse) {
    EXPECT_TRUE(compare("lse", lse_host.view(), lse_ref.view(), kLseTolerance));
  }
  if (c.out_pad > 0) {  // the padding columns stay poisoned
    const TensorView all = out_host.view();
    std::int64_t touched = 0;
    for (std::int64_t i = 0; i < B * c.q_len * c.q_heads; ++i) {
      for (std::int64_t d = D; d < D + c.out_pad; ++d) {
        if (!std::isnan(detail::load_as_double(all.dtype, all.data, i * (D + c.out_pad) + d))) ++touched;
      }
    }
    EXPECT_EQ(touched, 0) << "elements written outside the output view";
  }
}

struct Variant {
  std::int64_t head_dim;
  DType dtype;
  bool causal;
};

std::string variant_name(const ::testing::TestParamInfo<Variant>& info) {
  std::string name = "D";
  name.append(std::to_string(info.param.head_dim)).append("_").append(dtype_name(info.param.dtype));
  name.append(info.param.causal ? "_causal" : "_full");
  return name;
}

class AttentionCuda : public ::testing::TestWithParam<Variant> {};

// Sequence lengths on and off the tiles (1, 17, 129, 1000), Sq != Sk both ways, Sk = 0.
TEST_P(AttentionCuda, MatchesReference) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  const std::int64_t lens[][2] = {{1, 1}, {17, 17}, {129, 129}, {1000, 1000}, {100, 300}, {300, 100}, {64, 0}};
  for (const auto& [sq, sk] : lens) {
    Config c{.dtype = p.dtype, .batch = 2, .q_len = sq, .kv_len = sk, .q_heads = 2, .kv_heads = 1,
             .head_dim = p.head_dim, .causal = p.causal};
    check(c);
  }
}

// Grouped-query (8 query heads on 2 kv heads) and multi-query (8 on 1).
TEST_P(AttentionCuda, GroupedAndMultiQuery) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  for (std::int64_t kv_heads : {2, 1}) {
    check({.dtype = p.dtype, .batch = 1, .q_len = 257, .kv_len = 257, .q_heads = 8, .kv_heads = kv_heads,
           .head_dim = p.head_dim, .causal = p.causal});
  }
}

// q, k, v as head slices of one packed qkv tensor (strided heads); out in padded buffers (odd
// strides: single stores; strides of 2 mod 8: paired stores, no 16-byte ones), no lse; a
// negative scale.
TEST_P(AttentionCuda, StridedHeadsPaddedOutputNegativeScale) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  check({.dtype = p.dtype, .batch = 2, .q_len = 200, .kv_len = 200, .q_heads = 4, .kv_heads = 2,
         .head_dim = p.head_dim, .causal = p.causal, .packed = true});
  check({.dtype = p.dtype, .batch = 1, .q_len = 150, .kv_len = 150, .q_heads = 2, .kv_heads = 2,
         .head_dim = p.head_dim, .causal = p.causal, .with_lse = false, .out_pad = 1});
  check({.dtype = p.dtype, .batch = 1, .q_len = 150, .kv_len = 150, .q_heads = 2, .kv_heads = 2,
         .head_dim = p.head_dim, .causal = p.causal, .out_pad = 2});
  check({.dtype = p.dtype, .batch = 1, .q_len = 130, .kv_len = 130, .q_heads = 2, .kv_heads = 1,
         .head_dim = p.head_dim, .causal = p.causal, .scale = -0.3});
}

// Sliding windows: causal with a left side (Mistral), a band on both sides (the key blocks a
// query block visits start past 0), one key per query, Sq != Sk both ways; rows that see no key.
// A logit softcap of 30 at scale 1 (scores reach the cap), alone, with a window, and with a
// negative scale.
TEST_P(AttentionCuda, WindowAndSoftcap) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  const std::int64_t lens[][2] = {{300, 300}, {200, 520}, {520, 200}};
  for (const auto& [sq, sk] : lens) {
    Config c{.dtype = p.dtype, .batch = 1, .q_len = sq, .kv_len = sk, .q_heads = 4, .kv_heads = 2,
             .head_dim = p.head_dim, .causal = p.causal};
    for (const auto& [left, right] : {std::pair<std::int64_t, std::int64_t>{100, -1}, {37, 0}, {0, 0}}) {
      c.window_left = left;
      c.window_right = right;
      check(c);
    }
    if (!p.causal) {
      c.window_left = 150;
      c.window_right = 70;
      check(c);
      c.window_left = -1;
      c.window_right = 5;
      check(c);
    }
  }
  for (double scale : {1.0, -1.0}) {
    check({.dtype = p.dtype, .batch = 1, .q_len = 257, .kv_len = 257, .q_heads = 4, .kv_heads = 2,
           .head_dim = p.head_dim, .causal = p.causal, .scale = scale, .softcap = 30.0});
  }
  check({.dtype = p.dtype, .batch = 2, .q_len = 300, .kv_len = 300, .q_heads = 2, .kv_heads = 1,
         .head_dim = p.head_dim, .causal = p.causal, .window_left = 64, .softcap = 20.0});
}

// Many (batch, head) tiles on short sequences: more tiles than SMs, the persistent loop.
TEST_P(AttentionCuda, ManyHeadsShortSequences) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  check({.dtype = p.dtype, .batch = 2, .q_len = 40, .kv_len = 40, .q_heads = 64, .kv_heads = 64,
         .head_dim = p.head_dim, .causal = p.causal});
}

// Both schedules whatever kAuto picks: about twice as many tiles as an H100's 132 CTAs, of
// unequal cost (causal, a window), twice in a row (the dynamic counter starts from zero at every
// call: a tile skipped leaves its output poisoned).
TEST_P(AttentionCuda, ExplicitSchedules) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  for (AttentionSchedule schedule : {AttentionSchedule::kStatic, AttentionSchedule::kDynamic}) {
    Config c{.dtype = p.dtype, .batch = 1, .q_len = p.head_dim == 64 ? 400 : 260, .q_heads = 64,
             .kv_heads = 8, .head_dim = p.head_dim, .causal = p.causal, .schedule = schedule};
    c.kv_len = c.q_len;
    check(c);
    check(c);
    c.window_left = 70;
    c.window_right = p.causal ? 0 : 40;
    check(c);
  }
}

// A NaN in q reaches only its query's output and lse; in k or v (non-causal: every query sees
// it) every query of its kv head's group; in k under a causal mask only the queries that see it.
TEST_P(AttentionCuda, NaNPropagates) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  Config c{.dtype = p.dtype, .batch = 2, .q_len = 150, .kv_len = 150, .q_heads = 4, .kv_heads = 2,
           .head_dim = p.head_dim, .causal = p.causal};
  c.nan_in = 'q';
  const std::int64_t at[4] = {1, 77, 3, 5};
  std::copy(at, at + 4, c.nan_at);
  check(c);
  c.nan_at[2] = 1;  // a kv head
  c.nan_in = 'k';
  check(c);
  if (!p.causal) {  // see docs/perf/attention.md: a NaN in v may reach masked queries of its tile
    c.nan_in = 'v';
    check(c);
  }
}

// Same inputs, same bits: no atomics, one order of summation.
TEST_P(AttentionCuda, Deterministic) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  HostTensor q = HostTensor::random(p.dtype, {1, 300, 4, p.head_dim});
  HostTensor k = HostTensor::random(p.dtype, {1, 300, 2, p.head_dim});
  DeviceTensor dq(q), dk(k), dv(k);
  HostTensor a(p.dtype, q.shape()), b(p.dtype, q.shape());
  DeviceTensor da(a, false), db(b, false);
  const AttentionOptions options{.causal = p.causal};
  attention_forward(dq.view(), dk.view(), dv.view(), da.view(), TensorView{}, options);
  attention_forward(dq.view(), dk.view(), dv.view(), db.view(), TensorView{}, options);
  test::device_synchronize();
  da.copy_to(a);
  db.copy_to(b);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.storage_bytes())), 0);
}

std::vector<Variant> all_variants() {
  std::vector<Variant> v;
  for (std::int64_t d : {64, 128, 256})
    for (DType t : {DType::kBFloat16, DType::kFloat16})
      for (bool causal : {false, true}) v.push_back({d, t, causal});
  return v;
}
INSTANTIATE_TEST_SUITE_P(Variants, AttentionCuda, ::testing::ValuesIn(all_variants()), variant_name);

// Arguments the kernel cannot take, rejected on a GPU too (the same checks run first without one,
// tests/attention_test.cc).
TEST(AttentionCudaErrors, UnsupportedHeadDimDtypeAndLayout) {
  TS_REQUIRE_GPU();
  auto run = [](DType dtype, std::int64_t d, std::int64_t pad) {
    HostTensor q(dtype, {1, 8, 2, d + pad});
    DeviceTensor dq(q);
    TensorView v = head_slice(dq.view(), 0, 2, d);
    HostTensor o(dtype, {1, 8, 2, d});
    DeviceTensor dout(o, false);
    attention_forward(v, v, v, dout.view(), TensorView{});
  };
  TS_EXPECT_ERROR(run(DType::kBFloat16, 96, 0), "attention_forward", "'q'", "64, 128 or 256");
  TS_EXPECT_ERROR(run(DType::kFloat32, 64, 0), "attention_forward", "'q'", "float32");
  TS_EXPECT_ERROR(run(DType::kBFloat16, 64, 4), "attention_forward", "'q'", "16-byte");
}

// ---- backward ---------------------------------------------------------------------------------
//
// The CUDA backward against attention_backward on float64 copies. out and lse come from the fp64
// reference forward (out rounded to the input dtype, lse to float32), and the reference backward
// reads those same rounded values, so the comparison isolates the backward (and covers masks and
// softcaps whatever the CUDA forward supports). Gradients start NaN-poisoned.
//
// Tolerance: relative to the largest reference magnitude of each gradient (gradients scale with
// Sq / Sk and the group size): bf16 2e-2, fp16 4e-3. The kernel rounds P and dS to the input
// dtype before the products (relative 2^-9 / 2^-12 per term) and the result once on store;
// summed with random signs these stay a few units of 2^-8 / 2^-11 of the largest value.

struct BackwardConfig {
  DType dtype = DType::kBFloat16;
  std::int64_t batch = 1, q_len = 1, kv_len = 1, q_heads = 1, kv_heads = 1, head_dim = 64;
  AttentionOptions options{};
  bool packed = false;  // q, k, v: head slices of one [B, S, Hq + 2 Hkv, D] buffer (Sq == Sk)
  bool nan_in_q = false;
  std::int64_t nan_at[4] = {0, 0, 0, 0};  // (b, s, h, d) of q

  std::string str() const {
    std::ostringstream s;
    s << "backward " << dtype_name(dtype) << " B=" << batch << " Sq=" << q_len << " Sk=" << kv_len
      << " Hq=" << q_heads << " Hkv=" << kv_heads << " D=" << head_dim << (options.causal ? " causal" : "")
      << " window=(" << options.window_left << ", " << options.window_right << ") softcap=" << options.softcap
      << " scale=" << options.scale << (packed ? " packed-qkv" : "");
    if (nan_in_q) s << " NaN in q";
    return s.str();
  }
};

double grad_tolerance(DType dtype, const HostTensor& ref) {
  double largest = 0;
  for (double x : ref.values()) {
    if (std::isfinite(x)) largest = std::max(largest, std::fabs(x));
  }
  return (dtype == DType::kBFloat16 ? 2e-2 : 4e-3) * std::max(largest, 1e-3);
}

// Host tensors of one backward problem in the input dtype and their float64 twins for the
// reference. Built in place (the views point into the tensors).
struct BackwardProblem {
  HostTensor qkv_buf, k_buf, v_buf, dout, out, lse;  // k_buf, v_buf unused when packed
  TensorView q, k, v;
  HostTensor q64, k64, v64, dout64, out64, lse64;
  TensorView q_ref, k_ref, v_ref;

  explicit BackwardProblem(const BackwardConfig& c);
  BackwardProblem(const BackwardProblem&) = delete;
  BackwardProblem& operator=(const BackwardProblem&) = delete;
};

BackwardProblem::BackwardProblem(const BackwardConfig& c) {
  BackwardProblem& pr = *this;
  const std::int64_t B = c.batch, D = c.head_dim;
  if (c.packed) {
    EXPECT_EQ(c.q_len, c.kv_len);
    pr.qkv_buf = HostTensor::random(c.dtype, {B, c.q_len, c.q_heads + 2 * c.kv_heads, D});
    pr.q = head_slice(pr.qkv_buf.view(), 0, c.q_heads, D);
    pr.k = head_slice(pr.qkv_buf.view(), c.q_heads, c.kv_heads, D);
    pr.v = head_slice(pr.qkv_buf.view(), c.q_heads + c.kv_heads, c.kv_heads, D);
  } else {
    pr.qkv_buf = HostTensor::random(c.dtype, {B, c.q_len, c.q_heads, D});
    pr.k_buf = HostTensor::random(c.dtype, {B, c.kv_len, c.kv_heads, D});
    pr.v_buf = HostTensor::random(c.dtype, {B, c.kv_len, c.kv_heads, D});
    pr.q = pr.qkv_buf.view();
    pr.k = pr.k_buf.view();
    pr.v = pr.v_buf.view();
  }
  if (c.nan_in_q) set_element(pr.q, c.nan_at, kNaN, pr.qkv_buf);
  pr.q64 = to64(pr.qkv_buf);
  pr.q_ref = rebase(pr.q, pr.qkv_buf, pr.q64);
  if (c.packed) {
    pr.k_ref = rebase(pr.k, pr.qkv_buf, pr.q64);
    pr.v_ref = rebase(pr.v, pr.qkv_buf, pr.q64);
  } else {
    pr.k64 = to64(pr.k_buf);
    pr.v64 = to64(pr.v_buf);
    pr.k_ref = pr.k64.view();
    pr.v_ref = pr.v64.view();
  }
  // The forward in fp64, then rounded as a CUDA forward would store it.
  HostTensor out_exact(DType::kFloat64, {B, c.q_len, c.q_heads, D});
  HostTensor lse_exact(DType::kFloat64, {B, c.q_heads, c.q_len});
  attention_forward(pr.q_ref, pr.k_ref, pr.v_ref, out_exact.view(), lse_exact.view(), c.options);
  pr.out = HostTensor::from_values(c.dtype, out_exact.shape(), out_exact.values());
  pr.lse = HostTensor::from_values(DType::kFloat32, lse_exact.shape(), lse_exact.values());
  pr.dout = HostTensor::random(c.dtype, {B, c.q_len, c.q_heads, D});
  pr.out64 = to64(pr.out);
  pr.lse64 = to64(pr.lse);
  pr.dout64 = to64(pr.dout);
}

// Device copies of a problem's inputs, NaN-poisoned gradients and a workspace of the bytes the
// backward asks for.
struct DeviceBackward {
  DeviceTensor qkv, k, v, dout, out, lse;
  HostTensor dq_host, dk_host, dv_host, workspace_host;
  DeviceTensor dq, dk, dv, workspace;
  AttentionBackwardArgs args;

  DeviceBackward(const BackwardProblem& pr, bool packed)
      : qkv(pr.qkv_buf),
        k(packed ? pr.qkv_buf : pr.k_buf),
        v(packed ? pr.qkv_buf : pr.v_buf),
        dout(pr.dout),
        out(pr.out),
        lse(pr.lse),
        dq_host(pr.q.dtype, {pr.q.size(0), pr.q.size(1), pr.q.size(2), pr.q.size(3)}),
        dk_host(pr.k.dtype, {pr.k.size(0), pr.k.size(1), pr.k.size(2), pr.k.size(3)}),
        dv_host(pr.v.dtype, {pr.v.size(0), pr.v.size(1), pr.v.size(2), pr.v.size(3)}),
        workspace_host(DType::kFloat32,
                       {static_cast<std::int64_t>(attention_backward_workspace_bytes(pr.q) / sizeof(float))}),
        dq(dq_host, /*copy=*/false),
        dk(dk_host, /*copy=*/false),
        dv(dv_host, /*copy=*/false),
        workspace(workspace_host, /*copy=*/false) {
    args = {.dout = dout.view(),
            .q = on_device(pr.q, pr.qkv_buf, qkv),
            .k = packed ? on_device(pr.k, pr.qkv_buf, qkv) : k.view(),
            .v = packed ? on_device(pr.v, pr.qkv_buf, qkv) : v.view(),
            .out = out.view(),
            .lse = lse.view(),
            .dq = dq.view(),
            .dk = dk.view(),
            .dv = dv.view(),
            .workspace = workspace.view()};
  }

  void run(const AttentionOptions& options) {
    attention_backward(args, options);
    test::device_synchronize();
    dq.copy_to(dq_host);
    dk.copy_to(dk_host);
    dv.copy_to(dv_host);
  }
};

void check_backward(const BackwardConfig& c) {
  SCOPED_TRACE(c.str());
  std::fprintf(stderr, "[attention_cuda] %s\n", c.str().c_str());
  const BackwardProblem pr(c);
  HostTensor dq_ref(DType::kFloat64, {c.batch, c.q_len, c.q_heads, c.head_dim});
  HostTensor dk_ref(DType::kFloat64, {c.batch, c.kv_len, c.kv_heads, c.head_dim});
  HostTensor dv_ref(DType::kFloat64, {c.batch, c.kv_len, c.kv_heads, c.head_dim});
  attention_backward({.dout = pr.dout64.view(), .q = pr.q_ref, .k = pr.k_ref, .v = pr.v_ref, .out = pr.out64.view(),
                      .lse = pr.lse64.view(), .dq = dq_ref.view(), .dk = dk_ref.view(), .dv = dv_ref.view()},
                     c.options);

  DeviceBackward dev(pr, c.packed);
  dev.run(c.options);
  EXPECT_TRUE(compare("dq", dev.dq_host.view(), dq_ref.view(), grad_tolerance(c.dtype, dq_ref)));
  EXPECT_TRUE(compare("dk", dev.dk_host.view(), dk_ref.view(), grad_tolerance(c.dtype, dk_ref)));
  EXPECT_TRUE(compare("dv", dev.dv_host.view(), dv_ref.view(), grad_tolerance(c.dtype, dv_ref)));
}

class AttentionBackwardCuda : public ::testing::TestWithParam<Variant> {};

// Sequence lengths on and off the tiles (1, 17, 129, 1000), Sq != Sk both ways, Sk = 0 (dq = 0)
// and Sq = 0 (dk = dv = 0).
TEST_P(AttentionBackwardCuda, MatchesReference) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  const std::int64_t lens[][2] = {{1, 1},     {17, 17},  {129, 129}, {1000, 1000},
                                  {100, 300}, {300, 100}, {64, 0},    {0, 64}};
  for (const auto& [sq, sk] : lens) {
    check_backward({.dtype = p.dtype, .batch = 2, .q_len = sq, .kv_len = sk, .q_heads = 2, .kv_heads = 1,
                    .head_dim = p.head_dim, .options = {.causal = p.causal}});
  }
}

// Grouped-query (8 query heads on 2 kv heads) and multi-query (8 on 1): dK and dV sum the group.
TEST_P(AttentionBackwardCuda, GroupedAndMultiQuery) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  for (std::int64_t kv_heads : {2, 1}) {
    check_backward({.dtype = p.dtype, .batch = 1, .q_len = 257, .kv_len = 257, .q_heads = 8,
                    .kv_heads = kv_heads, .head_dim = p.head_dim, .options = {.causal = p.causal}});
  }
}

// q, k, v as head slices of one packed qkv tensor (strided heads); a negative scale.
TEST_P(AttentionBackwardCuda, StridedHeadsNegativeScale) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  check_backward({.dtype = p.dtype, .batch = 2, .q_len = 200, .kv_len = 200, .q_heads = 4, .kv_heads = 2,
                  .head_dim = p.head_dim, .options = {.causal = p.causal}, .packed = true});
  check_backward({.dtype = p.dtype, .batch = 1, .q_len = 130, .kv_len = 130, .q_heads = 2, .kv_heads = 1,
                  .head_dim = p.head_dim, .options = {.causal = p.causal, .scale = -0.3}});
}

// Sliding windows (left 64 / right 0, which with causal is the same mask; left 32 / right 16 when
// not causal), with Sq != Sk so the mask is offset, and a logit softcap of 30.
TEST_P(AttentionBackwardCuda, WindowAndSoftcap) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  AttentionOptions window{.causal = p.causal, .window_left = 64, .window_right = 0};
  if (!p.causal) {
    check_backward({.dtype = p.dtype, .batch = 1, .q_len = 300, .kv_len = 300, .q_heads = 2, .kv_heads = 1,
                    .head_dim = p.head_dim, .options = window});
    window.window_left = 32;
    window.window_right = 16;
  }
  for (const auto& [sq, sk] : {std::pair<std::int64_t, std::int64_t>{300, 300}, {200, 333}, {333, 200}}) {
    check_backward({.dtype = p.dtype, .batch = 1, .q_len = sq, .kv_len = sk, .q_heads = 2, .kv_heads = 1,
                    .head_dim = p.head_dim, .options = window});
  }
  AttentionOptions softcap{.causal = p.causal, .scale = 1.0, .softcap = 30.0};  // scores reach the cap
  check_backward({.dtype = p.dtype, .batch = 1, .q_len = 257, .kv_len = 257, .q_heads = 4, .kv_heads = 2,
                  .head_dim = p.head_dim, .options = softcap});
}

// A NaN in q reaches dq of its query and dk, dv of the keys that query sees: every key of its kv
// head without a mask; with the causal mask it is planted in the last query, which sees every key
// (the kernel's products spread a NaN row over the whole key tile, hidden keys included).
TEST_P(AttentionBackwardCuda, NaNInQueryPropagates) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  BackwardConfig c{.dtype = p.dtype, .batch = 2, .q_len = 150, .kv_len = 150, .q_heads = 4, .kv_heads = 2,
                   .head_dim = p.head_dim, .options = {.causal = p.causal}, .nan_in_q = true};
  const std::int64_t at[4] = {1, p.causal ? 149 : 77, 3, 5};
  std::copy(at, at + 4, c.nan_at);
  check_backward(c);
}

// options.deterministic: same inputs, same bits (the Hopper kernel adds dQ's partials in key-block
// order; the other paths always sum in one order), and still the reference's result, with a
// sliding window too (the order counts the key blocks each query block waits for).
TEST_P(AttentionBackwardCuda, Deterministic) {
  TS_REQUIRE_GPU();
  const Variant p = GetParam();
  const BackwardConfig c{.dtype = p.dtype, .batch = 1, .q_len = 300, .kv_len = 300, .q_heads = 8,
                         .kv_heads = 2, .head_dim = p.head_dim,
                         .options = {.causal = p.causal, .deterministic = true}};
  check_backward(c);
  check_backward({.dtype = p.dtype, .batch = 2, .q_len = 700, .kv_len = 650, .q_heads = 4, .kv_heads = 4,
                  .head_dim = p.head_dim,
                  .options = {.causal = p.causal, .window_left = 200, .deterministic = true}});
  const BackwardProblem pr(c);
  DeviceBackward first(pr, false), second(pr, false);
  first.run(c.options);
  second.run(c.options);
  for (const auto& [a, b] : {std::pair<const HostTensor*, const HostTensor*>{&first.dq_host, &second.dq_host},
                             {&first.dk_host, &second.dk_host},
                             {&first.dv_host, &second.dv_host}}) {
    EXPECT_EQ(std::memcmp(a->data(), b->data(), static_cast<std::size_t>(a->storage_bytes())), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, AttentionBackwardCuda, ::testing::ValuesIn(all_variants()), variant_name);

// On a GPU the backward needs its workspace: the error names the op, the argument, the bytes it
// needs and the bytes it was given.
TEST(AttentionBackwardCudaErrors, WorkspaceMissingOrSmall) {
  TS_REQUIRE_GPU();
  const BackwardConfig c{.dtype = DType::kBFloat16, .batch = 1, .q_len = 100, .kv_len = 100, .q_heads = 4,
                         .kv_heads = 1, .head_dim = 64};
  const BackwardProblem pr(c);
  DeviceBackward dev(pr, false);
  const std::string needed = "at least " + std::to_string(attention_backward_workspace_bytes(pr.q)) + " bytes";
  // D 64 has the Hopper kernel's parts: Sq 100 -> 128 rows of 4 heads: delta and lse * log2(e)
  // (2048 bytes each), 4 counters (256 after alignment), dQ 4 * 128 * 64 floats (131072).
  EXPECT_EQ(attention_backward_workspace_bytes(pr.q), 2048u + 2048u + 256u + 131072u);
  AttentionBackwardArgs args = dev.args;
  args.workspace = TensorView{};
  TS_EXPECT_ERROR(attention_backward(args), "attention_backward", "'workspace'", needed.c_str(), "0 bytes");
  args.workspace = dev.workspace.view();
  args.workspace.shape[0] = 16;
  TS_EXPECT_ERROR(attention_backward(args), "attention_backward", "'workspace'", needed.c_str(), "64 bytes");
}

// ---- packed variable-length sequences ----

// Packed sequences on CUDA (the batched kernels once per sequence) against the CPU varlen
// reference on float64 copies of the same rounded inputs: sequences without queries, without
// keys or both, lengths on and off the tiles, GQA, causal and a window; out and lse (the packed
// [Hq, Tq] layout) NaN-poisoned first; the backward from the forward's out and lse rounded as
// the CUDA forward stores them.
TEST(AttentionVarlenCuda, MatchesReference) {
  TS_REQUIRE_GPU();
  const std::vector<std::int32_t> q_lens = {37, 0, 130, 1, 0, 64}, k_lens = {37, 5, 130, 0, 0, 80};
  const std::int64_t hq = 4, hkv = 2;
  const auto offsets = [](const std::vector<std::int32_t>& lens) {
    std::vector<double> o{0};
    for (std::int32_t n : lens) o.push_back(o.back() + n);
    return HostTensor::from_values(DType::kInt32, {static_cast<std::int64_t>(o.size())}, o);
  };
  const HostTensor cu_q = offsets(q_lens), cu_k = offsets(k_lens);
  const DeviceTensor cu_q_dev(cu_q), cu_k_dev(cu_k);
  const std::int64_t tq = static_cast<std::int64_t>(cu_q.values().back());
  const std::int64_t tk = static_cast<std::int64_t>(cu_k.values().back());
  const AttentionSequences host_seq{cu_q.view(), cu_k.view(), 130, 130};
  const AttentionSequences dev_seq{cu_q_dev.view(), cu_k_dev.view(), 130, 130};
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (const std::int64_t d : {64, 128}) {
      for (const AttentionOptions& options :
           {AttentionOptions{}, AttentionOptions{.causal = true},
            AttentionOptions{.window_left = 16, .window_right = 8}}) {
        SCOPED_TRACE(testing::Message() << dtype_name(dtype) << " D=" << d << " causal=" << options.causal
                                        << " window=" << options.window_left << "/" << options.window_right);
        const HostTensor q = HostTensor::random(dtype, {tq, hq, d}), k = HostTensor::random(dtype, {tk, hkv, d}),
                         v = HostTensor::random(dtype, {tk, hkv, d}), dout = HostTensor::random(dtype, {tq, hq, d});
        const HostTensor q64 = to64(q), k64 = to64(k), v64 = to64(v), dout64 = to64(dout);
        HostTensor out_ref(DType::kFloat64, {tq, hq, d}), lse_ref(DType::kFloat64, {hq, tq});
        attention_varlen_forward(q64.view(), k64.view(), v64.view(), host_seq, out_ref.view(), lse_ref.view(),
                                 options);

        const DeviceTensor q_dev(q), k_dev(k), v_dev(v), dout_dev(dout);
        HostTensor out(dtype, {tq, hq, d}), lse(DType::kFloat32, {hq, tq});
        out.fill_nan();
        lse.fill_nan();
        DeviceTensor out_dev(out), lse_dev(lse);
        attention_varlen_forward(q_dev.view(), k_dev.view(), v_dev.view(), dev_seq, out_dev.view(), lse_dev.view(),
                                 options);
        test::device_synchronize();
        out_dev.copy_to(out);
        lse_dev.copy_to(lse);
        EXPECT_TRUE(compare("out", out.view(), out_ref.view(), out_tolerance(dtype)));
        EXPECT_TRUE(compare("lse", lse.view(), lse_ref.view(), kLseTolerance));

        // The backward from out and lse as the CUDA forward stores them.
        const HostTensor out_rounded = HostTensor::from_values(dtype, out_ref.shape(), out_ref.values());
        const HostTensor lse_rounded = HostTensor::from_values(DType::kFloat32, lse_ref.shape(), lse_ref.values());
        const HostTensor out64 = to64(out_rounded), lse64 = to64(lse_rounded);
        HostTensor dq_ref(DType::kFloat64, {tq, hq, d}), dk_ref(DType::kFloat64, {tk, hkv, d}),
            dv_ref(DType::kFloat64, {tk, hkv, d});
        attention_varlen_backward({.dout = dout64.view(), .q = q64.view(), .k = k64.view(), .v = v64.view(),
                                   .out = out64.view(), .lse = lse64.view(), .dq = dq_ref.view(),
                                   .dk = dk_ref.view(), .dv = dv_ref.view()},
                                  host_seq, options);
        const DeviceTensor out_r_dev(out_rounded), lse_r_dev(lse_rounded);
        HostTensor dq(dtype, {tq, hq, d}), dk(dtype, {tk, hkv, d}), dv(dtype, {tk, hkv, d});
        for (HostTensor* t : {&dq, &dk, &dv}) t->fill_nan();
        DeviceTensor dq_dev(dq), dk_dev(dk), dv_dev(dv);
        attention_varlen_backward({.dout = dout_dev.view(), .q = q_dev.view(), .k = k_dev.view(), .v = v_dev.view(),
                                   .out = out_r_dev.view(), .lse = lse_r_dev.view(), .dq = dq_dev.view(),
                                   .dk = dk_dev.view(), .dv = dv_dev.view()},
                                  dev_seq, options);
        test::device_synchronize();
        dq_dev.copy_to(dq);
        dk_dev.copy_to(dk);
        dv_dev.copy_to(dv);
        EXPECT_TRUE(compare("dq", dq.view(), dq_ref.view(), grad_tolerance(dtype, dq_ref)));
        EXPECT_TRUE(compare("dk", dk.view(), dk_ref.view(), grad_tolerance(dtype, dk_ref)));
        EXPECT_TRUE(compare("dv", dv.view(), dv_ref.view(), grad_tolerance(dtype, dv_ref)));
      }
    }
  }
}

// Offsets on the GPU are checked as on the CPU once read back: the error names the op and the
// argument.
TEST(AttentionVarlenCuda, OffsetsCheckedOnTheDevice) {
  TS_REQUIRE_GPU();
  const HostTensor q = HostTensor::random(DType::kBFloat16, {5, 2, 64});
  const HostTensor k = HostTensor::random(DType::kBFloat16, {5, 2, 64});
  const DeviceTensor q_dev(q), k_dev(k);
  HostTensor out(DType::kBFloat16, {5, 2, 64});
  DeviceTensor out_dev(out, /*copy=*/false);
  const HostTensor good = HostTensor::from_values(DType::kInt32, {3}, {0, 2, 5});
  const HostTensor decreasing = HostTensor::from_values(DType::kInt32, {3}, {0, 6, 5});
  const DeviceTensor good_dev(good), decreasing_dev(decreasing);
  TS_EXPECT_ERROR(attention_varlen_forward(q_dev.view(), k_dev.view(), k_dev.view(),
                                           {decreasing_dev.view(), good_dev.view(), 6, 5}, out_dev.view(), {}),
                  "attention_varlen_forward", "'cu_seqlens_q'", "non-decreasing", "6 then 5");
  TS_EXPECT_ERROR(attention_varlen_forward(q_dev.view(), k_dev.view(), k_dev.view(),
                                           {good_dev.view(), good_dev.view(), 5, 2}, out_dev.view(), {}),
                  "attention_varlen_forward", "'cu_seqlens_k'", "max_seqlen_k = 2");
}

}  // namespace
}  // namespace trainscale
