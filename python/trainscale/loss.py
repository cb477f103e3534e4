"""Cross-entropy (include/trainscale/loss.h) as a PyTorch function: the fake implementations and
autograd formula of its ops in torch.ops.trainscale (python/csrc/loss_ops.cc), and
cross_entropy."""
import torch
from torch.library import register_autograd, register_fake

from . import reference as _ref
from ._common import like as _like
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
    loss = ops.cross_entropy_forward(logits.reshape(-1, v), target.reshape(-1), ignore_index,
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
