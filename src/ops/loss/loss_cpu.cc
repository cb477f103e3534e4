// fp64 reference for the loss family.
#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "core/host_dtype.h"
#include "core/parallel.h"
#include "ops/loss/loss_internal.h"

namespace trainscale::ops::loss {

using detail::load_as_double;
using detail::store_from_double;

namespace {
// Row offset (in elements) of row i for a view validated with OpChecker::rows().
std::int64_t row_offset(const detail::Rows& r, std::int64_t i) { return i * r.row_stride; }

// Cross-entropy rows are long (a vocabulary each), so few make a thread's worth.
constexpr std::int64_t kCrossEntropyRowGrain = 4;

// Element i of a 1-D view.
double load_at(const TensorView& t, std::int64_t i) {
  return load_as_double(t.dtype, t.data, i * t.stride(0));
}
void store_at(TensorView t, std::int64_t i, double v) {
  store_from_double(t.dtype, t.data, i * t.stride(0), v);
}
std::int64_t target_at(const TensorView& targets, std::int64_t i) {
  return detail::load_index(targets.dtype, targets.data, i * targets.stride(0));
}

// Checks every target before any output is written (grad_logits may overwrite the logits);
// returns how many rows are not ignored.
std::int64_t count_valid_targets(const char* op, const TensorView& targets, std::int64_t classes,
                                 std::int64_t ignore_index) {
  std::int64_t valid = 0;
  for (std::int64_t i = 0; i < targets.numel(); ++i) {
    const std::int64_t t = target_at(targets, i);
    if (t == ignore_index) continue;
    if (t < 0 || t >= classes) {
      detail::throw_arg_error(op, "targets",
                              "class indices in [0, " + std::to_string(classes) +
                                  ") or ignore_index " + std::to_string(ignore_index),
                              "targets[" + std::to_string(i) + "] = " + std::to_string(t));
    }
    ++valid;
  }
  return valid;
}

// Multiplier of every row's gradient for an upstream gradient of 1 on the reduced loss.
double reduction_scale(Reduction reduction, std::int64_t valid_rows) {
  return reduction == Reduction::kMean ? 1.0 / static_cast<double>(valid_rows) : 1.0;
}

// Sum in fixed chunks, partials added in chunk order: independent of the thread count.
double sum_in_order(const std::vector<double>& values) {
  constexpr std::int64_t kGrain = 1024;
  const auto n = static_cast<std::int64_t>(values.size());
  std::vector<double> partial(detail::chunk_count(n, kGrain), 0.0);
  detail::parallel_chunks(n, kGrain, [&](std::int64_t chunk, std::int64_t lo, std::int64_t hi) {
    double s = 0;
    for (std::int64_t i = lo; i < hi; ++i) s += values[i];
    partial[chunk] = s;
  });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

// Writes per-row losses (kNone) or their reduction. As torch, a mean over no valid row is
// 0 / 0 = NaN.
void store_losses(TensorView loss, const std::vector<double>& row_losses, Reduction reduction,
                  std::int64_t valid_rows) {
  if (reduction == Reduction::kNone) {
    for (std::size_t i = 0; i < row_losses.size(); ++i) store_at(loss, static_cast<std::int64_t>(i), row_losses[i]);
    return;
  }
  double total = sum_in_order(row_losses);
  if (reduction == Reduction::kMean) total /= static_cast<double>(valid_rows);
  store_from_double(loss.dtype, loss.data, 0, total);
}

void load_row(const TensorView& t, const detail::Rows& r, std::int64_t i, std::span<double> row) {
  for (std::int64_t j = 0; j < r.cols; ++j) row[j] = load_as_double(t.dtype, t.data, row_offset(r, i) + j);
}
void store_row(TensorView t, const detail::Rows& r, std::int64_t i, std::span<const double> row) {
  for (std::int64_t j = 0; j < r.cols; ++j) store_from_double(t.dtype, t.data, row_offset(r, i) + j, row[j]);
}

// Raw logits -> c * tanh(x / c) in place; c == 0 leaves them as they are.
void apply_softcap(std::span<double> row, double cap) {
  if (cap == 0) return;
  for (double& v : row) v = cap * std::tanh(v / cap);
}

// Shifted by the maximum. The max skips NaN but the sum does not, so a NaN anywhere, or no
// finite maximum, gives NaN.
double logsumexp(std::span<const double> row) {
  double max = -std::numeric_limits<double>::infinity();
  for (double v : row) max = std::max(max, v);
  double sum = 0;
  for (double v : row) sum += std::exp(v - max);
  return max + std::log(sum);
}

// Loss of one non-ignored row from its softcapped logits x and their lse.
double row_loss(std::span<const double> x, std::int64_t target, double lse,
                const CrossEntropyOptions& o) {
  const double e = o.label_smoothing;
  double loss = o.z_loss * lse * lse;
  // Zero-weight terms are skipped so that a -inf logit cannot turn 0 * inf into NaN.
  if (e < 1) loss += (1 - e) * (lse - x[target]);
  if (e > 0) {
    double sum = 0;
    for (double v : x) sum += v;
    loss += e * (lse - sum / static_cast<double>(x.size()));
  }
  return loss;
}

// grad[j] = scale * d row_loss / d raw logit j, from the softcapped logits x and their lse
// (d x / d raw = 1 - tanh^2 = 1 - (x / c)^2). grad may be x itself.
void row_gradient(std::span<const double> x, std::int64_t target, double lse, double scale,
                  const CrossEntropyOptions& o, std::span<double> grad) {
  const double e = o.label_smoothing;
  const double prob_weight = 1 + 2 * o.z_loss * lse;
  const double smooth = e / static_cast<double>(x.size());
  const double cap = o.softcap;
  for (std::size_t j = 0; j < x.size(); ++j) {
    double g = std::exp(x[j] - lse) * prob_weight - smooth;
    if (static_cast<std::int64_t>(j) == target) g -= 1 - e;
    if (cap > 0) g *= 1 - (x[j] / cap) * (x[j] / cap);
    grad[j] = scale * g;
  }
}

// One row of the forward pass on raw logits in `x`: softcaps them, returns {lse, loss} and,
// when `with_grad`, leaves scale * d loss / d raw logits in `x` (0 for an ignored row).
struct RowResult {
  double lse;
  double loss;
};
RowResult forward_row(std::span<double> x, std::int64_t target, double scale, bool with_grad,
                      const CrossEntropyOptions& o) {
  apply_softcap(x, o.softcap);
  const double lse = logsumexp(x);
  const bool ignored = target == o.ignore_index;
  const double loss = ignored ? 0.0 : row_loss(x, target, lse, o);
  if (with_grad) {
    if (ignored) {
      std::fill(x.begin(), x.end(), 0.0);
    } else {
      row_gradient(x, target, lse, scale, o, x);
    }
  }
  return {lse, loss};
}

}  // namespace

void mse_forward_cpu(const TensorView& a, const TensorView& b, TensorView out,
                     Reduction reduction) {
  detail::OpChecker c("mse_forward");
  const auto ra = c.rows(a, "a"), rb = c.rows(b, "b");
  const std::int64_t M = ra.rows, N = ra.cols;
  if (reduction == Reduction::kNone) {
    const auto ro = c.rows(out, "out");
    detail::parallel_for(M, 64, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i) {
        for (std::int64_t j = 0; j < N; ++j) {
          const double d = load_as_double(a.dtype, a.data, row_offset(ra, i) + j) -
                           load_as_double(b.dtype, b.data, row_offset(rb, i) + j);
          store_from_double(out.dtype, out.data, row_offset(ro, i) + j, d * d);
        }
      }
    });
    return;
  }
  // Fixed row chunks summed in order: the same result whatever the thread count.
  constexpr std::int64_t kGrain = 64;
  std::vector<double> partial(detail::chunk_count(M, kGrain), 0.0);
  detail::parallel_chunks(M, kGrain, [&](std::int64_t chunk, std::int64_t lo, std::int64_t hi) {
    double s = 0;
    for (std::int64_t i = lo; i < hi; ++i) {
      for (std::int64_t j = 0; j < N; ++j) {
        const double d = load_as_double(a.dtype, a.data, row_offset(ra, i) + j) -
                         load_as_double(b.dtype, b.data, row_offset(rb, i) + j);
        s += d * d;
      }
    }
    partial[chunk] = s;
  });
  double total = 0;
  for (double p : partial) total += p;
  if (reduction == Reduction::kMean) total /= static_cast<double>(M * N);
  store_from_double(out.dtype, out.data, 0, total);
}

