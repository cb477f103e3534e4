// RoPE kernels against the fp64 CPU reference. Inputs are rounded to the kernel's dtype first;
// the reference runs on float64 copies of exactly those values (and of the rounded tables).
// q / k live in flat buffers laid out as [B, S, H, D + pad] (bshd) or [B, H, S, D + pad] (bhsd),
// optionally starting `misalign` elements past the allocation; every element of an output
// buffer outside the views written is checked bit for bit afterwards (still poisoned out of
// place, unchanged in place), and so are the pass-through dims [rotary_dim, D).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ops/rope/rope_cuda.h"
#include "trainscale/rope.h"
#include "util/gpu_util.h"

namespace trainscale {
namespace {

using ops::rope::RopeVariant;
using test::DeviceTensor;
using test::HostTensor;

constexpr DType kDtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
constexpr RopeStyle kStyles[] = {RopeStyle::kNeox, RopeStyle::kGptJ};

// Flat storage for B x S x H head vectors of D elements (+ pad), in bshd or bhsd order.
struct Buffer {
  DType dtype;
  std::int64_t B, S, H, D, pad, misalign;
  bool bhsd;
  HostTensor mem;

  Buffer(DType dt, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d,
         std::int64_t pad_, std::int64_t misalign_, bool bhsd_, bool random)
      : dtype(dt), B(b), S(s), H(h), D(d), pad(pad_), misalign(misalign_), bhsd(bhsd_),
        mem(dt, {size()}) {
    if (random) mem.fill_random(-2, 2);  // pads and unused heads get values too
  }
  std::int64_t row() const { return D + pad; }
  std::int64_t size() const { return misalign + B * S * H * row(); }
  std::int64_t index(std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d) const {
    const std::int64_t r = bhsd ? (b * H + h) * S + s : (b * S + s) * H + h;
    return misalign + r * row() + d;
  }
  std::array<std::int64_t, 4> strides() const {
    if (bhsd) return {H * S * row(), row(), S * row(), 1};
    return {S * H * row(), H * row(), row(), 1};
  }
  // Heads [h0, h0 + nh) of the buffer at `base` as a [B, S, nh, D] view.
  TensorView view(void* base, std::int64_t h0, std::int64_t nh, Device device) const {
    const auto st = strides();
    char* p = static_cast<char*>(base) +
              (misalign + h0 * st[2]) * static_cast<std::int64_t>(dtype_size(dtype));
    return TensorView(p, dtype, {B, S, nh, D}, {st[0], st[1], st[2], st[3]}, device);
  }
};

std::uint64_t bits(const HostTensor& t, std::int64_t flat) {
  std::uint64_t v = 0;
  const std::size_t size = dtype_size(t.dtype());
  std::memcpy(&v, static_cast<const char*>(t.data()) + flat * static_cast<std::int64_t>(size),
              size);
  return v;
}

std::uint64_t poison_bits(DType dt) {
  return dtype_size(dt) == 8 ? ~0ull : (1ull << (8 * dtype_size(dt))) - 1;
}

// Heads [h0, h0 + nh) of a buffer's storage `mem` as [B, S, nh, D] values.
std::vector<double> gather(const Buffer& buf, const HostTensor& mem, std::int64_t h0,
                           std::int64_t nh) {
  std::vector<double> out;
  out.reserve(static_cast<std::size_t>(buf.B * buf.S * nh * buf.D));
  for (std::int64_t b = 0; b < buf.B; ++b)
    for (std::int64_t s = 0; s < buf.S; ++s)
      for (std::int64_t h = 0; h < nh; ++h)
        for (std::int64_t d = 0; d < buf.D; ++d) out.push_back(mem.at(buf.index(b, s, h0 + h, d)));
  return out;
}

enum class Tables { kTheta, kFloat32, kSameDtype };
enum class Offsets { kNone, kInt32, kInt64 };

struct Case {
  DType dtype = DType::kBFloat16;
  RopeStyle style = RopeStyle::kNeox;
  bool backward = false;
  std::int64_t B = 2, S = 33, Hq = 4, Hk = 2, D = 128, R = -1;  // Hk == 0: no k
  bool bhsd = false;
  std::int64_t pad = 0, misalign = 0;
  bool in_place = false;
  bool fused = false;  // q, k (and Hk more "v" heads) as head slices of one buffer
  Tables tables = Tables::kTheta;
  std::int64_t table_pad = 0;
  Offsets offsets = Offsets::kInt32;
  std::int64_t max_offset = 100;
  std::vector<std::int64_t> offset_values;  // fixed offsets (else random in [0, max_offset])
  double theta = 10000.0;
  RopeVariant variant = RopeVariant::kAuto;
  // (b, s, h, d) of q elements set to NaN.
  std::vector<std::array<std::int64_t, 4>> q_nans;

