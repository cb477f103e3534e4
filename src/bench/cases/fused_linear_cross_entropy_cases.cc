// Fused linear cross-entropy: the LM head's product and the mean cross-entropy in one call,
// writing the loss, every token's lse and the gradients of hidden and weight (upstream gradient
// 1), with the CUDA path's workspace as the case's scratch tensor. Config T x H x V (tokens,
// hidden size, vocabulary). Compute-bound: 6 T H V FLOPs, the logits' GEMM and the two gradient
// GEMMs.
//
// Inputs: hidden uniform in [-1, 1], weight in +-6 / sqrt(H), so that the logits have a standard
// deviation of 2 at any H (unit weights would give sqrt(H / 9), and a one-hot softmax), targets
// uniform over the vocabulary with about 1 in 32 set to ignore_index.
//
// Gate. Up to GateLimits::reference_flops of the case's FLOPs, the fp64 CPU path runs whole.
// Above, the case's own check (SampledCheck), fp64 on the host from the inputs' fills, for about
// that many FLOPs:
//   - tokens (spread_rows: the first, the last, one per stratum between, plus the first ignored
//     one): lse and grad_hidden from the token's logits over the whole vocabulary, made in one
//     pass over the weight rows (online softmax); V H multiply-adds each for the logits and for
//     grad_hidden;
//   - vocabulary rows (the sampled tokens' targets, then spread_rows): grad_weight[v] =
//     sum over every token t of (exp(x_t . w_v - lse_t) - [target_t = v]) x_t / (tokens not
//     ignored), with lse_t the implementation's own (checked at the sampled tokens); T H
//     multiply-adds for the logits and for the sum;
//   - the loss: the mean over every token of lse_t - x_t . w_target (the implementation's lse,
//     fp64 target logits), T H multiply-adds.
// Not seen: an error confined to the lse or grad_hidden of tokens not sampled, or to vocabulary
// rows not sampled.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <set>
#include <string>

#include "bench/cases/case_util.h"
#include "bench/gate.h"
#include "core/parallel.h"
#include "trainscale/loss.h"

#if TRAINSCALE_HAVE_CUDA
#include "bench/baselines/unfused_linear_cross_entropy.h"
#endif

