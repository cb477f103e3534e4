// embedding_forward / embedding_backward on the GPU against the fp64 CPU reference on the same
// rounded inputs: every float dtype, int32 and int64 ids, row lengths on the vector path and off
// it (1, 5, 8, 12, 4096), padded and 2-byte-misaligned rows, many duplicates and rows no id
// names, padding_idx, no ids, outputs poisoned with NaN, NaN inputs, out-of-range ids (NaN), the
// same bits on every run, and the workspace error.
#include <cuda_runtime.h>

#include <cmath>
#include <memory>
#include <vector>

#include "trainscale/embedding.h"
#include "util/gpu_util.h"

namespace trainscale {
namespace {

using test::DeviceTensor;
using test::HostTensor;

HostTensor random_ids(DType dtype, std::int64_t tokens, std::int64_t vocab) {
  std::vector<double> v(static_cast<std::size_t>(tokens));
  // Half of the tokens on the first few rows (long runs), the rest anywhere.
  const std::vector<double> u = test::random_values(2 * tokens, 0.0, 1.0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double span = u[2 * t] < 0.5 ? std::min<double>(vocab, 4) : static_cast<double>(vocab);
    v[t] = std::min(std::floor(u[2 * t + 1] * span), static_cast<double>(vocab - 1));
  }
  return HostTensor::from_values(dtype, {tokens}, v);
}

struct Workspace {
  std::unique_ptr<DeviceTensor> dev;
  TensorView view;
  explicit Workspace(std::int64_t tokens) {
    const std::size_t bytes = embedding_backward_workspace_bytes(tokens);
    if (bytes == 0) return;
    dev = std::make_unique<DeviceTensor>(HostTensor(DType::kInt64, {static_cast<std::int64_t>(bytes / 8 + 2)}), false);
    view = dev->view();
  }
};

// A [rows, cols] device view whose rows are `pad` elements apart beyond cols, optionally one
// element past a 16-byte aligned start (the element path).
struct Rows {
  HostTensor host;  // the logical values
  std::unique_ptr<DeviceTensor> dev;
  TensorView view;
  Rows(const HostTensor& values, std::int64_t pad, bool misaligned) : host(values) {
    const std::int64_t rows = values.shape()[0], cols = values.shape()[1], stride = cols + pad;
    HostTensor storage(values.dtype(), {rows * stride + 1});
    storage.fill_nan();
    const std::int64_t start = misaligned ? 1 : 0;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < cols; ++j) storage.set(start + r * stride + j, values.at(r * cols + j));
    dev = std::make_unique<DeviceTensor>(storage);
    view = TensorView(static_cast<char*>(dev->view().data) + start * dtype_size(values.dtype()), values.dtype(),
                      {rows, cols}, {stride, 1}, Device::cuda(0));
  }
};

TEST(EmbeddingForwardCuda, MatchesReference) {
  TS_REQUIRE_GPU();
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (DType it : {DType::kInt32, DType::kInt64}) {
      for (std::int64_t cols : {1, 5, 8, 12, 4096}) {
        for (auto [pad, misaligned] : {std::pair<std::int64_t, bool>{0, false}, {8, false}, {3, true}}) {
          const std::int64_t vocab = 97, tokens = 301;
          Rows w(HostTensor::random(dt, {vocab, cols}), pad, misaligned);
          HostTensor ids = random_ids(it, tokens, vocab);
          DeviceTensor ids_dev(ids);
          HostTensor ref(dt, {tokens, cols});
          embedding_forward(w.host.view(), ids.view(), ref.view());
          HostTensor out(dt, {tokens, cols});
          DeviceTensor out_dev(out, false);
          out_dev.poison();
          embedding_forward(w.view, ids_dev.view(), out_dev.view());
          test::device_synchronize();
          EXPECT_EQ(out_dev.to_host().values(), ref.values()) << dtype_name(dt) << " cols " << cols << " pad " << pad;
        }
      }
    }
  }
}

TEST(EmbeddingForwardCuda, OutOfRangeIdGivesNaNRow) {
  TS_REQUIRE_GPU();
  HostTensor w = HostTensor::random(DType::kBFloat16, {10, 16});
  HostTensor ids = HostTensor::from_values(DType::kInt64, {3}, {2, 10, -1});
  DeviceTensor w_dev(w), ids_dev(ids);
  HostTensor out(DType::kBFloat16, {3, 16});
  DeviceTensor out_dev(out, false);
  embedding_forward(w_dev.view(), ids_dev.view(), out_dev.view());
  const HostTensor got = out_dev.to_host();
  for (std::int64_t j = 0; j < 16; ++j) {
    EXPECT_EQ(got.at(j), w.at(2 * 16 + j));
    EXPECT_TRUE(std::isnan(got.at(16 + j)) && std::isnan(got.at(32 + j))) << j;
  }
}

