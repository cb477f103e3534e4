// FP8 kernels against the CPU reference, bit for bit: the bytes of q and q_t (row padding
// included: it must stay poisoned) and the float bits of scales and scales_t. The one allowed
// difference is the NaN encoding: the reference writes 0x7F (e4m3) / 0x7E (e5m2); the GPU cast may
// write another NaN byte, so NaN codes match any NaN code (the bytes seen are printed).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ops/fp8/fp8_internal.h"
#include "trainscale/fp8.h"
#include "util/gpu_util.h"

namespace trainscale {
namespace {

using test::DeviceTensor;
using test::HostTensor;

constexpr DType kInputTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
constexpr DType kFp8Types[] = {DType::kFloat8E4M3, DType::kFloat8E5M2};
constexpr Fp8Granularity kGranularities[] = {Fp8Granularity::kTensor, Fp8Granularity::kRow,
                                             Fp8Granularity::kTile1x128,
                                             Fp8Granularity::kBlock128x128};

// Row padding that makes a row of n elements a multiple of `m` elements.
std::int64_t pad_to(std::int64_t n, std::int64_t m) { return (m - n % m) % m; }

std::vector<Fp8QuantizeOptions> every_layout(bool power_of_two) {
  std::vector<Fp8QuantizeOptions> layouts;
  for (Fp8Granularity g : kGranularities) layouts.push_back({g, power_of_two, false});
  layouts.push_back({Fp8Granularity::kTile1x128, power_of_two, true});
  return layouts;
}

// The scales' shape as the op validates it (fp8_test.cc checks the grid on its own).
std::vector<std::int64_t> scales_shape(const Fp8QuantizeOptions& o, std::int64_t rows,
                                       std::int64_t cols) {
  const ops::fp8::ScaleGrid grid = ops::fp8::scale_grid(o, rows, cols);
  if (grid.ndim == 1) return {grid.shape[0]};
  return {grid.shape[0], grid.shape[1]};
}

std::string describe(const Fp8QuantizeOptions& o, DType fp8, DType input, std::int64_t M,
                     std::int64_t N, bool transpose, bool aligned) {
  return std::string(fp8_granularity_name(o.granularity)) + (o.scales_m_major ? " m-major" : "") +
         (o.power_of_two_scales ? " pow2" : "") + " " + dtype_name(fp8) + " from " +
         dtype_name(input) + " M=" + std::to_string(M) + " N=" + std::to_string(N) +
         (transpose ? " +transposed" : "") + (aligned ? " aligned" : " unaligned");
}

bool is_nan_code(DType fp8, std::uint8_t c) {
  return fp8 == DType::kFloat8E4M3 ? (c & 0x7F) == 0x7F : (c & 0x7F) > 0x7C;
}

// NaN bytes the GPU wrote, per format (printed by the tests that make NaNs).
std::set<unsigned>& nan_bytes_seen(DType fp8) {
  static std::set<unsigned> e4m3, e5m2;
  return fp8 == DType::kFloat8E4M3 ? e4m3 : e5m2;
}

void print_nan_bytes() {
  for (DType fp8 : kFp8Types) {
    std::string seen;
    for (unsigned b : nan_bytes_seen(fp8)) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02X ", b);
      seen += hex;
    }
    std::printf("[fp8_cuda] %s NaN bytes written by the GPU: %s(reference writes %s)\n",
                dtype_name(fp8), seen.empty() ? "none seen " : seen.c_str(),
                fp8 == DType::kFloat8E4M3 ? "0x7F" : "0x7E");
  }
}

// Every storage byte equal (padding included), except NaN codes, which match any NaN code.
::testing::AssertionResult same_codes(const HostTensor& got, const HostTensor& want) {
  if (got.storage_bytes() != want.storage_bytes()) {
    return ::testing::AssertionFailure() << "storage sizes differ";
  }
  const auto* g = static_cast<const std::uint8_t*>(got.data());
  const auto* w = static_cast<const std::uint8_t*>(want.data());
  const DType fp8 = want.dtype();
  const std::int64_t stride = want.shape()[1] == 0 ? 1 : want.view().strides[0];
  for (std::int64_t k = 0; k < want.storage_bytes(); ++k) {
    if (g[k] == w[k]) continue;
    if (is_nan_code(fp8, g[k]) && is_nan_code(fp8, w[k])) {
      nan_bytes_seen(fp8).insert(g[k]);
      continue;
    }
    char msg[128];
    std::snprintf(msg, sizeof msg, "byte %lld (row %lld, col %lld): got 0x%02X, expected 0x%02X",
                  static_cast<long long>(k), static_cast<long long>(k / stride),
                  static_cast<long long>(k % stride), unsigned{g[k]}, unsigned{w[k]});
    return ::testing::AssertionFailure() << msg;
  }
  // Record the GPU's NaN byte where both wrote the same one too.
  for (std::int64_t k = 0; k < want.storage_bytes(); ++k) {
    const std::int64_t col = k % stride, row = k / stride;
    if (row < want.shape()[0] && col < want.shape()[1] && is_nan_code(fp8, g[k])) {
      nan_bytes_seen(fp8).insert(g[k]);
    }
  }
  return ::testing::AssertionSuccess();
}

// Float bits equal, or both NaN.
::testing::AssertionResult same_floats(const HostTensor& got, const HostTensor& want) {
  const auto* g = static_cast<const float*>(got.data());
  const auto* w = static_cast<const float*>(want.data());
  for (std::int64_t k = 0; k < want.numel(); ++k) {
    if (std::isnan(g[k]) && std::isnan(w[k])) continue;
    if (std::memcmp(&g[k], &w[k], sizeof(float)) != 0) {
      char msg[128];
      std::snprintf(msg, sizeof msg, "scale %lld: got %a, expected %a", static_cast<long long>(k),
                    static_cast<double>(g[k]), static_cast<double>(w[k]));
      return ::testing::AssertionFailure() << msg;
    }
  }
  return ::testing::AssertionSuccess();
}

struct Quantized {
  HostTensor q, scales, q_t, scales_t;
};

// Fresh (poisoned) outputs for x: aligned rows (16-byte multiples; for q optionally 8-byte ones
// that are not 16-byte ones) or odd paddings.
Quantized make_outputs(std::int64_t M, std::int64_t N, DType fp8, const Fp8QuantizeOptions& o,
                       bool transpose, bool aligned, bool q_rows_8_bytes = false) {
  Quantized r{HostTensor(fp8, {M, N}, aligned ? pad_to(N, 16) + (q_rows_8_bytes ? 8 : 0) : 5),
              HostTensor(DType::kFloat32, scales_shape(o, M, N)), {}, {}};
  if (transpose) {
    r.q_t = HostTensor(fp8, {N, M}, aligned ? pad_to(M, 16) : 1);
    r.scales_t = HostTensor(DType::kFloat32, scales_shape(o, N, M));
  }
  return r;
}

// Quantizes x on the CPU and on the GPU (on `stream`) and compares every output.
void check_quantize(const HostTensor& x, DType fp8, const Fp8QuantizeOptions& o, bool transpose,
                    bool aligned, cudaStream_t stream = nullptr, bool q_rows_8_bytes = false) {
  const std::int64_t M = x.shape()[0], N = x.shape()[1];
  SCOPED_TRACE(describe(o, fp8, x.dtype(), M, N, transpose, aligned));
  Quantized want = make_outputs(M, N, fp8, o, transpose, aligned, q_rows_8_bytes);
  fp8_quantize(x.view(), want.q.view(), want.scales.view(), want.q_t.view(),
               want.scales_t.view(), o);
  Quantized got = make_outputs(M, N, fp8, o, transpose, aligned, q_rows_8_bytes);
  DeviceTensor d_x(x), d_q(got.q, false), d_s(got.scales, false);
  std::unique_ptr<DeviceTensor> d_qt, d_st;
  if (transpose) {
    d_qt = std::make_unique<DeviceTensor>(got.q_t, false);
    d_st = std::make_unique<DeviceTensor>(got.scales_t, false);
  }
  fp8_quantize(d_x.view(), d_q.view(), d_s.view(), transpose ? d_qt->view() : TensorView{},
               transpose ? d_st->view() : TensorView{}, o, stream);
  d_q.copy_to(got.q);
  d_s.copy_to(got.scales);
  EXPECT_TRUE(same_codes(got.q, want.q)) << "q";
  EXPECT_TRUE(same_floats(got.scales, want.scales)) << "scales";
  if (transpose) {
    d_qt->copy_to(got.q_t);
    d_st->copy_to(got.scales_t);
    EXPECT_TRUE(same_codes(got.q_t, want.q_t)) << "q_t";
    EXPECT_TRUE(same_floats(got.scales_t, want.scales_t)) << "scales_t";
  }
}

// Uniform in [-1, 1] times 2^k, k uniform in [-10, 6] per element (as the CPU test): groups with
// very different amax and plenty of fp8 subnormals. Rows padded aligned or odd.
HostTensor random_input(DType dtype, std::int64_t M, std::int64_t N, bool aligned) {
  HostTensor x(dtype, {M, N}, aligned ? pad_to(N, 8) : 3);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-10, 6);
  for (std::int64_t k = 0; k < x.numel(); ++k) {
    x.set(k, std::ldexp(unit(test::rng()), exponent(test::rng())));
  }
  return x;
}

