"""The softmax family (include/trainscale/softmax.h) as PyTorch functions: the fake
implementations and autograd formula of its ops in torch.ops.trainscale
(python/csrc/softmax_ops.cc), and softmax."""
import torch
from torch.library import register_autograd, register_fake

from . import reference as _ref
from ._common import like as _like
from ._common import contiguous_rows
from ._common import ops
from .selection import dispatch as _dispatch


@register_fake("trainscale::softmax_forward")
def _(x):
    return _like(x)


@register_fake("trainscale::softmax_backward")
def _(dy, y):
    return _like(y)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return ops.softmax_backward(dy.contiguous(), y)


register_autograd("trainscale::softmax_forward", _softmax_backward, setup_context=_softmax_setup)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over the last dim (dim must name it), computed in float32."""
    if dim not in (-1, x.dim() - 1):
        raise ValueError(f"trainscale.softmax: argument 'dim': expected the last dim, got {dim}")
    return _dispatch("softmax", "softmax", lambda x: ops.softmax_forward(contiguous_rows(x)), _ref.softmax, x)
