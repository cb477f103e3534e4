"""Cross-entropy and fused linear cross-entropy (include/trainscale/loss.h) as PyTorch functions:
the fake implementations and autograd formulas of their ops in torch.ops.trainscale
(python/csrc/loss_ops.cc), cross_entropy and linear_cross_entropy."""
from typing import Optional

import torch
from torch.library import register_autograd, register_fake

from . import reference as _ref
from ._common import like as _like
from ._common import autocast_inputs, contiguous_rows
from ._common import ops
from .selection import dispatch as _dispatch


@register_fake("trainscale::cross_entropy_forward")
def _(logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction, with_grad):
    torch._check(logits.dim() == 2, lambda: "trainscale::cross_entropy_forward: argument 'logits': expected [M, V]")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    rows = logits.shape[0]
    loss = logits.new_empty((rows,) if reduction == "none" else (), dtype=dtype)
    grad = _like(logits) if with_grad else logits.new_empty((0,))
    return loss, logits.new_empty((rows,), dtype=dtype), grad


@register_fake("trainscale::cross_entropy_backward")
def _(grad_loss, logits, target, lse, ignore_index, label_smoothing, z_loss, softcap, reduction):
    return _like(logits)


# The backward reads the logits again with the saved lse (one read, one write) for any upstream
# gradient, where a gradient written by the forward (with_grad) would be held until the backward
# and then scaled by it: a pass more.
def _ce_setup(ctx, inputs, output):
    logits, target, *options = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.options = options[:5]  # ignore_index, label_smoothing, z_loss, softcap, reduction
    ctx.mark_non_differentiable(output[1], output[2])


def _ce_backward(ctx, dloss, _dlse, _dgrad):
    logits, target, lse = ctx.saved_tensors
    grad = ops.cross_entropy_backward(dloss.contiguous(), logits, target, lse, *ctx.options)
    return grad, None, None, None, None, None, None, None


register_autograd("trainscale::cross_entropy_forward", _ce_backward, setup_context=_ce_setup)


