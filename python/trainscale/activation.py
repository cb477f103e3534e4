"""The activation family (include/trainscale/activation.h) as PyTorch functions: fake
implementations and autograd formulas of its ops in torch.ops.trainscale
(python/csrc/activation_ops.cc), and gelu, silu, swiglu and geglu."""
from typing import Optional

import torch
from torch.library import register_autograd, register_fake

from . import reference as _ref
from ._common import contiguous_rows
from ._common import like as _like
from ._common import ops
from .norm import save_input, saved_input
from .selection import config as _config
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


@register_fake("trainscale::swiglu_backward_recompute_")
def _(dy, a, b):
    return _like(a)


@register_fake("trainscale::swiglu_forward_packed")
def _(ab):
    torch._check(ab.shape[-1] % 2 == 0,
                 lambda: "trainscale::swiglu_forward_packed: argument 'ab': expected an even last dim")
    return ab.new_empty((*ab.shape[:-1], ab.shape[-1] // 2))


@register_fake("trainscale::swiglu_backward_packed")
def _(dy, ab):
    return _like(ab)


@register_fake("trainscale::geglu_forward")
def _(a, b, approximate):
    return _like(a)


@register_fake("trainscale::geglu_backward")
def _(dy, a, b, approximate):
    return _like(a), _like(b)


@register_fake("trainscale::geglu_forward_packed")
def _(ab, approximate):
    torch._check(ab.shape[-1] % 2 == 0,
                 lambda: "trainscale::geglu_forward_packed: argument 'ab': expected an even last dim")
    return ab.new_empty((*ab.shape[:-1], ab.shape[-1] // 2))


@register_fake("trainscale::geglu_backward_packed")
def _(dy, ab, approximate):
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


def _geglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:-1])
    ctx.approximate = inputs[-1]


def _geglu_backward(ctx, dy):
    a, b = ctx.saved_tensors
    return *ops.geglu_backward(dy.contiguous(), a, b, ctx.approximate), None


def _geglu_packed_backward(ctx, dy):
    (ab,) = ctx.saved_tensors
    return ops.geglu_backward_packed(dy.contiguous(), ab, ctx.approximate), None


register_autograd("trainscale::geglu_forward", _geglu_backward, setup_context=_geglu_setup)
register_autograd("trainscale::geglu_forward_packed", _geglu_packed_backward, setup_context=_geglu_setup)


# ---- functions ------------------------------------------------------------------------------

def swiglu(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(a) * b; with b omitted, a is packed [..., 2F] (gate in the first half, up in the
    second) and the result is [..., F]."""
    return _dispatch("swiglu", "swiglu", _swiglu, _ref.swiglu, a, b)


def _swiglu(a, b):
    a = contiguous_rows(a)
    return ops.swiglu_forward_packed(a) if b is None else ops.swiglu_forward(a, contiguous_rows(b))


def geglu(a: torch.Tensor, b: Optional[torch.Tensor] = None, approximate: str = "none") -> torch.Tensor:
    """gelu(a, approximate) * b (Gemma's MLP takes approximate='tanh'); with b omitted, a is packed
    [..., 2F] (gate in the first half, up in the second) and the result is [..., F]."""
    return _dispatch("geglu", "geglu", _geglu, _ref.geglu, a, b, approximate)


def _geglu(a, b, approximate):
    a = contiguous_rows(a)
    return ops.geglu_forward_packed(a, approximate) if b is None else \
        ops.geglu_forward(a, contiguous_rows(b), approximate)


class _SwiGLUMLP(torch.autograd.Function):
    """down(swiglu(gate(x), up(x))) keeping x, gate(x) and up(x) for the backward, not the
    activation h = silu(gate(x)) * up(x): the backward recomputes h in the same pass that
    computes swiglu's gradient, for the down projection's weight gradient, and writes the
    gradients over the saved gate(x) and up(x) (swiglu_backward_recompute_), so that pass adds
    one [..., F] tensor (h) beside them and dh. The forward runs the same products and kernel
    as the unfused chain."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, b_down):
        g = torch.nn.functional.linear(x, w_gate, b_gate)
        u = torch.nn.functional.linear(x, w_up, b_up)
        y = torch.nn.functional.linear(ops.swiglu_forward(g, u), w_down, b_down)
        save_input(ctx, x, g, u, w_gate, w_up, w_down)  # x rebuilt when it is a norm's output
        return y

    @staticmethod
    def backward(ctx, dy):
        x, (g, u, w_gate, w_up, w_down) = saved_input(ctx)
        need = ctx.needs_input_grad
        dy = dy.reshape(-1, dy.shape[-1])
        # The products in the forward's dtype (under autocast its dtype, not the weights' or x's;
        # autograd casts each gradient back to its input's dtype).
        w_gate, w_up, w_down = (w.to(dy.dtype) for w in (w_gate, w_up, w_down))
        dg, du = g.reshape(dy.shape[0], -1), u.reshape(dy.shape[0], -1)
        h = ops.swiglu_backward_recompute_(dy @ w_down, dg, du)  # dg, du: gradients from here
        if not torch.compiler.is_compiling():
            # A second backward through this graph (retain_graph) must fail at unpacking g and u,
            # not read their gradients.
            torch.autograd.graph.increment_version(g)
            torch.autograd.graph.increment_version(u)
        dw_down = dy.t() @ h if need[3] else None
        del h
        x2 = x.reshape(-1, x.shape[-1]).to(dy.dtype)
        dx = torch.addmm(dg @ w_gate, du, w_up).reshape(x.shape) if need[0] else None
        dw_gate = dg.t() @ x2 if need[1] else None
        dw_up = du.t() @ x2 if need[2] else None
        db_gate = dg.sum(0) if need[4] else None
        db_up = du.sum(0) if need[5] else None
        db_down = dy.sum(0) if need[6] else None
        return dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down


def swiglu_mlp(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
               down_weight: torch.Tensor, gate_bias: Optional[torch.Tensor] = None,
               up_bias: Optional[torch.Tensor] = None,
               down_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """linear(silu(linear(x, gate_weight, gate_bias)) * linear(x, up_weight, up_bias),
    down_weight, down_bias), the Llama MLP, saving for the backward x and the two projections but
    not their SwiGLU product [..., F], which the backward recomputes in its SwiGLU pass: a third
    less saved activation than the unfused chain's gate, up and product (beside x). The same
    forward bits as the unfused chain; the backward writes its SwiGLU gradients over the saved
    projections (as Liger-Kernel's SwiGLU does), so a graph takes one backward: a second one
    (retain_graph) raises. It sums x's two gradient products in one GEMM accumulation. With
    config.use_swiglu False, the unfused PyTorch chain."""
    if _config.use_swiglu is False:
        lin = torch.nn.functional.linear
        return lin(_ref.swiglu(lin(x, gate_weight, gate_bias), lin(x, up_weight, up_bias)),
                   down_weight, down_bias)
    return _SwiGLUMLP.apply(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, erf form ('none') or tanh form ('tanh'), like F.gelu."""
    return _dispatch("gelu", "gelu", lambda x, a: ops.gelu_forward(contiguous_rows(x), a), _ref.gelu, x, approximate)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x)."""
    return _dispatch("silu", "silu", lambda x: ops.silu_forward(contiguous_rows(x)), _ref.silu, x)