  std::string name() const {
    const char* table_names[] = {"theta", "f32 tables", "dtype tables"};
    const char* offset_names[] = {"no offsets", "int32 offsets", "int64 offsets"};
    const char* variant_names[] = {"auto", "vector", "scalar"};
    return std::string(dtype_name(dtype)) + " " + rope_style_name(style) +
           (backward ? " bwd" : " fwd") + " B" + std::to_string(B) + " S" + std::to_string(S) +
           " Hq" + std::to_string(Hq) + " Hk" + std::to_string(Hk) + " D" + std::to_string(D) +
           " R" + std::to_string(R) + (bhsd ? " bhsd" : " bshd") + " pad" + std::to_string(pad) +
           " misalign" + std::to_string(misalign) + (in_place ? " in-place" : " out-of-place") +
           (fused ? " fused" : "") + " " + table_names[static_cast<int>(tables)] + " tpad" +
           std::to_string(table_pad) + " " + offset_names[static_cast<int>(offsets)] + " " +
           variant_names[static_cast<int>(variant)];
  }
};

struct Errors {
  double q_rel = 0, k_rel = 0, q_max = 0, k_max = 0;
};

// Where one of q / k lives: a buffer (index into the case's buffers) and its head range.
struct Slot {
  int buffer;
  std::int64_t h0, heads;
};

Errors run_case(const Case& c) {
  SCOPED_TRACE(c.name());
  const std::int64_t R = c.R < 0 ? c.D : c.R;
  const bool has_k = c.Hk > 0;

  // Inputs: buffers 0 (q, or the fused qkv) and 1 (k, when separate).
  std::vector<std::unique_ptr<Buffer>> in;
  auto make = [&](std::int64_t heads, bool random) {
    return std::make_unique<Buffer>(c.dtype, c.B, c.S, heads, c.D, c.pad, c.misalign, c.bhsd,
                                    random);
  };
  in.push_back(make(c.fused ? c.Hq + 2 * c.Hk : c.Hq, true));
  if (has_k && !c.fused) in.push_back(make(c.Hk, true));
  const Slot q_in{0, 0, c.Hq};
  const Slot k_in = c.fused ? Slot{0, c.Hq, c.Hk} : Slot{1, 0, c.Hk};
  for (const auto& n : c.q_nans) in[0]->mem.set(in[0]->index(n[0], n[1], n[2], n[3]), NAN);

  // Outputs: the inputs (in place) or poisoned buffers of the same structure.
  std::vector<std::unique_ptr<Buffer>> out;
  if (!c.in_place) {
    for (const auto& b : in) out.push_back(make(b->H, false));
  }
  std::vector<std::unique_ptr<DeviceTensor>> d_in, d_out;
  for (const auto& b : in) d_in.push_back(std::make_unique<DeviceTensor>(b->mem));
  for (const auto& b : out) d_out.push_back(std::make_unique<DeviceTensor>(b->mem, false));
  auto& out_bufs = c.in_place ? in : out;
  auto& d_out_bufs = c.in_place ? d_in : d_out;

  const Device cuda = Device::cuda(0);
  auto view_of = [&](const std::vector<std::unique_ptr<Buffer>>& bufs,
                     const std::vector<std::unique_ptr<DeviceTensor>>& dev, const Slot& slot) {
    return bufs[slot.buffer]->view(dev[slot.buffer]->view().data, slot.h0, slot.heads, cuda);
  };
  const TensorView q = view_of(in, d_in, q_in);
  const TensorView k = has_k ? view_of(in, d_in, k_in) : TensorView{};
  const TensorView q_out = view_of(out_bufs, d_out_bufs, q_in);
  const TensorView k_out = has_k ? view_of(out_bufs, d_out_bufs, k_in) : TensorView{};

  // Position offsets and tables.
  HostTensor offs;
  std::int64_t max_position = c.S - 1;
  if (c.offsets != Offsets::kNone) {
    offs = HostTensor(c.offsets == Offsets::kInt32 ? DType::kInt32 : DType::kInt64, {c.B});
    if (c.offset_values.empty()) {
      offs.fill_random(0, static_cast<double>(c.max_offset));
    } else {
      for (std::int64_t b = 0; b < c.B; ++b) offs.set(b, static_cast<double>(c.offset_values[b]));
    }
    for (std::int64_t b = 0; b < c.B; ++b) {
      max_position = std::max(max_position, static_cast<std::int64_t>(offs.at(b)) + c.S - 1);
    }
  }
  const std::int64_t positions = max_position + 1;
  HostTensor cos_t, sin_t, cos64, sin64;
  if (c.tables != Tables::kTheta) {
    const DType tdt = c.tables == Tables::kFloat32 ? DType::kFloat32 : c.dtype;
    cos_t = HostTensor(tdt, {positions, R / 2}, c.table_pad);
    sin_t = HostTensor(tdt, {positions, R / 2}, c.table_pad);
    for (std::int64_t p = 0; p < positions; ++p) {
      for (std::int64_t i = 0; i < R / 2; ++i) {
        const double angle = static_cast<double>(p) * std::pow(c.theta, -2.0 * i / R);
        cos_t.set(p * (R / 2) + i, std::cos(angle));
        sin_t.set(p * (R / 2) + i, std::sin(angle));
      }
    }
    cos64 = HostTensor::from_values(DType::kFloat64, {positions, R / 2}, cos_t.values());
    sin64 = HostTensor::from_values(DType::kFloat64, {positions, R / 2}, sin_t.values());
  }
  std::unique_ptr<DeviceTensor> d_offs, d_cos, d_sin;
  if (c.offsets != Offsets::kNone) d_offs = std::make_unique<DeviceTensor>(offs);
  if (c.tables != Tables::kTheta) {
    d_cos = std::make_unique<DeviceTensor>(cos_t);
    d_sin = std::make_unique<DeviceTensor>(sin_t);
  }
  const TensorView offs_view = d_offs ? d_offs->view() : TensorView{};
  const TensorView cos_view = d_cos ? d_cos->view() : TensorView{};
  const TensorView sin_view = d_sin ? d_sin->view() : TensorView{};

  // The kernel.
  const RopeOptions opt{c.style, c.R, c.theta};
  if (c.variant == RopeVariant::kAuto) {
    (c.backward ? rope_backward : rope_forward)(q, k, q_out, k_out, cos_view, sin_view, offs_view,
                                                opt, nullptr);
  } else {
    ops::rope::rope_cuda(c.backward ? ops::rope::Direction::kBackward
                                    : ops::rope::Direction::kForward,
                         q, k, q_out, k_out, cos_view, sin_view, offs_view, R, opt, nullptr,
                         c.variant);
  }
  std::vector<HostTensor> result;
  for (const auto& d : d_out_bufs) result.push_back(d->to_host());

  // The reference on float64 copies.
  const std::vector<std::int64_t> q_shape = {c.B, c.S, c.Hq, c.D}, k_shape = {c.B, c.S, c.Hk, c.D};
  const auto q64 = HostTensor::from_values(DType::kFloat64, q_shape,
                                           gather(*in[0], in[0]->mem, q_in.h0, c.Hq));
  HostTensor k64, q_ref(DType::kFloat64, q_shape), k_ref;
  if (has_k) {
    k64 = HostTensor::from_values(DType::kFloat64, k_shape,
                                  gather(*in[k_in.buffer], in[k_in.buffer]->mem, k_in.h0, c.Hk));
    k_ref = HostTensor(DType::kFloat64, k_shape);
  }
  (c.backward ? rope_backward : rope_forward)(
      q64.view(), has_k ? k64.view() : TensorView{}, q_ref.view(),
      has_k ? k_ref.view() : TensorView{}, c.tables != Tables::kTheta ? cos64.view() : TensorView{},
      c.tables != Tables::kTheta ? sin64.view() : TensorView{},
      c.offsets != Offsets::kNone ? offs.view() : TensorView{}, opt, nullptr);

  Errors e;
  const double tol = test::tolerance(c.dtype);
  const auto q_got = gather(*out_bufs[q_in.buffer], result[q_in.buffer], q_in.h0, c.Hq);
  const auto q_want = q_ref.values();
  EXPECT_TRUE(test::matches_reference(q_got, q_want, tol)) << "q_out";
  e.q_rel = test::rel_l2(q_got, q_want);
  e.q_max = test::max_abs_err(q_got, q_want);
  if (has_k) {
    const auto k_got = gather(*out_bufs[k_in.buffer], result[k_in.buffer], k_in.h0, c.Hk);
    const auto k_want = k_ref.values();
    EXPECT_TRUE(test::matches_reference(k_got, k_want, tol)) << "k_out";
    e.k_rel = test::rel_l2(k_got, k_want);
    e.k_max = test::max_abs_err(k_got, k_want);
  }

  // Bits: pass-through dims equal the input's; everything outside the written views is
  // still poisoned (out of place) or unchanged (in place).
  for (std::size_t bi = 0; bi < out_bufs.size(); ++bi) {
    const Buffer& ob = *out_bufs[bi];
    std::vector<char> covered(static_cast<std::size_t>(ob.size()), 0);
    int tail_mismatches = 0, outside_mismatches = 0;
    std::vector<Slot> slots = {q_in};
    if (has_k) slots.push_back(k_in);
    for (const Slot& slot : slots) {
      if (slot.buffer != static_cast<int>(bi)) continue;
      const Buffer& ib = *in[slot.buffer];
      for (std::int64_t b = 0; b < ob.B; ++b)
        for (std::int64_t s = 0; s < ob.S; ++s)
          for (std::int64_t h = slot.h0; h < slot.h0 + slot.heads; ++h)
            for (std::int64_t d = 0; d < ob.D; ++d) {
              const std::int64_t o = ob.index(b, s, h, d);
              covered[static_cast<std::size_t>(o)] = 1;
              if (d >= R && bits(result[bi], o) != bits(ib.mem, ib.index(b, s, h, d))) {
                ++tail_mismatches;
              }
            }
    }
    for (std::int64_t i = 0; i < ob.size(); ++i) {
      if (covered[static_cast<std::size_t>(i)]) continue;
      const std::uint64_t expected = c.in_place ? bits(in[bi]->mem, i) : poison_bits(c.dtype);
      if (bits(result[bi], i) != expected) ++outside_mismatches;
    }
    EXPECT_EQ(tail_mismatches, 0) << "pass-through dims differ from the input in buffer " << bi;
    EXPECT_EQ(outside_mismatches, 0) << "elements outside the outputs changed in buffer " << bi;
  }
  return e;
}

TEST(RopeCuda, EveryDtypeStyleDirectionAndVariant) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (RopeStyle style : kStyles)
      for (bool backward : {false, true})
        for (RopeVariant variant : {RopeVariant::kAuto, RopeVariant::kVector, RopeVariant::kScalar}) {
          Case c;
          c.dtype = dt;
          c.style = style;
          c.backward = backward;
          c.variant = variant;
          run_case(c);
        }
}

TEST(RopeCuda, HeadDimsAndPartialRotaryDims) {
  TS_REQUIRE_GPU();
  // (D, R): full, partial, an odd-ish D with R = 32, R below one 16-byte vector (NeoX falls
  // back to the scalar path; a GPT-J vector straddles R), no rotation, odd and tiny heads.
  const std::int64_t dims[][2] = {{64, 64}, {128, 128}, {128, 64}, {80, 32}, {128, 4},
                                  {64, 0},  {7, 6},     {10, 10},  {2, 2},   {96, 48}};
  for (DType dt : kDtypes)
    for (RopeStyle style : kStyles)
      for (const auto& dr : dims)
        for (RopeVariant variant : {RopeVariant::kAuto, RopeVariant::kScalar})
          for (bool in_place : {false, true}) {
            Case c;
            c.dtype = dt;
            c.style = style;
            c.D = dr[0];
            c.R = dr[1];
            c.S = 9;
            c.Hq = 3;
            c.Hk = 2;
            c.variant = variant;
            c.in_place = in_place;
            c.backward = in_place;  // both directions, without doubling the count
            run_case(c);
          }
}

TEST(RopeCuda, LayoutsInPlaceAndFusedQkv) {
  TS_REQUIRE_GPU();
  for (DType dt : {DType::kBFloat16, DType::kFloat32})
    for (RopeStyle style : kStyles)
      for (bool bhsd : {false, true})
        for (std::int64_t pad : {0, 8, 3})
          for (bool in_place : {false, true})
            for (bool fused : {false, true}) {
              Case c;
              c.dtype = dt;
              c.style = style;
              c.bhsd = bhsd;
              c.pad = pad;  // 8 keeps 16-byte strides; 3 forces the scalar path
              c.in_place = in_place;
              c.fused = fused;
              c.R = 64;  // pass-through dims: untouched in place, copied out of place
              c.S = 17;
              c.Hq = 5;
              c.Hk = 2;
              run_case(c);
              c.backward = true;
              c.R = -1;
              run_case(c);
            }
}

TEST(RopeCuda, TablesAndPositionOffsets) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (RopeStyle style : kStyles)
      for (Tables tables : {Tables::kTheta, Tables::kFloat32, Tables::kSameDtype})
        for (std::int64_t table_pad : {0, 3})
          for (Offsets offsets : {Offsets::kNone, Offsets::kInt32, Offsets::kInt64}) {
            if (tables == Tables::kTheta && table_pad != 0) continue;
            Case c;
            c.dtype = dt;
            c.style = style;
            c.tables = tables;
            c.table_pad = table_pad;  // 3: rows not 16-byte aligned (element table loads)
            c.offsets = offsets;
            c.S = 17;
            c.Hq = 4;
            c.Hk = 1;
            c.D = 64;
            c.theta = 500.0;
            run_case(c);
            c.backward = true;
            c.R = 32;
            run_case(c);
          }
}

