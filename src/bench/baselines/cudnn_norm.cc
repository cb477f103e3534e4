#include "bench/baselines/cudnn_norm.h"

#if TRAINSCALE_HAVE_CUDA && TRAINSCALE_HAVE_CUDNN_FRONTEND

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench/baselines/cudnn_graph.h"

namespace trainscale::bench {

namespace {

using cudnn::Binding;
namespace fe = cudnn::fe;

// Graph tensor uids.
enum Uid : std::int64_t { kX = 1, kWeight, kBias, kY, kMean, kRstd, kDy, kDx, kDw, kDb };

// The case's tensors and the graph tensor each binds to (our own backward workspace: none, cuDNN
// does not use it).
std::vector<Binding> bindings_of(CudnnNormOp op) {
  switch (op) {
    case CudnnNormOp::kRmsNormForward:
      return {{"x", kX}, {"weight", kWeight}, {"y", kY}, {"rstd", kRstd}};
    case CudnnNormOp::kRmsNormBackward:
      return {{"dy", kDy}, {"x", kX}, {"weight", kWeight}, {"rstd", kRstd},
              {"dx", kDx}, {"dw", kDw}, {"workspace", 0}};
    case CudnnNormOp::kLayerNormForward:
      return {{"x", kX}, {"weight", kWeight}, {"bias", kBias}, {"y", kY}, {"mean", kMean}, {"rstd", kRstd}};
    case CudnnNormOp::kLayerNormBackward:
      return {{"dy", kDy}, {"x", kX},   {"weight", kWeight}, {"mean", kMean},      {"rstd", kRstd},
              {"dx", kDx}, {"dw", kDw}, {"db", kDb},         {"workspace", 0}};
  }
  return {};
}

// M rows of N as cuDNN's 4-d [M, N, 1, 1] (the normalized axis is dim 1), per-feature tensors as
// [1, N, 1, 1] and per-row statistics as [M, 1, 1, 1]; statistics are float32 like ours.
void describe_graph(fe::graph::Graph& g, CudnnNormOp op, std::int64_t m, std::int64_t n, fe::DataType_t io,
                    fe::DataType_t param, float eps) {
  g.set_io_data_type(io).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(fe::DataType_t::FLOAT);
  const auto rows = [&](const char* name, std::int64_t uid, fe::DataType_t dtype) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_data_type(dtype)
                        .set_dim({m, n, 1, 1}).set_stride({n, 1, n, n}));
  };
  const auto feature = [&](const char* name, std::int64_t uid) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_data_type(param)
                        .set_dim({1, n, 1, 1}).set_stride({n, 1, n, n}));
  };
  const auto stat = [&](const char* name, std::int64_t uid) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_data_type(fe::DataType_t::FLOAT)
                        .set_dim({m, 1, 1, 1}).set_stride({1, 1, 1, 1}));
  };
  const auto output = [](const std::shared_ptr<fe::graph::Tensor_attributes>& t, std::int64_t uid, fe::DataType_t dtype,
                         std::vector<std::int64_t> dim, std::vector<std::int64_t> stride) {
    if (!t) throw Unsupported("cudnn: the graph lacks an output");
    t->set_output(true).set_uid(uid).set_data_type(dtype).set_dim(std::move(dim)).set_stride(std::move(stride));
  };
  const std::vector<std::int64_t> rows_dim{m, n, 1, 1}, rows_stride{n, 1, n, n};
  const std::vector<std::int64_t> feature_dim{1, n, 1, 1}, feature_stride{n, 1, n, n};
  const std::vector<std::int64_t> stat_dim{m, 1, 1, 1}, stat_stride{1, 1, 1, 1};

  switch (op) {
    case CudnnNormOp::kRmsNormForward: {
      auto x = rows("x", kX, io);
      auto w = feature("weight", kWeight);
      auto epsilon = g.tensor(fe::graph::Tensor_attributes(eps));
      epsilon->set_name("epsilon");
      auto attrs = fe::graph::Rmsnorm_attributes()
                       .set_forward_phase(fe::NormFwdPhase_t::TRAINING)
                       .set_epsilon(epsilon)
                       .set_compute_data_type(fe::DataType_t::FLOAT);
      auto [y, rstd] = g.rmsnorm(x, w, attrs);
      output(y, kY, io, rows_dim, rows_stride);
      output(rstd, kRstd, fe::DataType_t::FLOAT, stat_dim, stat_stride);
      break;
    }
    case CudnnNormOp::kRmsNormBackward: {
      auto dy = rows("dy", kDy, io);
      auto x = rows("x", kX, io);
      auto w = feature("weight", kWeight);
      auto rstd = stat("rstd", kRstd);
      auto attrs = fe::graph::Rmsnorm_backward_attributes().has_dbias(false).set_compute_data_type(fe::DataType_t::FLOAT);
      auto [dx, dw, db] = g.rmsnorm_backward(dy, x, w, rstd, attrs);
      if (db) throw Unsupported("cudnn: rmsnorm_backward returned a bias gradient that was not asked for");
      output(dx, kDx, io, rows_dim, rows_stride);
      output(dw, kDw, param, feature_dim, feature_stride);
      break;
    }
    case CudnnNormOp::kLayerNormForward: {
      auto x = rows("x", kX, io);
      auto w = feature("weight", kWeight);
      auto b = feature("bias", kBias);
      auto epsilon = g.tensor(fe::graph::Tensor_attributes(eps));
      epsilon->set_name("epsilon");
      auto attrs = fe::graph::Layernorm_attributes()
                       .set_forward_phase(fe::NormFwdPhase_t::TRAINING)
                       .set_epsilon(epsilon)
                       .set_compute_data_type(fe::DataType_t::FLOAT);
      auto [y, mean, rstd] = g.layernorm(x, w, b, attrs);
      output(y, kY, io, rows_dim, rows_stride);
      output(mean, kMean, fe::DataType_t::FLOAT, stat_dim, stat_stride);
      output(rstd, kRstd, fe::DataType_t::FLOAT, stat_dim, stat_stride);
      break;
    }
    case CudnnNormOp::kLayerNormBackward: {
      auto dy = rows("dy", kDy, io);
      auto x = rows("x", kX, io);
      auto w = feature("weight", kWeight);
      auto mean = stat("mean", kMean);
      auto rstd = stat("rstd", kRstd);
      auto attrs = fe::graph::Layernorm_backward_attributes()
                       .set_saved_mean_and_inv_variance(mean, rstd)
                       .set_compute_data_type(fe::DataType_t::FLOAT);
      auto [dx, dw, db] = g.layernorm_backward(dy, x, w, attrs);
      output(dx, kDx, io, rows_dim, rows_stride);
      output(dw, kDw, param, feature_dim, feature_stride);
      output(db, kDb, param, feature_dim, feature_stride);
      break;
    }
  }
}

}  // namespace