void mse_backward_cpu(const TensorView& grad_out, const TensorView& a, const TensorView& b,
                      TensorView grad_a, TensorView grad_b, Reduction reduction) {
  detail::OpChecker c("mse_backward");
  const auto ra = c.rows(a, "a"), rb = c.rows(b, "b");
  const std::int64_t M = ra.rows, N = ra.cols;
  const detail::Rows rg = reduction == Reduction::kNone ? c.rows(grad_out, "grad_out") : detail::Rows{};
  const detail::Rows rga = grad_a.defined() ? c.rows(grad_a, "grad_a") : detail::Rows{};
  const detail::Rows rgb = grad_b.defined() ? c.rows(grad_b, "grad_b") : detail::Rows{};
  double scale = 2.0;
  if (reduction != Reduction::kNone) {
    scale *= load_as_double(grad_out.dtype, grad_out.data, 0);
    if (reduction == Reduction::kMean) scale /= static_cast<double>(M * N);
  }
  detail::parallel_for(M, 64, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      for (std::int64_t j = 0; j < N; ++j) {
        double g = scale * (load_as_double(a.dtype, a.data, row_offset(ra, i) + j) -
                            load_as_double(b.dtype, b.data, row_offset(rb, i) + j));
        if (reduction == Reduction::kNone) {
          g *= load_as_double(grad_out.dtype, grad_out.data, row_offset(rg, i) + j);
        }
        if (grad_a.defined()) store_from_double(grad_a.dtype, grad_a.data, row_offset(rga, i) + j, g);
        if (grad_b.defined()) store_from_double(grad_b.dtype, grad_b.data, row_offset(rgb, i) + j, -g);
      }
    }
  });
}

