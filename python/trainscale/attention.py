"""Scaled dot-product attention (include/trainscale/attention.h) as PyTorch functions: the fake
implementations and autograd formula of its ops in torch.ops.trainscale
(python/csrc/attention_ops.cc), attention, and the Hugging Face attention function
(hf_attention_forward, registered as "trainscale" by register_hf_attention).

Layout is BSHD: q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] with Hq % Hkv == 0 (grouped-query
heads are read in place, never repeated). The forward runs the CUDA kernel (bf16 / fp16, D 64,
128 or 256, sm_90a) or the CPU reference (any dtype, float64 included); the backward runs its
CUDA kernels (bf16 / fp16, D 64, 128 or 256, sm_80+; the workspace is allocated by the op) or
the CPU reference."""
import sys
import warnings
from typing import Optional

import torch
from torch.library import register_autograd, register_fake

from ._common import ops


def _stat_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@register_fake("trainscale::attention_forward")
def _(q, k, v, causal, scale):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_stat_dtype(q))
    return out, lse


@register_fake("trainscale::attention_backward")
def _(dout, q, k, v, out, lse, causal, scale):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(lse)


def _attention_backward(ctx, dout, dlse):
    # lse is not differentiable (marked so above): dlse is None or zeros and is not used.
    q, k, v, out, lse = ctx.saved_tensors
    if dout.stride(-1) != 1:  # e.g. the expanded gradient of a sum
        dout = dout.contiguous()
    dq, dk, dv = ops.attention_backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


register_autograd("trainscale::attention_forward", _attention_backward, setup_context=_attention_setup)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       scale: Optional[float] = None):
    """(out, lse) of attention: lse [B, Hq, Sq] float32 (float64 for float64 inputs), the
    log-sum-exp of each query's scaled, masked scores; lse is not differentiable."""
    return ops.attention_forward(q, k, v, bool(causal), 0.0 if scale is None else float(scale))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v in BSHD layout: q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D]
    (Hq % Hkv == 0; query head h reads kv head h // (Hq // Hkv)); returns out [B, Sq, Hq, D]
    (contiguous, q's dtype). scale None (or 0, as in the C++ contract) is 1 / sqrt(D). causal:
    query i sees key j iff j <= i + (Sk - Sq) (bottom-right aligned, as FlashAttention); a query
    that sees no key gets 0. Any strides with stride 1 in D (e.g. a transposed [B, H, S, D]
    view). Differentiable: the backward saves out and lse."""
    return attention_with_lse(q, k, v, causal, scale)[0]


# --- Hugging Face -----------------------------------------------------------------------------

_warned = set()


def _warn_once(reason: str):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"trainscale attention: {reason}; falling back to transformers' sdpa attention "
                      "for such calls", stacklevel=3)


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _is_plain_causal(mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
    """Whether a boolean mask [B or 1, 1 or H, Sq, Sk] is the bottom-right causal pattern in every
    batch and head (reads the mask: not done while compiling)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-2:] != (q_len, kv_len):
        return False
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril(kv_len - q_len)
    return bool((mask == causal).all())


def hf_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                         scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention-function signature (as sdpa_attention_forward): query [B, Hq, S, D],
    key / value [B, Hkv, Sk, D] -> (attn_output [B, S, Hq, D], None). Runs trainscale.attention
    on BSHD views (no copies, grouped-query heads in place) when the call is plain attention:
    no mask (causal from is_causal / module.is_causal, as sdpa decides it) or a boolean mask that
    is exactly the causal pattern. Anything else (padding or other masks, dropout > 0, softcap,
    sliding window, position bias, attention sinks, a different value head dim, and on CUDA a
    dtype / head dim the kernel lacks) falls back to transformers' sdpa_attention_forward with a
    one-time warning per reason."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    reason = None
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if dropout:
        reason = "dropout > 0 is not supported"
    elif kwargs.get("softcap") is not None:
        reason = "softcap is not supported yet"
    elif kwargs.get("sliding_window") is not None:
        reason = "sliding-window attention is not supported yet"
    elif kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
        reason = "position bias / attention sinks are not supported"
    elif key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        reason = "query, key and value head dims differ"
    elif query.shape[1] % key.shape[1] != 0:
        reason = "query heads are not a multiple of key/value heads"
    elif query.is_cuda and (query.dtype not in (torch.bfloat16, torch.float16) or query.shape[-1] not in (64, 128, 256)):
        reason = "the CUDA kernel needs bfloat16 / float16 and head dim 64, 128 or 256"
    elif attention_mask is not None:
        if not causal or _is_compiling() or not _is_plain_causal(attention_mask, q_len, kv_len):
            reason = "attention masks other than the causal one (e.g. padding) are not supported"
    if reason is not None:
        _warn_once(reason)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)

    # As sdpa: one query attends to every key; without a mask, a longer key/value (an empty
    # static cache's prefill) is cut to the query length (sdpa's causal mask is top-left aligned).
    causal = bool(causal) and q_len > 1
    if causal and attention_mask is None and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=causal,
                    scale=scaling)
    return out, None


def register_hf_attention(name: str = "trainscale") -> None:
    """Registers hf_attention_forward with transformers' AttentionInterface (and sdpa's mask
    function with its AttentionMaskInterface, so models build the masks this function reads)
    under `name`: then `attn_implementation="trainscale"` selects it. Done on `import
    trainscale` when transformers is already imported, and by trainscale.patch."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, hf_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)


if "transformers" in sys.modules:
    try:
        register_hf_attention()
    except ImportError:  # a transformers without the attention registry
        pass
