"""The rope family (include/trainscale/rope.h) as PyTorch functions: fake implementations and
the autograd formula of its ops in torch.ops.trainscale (python/csrc/rope_ops.cc), and
apply_rotary and rope_tables."""
from typing import Optional, Tuple

import torch
from torch.library import register_autograd, register_fake

from . import reference as _ref
from ._common import like as _like
from ._common import ops
from .selection import dispatch as _dispatch


# ---- fake implementations (shapes and dtypes only; torch.compile traces through these) ------

def _rope_fake(q, k, cos, sin, position_offsets, interleaved, rotary_dim, theta):
    return _like(q), (_like(k) if k is not None else q.new_empty((0,)))


register_fake("trainscale::rope_forward")(_rope_fake)
register_fake("trainscale::rope_backward")(_rope_fake)


# ---- autograd -------------------------------------------------------------------------------

def _rope_setup(ctx, inputs, output):
    q, k, cos, sin, offsets, interleaved, rotary_dim, theta = inputs
    ctx.save_for_backward(cos, sin, offsets)
    ctx.has_k = k is not None
    ctx.args = (interleaved, rotary_dim, theta)


def _rope_backward(ctx, dq_out, dk_out):
    cos, sin, offsets = ctx.saved_tensors
    dq_out = dq_out.contiguous()  # upstream gradients may be expanded (stride 0), e.g. of a sum
    dk_out = dk_out.contiguous() if ctx.has_k else None
    dq, dk = ops.rope_backward(dq_out, dk_out, cos, sin, offsets, *ctx.args)
    return dq, (dk if ctx.has_k else None), None, None, None, None, None, None


register_autograd("trainscale::rope_forward", _rope_backward, setup_context=_rope_setup)


# ---- functions ------------------------------------------------------------------------------

def rope_tables(positions: int, rotary_dim: int, theta: float = 10000.0,
                device=None, dtype=torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [positions, rotary_dim // 2]: angle(p, i) = p * theta^(-2i/rotary_dim)."""
    inv = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
    ang = torch.arange(positions, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rotary(q: torch.Tensor, k: Optional[torch.Tensor] = None,
                 cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
                 position_offsets: Optional[torch.Tensor] = None, interleaved: bool = False,
                 rotary_dim: int = -1, theta: float = 10000.0):
    """RoPE of q [B, S, Hq, D] (and k [B, S, Hk, D]) in one call. NeoX (rotate-half) pairing by
    default, GPT-J with interleaved=True. cos / sin: [P, rotary_dim // 2] tables, or None to
    compute angles from theta. position_offsets: int [B], token s of batch b at offsets[b] + s.
    Returns q_out, or (q_out, k_out) when k is given. No gradient flows to cos / sin."""
    return _dispatch("rope", "apply_rotary", _apply_rotary, _ref.apply_rotary, q, k, cos, sin,
                     position_offsets, interleaved, rotary_dim, theta)


def _apply_rotary(q, k, cos, sin, position_offsets, interleaved, rotary_dim, theta):
    q_out, k_out = ops.rope_forward(q, k, cos, sin, position_offsets, interleaved, rotary_dim, theta)
    return q_out if k is None else (q_out, k_out)