// --- Every dtype, format, granularity, scale kind, layout, tail and alignment ---

TEST(Fp8QuantizeCuda, MatchesReferenceForEveryDtypeLayoutAndTail) {
  TS_REQUIRE_GPU();
  const std::pair<std::int64_t, std::int64_t> shapes[] = {
      {1, 1}, {3, 127}, {5, 129}, {130, 300}, {129, 128}, {256, 256}, {2, 1000}};
  for (DType input : kInputTypes) {
    for (DType fp8 : kFp8Types) {
      for (bool pow2 : {false, true}) {
        for (const Fp8QuantizeOptions& o : every_layout(pow2)) {
          for (auto [M, N] : shapes) {
            for (bool aligned : {true, false}) {
              const HostTensor x = random_input(input, M, N, aligned);
              for (bool transpose : {false, true}) check_quantize(x, fp8, o, transpose, aligned);
            }
          }
        }
      }
    }
  }
}

// Row lengths that pick every row-kernel configuration (16 ... 1024 threads per row), the
// global-amax path beyond 32768 columns, and 1x128 rows with 1 ... 4 tiles per lane group.
TEST(Fp8QuantizeCuda, RowKernelConfigurationsAndLongRows) {
  TS_REQUIRE_GPU();
  const std::int64_t lengths[] = {8, 100, 128, 200, 257, 1000, 1024, 4000, 4096, 8192,
                                  16000, 16384, 32768, 32769, 40000};
  for (DType input : {DType::kBFloat16, DType::kFloat32}) {
    for (DType fp8 : kFp8Types) {
      for (std::int64_t N : lengths) {
        for (bool aligned : {true, false}) {
          const HostTensor x = random_input(input, 17, N, aligned);
          for (Fp8Granularity g : {Fp8Granularity::kRow, Fp8Granularity::kTile1x128}) {
            check_quantize(x, fp8, {g, false, false}, false, aligned);
          }
        }
      }
    }
  }
  // The transposed copy of long rows, and pow2 scales through the global-amax path.
  const HostTensor x = random_input(DType::kBFloat16, 3, 40000, true);
  check_quantize(x, DType::kFloat8E4M3, {Fp8Granularity::kRow, true, false}, true, true);
  check_quantize(x, DType::kFloat8E5M2, {Fp8Granularity::kTensor, true, false}, true, true);
}

