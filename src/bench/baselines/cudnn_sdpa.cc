#include "bench/baselines/cudnn_sdpa.h"

#if TRAINSCALE_HAVE_CUDA && TRAINSCALE_HAVE_CUDNN_FRONTEND

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench/baselines/cudnn_graph.h"
#include "ops/attention/attention_internal.h"

namespace trainscale::bench {

namespace {

using cudnn::Binding;
namespace fe = cudnn::fe;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// Graph tensor uids.
enum Uid : std::int64_t { kQ = 1, kK, kV, kOut, kLse, kDout, kDq, kDk, kDv };

std::vector<Binding> bindings_of(CudnnSdpaOp op) {
  switch (op) {
    case CudnnSdpaOp::kForward:
      return {{"q", kQ}, {"k", kK}, {"v", kV}, {"out", kOut}, {"lse", kLse}};
    case CudnnSdpaOp::kBackward:
      return {{"dout", kDout}, {"q", kQ},   {"k", kK},   {"v", kV},  {"out", kOut},
              {"lse", kLse},   {"dq", kDq}, {"dk", kDk}, {"dv", kDv}};
  }
  return {};
}

struct Geometry {
  std::int64_t batch, q_len, kv_len, q_heads, kv_heads, head_dim;
  float scale;
  bool causal;
};

// Our [B, S, H, D] tensors as cuDNN's [B, H, S, D] dims with BSHD strides; lse [B, Hq, Sq] as
// cuDNN's stats [B, Hq, Sq, 1] (the natural-log log-sum-exp, float32).
struct Layout {
  std::vector<std::int64_t> dim, stride;
};

Layout bshd(std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d) {
  return {{b, h, s, d}, {s * h * d, d, h * d, 1}};
}

void describe_graph(fe::graph::Graph& g, CudnnSdpaOp op, const Geometry& x, fe::DataType_t io) {
  g.set_io_data_type(io).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(fe::DataType_t::FLOAT);
  const Layout q_layout = bshd(x.batch, x.q_len, x.q_heads, x.head_dim);
  const Layout kv_layout = bshd(x.batch, x.kv_len, x.kv_heads, x.head_dim);
  const Layout lse_layout{{x.batch, x.q_heads, x.q_len, 1}, {x.q_heads * x.q_len, x.q_len, 1, 1}};
  const auto input = [&](const char* name, std::int64_t uid, const Layout& layout, fe::DataType_t dtype) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_data_type(dtype)
                        .set_dim(layout.dim).set_stride(layout.stride));
  };
  const auto output = [](const TensorPtr& t, std::int64_t uid, const Layout& layout, fe::DataType_t dtype) {
    if (!t) throw Unsupported("cudnn: the SDPA graph lacks an output");
    t->set_output(true).set_uid(uid).set_data_type(dtype).set_dim(layout.dim).set_stride(layout.stride);
  };
  // Query i sees key j <= i + (Sk - Sq): cuDNN's bottom-right diagonal; with Sq == Sk (every
  // case) that is its top-left causal mask, the one PyTorch's is_causal uses.
  const auto alignment =
      x.q_len == x.kv_len ? fe::DiagonalAlignment_t::TOP_LEFT : fe::DiagonalAlignment_t::BOTTOM_RIGHT;

  auto q = input("q", kQ, q_layout, io);
  auto k = input("k", kK, kv_layout, io);
  auto v = input("v", kV, kv_layout, io);
  switch (op) {
    case CudnnSdpaOp::kForward: {
      auto attrs = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(x.scale);
      if (x.causal) attrs.set_diagonal_alignment(alignment).set_diagonal_band_right_bound(0);
      auto [out, lse] = g.sdpa(q, k, v, attrs);
      output(out, kOut, q_layout, io);
      output(lse, kLse, lse_layout, fe::DataType_t::FLOAT);
      break;
    }
    case CudnnSdpaOp::kBackward: {
      auto out = input("out", kOut, q_layout, io);
      auto dout = input("dout", kDout, q_layout, io);
      auto lse = input("lse", kLse, lse_layout, fe::DataType_t::FLOAT);
      auto attrs = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(x.scale);
      if (x.causal) attrs.set_diagonal_alignment(alignment).set_diagonal_band_right_bound(0);
      auto [dq, dk, dv] = g.sdpa_backward(q, k, v, out, dout, lse, attrs);
      output(dq, kDq, q_layout, io);
      output(dk, kDk, kv_layout, io);
      output(dv, kDv, kv_layout, io);
      break;
    }
  }
}

const TensorSpec* spec_named(const Case& c, const char* name) {
  const auto it = std::find_if(c.tensors.begin(), c.tensors.end(), [&](const TensorSpec& t) { return t.name == name; });
  return it == c.tensors.end() ? nullptr : &*it;
}

}  // namespace

std::optional<Implementation> cudnn_sdpa_baseline(CudnnSdpaOp op, const Case& c, const AttentionOptions& options) {
  if (c.dtype != DType::kFloat16 && c.dtype != DType::kBFloat16) {
    return cudnn::unsupported(std::string("cudnn: SDPA runs in float16 or bfloat16, not ") + dtype_name(c.dtype));
  }
  const TensorSpec* q = spec_named(c, "q");
  const TensorSpec* k = spec_named(c, "k");
  const TensorSpec* lse = spec_named(c, "lse");
  if (!q || !k || !lse || q->shape.size() != 4 || k->shape.size() != 4) {
    return cudnn::unsupported("cudnn: case " + c.name() + " has no 4-dim 'q' and 'k' and no 'lse'");
  }
  if (lse->dtype != DType::kFloat32) {
    return cudnn::unsupported(std::string("cudnn: SDPA's log-sum-exp is float32, the case's 'lse' is ") +
                              dtype_name(lse->dtype));
  }
  Geometry x;
  x.batch = q->shape[0];
  x.q_len = q->shape[1];
  x.q_heads = q->shape[2];
  x.head_dim = q->shape[3];
  x.kv_len = k->shape[1];
  x.kv_heads = k->shape[2];
  x.scale = static_cast<float>(ops::attention::resolved_scale(options, x.head_dim));
  x.causal = options.causal;
  char params[64];
  std::snprintf(params, sizeof params, "causal %d scale %a", x.causal ? 1 : 0, static_cast<double>(x.scale));
  const fe::DataType_t io = *cudnn::io_type(c.dtype);
  return cudnn::graph_baseline(c, bindings_of(op), params,
                               [=](fe::graph::Graph& g) { describe_graph(g, op, x, io); });
}

}  // namespace trainscale::bench

#else  // no cuDNN frontend in this build

namespace trainscale::bench {

std::optional<Implementation> cudnn_sdpa_baseline(CudnnSdpaOp, const Case&, const AttentionOptions&) {
  return std::nullopt;
}

}  // namespace trainscale::bench

#endif
