"""torch.nn modules backed by the trainscale ops (drop-in replacements, Liger-style)."""
from typing import Optional

import torch
from torch import nn

from . import functional as F
from .norm import mark_rebuildable


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: x * rstd * (weight + offset). offset=1.0 with zero-initialized
    weights is Gemma's form. With rebuildable_output the output carries how to rebuild it from x
    (trainscale.norm.mark_rebuildable): the projections of trainscale.linear and swiglu_mlp
    that take it then keep x (which the norm keeps anyway) instead of it, one [..., H] tensor
    less per norm until the backward, for one rms_norm pass there."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0,
                 elementwise_affine: bool = True, device=None, dtype=None, rebuildable_output: bool = False):
        super().__init__()
        self.hidden_size, self.eps, self.weight_offset = hidden_size, eps, weight_offset
        self.rebuildable_output = rebuildable_output
        if elementwise_affine:
            init = torch.zeros if weight_offset != 0.0 else torch.ones
            self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x):
        y = F.rms_norm(x, self.weight, self.eps, self.weight_offset)
        if self.rebuildable_output:
            mark_rebuildable(y, x, self.weight, self.eps, self.weight_offset)
        return y

    def extra_repr(self):
        return (f"{self.hidden_size}, eps={self.eps}, weight_offset={self.weight_offset}" +
                (", rebuildable_output=True" if self.rebuildable_output else ""))


class Embedding(nn.Embedding):
    """nn.Embedding whose forward is trainscale.embedding (the table's gradient written in one
    deterministic pass). max_norm, scale_grad_by_freq and sparse gradients are nn.Embedding's
    own: with any of them set the forward is nn.Embedding's."""

    def forward(self, ids):
        if self.max_norm is not None or self.scale_grad_by_freq or self.sparse:
            return super().forward(ids)
        return F.embedding(ids, self.weight, self.padding_idx)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, like nn.LayerNorm(hidden_size)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.ones(hidden_size, **kw)) if elementwise_affine else None
        self.bias = (nn.Parameter(torch.zeros(hidden_size, **kw))
                     if elementwise_affine and bias else None)

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.hidden_size}, eps={self.eps}"


class FusedAddRMSNorm(RMSNorm):
    """forward(x, residual) -> (rms_norm(x + residual), x + residual): the pre-norm residual
    pattern of a transformer block in one pass."""

    def forward(self, x, residual):
        return F.fused_add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset)


class SwiGLU(nn.Module):
    """silu(a) * b; forward(ab) for a packed [..., 2F] input, forward(a, b) for halves."""

    def forward(self, a, b=None):
        return F.swiglu(a, b)


class GeGLU(nn.Module):
    """gelu(a, approximate) * b; forward(ab) for a packed [..., 2F] input, forward(a, b) for halves."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, a, b=None):
        return F.geglu(a, b, self.approximate)

    def extra_repr(self):
        return f"approximate={self.approximate!r}"


class _GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)): the projections of a gated MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, device, dtype):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)


class SwiGLUMLP(_GatedMLP):
    """Llama MLP: down_proj(silu(gate_proj(x)) * up_proj(x)) with the activation fused. With
    fused=True (trainscale.functional.swiglu_mlp) the backward recomputes the activation instead
    of keeping it: a third less saved activation beside the input, the same forward, one
    backward per forward (no retain_graph); while every projection is a plain nn.Linear (a
    wrapped one, e.g. by a LoRA adapter, is called as in the unfused chain)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 device=None, dtype=None, fused: bool = False):
        super().__init__(hidden_size, intermediate_size, bias, device, dtype)
        self.fused = fused

    def forward(self, x):
        # The fused path reads the projections' weights: only for plain nn.Linear layers, not ones
        # wrapped since (a LoRA adapter's delta, a quantized weight), which are called instead.
        if self.fused and all(type(p) is nn.Linear for p in (self.gate_proj, self.up_proj, self.down_proj)):
            return F.swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                                self.gate_proj.bias, self.up_proj.bias, self.down_proj.bias)
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x)))

    def extra_repr(self):
        return f"fused={self.fused}"


class GeGLUMLP(_GatedMLP):
    """Gemma MLP: down_proj(gelu(gate_proj(x), approximate) * up_proj(x)) with the activation
    fused (Gemma's configurations take approximate='tanh')."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 device=None, dtype=None, approximate: str = "none"):
        super().__init__(hidden_size, intermediate_size, bias, device, dtype)
        self.approximate = approximate

    def forward(self, x):
        return self.down_proj(F.geglu(self.gate_proj(x), self.up_proj(x), self.approximate))

    def extra_repr(self):
        return f"approximate={self.approximate!r}"


class RotaryEmbedding(nn.Module):
    """RoPE with cached cos / sin tables (float32, [max_positions, rotary_dim // 2], grown on
    demand). forward(q, k=None, position_offsets=None) -> q_out or (q_out, k_out), q / k
    [B, S, H, head_dim]."""

    def __init__(self, head_dim: int, max_positions: int = 2048, theta: float = 10000.0,
                 rotary_dim: Optional[int] = None, interleaved: bool = False, device=None):
        super().__init__()
        self.head_dim, self.theta, self.interleaved = head_dim, theta, interleaved
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self._build(max_positions, device)

    def _build(self, positions, device):
        cos, sin = F.rope_tables(positions, self.rotary_dim, self.theta, device=device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, q, k=None, position_offsets=None):
        needed = q.shape[1]
        if position_offsets is not None and not torch.compiler.is_compiling():
            needed += int(position_offsets.max()) if position_offsets.numel() else 0
        if needed > self.cos.shape[0] or self.cos.device != q.device:
            self._build(max(needed, 2 * self.cos.shape[0]), q.device)
        return F.apply_rotary(q, k, self.cos, self.sin, position_offsets, self.interleaved,
                              self.rotary_dim, self.theta)

    def extra_repr(self):
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, theta={self.theta}, "
                f"interleaved={self.interleaved}, cached={self.cos.shape[0]}")


class CrossEntropyLoss(nn.Module):
    """Like nn.CrossEntropyLoss (classes in the last dim, integer targets), with softcap and
    z_loss; see trainscale.cross_entropy. The loss is float32."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0):
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.z_loss, self.softcap = label_smoothing, z_loss, softcap

    def forward(self, logits, target):
        return F.cross_entropy(logits, target, self.ignore_index, self.label_smoothing, self.z_loss,
                               self.softcap, self.reduction)

    def extra_repr(self):
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}")


class LinearCrossEntropyLoss(nn.Module):
    """The loss of a linear head without its logits: forward(hidden, weight, target, bias=None)
    is trainscale.linear_cross_entropy with this module's options (the head's weight stays
    where it lives, e.g. a model's lm_head). The loss is float32."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap: float = 0.0, grad_weight_accumulation: torch.dtype = torch.float32,
                 chunk_tokens: int = 0):
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.z_loss, self.softcap = label_smoothing, z_loss, softcap
        self.grad_weight_accumulation, self.chunk_tokens = grad_weight_accumulation, chunk_tokens

    def forward(self, hidden, weight, target, bias=None):
        return F.linear_cross_entropy(hidden, weight, target, bias, self.ignore_index, self.label_smoothing,
                                      self.z_loss, self.softcap, self.reduction, self.grad_weight_accumulation,
                                      self.chunk_tokens)

    def extra_repr(self):
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}, "
                f"grad_weight_accumulation={self.grad_weight_accumulation}, chunk_tokens={self.chunk_tokens}")