// q rows 8- but not 16-byte aligned: the 16-byte code stores of the row and 1x128 kernels fall
// back to 8-byte ones.
TEST(Fp8QuantizeCuda, CodeRowsAlignedToEightBytesOnly) {
  TS_REQUIRE_GPU();
  for (DType input : {DType::kBFloat16, DType::kFloat32}) {
    for (std::int64_t N : {16, 200, 1000, 8192}) {
      const HostTensor x = random_input(input, 37, N, true);
      for (Fp8Granularity g : {Fp8Granularity::kRow, Fp8Granularity::kTile1x128}) {
        check_quantize(x, DType::kFloat8E4M3, {g, false, false}, false, true, nullptr, true);
      }
    }
  }
}

// Several tiles down and across, grids of many blocks, M not a multiple of 128.
TEST(Fp8QuantizeCuda, ManyTiles) {
  TS_REQUIRE_GPU();
  for (auto [M, N] : {std::pair<std::int64_t, std::int64_t>{1000, 384}, {520, 1304}, {2048, 2048}}) {
    const HostTensor x = random_input(DType::kBFloat16, M, N, true);
    for (DType fp8 : kFp8Types) {
      for (const Fp8QuantizeOptions& o : every_layout(false)) {
        for (bool transpose : {false, true}) check_quantize(x, fp8, o, transpose, true);
      }
    }
  }
}