TEST(RopeCuda, GroupedQueryHeadsAndAbsentK) {
  TS_REQUIRE_GPU();
  // (Hq, Hk): Llama-3 GQA, no k, one head each, a thread's pair of heads straddling q and k.
  const std::int64_t heads[][2] = {{32, 8}, {8, 0}, {1, 0}, {1, 1}, {3, 1}, {6, 3}, {2, 5}};
  for (DType dt : {DType::kBFloat16, DType::kFloat32})
    for (RopeStyle style : kStyles)
      for (const auto& h : heads) {
        Case c;
        c.dtype = dt;
        c.style = style;
        c.Hq = h[0];
        c.Hk = h[1];
        c.S = 16;
        run_case(c);
        c.backward = true;
        c.in_place = true;
        run_case(c);
      }
}

TEST(RopeCuda, LargeRotaryDimsAndShortSequences) {
  TS_REQUIRE_GPU();
  // R = 2048: the largest shared angle tables (16-24 KB per block); R = 8192: tables over the
  // shared memory budget, angles computed per thread.
  for (DType dt : {DType::kBFloat16, DType::kFloat32})
    for (RopeStyle style : kStyles)
      for (std::int64_t r : {std::int64_t{2048}, std::int64_t{8192}})
        for (RopeVariant variant : {RopeVariant::kAuto, RopeVariant::kScalar}) {
          Case c;
          c.dtype = dt;
          c.style = style;
          c.variant = variant;
          c.B = 2;
          c.S = 3;
          c.Hq = 2;
          c.Hk = 1;
          c.D = 8192;
          c.R = r;
          c.tables = r == 2048 ? Tables::kTheta : Tables::kFloat32;
          run_case(c);
          c.backward = true;
          c.tables = r == 2048 ? Tables::kSameDtype : Tables::kTheta;
          run_case(c);
        }
  // Sequences of one and two tokens: a block's tile spans many sequences (and batch indices).
  for (std::int64_t s : {std::int64_t{1}, std::int64_t{2}})
    for (RopeStyle style : kStyles) {
      Case c;
      c.style = style;
      c.B = 300;
      c.S = s;
      c.Hq = 1;
      c.Hk = 1;
      c.D = 16;
      c.max_offset = 5000;
      run_case(c);
    }
}