namespace trainscale::bench::cases {
namespace {

constexpr const char* kOp = "fused_linear_cross_entropy_forward";
constexpr std::int64_t kIgnoreIndex = CrossEntropyOptions{}.ignore_index;
constexpr double kIgnoredShare = 1.0 / 32;
// Tokens and vocabulary rows the sampled check takes: at least enough for the edges and a few
// strata, at most what keeps its partial sums (per chunk below, H doubles each) small.
constexpr std::int64_t kMinSampled = 8, kMaxSampled = 64;
// Vocabulary rows and tokens per chunk of the check's parallel loops.
constexpr std::int64_t kVocabGrain = 4096, kTokenGrain = 512;

struct Dims {
  std::int64_t tokens, dim, classes;
};

struct Ids {
  TensorId hidden, weight, targets, loss, lse, grad_hidden, grad_weight;
};

// SamplePlan::reads, in this order.
enum Read : std::size_t { kLossRead, kLseRead, kGradHiddenRead, kGradWeightRead };

Dims dims_of(std::span<const std::int64_t> shape) {
  if (shape[0] < 1 || shape[1] < 1 || shape[2] < 1) throw Unsupported("T, H and V must be at least 1");
  return {shape[0], shape[1], shape[2]};
}

// The CUDA path's workspace for the case's tensors. The query reads shapes, dtypes and which
// outputs are given, never the data, but its argument checks want non-null pointers.
std::int64_t workspace_bytes(const Dims& d, DType dtype) {
  static std::byte placeholder;
  const auto view = [](DType t, std::initializer_list<std::int64_t> shape) {
    return TensorView(&placeholder, t, shape, Device::cuda());
  };
  return static_cast<std::int64_t>(fused_linear_cross_entropy_workspace_bytes(
      {.hidden = view(dtype, {d.tokens, d.dim}),
       .weight = view(dtype, {d.classes, d.dim}),
       .targets = view(DType::kInt64, {d.tokens}),
       .loss = view(DType::kFloat32, {}),
       .lse = view(DType::kFloat32, {d.tokens}),
       .grad_hidden = view(dtype, {d.tokens, d.dim}),
       .grad_weight = view(dtype, {d.classes, d.dim})}));
}

std::int64_t target_at(const RandomFill& targets, std::int64_t t) {
  return static_cast<std::int64_t>(random_value(targets, t));
}

// Row r of a row-major input with rows of row.size() elements, as its fill made it.
void input_row(const RandomFill& fill, std::int64_t r, std::span<double> row) {
  const auto n = static_cast<std::int64_t>(row.size());
  for (std::int64_t k = 0; k < n; ++k) row[k] = random_value(fill, r * n + k);
}

// Four partial sums, so that the multiply-adds do not wait on one another.
double dot(std::span<const double> a, std::span<const double> b) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  const std::size_t n = a.size(), quads = n / 4 * 4;
  for (std::size_t k = 0; k < quads; k += 4) {
    s0 += a[k] * b[k];
    s1 += a[k + 1] * b[k + 1];
    s2 += a[k + 2] * b[k + 2];
    s3 += a[k + 3] * b[k + 3];
  }
  for (std::size_t k = quads; k < n; ++k) s0 += a[k] * b[k];
  return (s0 + s1) + (s2 + s3);
}

void add_scaled(std::span<double> acc, double g, std::span<const double> x) {
  for (std::size_t k = 0; k < acc.size(); ++k) acc[k] += g * x[k];
}

// Online softmax of logits z_v with rows w_v: max_v z_v, sum_v e^(z_v - max) and
// sum_v e^(z_v - max) w_v, so lse = max + log(sum) and the softmax-weighted rows are
// weighted / sum.
struct SoftmaxSum {
  double max = -std::numeric_limits<double>::infinity();
  double sum = 0;
  std::vector<double> weighted;

  explicit SoftmaxSum(std::int64_t dim) : weighted(static_cast<std::size_t>(dim), 0.0) {}

