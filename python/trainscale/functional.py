"""Functions in the style of torch.nn.functional, backed by torch.ops.trainscale. Each public
function follows its trainscale.config switch (selection.py): ours (the default), PyTorch's
(trainscale.reference), or the faster of the two per shape ("auto")."""
from typing import Optional, Tuple

import torch

from . import reference as _ref
from .selection import dispatch as _dispatch

ops = torch.ops.trainscale


def _rms_norm(x, weight, eps, weight_offset):
    return ops.rmsnorm_fwd(x, weight, eps, weight_offset)[0]


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
             weight_offset: float = 0.0) -> torch.Tensor:
    """y = x / sqrt(mean(x^2, -1) + eps) * (weight + weight_offset), over the last dim."""
    return _dispatch("rmsnorm", "rms_norm", _rms_norm, _ref.rms_norm, x, weight, eps, weight_offset)


def _layer_norm(x, weight, bias, eps):
    return ops.layernorm_fwd(x, weight, bias, eps)[0]


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim (biased variance), like F.layer_norm(x, (N,), w, b, eps)."""
    return _dispatch("layernorm", "layer_norm", _layer_norm, _ref.layer_norm, x, weight, bias, eps)


class _FusedAddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, weight_offset):
        out = x.clone(memory_format=torch.contiguous_format)
        res = residual.clone(memory_format=torch.contiguous_format)
        rstd = ops.fused_add_rmsnorm_fwd(out, res, weight, eps, weight_offset)
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
        dx, dw = ops.fused_add_rmsnorm_bwd(dy.contiguous(), d_residual, res, weight, rstd,
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
    ops.fused_add_rmsnorm_fwd(x, residual, weight, eps, weight_offset)
    return x, residual


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over the last dim (dim must name it), computed in float32."""
    if dim not in (-1, x.dim() - 1):
        raise ValueError(f"trainscale.softmax: argument 'dim': expected the last dim, got {dim}")
    return _dispatch("softmax", "softmax", ops.softmax_forward, _ref.softmax, x)


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


def swiglu(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(a) * b; with b omitted, a is packed [..., 2F] (gate in the first half, up in the
    second) and the result is [..., F]."""
    return _dispatch("swiglu", "swiglu", _swiglu, _ref.swiglu, a, b)


def _swiglu(a, b):
    return ops.swiglu_packed_fwd(a) if b is None else ops.swiglu_fwd(a, b)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, erf form ('none') or tanh form ('tanh'), like F.gelu."""
    return _dispatch("gelu", "gelu", ops.gelu_fwd, _ref.gelu, x, approximate)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x)."""
    return _dispatch("silu", "silu", ops.silu_fwd, _ref.silu, x)


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
    q_out, k_out = ops.rope_fwd(q, k, cos, sin, position_offsets, interleaved, rotary_dim, theta)
    return q_out if k is None else (q_out, k_out)


def fp8_quantize(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                 granularity: str = "row", power_of_two_scales: bool = False,
                 scales_m_major: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantizes x [M, N] to fp8 with float32 dequantization scales per row ('row', [M]) or per
    1x128 tile ('1x128', [M, ceil(N/128)], or [ceil(N/128), align4(M)] when scales_m_major).
    Returns (q, scales) with x ~= q.float() * scales (broadcast per group)."""
    return _dispatch("fp8", "fp8_quantize", ops.fp8_quantize, _ref.fp8_quantize, x, dtype, granularity,
                     power_of_two_scales, scales_m_major)