TEST(RopeCuda, MisalignedViewsTakeTheScalarPath) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (RopeStyle style : kStyles) {
      Case c;
      c.dtype = dt;
      c.style = style;
      c.misalign = 1;
      c.S = 9;
      run_case(c);
      c.in_place = true;
      c.fused = true;
      c.backward = true;
      run_case(c);
    }
  // Forcing the vector path on such views is an error, not a fault.
  HostTensor q(DType::kBFloat16, {1, 2, 1, 9});
  DeviceTensor d_q(q);
  TensorView v = d_q.view();
  v.data = static_cast<char*>(v.data) + 2;
  v.shape[3] = 8;
  TS_EXPECT_ERROR(ops::rope::rope_cuda(ops::rope::Direction::kForward, v, {}, v, {}, {}, {}, {}, 8,
                                       {}, nullptr, RopeVariant::kVector),
                  "rope_forward", "vector variant");
}

TEST(RopeCuda, NaNPropagatesAsInTheReference) {
  TS_REQUIRE_GPU();
  for (DType dt : kDtypes)
    for (RopeStyle style : kStyles)
      for (RopeVariant variant : {RopeVariant::kAuto, RopeVariant::kScalar}) {
        Case c;
        c.dtype = dt;
        c.style = style;
        c.variant = variant;
        c.D = 64;
        c.R = 48;
        c.S = 5;
        // In a rotated pair (its partner turns NaN too), at position 0 (sin = 0), in the tail.
        c.q_nans = {{0, 1, 0, 3}, {1, 0, 2, 10}, {1, 3, 3, 50}, {0, 4, 1, 63}};
        c.offsets = Offsets::kNone;
        run_case(c);
        c.in_place = true;
        c.tables = Tables::kFloat32;
        run_case(c);
      }
}

