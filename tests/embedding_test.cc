// embedding_forward / embedding_backward on the CPU: against sums written out here in fp64,
// duplicates, padding_idx, rows no id names, padded rows of grad_output, int32 and int64 ids,
// NaN propagation, empty inputs, and every argument error.
#include "trainscale/embedding.h"

#include <cmath>
#include <limits>
#include <vector>

#include "util/gpu_util.h"

namespace trainscale {
namespace {

using test::HostTensor;

HostTensor ids_of(DType dtype, const std::vector<double>& ids) {
  return HostTensor::from_values(dtype, {static_cast<std::int64_t>(ids.size())}, ids);
}

TEST(EmbeddingForward, GathersRows) {
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
    for (DType it : {DType::kInt32, DType::kInt64}) {
      HostTensor w = HostTensor::random(dt, {5, 3}, -1, 1, /*row_pad=*/2);
      HostTensor ids = ids_of(it, {4, 0, 4, 2});
      HostTensor out(dt, {4, 3});
      out.fill_nan();
      embedding_forward(w.view(), ids.view(), out.view());
      for (std::int64_t t = 0; t < 4; ++t) {
        for (std::int64_t j = 0; j < 3; ++j) EXPECT_EQ(out.at(t * 3 + j), w.at(static_cast<std::int64_t>(ids.at(t)) * 3 + j));
      }
    }
  }
}

// Row v of grad_weight = the sum over the tokens t with ids[t] == v, written out naively.
TEST(EmbeddingBackward, SumsTokensPerRow) {
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (std::int64_t padding : {-1, 3}) {
      const std::int64_t tokens = 37, vocab = 11, cols = 5;
      std::vector<double> id_values;
      for (std::int64_t t = 0; t < tokens; ++t) id_values.push_back(static_cast<double>((t * 7 + t / 3) % 9));  // rows 9, 10 unused
      HostTensor ids = ids_of(DType::kInt64, id_values);
      HostTensor dy = HostTensor::random(dt, {tokens, cols}, -1, 1, /*row_pad=*/3);
      HostTensor dw(dt, {vocab, cols});
      dw.fill_nan();
      embedding_backward(dy.view(), ids.view(), dw.view(), padding);
      for (std::int64_t v = 0; v < vocab; ++v) {
        for (std::int64_t j = 0; j < cols; ++j) {
          double sum = 0;
          for (std::int64_t t = 0; t < tokens; ++t) {
            if (id_values[t] == static_cast<double>(v) && v != padding) sum += dy.at(t * cols + j);
          }
          HostTensor rounded(dt, {1});
          rounded.set(0, sum);
          EXPECT_EQ(dw.at(v * cols + j), rounded.at(0)) << v << "," << j;
        }
      }
    }
  }
}

TEST(EmbeddingBackward, NaNReachesOnlyItsRow) {
  HostTensor ids = ids_of(DType::kInt32, {2, 0, 2});
  HostTensor dy = HostTensor::random(DType::kFloat32, {3, 4});
  dy.set(2 * 4 + 1, std::numeric_limits<double>::quiet_NaN());
  HostTensor dw(DType::kFloat32, {3, 4});
  embedding_backward(dy.view(), ids.view(), dw.view());
  for (std::int64_t i = 0; i < 12; ++i) EXPECT_EQ(std::isnan(dw.at(i)), i == 2 * 4 + 1) << i;
}

TEST(EmbeddingBackward, NoIdsGiveZeros) {
  HostTensor ids(DType::kInt64, {0});
  HostTensor dy(DType::kFloat32, {0, 4});
  HostTensor dw(DType::kFloat32, {3, 4});
  dw.fill_nan();
  embedding_backward(dy.view(), ids.view(), dw.view());
  for (std::int64_t i = 0; i < 12; ++i) EXPECT_EQ(dw.at(i), 0.0);
}

TEST(Embedding, ArgumentErrors) {
  HostTensor w = HostTensor::random(DType::kFloat32, {6, 4});
  HostTensor ids = ids_of(DType::kInt64, {1, 5});
  HostTensor out(DType::kFloat32, {2, 4});
  TS_EXPECT_ERROR(embedding_forward(w.view(), ids_of(DType::kInt64, {1, 6}).view(), out.view()), "embedding_forward",
                  "'ids'", "[0, 6)", "6 at position 1");
  TS_EXPECT_ERROR(embedding_forward(w.view(), ids_of(DType::kInt64, {1, 2, 3}).view(), out.view()), "embedding_forward",
                  "'ids'", "one id per row of out: 2", "3");
  HostTensor fids = HostTensor::from_values(DType::kFloat32, {2}, {1, 2});
  TS_EXPECT_ERROR(embedding_forward(w.view(), fids.view(), out.view()), "embedding_forward", "'ids'", "int64", "float32");
  HostTensor out16(DType::kBFloat16, {2, 4});
  TS_EXPECT_ERROR(embedding_forward(w.view(), ids.view(), out16.view()), "embedding_forward", "'out'", "bfloat16");
  HostTensor out5(DType::kFloat32, {2, 5});
  TS_EXPECT_ERROR(embedding_forward(w.view(), ids.view(), out5.view()), "embedding_forward", "'out'", "4", "5");
  TS_EXPECT_ERROR(embedding_forward(w.view(), ids.view(), w.view()), "embedding_forward", "'ids'");

  HostTensor dy = HostTensor::random(DType::kFloat32, {2, 4});
  HostTensor dw(DType::kFloat32, {6, 4});
  TS_EXPECT_ERROR(embedding_backward(dy.view(), ids_of(DType::kInt64, {-1, 0}).view(), dw.view()),
                  "embedding_backward", "'ids'", "[0, 6)", "-1 at position 0");
  TS_EXPECT_ERROR(embedding_backward(dy.view(), ids.view(), dw.view(), 6), "embedding_backward", "'padding_idx'",
                  "-1 (none) or a row in [0, 6)", "6");
  TS_EXPECT_ERROR(embedding_backward(dy.view(), ids.view(), dw.view(), -2), "embedding_backward", "'padding_idx'");
  HostTensor dw16(DType::kBFloat16, {6, 4});
  TS_EXPECT_ERROR(embedding_backward(dy.view(), ids.view(), dw16.view()), "embedding_backward", "'grad_weight'",
                  "bfloat16");
  HostTensor dw_padded = HostTensor::random(DType::kFloat32, {6, 4}, -1, 1, 1);
  TS_EXPECT_ERROR(embedding_backward(dy.view(), ids.view(), dw_padded.view()), "embedding_backward", "'grad_weight'",
                  "contiguous");
  HostTensor dy3 = HostTensor::random(DType::kFloat32, {1, 2, 4});
  TS_EXPECT_ERROR(embedding_backward(dy3.view(), ids.view(), dw.view()), "embedding_backward", "'grad_output'", "2");
  TS_EXPECT_ERROR(embedding_backward(dy.view(), ids.view(), dy.view()), "embedding_backward", "'grad_weight'");
  TS_EXPECT_ERROR(embedding_backward_workspace_bytes(-1), "embedding_backward_workspace_bytes", "'num_ids'");
}

}  // namespace
}  // namespace trainscale
