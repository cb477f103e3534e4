"""The math of each trainscale op in plain PyTorch (eager), with trainscale.functional's
signatures: what "PyTorch" means for the config switches and the automatic selection, and the
PyTorch baselines of ``python -m trainscale.bench``. Native PyTorch kernels where PyTorch has
them (F.rms_norm, F.layer_norm, F.gelu, F.silu); reductions in float32 (float64 for float64)."""
from typing import Optional

import torch
import torch.nn.functional as F

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm_with_rstd(x, weight=None, eps=1e-6, weight_offset=0.0):
    """(y, rstd) with rstd = 1 / sqrt(mean(x^2) + eps) in the accumulation dtype."""
    xf = x.to(_acc(x.dtype))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf * rstd
    if weight is not None:
        y = y * (weight.to(xf.dtype) + weight_offset)
    return y.to(x.dtype), rstd.squeeze(-1)


def rms_norm(x, weight=None, eps=1e-6, weight_offset=0.0):
    if weight_offset == 0.0 and (weight is None or weight.dtype == x.dtype):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm_with_rstd(x, weight, eps, weight_offset)[0]


def layer_norm_with_stats(x, weight=None, bias=None, eps=1e-5):
    """(y, mean, rstd), statistics in the accumulation dtype."""
    xf = x.to(_acc(x.dtype))
    mean = xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
    y = (xf - mean) * rstd
    if weight is not None:
        y = y * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype), mean.squeeze(-1), rstd.squeeze(-1)


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    if all(t is None or t.dtype == x.dtype for t in (weight, bias)):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return layer_norm_with_stats(x, weight, bias, eps)[0]


def fused_add_rms_norm(x, residual, weight=None, eps=1e-6, weight_offset=0.0):
    s = x + residual
    return rms_norm(s, weight, eps, weight_offset), s


def swiglu(a, b=None):
    if b is None:
        a, b = a.chunk(2, dim=-1)
    return F.silu(a) * b


def geglu(a, b=None, approximate="none"):
    if b is None:
        a, b = a.chunk(2, dim=-1)
    return F.gelu(a, approximate=approximate) * b


def gelu(x, approximate="none"):
    return F.gelu(x, approximate=approximate)


def silu(x):
    return F.silu(x)


def rope_angles(positions: torch.Tensor, rotary_dim: int, theta: float):
    """cos, sin of angle(p, i) = p * theta^(-2i / rotary_dim), from float64 angles (float32
    angles lose ~1e-3 at position 8192), as float32 [..., rotary_dim // 2]."""
    inv = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=positions.device) / rotary_dim)
    ang = positions.to(torch.float64)[..., None] * inv
    return ang.cos().float(), ang.sin().float()


def _rotate(x, cos, sin, interleaved, rotary_dim):
    xr, rest = x[..., :rotary_dim].to(_acc(x.dtype)), x[..., rotary_dim:]
    c, s = cos.to(xr.dtype), sin.to(xr.dtype)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2)
    else:
        x0, x1 = xr.chunk(2, dim=-1)
        out = torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], -1)
    return torch.cat([out.to(x.dtype), rest], -1)


def apply_rotary(q, k=None, cos=None, sin=None, position_offsets: Optional[torch.Tensor] = None,
                 interleaved=False, rotary_dim=-1, theta=10000.0):
    d = q.shape[-1] if rotary_dim < 0 else rotary_dim
    pos = torch.arange(q.shape[1], device=q.device)[None, :]  # [1 or B, S]
    if position_offsets is not None:
        pos = pos + position_offsets.to(pos.dtype)[:, None]
    if cos is None:
        c, s = rope_angles(pos, d, theta)
    else:
        c, s = cos[pos], sin[pos]
    c, s = c[:, :, None, :], s[:, :, None, :]  # [B, S, 1, d/2]: broadcast over heads
    q_out = _rotate(q, c, s, interleaved, d)
    return q_out if k is None else (q_out, _rotate(k, c, s, interleaved, d))


def fp8_quantize(x, dtype=torch.float8_e4m3fn, granularity="row", power_of_two_scales=False,
                 scales_m_major=False):
    """Same contract as trainscale.fp8_quantize: s = amax / fmax (1 when that is 0), one float32
    division, saturating cast (bit-exact with trainscale)."""
    fmax = _FP8_MAX[dtype]
    m, n = x.shape
    xf = x.float()
    if granularity == "row":
        groups = xf[:, None, :]
    else:
        tiles = (n + 127) // 128
        groups = F.pad(xf, (0, tiles * 128 - n)).view(m, tiles, 128)
    amax = groups.abs().amax(-1)
    # NaN wins the max whatever the order (amax above drops none: torch propagates NaN).
    # A tensor divisor: PyTorch's CUDA division by a Python scalar multiplies by its reciprocal,
    # which is not the correctly rounded quotient the contract asks for.
    scale = amax / torch.full((), fmax, dtype=amax.dtype, device=amax.device)
    if power_of_two_scales:
        mant, exp = torch.frexp(scale)
        pow2 = torch.ldexp(torch.ones_like(scale), exp)
        scale = torch.where((mant == 0.5) | ~torch.isfinite(scale), scale, pow2)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (groups / scale[..., None]).clamp(-fmax, fmax).to(dtype)
    q = q.reshape(m, -1)[:, :n]
    if granularity == "row":
        return q, scale.reshape(m)
    if scales_m_major:
        t = scale.new_zeros((scale.shape[1], (m + 3) // 4 * 4))
        t[:, :m] = scale.t()
        return q, t
    return q, scale


def embedding(ids, weight, padding_idx=None):
    return F.embedding(ids, weight, padding_idx)


def softmax(x):
    return torch.softmax(x, dim=-1)


def cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0,
                  reduction="mean"):
    """trainscale.cross_entropy's math in float32 (float64 for float64): softcap, logsumexp,
    label smoothing over the classes, z-loss lse^2; ignored rows give 0 and leave the mean."""
    v = logits.shape[-1]
    x = logits.reshape(-1, v).to(_acc(logits.dtype))
    t = target.reshape(-1)
    if softcap > 0:
        x = softcap * torch.tanh(x / softcap)
    lse = torch.logsumexp(x, dim=-1)
    valid = t != ignore_index
    loss = z_loss * lse * lse
    if label_smoothing < 1:
        picked = x.gather(1, torch.where(valid, t, 0)[:, None].long())[:, 0]
        loss = loss + (1 - label_smoothing) * (lse - picked)
    if label_smoothing > 0:
        loss = loss + label_smoothing * (lse - x.mean(dim=-1))
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.reshape(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


def linear_cross_entropy(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0,
                         z_loss=0.0, softcap=0.0, reduction="mean", grad_weight_accumulation=torch.float32,
                         chunk_tokens=0):
    """trainscale.linear_cross_entropy's math: the logits in hidden's dtype (F.linear), then
    cross_entropy above. Every logit exists at once; grad_weight_accumulation and chunk_tokens
    (how ours splits the work) do not apply."""
    return cross_entropy(F.linear(hidden, weight, bias), target, ignore_index, label_smoothing, z_loss, softcap,
                         reduction)