TEST(RopeCuda, ThetaAnglesAtLongPositionsStayWithinFloat32Tolerance) {
  TS_REQUIRE_GPU();
  // Positions up to 8191 (and up to ~2^20), float32 data: the angle is formed in double.
  for (std::int64_t base : {std::int64_t{8192}, std::int64_t{1} << 20})
    for (RopeStyle style : kStyles)
      for (bool backward : {false, true}) {
        Case c;
        c.dtype = DType::kFloat32;
        c.style = style;
        c.backward = backward;
        c.B = 4;
        c.S = 256;
        c.Hq = 2;
        c.Hk = 1;
        c.offsets = Offsets::kInt64;
        c.offset_values = {0, base / 4, base / 2, base - c.S};
        const Errors e = run_case(c);
        std::printf("[rope theta fp32] max position %lld %s %s: rel L2 q %.3g k %.3g, max abs q "
                    "%.3g k %.3g\n",
                    static_cast<long long>(base - 1), rope_style_name(style),
                    backward ? "bwd" : "fwd", e.q_rel, e.k_rel, e.q_max, e.k_max);
        ::testing::Test::RecordProperty(
            "rel_l2_" + std::to_string(base) + "_" + rope_style_name(style) +
                (backward ? "_bwd" : "_fwd"),
            std::to_string(e.q_rel));
      }
}

