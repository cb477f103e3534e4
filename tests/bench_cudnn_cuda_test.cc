// The cuDNN SDPA baseline through the engine on a GPU, named alone (our attention has no CUDA
// kernel yet): gated against the fp64 reference on fresh random inputs with NaN-poisoned
// outputs. Skips without a GPU, without the cuDNN baselines in this build, or where libcudnn
// cannot be loaded.
#include <gtest/gtest.h>

#include "bench/baselines/cudnn_sdpa.h"
#include "bench/engine.h"
#include "util/gpu_util.h"

namespace trainscale::bench {
namespace {

AttentionOptions options_of(const Case& c) {
  AttentionOptions options;
  options.causal = c.shape.at(5) == 1;
  return options;
}

TEST(CudnnSdpaBaseline, MatchesTheReferenceWhereOursHasNoCudaKernel) {
  TS_REQUIRE_GPU();
  if (!cudnn_baselines_built()) GTEST_SKIP() << "this build has no cuDNN baselines";
  const Registry& global = Registry::global();
  Registry registry;
  for (const char* op : {"attention_forward", "attention_backward"}) {
    ASSERT_NE(global.find_op(op), nullptr) << op;
    registry.add_op(*global.find_op(op));
    // B x Hq x Hkv x S x D x causal: GQA and plain, causal and not, S off multiples of 64,
    // head dims 32 ... 128; float32 is what cuDNN cannot do.
    registry.add_configs("smoke", op,
                         {{1, 4, 2, 64, 32, 1}, {2, 6, 2, 77, 64, 1}, {2, 4, 4, 130, 128, 0}, {1, 8, 1, 200, 64, 0},
                          {3, 2, 1, 33, 64, 1}},
                         {DType::kBFloat16, DType::kFloat16, DType::kFloat32});
  }
  registry.add_baseline("attention_forward", "cudnn", [](const Case& c) {
    return cudnn_sdpa_baseline(CudnnSdpaOp::kForward, c, options_of(c));
  });
  registry.add_baseline("attention_backward", "cudnn", [](const Case& c) {
    return cudnn_sdpa_baseline(CudnnSdpaOp::kBackward, c, options_of(c));
  });

  RunOptions options;
  options.use_gpu = true;
  // Ours has no attention kernel yet: named alone, the baseline is gated and timed.
  options.selection.impls = {"cudnn"};
  options.timing.warmup_ms = 0;
  options.timing.stop.min_time_ms = 0;
  options.timing.stop.timeout_ms = 20;
  RunResult result;
  run_cases(registry, options, result);
  EXPECT_TRUE(result.skipped.empty());
  ASSERT_EQ(result.rows.size(), 2u * 5 * 3);
  for (const Row& r : result.rows) {
    SCOPED_TRACE(r.key() + ": " + r.message);
    ASSERT_EQ(r.impl, "cudnn");
    if (r.message.find("cannot load libcudnn") != std::string::npos) GTEST_SKIP() << r.message;
    if (r.dtype == "float32") {
      EXPECT_EQ(r.status, Status::kUnsupported);
      EXPECT_NE(r.message.find("float16 or bfloat16"), std::string::npos);
      continue;
    }
    EXPECT_EQ(r.status, Status::kOk);
    EXPECT_LE(r.rel_l2, r.tolerance);
    EXPECT_GE(r.ms.count, 1);
  }
  EXPECT_FALSE(result.any_failed());
}

}  // namespace
}  // namespace trainscale::bench