// Empty matrices: tensor and row scales are 1 (groups over nothing), other grids have no entries.
TEST(Fp8QuantizeCuda, EmptyRowsOrColumns) {
  TS_REQUIRE_GPU();
  for (auto [M, N] : {std::pair<std::int64_t, std::int64_t>{0, 5}, {3, 0}, {0, 0}, {0, 300}}) {
    const HostTensor x(DType::kFloat32, {M, N});
    for (bool pow2 : {false, true}) {
      for (const Fp8QuantizeOptions& o : every_layout(pow2)) {
        for (bool transpose : {false, true}) check_quantize(x, DType::kFloat8E4M3, o, transpose, true);
      }
    }
  }
}

// --- Special values ---

// 130 x 300: a NaN in one group, an Inf in another, a row of float32 subnormal multiples of
// 2^-149 that meet the fp8 saturation boundary (r rounds below amax / fmax), a row whose amax
// makes r underflow (scale 1), a zero row, a row at exactly fmax, input-dtype subnormals, and
// rows around the limits of the division-free quotient (fp8_quotient.h).
HostTensor special_input(DType dtype) {
  const std::int64_t M = 130, N = 300;
  HostTensor x = random_input(dtype, M, N, true);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  const double d = std::ldexp(1.0, -149);
  const double boundary[] = {600, 464, 480, 456, 440, 420, 432, 1, -600, 0,
                             70000, 61440, 60000, 55296, 53248};
  for (std::int64_t j = 0; j < N; ++j) {
    x.set(40 * N + j, boundary[j % 15] * d);                       // saturation boundary
    x.set(41 * N + j, (j % 3 == 0 ? 224 : j % 3 == 1 ? -1 : 7) * d);  // r underflows
    x.set(42 * N + j, j % 2 ? 0.0 : -0.0);                          // zeros
    x.set(43 * N + j, j % 7 == 0 ? 448.0 : j % 7 == 1 ? -57344.0 : 447.5 - j);  // fmax edges
    // Smallest subnormals of the input dtype (2^-149, 2^-24, 2^-133) and small multiples.
    const double sub = std::ldexp(1.0, dtype == DType::kFloat32   ? -149
                                        : dtype == DType::kFloat16 ? -24
                                                                   : -133);
    x.set(44 * N + j, (j % 5 - 2) * sub);
    // Elements from amax down to 2^-149 (signed zeros too), for amax where the scale sits just
    // inside (2^-68: e4m3) or outside (2^-72; 2^-68 for e5m2) the division-free quotient's range
    // (kMinReciprocalScale), and for a huge amax: tiny quotients under a large or small 1/s.
    const int top[] = {-68, -72, 120};
    for (int r = 0; r < 3; ++r) {
      const int k = j == 0 ? top[r] : top[r] - static_cast<int>(j * (top[r] + 149) / N);
      x.set((45 + r) * N + j, j % 37 == 5 ? (j % 2 ? 0.0 : -0.0)
                                          : std::ldexp(j == 0 ? 1.0 : unit(test::rng()), k));
    }
  }
  x.set(5 * N + 7, NAN);         // row 5, tile 0, block (0, 0)
  x.set(129 * N + 200, INFINITY);  // row 129, tile 1, block (1, 1)
  x.set(100 * N + 299, -INFINITY);
  return x;
}

TEST(Fp8QuantizeCuda, NaNInfSaturationAndSubnormals) {
  TS_REQUIRE_GPU();
  for (DType input : kInputTypes) {
    const HostTensor x = special_input(input);
    for (DType fp8 : kFp8Types) {
      for (bool pow2 : {false, true}) {
        for (const Fp8QuantizeOptions& o : every_layout(pow2)) {
          for (bool transpose : {false, true}) check_quantize(x, fp8, o, transpose, true);
        }
      }
    }
  }
  // Long rows (global-amax path) with a NaN and an Inf.
  HostTensor long_rows = random_input(DType::kFloat32, 4, 40000, true);
  long_rows.set(1 * 40000 + 12345, NAN);
  long_rows.set(2 * 40000 + 39999, -INFINITY);
  for (DType fp8 : kFp8Types) {
    check_quantize(long_rows, fp8, {Fp8Granularity::kRow}, false, true);
    check_quantize(long_rows, fp8, {Fp8Granularity::kRow}, true, true);
    check_quantize(long_rows, fp8, {Fp8Granularity::kTensor}, true, true);
  }
  print_nan_bytes();
}