TEST(RopeCuda, ManyItemsPerThread) {
  TS_REQUIRE_GPU();
  // More work items than one wave of threads: the grid-stride loop runs several times.
  Case c;
  c.B = 4;
  c.S = 4096;
  c.Hq = 4;
  c.Hk = 1;
  c.style = RopeStyle::kGptJ;  // 16 chunks per head: 524288 items on the vector path
  c.offsets = Offsets::kNone;
  run_case(c);
  c.B = 2;
  c.S = 2048;
  c.Hq = 8;
  c.Hk = 2;
  c.style = RopeStyle::kNeox;
  c.variant = RopeVariant::kScalar;  // 64 pairs per head: 786432 items
  c.backward = true;
  run_case(c);
}

TEST(RopeCuda, EmptyTensorsLaunchNothing) {
  TS_REQUIRE_GPU();
  for (std::vector<std::int64_t> shape :
       {std::vector<std::int64_t>{0, 3, 2, 8}, {2, 0, 2, 8}, {2, 3, 0, 8}, {2, 3, 2, 0}}) {
    HostTensor q(DType::kBFloat16, shape);
    DeviceTensor d_q(q), d_out(q, false);
    rope_forward(d_q.view(), {}, d_out.view(), {}, {}, {}, {}, {RopeStyle::kNeox, 0});
    rope_backward(d_q.view(), d_q.view(), d_out.view(), d_out.view(), {}, {}, {},
                  {RopeStyle::kGptJ, 0});
  }
  test::device_synchronize();
}

