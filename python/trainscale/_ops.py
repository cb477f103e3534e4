"""Fake (meta) implementations and autograd formulas of the ops in torch.ops.trainscale."""
import torch
from torch.library import register_autograd, register_fake

ops = torch.ops.trainscale


def _like(t):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _stat(x):
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.new_empty(x.shape[:-1], dtype=dtype)


def _grad_like(w, x):
    return _like(w) if w is not None else x.new_empty((0,))


# ---- fake implementations (shapes and dtypes only; torch.compile traces through these) ------

@register_fake("trainscale::rmsnorm_fwd")
def _(x, weight, eps, weight_offset):
    return _like(x), _stat(x)


@register_fake("trainscale::rmsnorm_bwd")
def _(dy, x, weight, rstd, eps, weight_offset):
    return _like(x), _grad_like(weight, x)


@register_fake("trainscale::fused_add_rmsnorm_fwd")
def _(x, residual, weight, eps, weight_offset):
    return _stat(x)


@register_fake("trainscale::fused_add_rmsnorm_bwd")
def _(dy, d_residual, residual, weight, rstd, eps, weight_offset):
    return _like(dy), _grad_like(weight, dy)


@register_fake("trainscale::layernorm_fwd")
def _(x, weight, bias, eps):
    return _like(x), _stat(x), _stat(x)


@register_fake("trainscale::layernorm_bwd")
def _(dy, x, weight, bias, mean, rstd, eps):
    return _like(x), _grad_like(weight, x), _grad_like(bias, x)


@register_fake("trainscale::gelu_fwd")
def _(x, approximate):
    return _like(x)


@register_fake("trainscale::gelu_bwd")
def _(dy, x, approximate):
    return _like(x)


@register_fake("trainscale::silu_fwd")
def _(x):
    return _like(x)


@register_fake("trainscale::silu_bwd")
def _(dy, x):
    return _like(x)


@register_fake("trainscale::swiglu_fwd")
def _(a, b):
    return _like(a)


@register_fake("trainscale::swiglu_bwd")
def _(dy, a, b):
    return _like(a), _like(b)


@register_fake("trainscale::swiglu_packed_fwd")
def _(ab):
    torch._check(ab.shape[-1] % 2 == 0,
                 lambda: "trainscale::swiglu_forward_packed: argument 'ab': expected an even last dim")
    return ab.new_empty((*ab.shape[:-1], ab.shape[-1] // 2))


@register_fake("trainscale::swiglu_packed_bwd")
def _(dy, ab):
    return _like(ab)


def _rope_fake(q, k, cos, sin, position_offsets, interleaved, rotary_dim, theta):
    return _like(q), (_like(k) if k is not None else q.new_empty((0,)))


register_fake("trainscale::rope_fwd")(_rope_fake)
register_fake("trainscale::rope_bwd")(_rope_fake)


@register_fake("trainscale::fp8_quantize")
def _(x, dtype, granularity, power_of_two_scales, scales_m_major):
    m, n = x.shape
    if granularity == "row":
        s = (m,)
    else:
        tiles = (n + 127) // 128
        s = (tiles, (m + 3) // 4 * 4) if scales_m_major else (m, tiles)
    return x.new_empty((m, n), dtype=dtype), x.new_empty(s, dtype=torch.float32)


@register_fake("trainscale::softmax_forward")
def _(x):
    return _like(x)


@register_fake("trainscale::softmax_backward")
def _(dy, y):
    return _like(y)


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


# ---- autograd -------------------------------------------------------------------------------

def _rms_setup(ctx, inputs, output):
    x, weight, eps, weight_offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps, ctx.weight_offset = eps, weight_offset


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = ops.rmsnorm_bwd(dy.contiguous(), x, weight, rstd, ctx.eps, ctx.weight_offset)
    return dx, (dw if weight is not None else None), None, None


register_autograd("trainscale::rmsnorm_fwd", _rms_backward, setup_context=_rms_setup)


def _ln_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.eps = eps


def _ln_backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = ops.layernorm_bwd(dy.contiguous(), x, weight, bias, mean, rstd, ctx.eps)
    return dx, (dw if weight is not None else None), (db if bias is not None else None), None


register_autograd("trainscale::layernorm_fwd", _ln_backward, setup_context=_ln_setup)


def _gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.approximate = inputs[1]


def _gelu_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return ops.gelu_bwd(dy.contiguous(), x, ctx.approximate), None


register_autograd("trainscale::gelu_fwd", _gelu_backward, setup_context=_gelu_setup)


def _silu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _silu_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return ops.silu_bwd(dy.contiguous(), x)


register_autograd("trainscale::silu_fwd", _silu_backward, setup_context=_silu_setup)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    a, b = ctx.saved_tensors
    return ops.swiglu_bwd(dy.contiguous(), a, b)


register_autograd("trainscale::swiglu_fwd", _swiglu_backward, setup_context=_swiglu_setup)


def _swiglu_packed_backward(ctx, dy):
    (ab,) = ctx.saved_tensors
    return ops.swiglu_packed_bwd(dy.contiguous(), ab)


register_autograd("trainscale::swiglu_packed_fwd", _swiglu_packed_backward,
                  setup_context=_swiglu_setup)


def _rope_setup(ctx, inputs, output):
    q, k, cos, sin, offsets, interleaved, rotary_dim, theta = inputs
    ctx.save_for_backward(cos, sin, offsets)
    ctx.has_k = k is not None
    ctx.args = (interleaved, rotary_dim, theta)


def _rope_backward(ctx, dq_out, dk_out):
    cos, sin, offsets = ctx.saved_tensors
    dq_out = dq_out.contiguous()  # upstream gradients may be expanded (stride 0), e.g. of a sum
    dk_out = dk_out.contiguous() if ctx.has_k else None
    dq, dk = ops.rope_bwd(dq_out, dk_out, cos, sin, offsets, *ctx.args)
    return dq, (dk if ctx.has_k else None), None, None, None, None, None, None


register_autograd("trainscale::rope_fwd", _rope_backward, setup_context=_rope_setup)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return ops.softmax_backward(dy.contiguous(), y)


register_autograd("trainscale::softmax_forward", _softmax_backward, setup_context=_softmax_setup)


# Cross-entropy's backward reads the logits again with the saved lse (one read, one write): for
# any upstream gradient, where a gradient written by the forward (with_grad) would be held
# until the backward and then scaled by it, a pass more.
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