std::optional<Implementation> cudnn_norm_baseline(CudnnNormOp op, const Case& c, double eps, double weight_offset) {
  const std::optional<fe::DataType_t> io = cudnn::io_type(c.dtype);
  if (!io) return std::nullopt;
  if (weight_offset != 0.0) return cudnn::unsupported("cudnn: RMSNorm weight offset " + std::to_string(weight_offset));
  if (c.shape.size() != 2) return cudnn::unsupported("cudnn: case " + c.name() + " is not M x N");
  const std::int64_t m = c.shape[0], n = c.shape[1];
  // Weight and bias (and their gradients) as the case holds them: the activation dtype, or fp32.
  fe::DataType_t param = *io;
  for (const TensorSpec& t : c.tensors) {
    if (t.name != "weight") continue;
    const std::optional<fe::DataType_t> p = cudnn::io_type(t.dtype);
    if (!p) return cudnn::unsupported(std::string("cudnn: weight dtype ") + dtype_name(t.dtype));
    param = *p;
  }
  const auto eps32 = static_cast<float>(eps);
  char eps_hex[32];
  std::snprintf(eps_hex, sizeof eps_hex, "eps %a", static_cast<double>(eps32));  // exact, for the graph cache
  return cudnn::graph_baseline(c, bindings_of(op), eps_hex,
                               [=](fe::graph::Graph& g) { describe_graph(g, op, m, n, *io, param, eps32); });
}

}  // namespace trainscale::bench

#else  // no cuDNN frontend in this build

namespace trainscale::bench {

std::optional<Implementation> cudnn_norm_baseline(CudnnNormOp, const Case&, double, double) { return std::nullopt; }

}  // namespace trainscale::bench

#endif