TEST(RopeCuda, RunsOnTheCallersStreamAndInACudaGraph) {
  TS_REQUIRE_GPU();
  const std::int64_t B = 2, S = 64, Hq = 8, Hk = 2, D = 128;
  auto q = HostTensor::random(DType::kBFloat16, {B, S, Hq, D});
  auto k = HostTensor::random(DType::kBFloat16, {B, S, Hk, D});
  HostTensor offs(DType::kInt32, {B});
  offs.set(0, 5);
  offs.set(1, 900);
  HostTensor q_ref(DType::kBFloat16, {B, S, Hq, D}), k_ref(DType::kBFloat16, {B, S, Hk, D});
  rope_forward(q.view(), k.view(), q_ref.view(), k_ref.view(), {}, {}, offs.view());
  DeviceTensor d_q(q), d_k(k), d_offs(offs), d_q_out(q_ref, false), d_k_out(k_ref, false);

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  rope_forward(d_q.view(), d_k.view(), d_q_out.view(), d_k_out.view(), {}, {}, d_offs.view(), {},
               stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_TRUE(test::matches_reference(d_q_out.to_host().values(), q_ref.values(), 1e-2));

  // Captured (after the warm-up call above), then replayed twice: out of place, so every
  // replay writes the same result.
  d_q_out.poison();
  d_k_out.poison();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  rope_forward(d_q.view(), d_k.view(), d_q_out.view(), d_k_out.view(), {}, {}, d_offs.view(), {},
               stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  }
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_TRUE(test::matches_reference(d_q_out.to_host().values(), q_ref.values(), 1e-2));
  EXPECT_TRUE(test::matches_reference(d_k_out.to_host().values(), k_ref.values(), 1e-2));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace trainscale