void cross_entropy_forward_cpu(const TensorView& logits, const TensorView& targets,
                               TensorView loss, TensorView lse, TensorView grad_logits,
                               const CrossEntropyOptions& options) {
  detail::OpChecker c("cross_entropy_forward");
  const auto rl = c.rows(logits, "logits");
  const detail::Rows rg = grad_logits.defined() ? c.rows(grad_logits, "grad_logits") : detail::Rows{};
  const std::int64_t valid = count_valid_targets(c.op(), targets, rl.cols, options.ignore_index);
  const double scale = reduction_scale(options.reduction, valid);
  std::vector<double> row_losses(rl.rows);
  detail::parallel_for(rl.rows, kCrossEntropyRowGrain, [&](std::int64_t lo, std::int64_t hi) {
    std::vector<double> x(rl.cols);
    for (std::int64_t i = lo; i < hi; ++i) {
      load_row(logits, rl, i, x);
      const RowResult r = forward_row(x, target_at(targets, i), scale, grad_logits.defined(), options);
      row_losses[i] = r.loss;
      if (lse.defined()) store_at(lse, i, r.lse);
      if (grad_logits.defined()) store_row(grad_logits, rg, i, x);
    }
  });
  store_losses(loss, row_losses, options.reduction, valid);
}

void cross_entropy_backward_cpu(const TensorView& grad_loss, const TensorView& logits,
                                const TensorView& targets, const TensorView& lse,
                                TensorView grad_logits, const CrossEntropyOptions& options) {
  detail::OpChecker c("cross_entropy_backward");
  const auto rl = c.rows(logits, "logits"), rg = c.rows(grad_logits, "grad_logits");
  const std::int64_t valid = count_valid_targets(c.op(), targets, rl.cols, options.ignore_index);
  const bool per_row = options.reduction == Reduction::kNone;
  const double reduced_scale =
      per_row ? 1.0 : load_as_double(grad_loss.dtype, grad_loss.data, 0) * reduction_scale(options.reduction, valid);
  detail::parallel_for(rl.rows, kCrossEntropyRowGrain, [&](std::int64_t lo, std::int64_t hi) {
    std::vector<double> x(rl.cols);
    for (std::int64_t i = lo; i < hi; ++i) {
      const std::int64_t target = target_at(targets, i);
      if (target == options.ignore_index) {
        std::fill(x.begin(), x.end(), 0.0);
      } else {
        load_row(logits, rl, i, x);
        apply_softcap(x, options.softcap);
        const double scale = per_row ? load_at(grad_loss, i) : reduced_scale;
        row_gradient(x, target, load_at(lse, i), scale, options, x);
      }
      store_row(grad_logits, rg, i, x);
    }
  });
}