// --- Streams and CUDA graphs ---

// The multi-launch paths (memset, amax, finalize, quantize) captured in a graph on a user
// stream and replayed: the same bytes as the reference every time.
TEST(Fp8QuantizeCuda, CapturedInAGraphOnAStream) {
  TS_REQUIRE_GPU();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const HostTensor x = random_input(DType::kBFloat16, 260, 40000, true);
  for (const Fp8QuantizeOptions& o :
       {Fp8QuantizeOptions{Fp8Granularity::kTensor}, Fp8QuantizeOptions{Fp8Granularity::kRow},
        Fp8QuantizeOptions{Fp8Granularity::kTile1x128, true, true}}) {
    for (bool transpose : {false, true}) {
      SCOPED_TRACE(describe(o, DType::kFloat8E4M3, x.dtype(), 260, 40000, transpose, true));
      const std::int64_t M = 260, N = 40000;
      Quantized want = make_outputs(M, N, DType::kFloat8E4M3, o, transpose, true);
      fp8_quantize(x.view(), want.q.view(), want.scales.view(), want.q_t.view(),
                   want.scales_t.view(), o);
      Quantized got = make_outputs(M, N, DType::kFloat8E4M3, o, transpose, true);
      DeviceTensor d_x(x), d_q(got.q, false), d_s(got.scales, false);
      std::unique_ptr<DeviceTensor> d_qt, d_st;
      if (transpose) {
        d_qt = std::make_unique<DeviceTensor>(got.q_t, false);
        d_st = std::make_unique<DeviceTensor>(got.scales_t, false);
      }
      cudaGraph_t graph = nullptr;
      ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      fp8_quantize(d_x.view(), d_q.view(), d_s.view(), transpose ? d_qt->view() : TensorView{},
                   transpose ? d_st->view() : TensorView{}, o, stream);
      ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
      cudaGraphExec_t exec = nullptr;
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      for (int replay = 0; replay < 2; ++replay) {
        d_q.poison();
        d_s.poison();
        if (transpose) {
          d_qt->poison();
          d_st->poison();
        }
        test::device_synchronize();  // the poisoning memsets run on the legacy stream
        ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        d_q.copy_to(got.q);
        d_s.copy_to(got.scales);
        EXPECT_TRUE(same_codes(got.q, want.q)) << "q, replay " << replay;
        EXPECT_TRUE(same_floats(got.scales, want.scales)) << "scales, replay " << replay;
        if (transpose) {
          d_qt->copy_to(got.q_t);
          d_st->copy_to(got.scales_t);
          EXPECT_TRUE(same_codes(got.q_t, want.q_t)) << "q_t, replay " << replay;
          EXPECT_TRUE(same_floats(got.scales_t, want.scales_t)) << "scales_t, replay " << replay;
        }
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
  }
  cudaStreamDestroy(stream);
}

// --- Dequantize ---

// Bytes of every row's padding (after the last column) are still the poison byte.
bool row_padding_untouched(const HostTensor& t) {
  if (t.shape()[1] == 0) return true;
  const std::int64_t elem = static_cast<std::int64_t>(dtype_size(t.dtype()));
  const std::int64_t rows = t.shape()[0], cols = t.shape()[1], stride = t.view().strides[0];
  const auto* bytes = static_cast<const std::uint8_t*>(t.data());
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t b = cols * elem; b < stride * elem; ++b) {
      if (bytes[i * stride * elem + b] != 0xFF) return false;
    }
  }
  return true;
}

// Values equal (NaN matching NaN: the GPU's NaN payload may differ), padding untouched.
void check_dequantize(const HostTensor& q, const HostTensor& scales, DType out,
                      const Fp8QuantizeOptions& o, bool aligned) {
  const std::int64_t M = q.shape()[0], N = q.shape()[1];
  SCOPED_TRACE(std::string("dequantize to ") + dtype_name(out) + " " +
               describe(o, q.dtype(), out, M, N, false, aligned));
  HostTensor want(out, {M, N}, aligned ? pad_to(N, 8) : 3);
  fp8_dequantize(q.view(), scales.view(), want.view(), o);
  HostTensor got(out, {M, N}, aligned ? pad_to(N, 8) : 3);
  DeviceTensor d_q(q), d_s(scales), d_y(got, false);
  fp8_dequantize(d_q.view(), d_s.view(), d_y.view(), o);
  d_y.copy_to(got);
  const std::vector<double> g = got.values(), w = want.values();
  for (std::size_t k = 0; k < w.size(); ++k) {
    if (std::isnan(g[k]) && std::isnan(w[k])) continue;
    ASSERT_EQ(g[k], w[k]) << "element " << k;
    ASSERT_EQ(std::signbit(g[k]), std::signbit(w[k])) << "element " << k;
  }
  EXPECT_TRUE(row_padding_untouched(got));
}

