"""The activation family (include/trainscale/activation.h) as PyTorch functions: fake
implementations and autograd formulas of its ops in torch.ops.trainscale
(python/csrc/activation_ops.cc), and gelu, silu and swiglu."""
from typing import Optional

import torch
from torch.library import register_autograd, register_fake

from . import reference as _ref
from ._common import like as _like
from ._common import ops
from .selection import dispatch as _dispatch


# ---- fake implementations (shapes and dtypes only; torch.compile traces through these) ------

@register_fake("trainscale::gelu_forward")
def _(x, approximate):
    return _like(x)


@register_fake("trainscale::gelu_backward")
def _(dy, x, approximate):
    return _like(x)


@register_fake("trainscale::silu_forward")
def _(x):
    return _like(x)


@register_fake("trainscale::silu_backward")
def _(dy, x):
    return _like(x)


@register_fake("trainscale::swiglu_forward")
def _(a, b):
    return _like(a)


@register_fake("trainscale::swiglu_backward")
def _(dy, a, b):
    return _like(a), _like(b)


@register_fake("trainscale::swiglu_forward_packed")
def _(ab):
    torch._check(ab.shape[-1] % 2 == 0,
                 lambda: "trainscale::swiglu_forward_packed: argument 'ab': expected an even last dim")
    return ab.new_empty((*ab.shape[:-1], ab.shape[-1] // 2))


@register_fake("trainscale::swiglu_backward_packed")
def _(dy, ab):
    return _like(ab)


# ---- autograd -------------------------------------------------------------------------------

def _gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.approximate = inputs[1]


def _gelu_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return ops.gelu_backward(dy.contiguous(), x, ctx.approximate), None


register_autograd("trainscale::gelu_forward", _gelu_backward, setup_context=_gelu_setup)


def _silu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _silu_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return ops.silu_backward(dy.contiguous(), x)


register_autograd("trainscale::silu_forward", _silu_backward, setup_context=_silu_setup)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    a, b = ctx.saved_tensors
    return ops.swiglu_backward(dy.contiguous(), a, b)


register_autograd("trainscale::swiglu_forward", _swiglu_backward, setup_context=_swiglu_setup)


def _swiglu_packed_backward(ctx, dy):
    (ab,) = ctx.saved_tensors
    return ops.swiglu_backward_packed(dy.contiguous(), ab)


register_autograd("trainscale::swiglu_forward_packed", _swiglu_packed_backward,
                  setup_context=_swiglu_setup)


# ---- functions ------------------------------------------------------------------------------

def swiglu(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(a) * b; with b omitted, a is packed [..., 2F] (gate in the first half, up in the
    second) and the result is [..., F]."""
    return _dispatch("swiglu", "swiglu", _swiglu, _ref.swiglu, a, b)


def _swiglu(a, b):
    return ops.swiglu_forward_packed(a) if b is None else ops.swiglu_forward(a, b)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, erf form ('none') or tanh form ('tanh'), like F.gelu."""
    return _dispatch("gelu", "gelu", ops.gelu_forward, _ref.gelu, x, approximate)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x)."""
    return _dispatch("silu", "silu", ops.silu_forward, _ref.silu, x)
