"""The norm family (include/trainscale/norm.h) as PyTorch functions: fake implementations and
autograd formulas of its ops in torch.ops.trainscale (python/csrc/norm_ops.cc), and rms_norm,
layer_norm, fused_add_rms_norm and fused_add_rms_norm_."""
from typing import Optional, Tuple

import torch
from torch.library import register_autograd, register_fake

from . import reference as _ref
from ._common import contiguous_rows
from ._common import like as _like
from ._common import ops
from .selection import dispatch as _dispatch


def _stat(x):
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.new_empty(x.shape[:-1], dtype=dtype)


def _grad_like(w, x):
    return _like(w) if w is not None else x.new_empty((0,))


# ---- fake implementations (shapes and dtypes only; torch.compile traces through these) ------

@register_fake("trainscale::rmsnorm_forward")
def _(x, weight, eps, weight_offset):
    return _like(x), _stat(x)


@register_fake("trainscale::rmsnorm_backward")
def _(dy, x, weight, rstd, eps, weight_offset):
    return _like(x), _grad_like(weight, x)


@register_fake("trainscale::fused_add_rmsnorm_forward")
def _(x, residual, weight, eps, weight_offset):
    return _stat(x)


@register_fake("trainscale::fused_add_rmsnorm_forward_out_of_place")
def _(x, residual, weight, eps, weight_offset):
    return _like(x), _like(residual), _stat(x)


@register_fake("trainscale::fused_add_rmsnorm_backward")
def _(dy, d_residual, residual, weight, rstd, eps, weight_offset):
    return _like(dy), _grad_like(weight, dy)


@register_fake("trainscale::layernorm_forward")
def _(x, weight, bias, eps):
    return _like(x), _stat(x), _stat(x)


@register_fake("trainscale::layernorm_backward")
def _(dy, x, weight, bias, mean, rstd, eps):
    return _like(x), _grad_like(weight, x), _grad_like(bias, x)


# ---- autograd -------------------------------------------------------------------------------

def _rms_setup(ctx, inputs, output):
    x, weight, eps, weight_offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps, ctx.weight_offset = eps, weight_offset


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = ops.rmsnorm_backward(dy.contiguous(), x, weight, rstd, ctx.eps, ctx.weight_offset)
    return dx, (dw if weight is not None else None), None, None


register_autograd("trainscale::rmsnorm_forward", _rms_backward, setup_context=_rms_setup)


def _ln_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.eps = eps


def _ln_backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = ops.layernorm_backward(dy.contiguous(), x, weight, bias, mean, rstd, ctx.eps)
    return dx, (dw if weight is not None else None), (db if bias is not None else None), None


register_autograd("trainscale::layernorm_forward", _ln_backward, setup_context=_ln_setup)


# ---- functions ------------------------------------------------------------------------------

def _rms_norm(x, weight, eps, weight_offset):
    return ops.rmsnorm_forward(contiguous_rows(x), weight, eps, weight_offset)[0]


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
             weight_offset: float = 0.0) -> torch.Tensor:
    """y = x / sqrt(mean(x^2, -1) + eps) * (weight + weight_offset), over the last dim."""
    return _dispatch("rmsnorm", "rms_norm", _rms_norm, _ref.rms_norm, x, weight, eps, weight_offset)


# ---- rebuilding a norm's output in a backward -----------------------------------------------
# A pre-norm block saves its norm's input x for the norm's backward, and the projection after it
# saves the norm's output y for its weight gradient: two [T, H] tensors where one determines the
# other. An output marked rebuildable carries its recipe (x, weight, eps, offset); the autograd
# functions that know it (shared_input_linear, swiglu_mlp) save x and the weight instead of y and
# rebuild y in their backward with the same rms_norm (the same bits), one pass over [T, H].

def mark_rebuildable(y: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                     weight_offset: float) -> torch.Tensor:
    """Tags y = rms_norm(x, weight, eps, weight_offset) as rebuildable from x (eager autograd only:
    untouched under torch.compile or without grad). A y changed in place afterwards is saved as
    it is."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        grad = x.requires_grad or (weight is not None and weight.requires_grad)
        y._trainscale_rms_norm_of = (x, weight, eps, weight_offset, grad, y._version)
    return y


def save_input(ctx, x: torch.Tensor, *others) -> None:
    """ctx.save_for_backward(x, *others), with a rebuildable norm output x (mark_rebuildable)
    saved as its recipe; saved_input gives x back either way."""
    recipe = getattr(x, "_trainscale_rms_norm_of", None)
    if recipe is None or recipe[5] != x._version:
        ctx.rms_norm_of = None
        ctx.save_for_backward(x, *others)
        return
    source, weight, eps, weight_offset, grad, _ = recipe
    ctx.rms_norm_of = (eps, weight_offset, grad)
    ctx.save_for_backward(source, weight, *others)


def saved_input(ctx):
    """(x, [others]) as save_input received them, x rebuilt from its norm's input if so saved."""
    saved = ctx.saved_tensors
    if ctx.rms_norm_of is None:
        return saved[0], saved[1:]
    eps, weight_offset, grad = ctx.rms_norm_of
    # In the forward's grad mode, so that rms_norm's automatic selection (keyed on it) picks the
    # same implementation, hence the same bits; the graph built here is dropped at once.
    with torch.enable_grad():
        x = rms_norm(saved[0].detach().requires_grad_(grad), saved[1], eps, weight_offset)
    return x.detach(), saved[2:]


def _layer_norm(x, weight, bias, eps):
    return ops.layernorm_forward(contiguous_rows(x), weight, bias, eps)[0]


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim (biased variance), like F.layer_norm(x, (N,), w, b, eps)."""
    return _dispatch("layernorm", "layer_norm", _layer_norm, _ref.layer_norm, x, weight, bias, eps)


class _FusedAddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, weight_offset):
        out, res, rstd = ops.fused_add_rmsnorm_forward_out_of_place(contiguous_rows(x), contiguous_rows(residual),
                                                                     weight, eps, weight_offset)
        ctx.save_for_backward(res, weight, rstd)
        ctx.eps, ctx.weight_offset = eps, weight_offset
        return out, res

    @staticmethod
    def backward(ctx, dy, d_residual):
        res, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(res, dtype=res.dtype)
        if d_residual is not None:
            d_residual = d_residual.contiguous()  # may be expanded (stride 0), e.g. of a sum
        dx, dw = ops.fused_add_rmsnorm_backward(dy.contiguous(), d_residual, res, weight, rstd,
                                           ctx.eps, ctx.weight_offset)
        return dx, dx, (dw if weight is not None else None), None, None


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor,
                       weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                       weight_offset: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); differentiable, inputs untouched."""
    return _dispatch("rmsnorm", "fused_add_rms_norm", _FusedAddRMSNorm.apply, _ref.fused_add_rms_norm,
                     x, residual, weight, eps, weight_offset)


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor,
                        weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                        weight_offset: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- rms_norm(residual). Returns (x, residual).

    No autograd (use fused_add_rms_norm for training). Always trainscale's kernel: an in-place
    call cannot be timed against another on the same data."""
    ops.fused_add_rmsnorm_forward(x, residual, weight, eps, weight_offset)
    return x, residual
