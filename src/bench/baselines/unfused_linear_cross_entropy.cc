#include "bench/baselines/unfused_linear_cross_entropy.h"

#if TRAINSCALE_HAVE_CUDA
#include <memory>
#include <string>

#include "bench/cuda_util.h"
#include "common/gemm.h"
#include "trainscale/loss.h"

namespace trainscale::bench {
namespace {

constexpr const char* kName = "unfused_linear_cross_entropy";
// What detail::gemm says lets cuBLASLt choose any algorithm.
constexpr std::int64_t kGemmWorkspaceBytes = std::int64_t{32} << 20;

struct Buffers {
  std::unique_ptr<DeviceBuffer> logits, gemm_workspace;
};

}  // namespace

std::optional<Implementation> unfused_linear_cross_entropy_baseline(const Case& c) {
  const auto [hidden, weight, targets, loss, lse, grad_hidden, grad_weight] =
      c.ids("hidden", "weight", "targets", "loss", "lse", "grad_hidden", "grad_weight");
  const std::int64_t tokens = c.shape[0], dim = c.shape[1], classes = c.shape[2];
  const DType dtype = c.dtype;
  // Logits rows padded to 16 bytes, the leading dimension cuBLASLt's fastest kernels want (the
  // fused op pads its chunk of them alike).
  const auto elem = static_cast<std::int64_t>(dtype_size(dtype));
  const std::int64_t per_vector = 16 / elem;
  const std::int64_t ld = (classes + per_vector - 1) / per_vector * per_vector;
  const std::int64_t logits_bytes = tokens * ld * elem;

  Implementation impl;
  impl.run = [=, buffers = std::make_shared<Buffers>()](CaseTensors t, cudaStream_t s) {
    if (!buffers->logits) {
      try {
        buffers->logits = std::make_unique<DeviceBuffer>(logits_bytes, "cudaMalloc (unfused logits)");
        buffers->gemm_workspace = std::make_unique<DeviceBuffer>(kGemmWorkspaceBytes, "cudaMalloc (cuBLASLt workspace)");
      } catch (const Error& e) {
        throw Unsupported(std::string("its [T, V] logits do not fit in device memory: ") + e.what());
      }
    }
    void* logits = buffers->logits->data;
    void* workspace = buffers->gemm_workspace->data;
    const auto ws_bytes = static_cast<std::size_t>(kGemmWorkspaceBytes);
    static constexpr float kOne = 1.0f, kZero = 0.0f;
    const detail::GemmScalars plain{&kOne, &kZero, false};
    const void* h = t[hidden].data;
    const void* w = t[weight].data;
    detail::gemm(kName, {h, dtype, tokens, dim, dim}, {w, dtype, dim, classes, dim, true},
                 {logits, dtype, tokens, classes, ld}, plain, workspace, ws_bytes, s);
    // The mean's gradient (1 / tokens not ignored) is in G already.
    const TensorView g(logits, dtype, {tokens, classes}, {ld, 1}, t[hidden].device);
    cross_entropy_forward(g, t[targets], t[loss], t[lse], g, {}, s);
    detail::gemm(kName, {logits, dtype, tokens, classes, ld}, {w, dtype, classes, dim, dim},
                 {t[grad_hidden].data, dtype, tokens, dim, dim}, plain, workspace, ws_bytes, s);
    detail::gemm(kName, {logits, dtype, classes, tokens, ld, true}, {h, dtype, tokens, dim, dim},
                 {t[grad_weight].data, dtype, classes, dim, dim}, plain, workspace, ws_bytes, s);
  };
  return impl;
}

}  // namespace trainscale::bench
#endif