  // Adds another such sum (one logit z with its row w: add(z, 1, w)).
  void add(double other_max, double other_sum, std::span<const double> other_weighted) {
    if (other_sum == 0) return;  // nothing in it
    if (other_max > max) {
      const double scale = std::exp(max - other_max);  // 0 while this one is empty
      sum = sum * scale + other_sum;
      for (std::size_t k = 0; k < weighted.size(); ++k) weighted[k] = weighted[k] * scale + other_weighted[k];
      max = other_max;
    } else {
      const double scale = std::exp(other_max - max);
      sum += other_sum * scale;
      for (std::size_t k = 0; k < weighted.size(); ++k) weighted[k] += other_weighted[k] * scale;
    }
  }
};

struct Fills {
  const RandomFill& hidden;
  const RandomFill& weight;
  const RandomFill& targets;
};

// lse and grad_hidden rows of `tokens`: one pass over the weight rows, each made once for all
// the tokens, in chunks whose sums are combined in chunk order.
void token_references(const Dims& d, const Fills& in, std::span<const std::int64_t> tokens, double scale,
                      std::vector<double>& lse, std::vector<double>& grad_hidden) {
  const std::size_t count = tokens.size(), dim = static_cast<std::size_t>(d.dim);
  std::vector<double> x(count * dim);
  for (std::size_t s = 0; s < count; ++s) input_row(in.hidden, tokens[s], std::span(x).subspan(s * dim, dim));
  const auto chunks = static_cast<std::size_t>(detail::chunk_count(d.classes, kVocabGrain));
  std::vector<SoftmaxSum> partial(chunks * count, SoftmaxSum(d.dim));
  detail::parallel_chunks(d.classes, kVocabGrain, [&](std::int64_t chunk, std::int64_t lo, std::int64_t hi) {
    std::vector<double> w(dim);
    for (std::int64_t v = lo; v < hi; ++v) {
      input_row(in.weight, v, w);
      for (std::size_t s = 0; s < count; ++s) {
        partial[static_cast<std::size_t>(chunk) * count + s].add(dot(std::span(x).subspan(s * dim, dim), w), 1.0, w);
      }
    }
  });
  lse.assign(count, 0.0);
  grad_hidden.assign(count * dim, 0.0);
  std::vector<double> w_target(dim);
  for (std::size_t s = 0; s < count; ++s) {
    SoftmaxSum total(d.dim);
    for (std::size_t c = 0; c < chunks; ++c) {
      const SoftmaxSum& p = partial[c * count + s];
      total.add(p.max, p.sum, p.weighted);
    }
    lse[s] = total.max + std::log(total.sum);
    const std::int64_t target = target_at(in.targets, tokens[s]);
    if (target == kIgnoreIndex) continue;  // its gradient is 0
    input_row(in.weight, target, w_target);
    for (std::size_t k = 0; k < dim; ++k) {
      grad_hidden[s * dim + k] = scale * (total.weighted[k] / total.sum - w_target[k]);
    }
  }
}

// grad_weight rows `classes` and the summed loss of the tokens not ignored, over every token,
// from the implementation's lse; chunks of tokens summed in chunk order.
void class_references(const Dims& d, const Fills& in, std::span<const std::int64_t> classes,
                      std::span<const double> lse, double scale, std::vector<double>& grad_weight,
                      double& loss_sum) {
  const std::size_t count = classes.size(), dim = static_cast<std::size_t>(d.dim);
  std::vector<double> w(count * dim);
  for (std::size_t j = 0; j < count; ++j) input_row(in.weight, classes[j], std::span(w).subspan(j * dim, dim));
  const auto chunks = static_cast<std::size_t>(detail::chunk_count(d.tokens, kTokenGrain));
  std::vector<double> partial(chunks * count * dim, 0.0), partial_loss(chunks, 0.0);
  detail::parallel_chunks(d.tokens, kTokenGrain, [&](std::int64_t chunk, std::int64_t lo, std::int64_t hi) {
    const auto c = static_cast<std::size_t>(chunk);
    const std::span<double> acc = std::span(partial).subspan(c * count * dim, count * dim);
    std::vector<double> x(dim), w_target(dim);
    for (std::int64_t t = lo; t < hi; ++t) {
      const std::int64_t target = target_at(in.targets, t);
      if (target == kIgnoreIndex) continue;  // no loss, no gradient
      input_row(in.hidden, t, x);
      input_row(in.weight, target, w_target);
      partial_loss[c] += lse[t] - dot(x, w_target);
      for (std::size_t j = 0; j < count; ++j) {
        const double g = std::exp(dot(x, std::span(w).subspan(j * dim, dim)) - lse[t]) - (target == classes[j] ? 1.0 : 0.0);
        add_scaled(acc.subspan(j * dim, dim), g, x);
      }
    }
  });
  grad_weight.assign(count * dim, 0.0);
  loss_sum = 0;
  for (std::size_t c = 0; c < chunks; ++c) {
    for (std::size_t i = 0; i < count * dim; ++i) grad_weight[i] += partial[c * count * dim + i];
    loss_sum += partial_loss[c];
  }
  for (double& g : grad_weight) g *= scale;
}

std::string join(const std::set<std::int64_t>& rows) {
  std::string s;
  for (std::int64_t r : rows) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

SamplePlan plan_check(const Dims& d, const Ids& ids, std::uint64_t seed, double flops, std::span<const RandomFill> fills) {
  const RandomFill& targets = fills[ids.targets.index];
  // Half the budget for each kind of row: a token costs 4 V H FLOPs (its logits, its
  // grad_hidden row), a vocabulary row 4 T H (its logits over every token, its grad_weight row).
  const auto within = [&](double each) {
    return std::clamp<std::int64_t>(static_cast<std::int64_t>(flops / 2 / each), kMinSampled, kMaxSampled);
  };
  const auto [tokens_total, dim, classes_total] = d;
  std::set<std::int64_t> tokens;
  for (std::int64_t t : spread_rows(tokens_total, within(4.0 * static_cast<double>(classes_total * dim)), seed)) {
    tokens.insert(t);
  }
  std::int64_t ignored = -1;
  for (std::int64_t t = 0; t < tokens_total && ignored < 0; ++t) {
    if (target_at(targets, t) == kIgnoreIndex) ignored = t;
  }
  if (ignored >= 0) tokens.insert(ignored);
  // The sampled tokens' targets, so that the one-hot term of grad_weight is checked too.
  std::set<std::int64_t> classes;
  for (std::int64_t t : tokens) {
    if (const std::int64_t target = target_at(targets, t); target != kIgnoreIndex) classes.insert(target);
  }
  const auto target_rows = static_cast<std::int64_t>(classes.size());
  const std::int64_t spread = within(4.0 * static_cast<double>(tokens_total * dim)) - target_rows;
  for (std::int64_t v : spread_rows(classes_total, spread, seed + 1)) classes.insert(v);

  SamplePlan plan;
  plan.reads = {{ids.loss, {}},
                {ids.lse, {}},
                {ids.grad_hidden, {tokens.begin(), tokens.end()}},
                {ids.grad_weight, {classes.begin(), classes.end()}}};
  plan.rows_checked = static_cast<std::int64_t>(tokens.size());
  plan.rows_total = tokens_total;
  plan.scope = "fp64 on the host: lse and grad_hidden at " + std::to_string(tokens.size()) + " of " +
               std::to_string(tokens_total) + " tokens (" + join(tokens) +
               (ignored >= 0 ? "; " + std::to_string(ignored) + " ignored" : "") + "), grad_weight at " +
               std::to_string(classes.size()) + " of " + std::to_string(classes_total) + " vocabulary rows (" +
               join(classes) + "; " + std::to_string(target_rows) +
               " of them those tokens' targets), the loss over every token from the implementation's lse";
  return plan;
}

std::vector<SampledValues> run_check(const Dims& d, const Ids& ids, const SamplePlan& plan,
                                     std::span<const RandomFill> fills, const std::vector<std::vector<double>>& read) {
  const Fills in{fills[ids.hidden.index], fills[ids.weight.index], fills[ids.targets.index]};
  const std::vector<std::int64_t>& tokens = plan.reads[kGradHiddenRead].rows;
  const std::vector<std::int64_t>& classes = plan.reads[kGradWeightRead].rows;
  const std::vector<double>& lse = read[kLseRead];
  std::int64_t valid = 0;
  for (std::int64_t t = 0; t < d.tokens; ++t) valid += target_at(in.targets, t) != kIgnoreIndex;
  // kMean's scale of every gradient row; with every token ignored the gradients are 0 (the
  // loss 0 / 0 = NaN).
  const double scale = valid > 0 ? 1.0 / static_cast<double>(valid) : 0.0;

  std::vector<double> lse_ref, grad_hidden_ref, grad_weight_ref;
  double loss_sum = 0;
  token_references(d, in, tokens, scale, lse_ref, grad_hidden_ref);
  class_references(d, in, classes, lse, scale, grad_weight_ref, loss_sum);
  std::vector<double> lse_out;
  for (std::int64_t t : tokens) lse_out.push_back(lse[static_cast<std::size_t>(t)]);
  return {{ids.loss, read[kLossRead], {loss_sum / static_cast<double>(valid)}},
          {ids.lse, std::move(lse_out), std::move(lse_ref)},
          {ids.grad_hidden, read[kGradHiddenRead], std::move(grad_hidden_ref)},
          {ids.grad_weight, read[kGradWeightRead], std::move(grad_weight_ref)}};
}

Case fused_linear_cross_entropy_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case(kOp, "loss", shape, dtype, 3, "TxHxV");
  const Dims d = dims_of(c.shape);
  TensorSpec weight = input("weight", dtype, {d.classes, d.dim}, false);
  weight.hi = 6.0 / std::sqrt(static_cast<double>(d.dim));
  weight.lo = -weight.hi;
  TensorSpec targets = input("targets", DType::kInt64, {d.tokens});
  targets.lo = 0;
  targets.hi = static_cast<double>(d.classes - 1);
  targets.special_share = kIgnoredShare;
  targets.special = kIgnoreIndex;
  c.tensors = {input("hidden", dtype, {d.tokens, d.dim}),
               weight,
               targets,
               output("loss", DType::kFloat32, {}, false),
               output("lse", DType::kFloat32, {d.tokens}),
               output("grad_hidden", dtype, {d.tokens, d.dim}),
               output("grad_weight", dtype, {d.classes, d.dim}, false),
               scratch("workspace", workspace_bytes(d, dtype))};
  // The loss and lse come from logits in the activation dtype (the CUDA path stores each chunk
  // of them so before the cross-entropy kernel reads them): held to that dtype's tolerance.
  c.spec("loss").tolerance = default_tolerance(dtype);
  c.spec("lse").tolerance = default_tolerance(dtype);
  c.bytes = traffic(c.tensors);
  c.flops = 6.0 * static_cast<double>(d.tokens) * static_cast<double>(d.dim) * static_cast<double>(d.classes);
  c.bound = Bound::kCompute;
  const Ids ids{c.id("hidden"), c.id("weight"), c.id("targets"), c.id("loss"), c.id("lse"), c.id("grad_hidden"),
                c.id("grad_weight")};
  const TensorId workspace = c.id("workspace");
  c.entry = [=](CaseTensors t, cudaStream_t s) {
    fused_linear_cross_entropy_forward({.hidden = t[ids.hidden],
                                        .weight = t[ids.weight],
                                        .targets = t[ids.targets],
                                        .loss = t[ids.loss],
                                        .lse = t[ids.lse],
                                        .grad_hidden = t[ids.grad_hidden],
                                        .grad_weight = t[ids.grad_weight],
                                        .workspace = t[workspace]},
                                       {}, s);
  };
  c.reference = on_cpu(c.entry);
  c.sampled_check = SampledCheck{
      [=](std::uint64_t seed, double flops, std::span<const RandomFill> fills) {
        return plan_check(d, ids, seed, flops, fills);
      },
      [=](const SamplePlan& plan, std::span<const RandomFill> fills, const std::vector<std::vector<double>>& read) {
        return run_check(d, ids, plan, fills, read);
      }};
  return c;
}

const Registrar kRegister([](Registry& r) {
  r.add_op({kOp, "loss", "T x H x V (tokens, hidden size, vocabulary)", fused_linear_cross_entropy_case});
  r.add_configs("smoke", kOp, {{64, 32, 1000}}, {DType::kFloat32, DType::kBFloat16});
  // T x V at H 4096; (8192, 128256) is the Llama-3-8B head.
  std::vector<Shape> flce;
  for (std::int64_t tokens : {2048, 8192, 32768}) {
    for (std::int64_t vocab : {32000, 128256, 256000}) flce.push_back({tokens, kLlamaHidden, vocab});
  }
  const auto bf16 = std::vector<DType>{DType::kBFloat16};
  r.add_configs("flce", kOp, flce, bf16);
  r.add_configs("llama", kOp, {{kLlamaTokens, kLlamaHidden, kLlamaVocab}}, bf16);
#if TRAINSCALE_HAVE_CUDA
  r.add_baseline(kOp, "unfused", unfused_linear_cross_entropy_baseline);
#endif
});

}  // namespace
}  // namespace trainscale::bench::cases
