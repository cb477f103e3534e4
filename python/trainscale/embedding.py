"""The embedding family (include/trainscale/embedding.h) as a PyTorch function: the fake
implementations and the autograd formula of torch.ops.trainscale.embedding_forward /
embedding_backward (python/csrc/embedding_ops.cc), and embedding(), F.embedding's drop-in whose
backward writes the table's gradient in one deterministic pass."""
from typing import Optional

import torch
from torch.library import register_autograd, register_fake

from . import reference as _ref
from ._common import ops
from .selection import dispatch as _dispatch


@register_fake("trainscale::embedding_forward")
def _(weight, ids, padding_idx):
    return weight.new_empty((*ids.shape, weight.shape[1]))


@register_fake("trainscale::embedding_backward")
def _(grad_output, ids, num_weights, padding_idx):
    return grad_output.new_empty((num_weights, grad_output.shape[-1]))


def _setup(ctx, inputs, output):
    weight, ids, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx


def _backward(ctx, grad_output):
    (ids,) = ctx.saved_tensors
    return ops.embedding_backward(grad_output, ids, ctx.num_weights, ctx.padding_idx), None, None


register_autograd("trainscale::embedding_forward", _backward, setup_context=_setup)


def _embedding(ids, weight, padding_idx):
    return ops.embedding_forward(weight, ids, -1 if padding_idx is None else padding_idx)


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int] = None) -> torch.Tensor:
    """F.embedding(ids, weight, padding_idx): weight's rows [V, H] at ids (any shape, int32 or
    int64), out ids.shape + [H]. Its backward writes every row of the table's gradient once: the
    sum of the gradient rows of the tokens naming it, in increasing token order (the same bits
    every run), zero for the rows no token names and for padding_idx (negative: counted from
    the end, as F.embedding does). On CUDA an id outside [0, V) gives NaN (that token's row in
    the forward, the whole gradient in the backward) where F.embedding stops with a device-side
    assertion; the CPU raises."""
    if padding_idx is not None:
        if not -weight.shape[0] <= padding_idx < weight.shape[0]:
            raise ValueError(f"trainscale.embedding: argument 'padding_idx': expected a row in "
                             f"[{-weight.shape[0]}, {weight.shape[0]}), got {padding_idx}")
        padding_idx = padding_idx % weight.shape[0]
    return _dispatch("embedding", "embedding", _embedding, _ref.embedding, ids, weight, padding_idx)