TEST(Fp8DequantizeCuda, MatchesReferenceForEveryLayoutAndDtype) {
  TS_REQUIRE_GPU();
  for (auto [M, N] : {std::pair<std::int64_t, std::int64_t>{130, 300}, {1, 1}, {3, 127},
                      {5, 4000}, {0, 7}}) {
    for (DType fp8 : kFp8Types) {
      for (const Fp8QuantizeOptions& o : every_layout(false)) {
        for (bool aligned : {true, false}) {
          const HostTensor x = M == 130 ? special_input(DType::kFloat32)
                                        : random_input(DType::kFloat32, M, N, aligned);
          Quantized r = make_outputs(M, N, fp8, o, true, aligned);
          fp8_quantize(x.view(), r.q.view(), r.scales.view(), r.q_t.view(), r.scales_t.view(), o);
          for (DType out : kInputTypes) {
            check_dequantize(r.q, r.scales, out, o, aligned);
            check_dequantize(r.q_t, r.scales_t, out, o, aligned);  // the transposed copy
          }
        }
      }
    }
  }
}

// --- Bandwidth (disabled; run with --gtest_also_run_disabled_tests) ---

// bf16 65536 x 8192 (docs/perf/fp8.md): GB/s counting x read once and every output written
// once, median of 20 launches after warm-up (no L2 flush: the 1 GiB input dwarfs the 50 MB L2).
TEST(Fp8QuantizeCuda, DISABLED_Bandwidth) {
  TS_REQUIRE_GPU();
  const std::int64_t M = 65536, N = 8192;
  const HostTensor x_layout(DType::kBFloat16, {M, N});
  DeviceTensor d_x(x_layout, false);
  ASSERT_EQ(cudaMemset(d_x.view().data, 0x3C, static_cast<std::size_t>(M * N * 2)), cudaSuccess);
  const HostTensor q_layout(DType::kFloat8E4M3, {M, N}), qt_layout(DType::kFloat8E4M3, {N, M});
  DeviceTensor d_q(q_layout, false), d_qt(qt_layout, false);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (const Fp8QuantizeOptions& o : every_layout(false)) {
    for (bool transpose : {false, true}) {
      DeviceTensor d_s(HostTensor(DType::kFloat32, scales_shape(o, M, N)), false);
      DeviceTensor d_st(HostTensor(DType::kFloat32, scales_shape(o, N, M)), false);
      auto launch = [&] {
        fp8_quantize(d_x.view(), d_q.view(), d_s.view(), transpose ? d_qt.view() : TensorView{},
                     transpose ? d_st.view() : TensorView{}, o);
      };
      for (int i = 0; i < 3; ++i) launch();
      std::vector<float> ms;
      for (int i = 0; i < 20; ++i) {
        cudaEventRecord(start);
        launch();
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        float t = 0;
        cudaEventElapsedTime(&t, start, stop);
        ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      const double scale_bytes = 4.0 * (HostTensor(DType::kFloat32, scales_shape(o, M, N)).numel() +
                                        (transpose ? HostTensor(DType::kFloat32, scales_shape(o, N, M)).numel() : 0));
      const double bytes = static_cast<double>(M * N) * (2 + 1 + (transpose ? 1 : 0)) + scale_bytes;
      std::printf("[fp8_cuda] bf16 %lldx%lld %-12s%s%s: %.3f ms, %.0f GB/s\n",
                  static_cast<long long>(M), static_cast<long long>(N),
                  fp8_granularity_name(o.granularity), o.scales_m_major ? " m-major" : "",
                  transpose ? " +transposed" : "", ms[ms.size() / 2], bytes / ms[ms.size() / 2] / 1e6);
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace
}  // namespace trainscale