def _cross_entropy(logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction):
    v = logits.shape[-1]
    loss = ops.cross_entropy_forward(contiguous_rows(logits).reshape(-1, v), target.reshape(-1), ignore_index,
                                     label_smoothing, z_loss, softcap, reduction, False)[0]
    return loss.reshape(target.shape) if reduction == "none" else loss


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0,
                  reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits [..., V] (classes last) against integer targets [...], like
    F.cross_entropy(logits.view(-1, V), target.view(-1), ...) with, all in the kernel: softcap
    c > 0 (logits -> c tanh(logits / c) first), z_loss (adds z_loss * logsumexp^2 per row) and
    label smoothing. Rows whose target is ignore_index give 0 and leave the mean (all ignored:
    NaN). The loss is float32 (float64 for float64 logits), as is its accumulation."""
    return _dispatch("cross_entropy", "cross_entropy", _cross_entropy, _ref.cross_entropy, logits,
                     target, ignore_index, label_smoothing, z_loss, softcap, reduction)


def _stat_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@register_fake("trainscale::fused_linear_cross_entropy_forward")
def _(hidden, weight, bias, target, grad_loss, ignore_index, label_smoothing, z_loss, softcap, reduction,
      with_grad_hidden, with_grad_weight, with_grad_bias, grad_weight_accumulation, chunk_tokens):
    op = "trainscale::fused_linear_cross_entropy_forward"
    torch._check(hidden.dim() == 2, lambda: f"{op}: argument 'hidden': expected [T, H]")
    torch._check(bias is not None or not with_grad_bias,
                 lambda: f"{op}: argument 'with_grad_bias': a gradient of a bias that is not given")
    dtype, tokens = _stat_dtype(hidden), hidden.shape[0]
    loss = hidden.new_empty((tokens,) if reduction == "none" else (), dtype=dtype)

    def grad_of(wanted, x):
        return _like(x) if wanted else x.new_empty((0,))
    return (loss, hidden.new_empty((tokens,), dtype=dtype), grad_of(with_grad_hidden, hidden),
            grad_of(with_grad_weight, weight), grad_of(with_grad_bias, bias if bias is not None else hidden))


# A reduced loss ('mean' / 'sum') has one upstream gradient, a scalar: the forward computed the
# gradients its with_grad flags asked for (of an upstream 1), and the backward scales them. A
# per-token loss ('none') has one upstream gradient per token, which the forward cannot know:
# the backward runs the op again with grad_loss, so ignored tokens and any weighting of the
# tokens are exact. An input whose gradient the forward did not compute gets it that way too.
def _flce_setup(ctx, inputs, output):
    hidden, weight, bias, target, _grad_loss, *options = inputs
    ctx.options = options[:5]  # ignore_index, label_smoothing, z_loss, softcap, reduction
    ctx.accumulation = options[8:]  # grad_weight_accumulation, chunk_tokens
    ctx.with_grads = options[5:8] if ctx.options[4] != "none" else (False, False, False)
    ctx.save_for_backward(hidden, weight, bias, target, *output[2:])
    ctx.mark_non_differentiable(*output[1:])
    # No zero tensors for the outputs that take no gradient (lse and the gradients themselves:
    # grad_weight is V x H, a 1 GiB fill at Llama-3 8B's head in every backward).
    ctx.set_materialize_grads(False)


# Whether the running backward keeps its graph (retain_graph), so that it may run again; assumed
# where this torch cannot tell.
_keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)


def _flce_backward(ctx, dloss, *_):
    if dloss is None:  # the loss reached the graph's output through nothing differentiable
        return (None,) * 15
    hidden, weight, bias, target, *saved = ctx.saved_tensors
    wanted = ctx.needs_input_grad[:3]
    # The saved gradients are scaled in place (no second gradient-sized buffer) when nothing reads
    # them again: an eager backward that frees its graph. Traced (torch.compile, a functional
    # graph: tensor subclasses here) or with retain_graph, a scaled copy.
    in_place = type(dloss) is torch.Tensor and not _keeps_graph()
    grads = [(g if in_place else g * dloss) if w and have else None
             for g, w, have in zip(saved, wanted, ctx.with_grads)]
    scaled = [g for g in grads if g is not None]
    if in_place and scaled:
        # By the factor read on the device: at exactly 1 (loss.backward() of a mean or a sum) the
        # kernels return at once, saving a pass over every gradient (grad_weight: V x H, 0.7 ms at
        # Llama-3 8B's head) without a host sync, which would leave the GPU idle while the host
        # queues the rest of the backward.
        if dloss.dtype == torch.float32:
            ops.scale_by_device_factor_(scaled, dloss.reshape(()))
        else:
            for g in scaled:
                g.mul_(dloss)
    missing = [w and g is None for w, g in zip(wanted, grads)]
    if any(missing):
        computed = ops.fused_linear_cross_entropy_forward(
            hidden, weight, bias, target, dloss.to(_stat_dtype(hidden)).contiguous(), *ctx.options,
            *missing, *ctx.accumulation)[2:]
        grads = [c if m else g for g, c, m in zip(grads, computed, missing)]
    return (*grads, None, None, None, None, None, None, None, None, None, None, None, None)


register_autograd("trainscale::fused_linear_cross_entropy_forward", _flce_backward, setup_context=_flce_setup)


def _linear_cross_entropy(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap,
                          reduction, grad_weight_accumulation, chunk_tokens):
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)  # the product as F.linear's would be
    # Gradients in the forward only for a reduced loss (see _flce_setup), of what needs them.
    in_forward = torch.is_grad_enabled() and reduction != "none"
    with_grads = [in_forward and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    loss = ops.fused_linear_cross_entropy_forward(
        contiguous_rows(hidden).reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1), None, ignore_index,
        label_smoothing, z_loss, softcap, reduction, *with_grads, grad_weight_accumulation, chunk_tokens)[0]
    return loss.reshape(target.shape) if reduction == "none" else loss


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0,
                         reduction: str = "mean", grad_weight_accumulation: torch.dtype = torch.float32,
                         chunk_tokens: int = 0) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, target, ...) without the logits: hidden [..., H],
    weight [V, H], bias [V] (optional), one dtype; target [...] integer. Tokens go through the
    kernel in chunks of chunk_tokens (0 chooses), so only one chunk's logits exist at a time; the
    options and the loss (float32; float64 for float64 inputs) are cross_entropy's. When hidden,
    weight or bias requires grad, a 'mean' / 'sum' loss computes their gradients in the same call
    (the backward scales them); a 'none' loss computes them in the backward, from its per-token
    upstream gradient.
    grad_weight_accumulation: torch.float32 (grad_weight summed over the chunks in float32) or
    the weight's dtype (summed in grad_weight itself: no float32 [V, H] buffer, a rounding per
    chunk)."""
    return _dispatch("fused_linear_cross_entropy", "linear_cross_entropy", _linear_cross_entropy,
                     _ref.linear_cross_entropy, hidden, weight, target, bias, ignore_index, label_smoothing,
                     z_loss, softcap, reduction, grad_weight_accumulation, chunk_tokens)