void fused_linear_cross_entropy_forward_cpu(const FusedLinearCrossEntropyArgs& args,
                                            const CrossEntropyOptions& options,
                                            std::int64_t chunk_rows) {
  const auto& [hidden, weight, bias, targets, loss, lse, grad_loss] =
      std::tie(args.hidden, args.weight, args.bias, args.targets, args.loss, args.lse, args.grad_loss);
  const auto& [grad_hidden, grad_weight, grad_bias] =
      std::tie(args.grad_hidden, args.grad_weight, args.grad_bias);
  detail::OpChecker c("fused_linear_cross_entropy_forward");
  const auto rh = c.rows(hidden, "hidden"), rw = c.rows(weight, "weight");
  const detail::Rows rgh = grad_hidden.defined() ? c.rows(grad_hidden, "grad_hidden") : detail::Rows{};
  const detail::Rows rgw = grad_weight.defined() ? c.rows(grad_weight, "grad_weight") : detail::Rows{};
  const std::int64_t tokens = rh.rows, dim = rh.cols, classes = rw.rows;
  const std::int64_t valid = count_valid_targets(c.op(), targets, classes, options.ignore_index);
  const bool per_row = options.reduction == Reduction::kNone;
  // The gradient scale of token t: its upstream gradient (1 when absent), over the rows not
  // ignored for kMean.
  const double reduced_scale = (per_row || !grad_loss.defined() ? 1.0 : load_at(grad_loss, 0)) *
                               reduction_scale(options.reduction, valid);
  const auto scale_of = [&](std::int64_t t) {
    return per_row && grad_loss.defined() ? load_at(grad_loss, t) : reduced_scale;
  };
  const bool with_grad = grad_hidden.defined() || grad_weight.defined() || grad_bias.defined();
  auto h_at = [&](std::int64_t t, std::int64_t k) { return load_as_double(hidden.dtype, hidden.data, row_offset(rh, t) + k); };
  auto w_at = [&](std::int64_t v, std::int64_t k) { return load_as_double(weight.dtype, weight.data, row_offset(rw, v) + k); };

  // grad_weight / grad_bias add every row's contribution in row order, so neither the chunk
  // size nor the thread count changes a bit of them; they are rounded once at the end.
  std::vector<double> weight_acc(grad_weight.defined() ? classes * dim : 0, 0.0);
  std::vector<double> bias_acc(grad_bias.defined() ? classes : 0, 0.0);
  std::vector<double> row_losses(tokens);
  // The only logits held at once: one chunk of rows, in double (later their gradients).
  std::vector<double> logits(std::min(chunk_rows, tokens) * classes);
  for (std::int64_t begin = 0; begin < tokens; begin += chunk_rows) {
    const std::int64_t rows = std::min(chunk_rows, tokens - begin);
    detail::parallel_for(rows, 1, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t r = lo; r < hi; ++r) {
        const std::int64_t t = begin + r;
        const auto x = std::span(logits).subspan(r * classes, classes);
        for (std::int64_t v = 0; v < classes; ++v) {
          double dot = bias.defined() ? load_at(bias, v) : 0.0;
          for (std::int64_t k = 0; k < dim; ++k) dot += h_at(t, k) * w_at(v, k);
          x[v] = dot;
        }
        const RowResult res = forward_row(x, target_at(targets, t), scale_of(t), with_grad, options);
        row_losses[t] = res.loss;
        if (lse.defined()) store_at(lse, t, res.lse);
      }
    });
    if (grad_hidden.defined()) {
      detail::parallel_for(rows, 1, [&](std::int64_t lo, std::int64_t hi) {
        std::vector<double> acc(dim);
        for (std::int64_t r = lo; r < hi; ++r) {
          std::fill(acc.begin(), acc.end(), 0.0);
          for (std::int64_t v = 0; v < classes; ++v) {
            const double g = logits[r * classes + v];
            for (std::int64_t k = 0; k < dim; ++k) acc[k] += g * w_at(v, k);
          }
          store_row(grad_hidden, rgh, begin + r, acc);
        }
      });
    }
    if (grad_weight.defined() || grad_bias.defined()) {
      detail::parallel_for(classes, 16, [&](std::int64_t lo, std::int64_t hi) {
        for (std::int64_t v = lo; v < hi; ++v) {
          for (std::int64_t r = 0; r < rows; ++r) {
            const double g = logits[r * classes + v];
            if (grad_bias.defined()) bias_acc[v] += g;
            if (!grad_weight.defined()) continue;
            for (std::int64_t k = 0; k < dim; ++k) weight_acc[v * dim + k] += g * h_at(begin + r, k);
          }
        }
      });
    }
  }
  detail::parallel_for(classes, 16, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t v = lo; v < hi; ++v) {
      if (grad_weight.defined()) store_row(grad_weight, rgw, v, std::span(weight_acc).subspan(v * dim, dim));
      if (grad_bias.defined()) store_at(grad_bias, v, bias_acc[v]);
    }
  });
  store_losses(loss, row_losses, options.reduction, valid);
}

}  // namespace trainscale::ops::loss