// Runs the backward on the device (grad_weight poisoned first) and returns grad_weight.
HostTensor backward_on_device(const Rows& dy, const HostTensor& ids, std::int64_t vocab, std::int64_t padding) {
  DeviceTensor ids_dev(ids);
  const std::int64_t cols = dy.host.shape()[1];
  HostTensor dw(dy.host.dtype(), {vocab, cols});
  DeviceTensor dw_dev(dw, false);
  dw_dev.poison();
  Workspace ws(ids.numel());
  embedding_backward(dy.view, ids_dev.view(), dw_dev.view(), padding, ws.view);
  test::device_synchronize();
  return dw_dev.to_host();
}

TEST(EmbeddingBackwardCuda, MatchesReference) {
  TS_REQUIRE_GPU();
  struct Shape {
    std::int64_t tokens, vocab, cols;
  };
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (DType it : {DType::kInt32, DType::kInt64}) {
      for (Shape s : {Shape{0, 7, 8}, Shape{1, 1, 5}, Shape{37, 11, 1}, Shape{301, 97, 12}, Shape{4099, 1000, 8},
                      Shape{2048, 5000, 4096}}) {
        for (auto [pad, misaligned] : {std::pair<std::int64_t, bool>{0, false}, {8, false}, {3, true}}) {
          for (std::int64_t padding : {std::int64_t{-1}, std::int64_t{0}}) {
            Rows dy(HostTensor::random(dt, {s.tokens, s.cols}), pad, misaligned);
            const HostTensor ids = random_ids(it, s.tokens, s.vocab);
            HostTensor ref(dt, {s.vocab, s.cols});
            embedding_backward(dy.host.view(), ids.view(), ref.view(), padding);
            const HostTensor got = backward_on_device(dy, ids, s.vocab, padding);
            const std::vector<double> g = got.values(), r = ref.values();
            for (std::int64_t i = 0; i < ref.numel(); ++i) {
              if (r[i] == 0.0) {  // rows no id names, the padding row: exactly 0
                EXPECT_EQ(g[i], 0.0) << i;
              }
            }
            EXPECT_LE(test::rel_l2(g, r), test::tolerance(dt))
                << dtype_name(dt) << " " << s.tokens << "x" << s.vocab << "x" << s.cols << " pad " << pad;
            if (s.cols == 4096 && pad == 0 && padding == -1) {  // the same bits again
              EXPECT_EQ(backward_on_device(dy, ids, s.vocab, padding).values(), g);
            }
          }
        }
      }
    }
  }
}

TEST(EmbeddingBackwardCuda, NaNInputReachesItsRowOnly) {
  TS_REQUIRE_GPU();
  HostTensor values = HostTensor::random(DType::kBFloat16, {6, 16});
  values.set(4 * 16 + 3, std::nan(""));
  Rows dy(values, 0, false);
  const HostTensor ids = HostTensor::from_values(DType::kInt64, {6}, {1, 3, 1, 0, 3, 2});
  const HostTensor got = backward_on_device(dy, ids, 5, -1);
  for (std::int64_t i = 0; i < got.numel(); ++i) EXPECT_EQ(std::isnan(got.at(i)), i == 3 * 16 + 3) << i;
}

TEST(EmbeddingBackwardCuda, OutOfRangeIdPoisonsEverything) {
  TS_REQUIRE_GPU();
  Rows dy(HostTensor::random(DType::kFloat32, {4, 8}), 0, false);
  for (double bad : {5.0, -3.0}) {
    const HostTensor ids = HostTensor::from_values(DType::kInt32, {4}, {1, bad, 0, 1});
    const HostTensor got = backward_on_device(dy, ids, 5, -1);
    for (std::int64_t i = 0; i < got.numel(); ++i) EXPECT_TRUE(std::isnan(got.at(i))) << bad << " " << i;
  }
}

TEST(EmbeddingBackwardCuda, WorkspaceError) {
  TS_REQUIRE_GPU();
  Rows dy(HostTensor::random(DType::kFloat32, {4, 8}), 0, false);
  HostTensor ids = HostTensor::from_values(DType::kInt64, {4}, {1, 2, 0, 1});
  DeviceTensor ids_dev(ids);
  DeviceTensor dw_dev(HostTensor(DType::kFloat32, {3, 8}), false);
  TS_EXPECT_ERROR(embedding_backward(dy.view, ids_dev.view(), dw_dev.view(), -1), "embedding_backward", "'workspace'",
                  "embedding_backward_workspace_bytes", "none");
  DeviceTensor small(HostTensor(DType::kInt64, {2}), false);
  TS_EXPECT_ERROR(embedding_backward(dy.view, ids_dev.view(), dw_dev.view(), -1, small.view()), "embedding_backward",
                  "'workspace'", "at least");
}

}  // namespace
}  // namespace trainscale
