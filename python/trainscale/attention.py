"""Scaled dot-product attention (include/trainscale/attention.h) as PyTorch functions: the fake
implementations and autograd formula of its ops in torch.ops.trainscale
(python/csrc/attention_ops.cc), attention, and the Hugging Face attention function
(hf_attention_forward, registered as "trainscale" by register_hf_attention).

Layout is BSHD: q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] with Hq % Hkv == 0 (grouped-query
heads are read in place, never repeated). The forward runs the CUDA kernel (bf16 / fp16, D 64,
128 or 256, sm_90a) or the CPU reference (any dtype, float64 included); the backward runs its
CUDA kernels (bf16 / fp16, D 64, 128 or 256, sm_80+; a Hopper kernel at D 64, 128 and 256 whose
dQ order is fixed only under torch.use_deterministic_algorithms(True), which at D 256 runs the
sm_80 kernels instead; the workspace is allocated by the op) or the CPU reference. Packed sequences (attention_varlen) run on CUDA as the same kernels
once per sequence, after reading cu_seqlens back to the host (a synchronization of the stream)."""
import sys
import warnings
from typing import Optional, Tuple

import torch
from torch.library import register_autograd, register_fake

from ._common import autocast_inputs, ops


def _stat_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@register_fake("trainscale::attention_forward")
def _(q, k, v, causal, scale, window_left=-1, window_right=-1, softcap=0.0):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_stat_dtype(q))
    return out, lse


@register_fake("trainscale::attention_backward")
def _(dout, q, k, v, out, lse, causal, scale, window_left=-1, window_right=-1, softcap=0.0):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _attention_setup(ctx, inputs, output):
    q, k, v, *options = inputs  # causal, scale, and window_left, window_right, softcap when given
    # (callers of the op may leave the last three to their defaults)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _attention_backward(ctx, dout, dlse):
    # lse is not differentiable (marked so above): dlse is None or zeros and is not used.
    q, k, v, out, lse = ctx.saved_tensors
    if dout.stride(-1) != 1:  # e.g. the expanded gradient of a sum
        dout = dout.contiguous()
    dq, dk, dv = ops.attention_backward(dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * len(ctx.options)


register_autograd("trainscale::attention_forward", _attention_backward, setup_context=_attention_setup)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                       softcap: float = 0.0):
    """(out, lse) of attention: lse [B, Hq, Sq] float32 (float64 for float64 inputs), the
    log-sum-exp of each query's scaled, masked scores; lse is not differentiable. Under autocast,
    float32 q / k / v are cast to its dtype, as sdpa's are."""
    q, k, v = autocast_inputs(q, k, v)
    return ops.attention_forward(q, k, v, bool(causal), 0.0 if scale is None else float(scale),
                                 int(window_size[0]), int(window_size[1]), float(softcap))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
              softcap: float = 0.0) -> torch.Tensor:
    """softmax(mask(softcap(q k^T * scale))) v in BSHD layout: q [B, Sq, Hq, D], k / v
    [B, Sk, Hkv, D] (Hq % Hkv == 0; query head h reads kv head h // (Hq // Hkv)); returns out
    [B, Sq, Hq, D] (contiguous, q's dtype). scale None (or 0, as in the C++ contract) is
    1 / sqrt(D). Query i sits at key position i + (Sk - Sq) (bottom-right aligned, as
    FlashAttention). causal: it sees keys j <= that position. window_size (left, right), as
    FlashAttention's: it also sees only keys within `left` before and `right` after it (-1:
    unbounded; with causal, right is -1 or 0). softcap > 0: scores s become softcap * tanh(s /
    softcap) (Gemma 2). A query that sees no key gets 0. Any strides with stride 1 in D (e.g. a
    transposed [B, H, S, D] view). Differentiable: the backward saves out and lse."""
    return attention_with_lse(q, k, v, causal, scale, window_size, softcap)[0]


@register_fake("trainscale::attention_varlen_forward")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left=-1,
      window_right=-1, softcap=0.0):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=_stat_dtype(q))


@register_fake("trainscale::attention_varlen_backward")
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
      window_left=-1, window_right=-1, softcap=0.0):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _attention_varlen_setup(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.options = options  # max_seqlen_q, max_seqlen_k, causal, scale, and the window and softcap when given
    ctx.mark_non_differentiable(lse)


def _attention_varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv = ops.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options)
    return (dq, dk, dv, None, None) + (None,) * len(ctx.options)


register_autograd("trainscale::attention_varlen_forward", _attention_varlen_backward,
                  setup_context=_attention_varlen_setup)


def attention_varlen_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              causal: bool = False, scale: Optional[float] = None,
                              window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0):
    """(out, lse) of attention_varlen: lse [Hq, Tq] (float32; float64 for float64 inputs); under
    autocast as attention_with_lse."""
    q, k, v = autocast_inputs(q, k, v)
    return ops.attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                        bool(causal), 0.0 if scale is None else float(scale), int(window_size[0]),
                                        int(window_size[1]), float(softcap))


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                     scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                     softcap: float = 0.0) -> torch.Tensor:
    """attention over packed variable-length sequences, as FlashAttention's varlen function: q
    [Tq, Hq, D] and k / v [Tk, Hkv, D] hold B sequences back to back; sequence b has queries
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] and keys cu_seqlens_k[b]:cu_seqlens_k[b + 1] (int32
    [B + 1] on q's device, from 0 to Tq / Tk), each attended as `attention` attends one batch
    entry (causal and window_size aligned bottom-right within the sequence). max_seqlen_q / _k
    bound the lengths. Returns out [Tq, Hq, D]. Differentiable. On CUDA the kernels of `attention`
    run once per sequence, after cu_seqlens are read back to the host (a synchronization)."""
    return attention_varlen_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                     scale, window_size, softcap)[0]


# --- Hugging Face -----------------------------------------------------------------------------

_warned = set()


def _warn_once(reason: str):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"trainscale attention: {reason}; falling back to transformers' sdpa attention "
                      "(the model's eager attention for options sdpa lacks) for such calls", stacklevel=3)


# Arguments some models pass to their attention function that change what it computes:
# T5-style position bias, gpt-oss's and others' attention sinks, DeepSeek-V3.2's and
# MiniMax-M3's selected key indices.
_UNSUPPORTED_KWARGS = ("position_bias", "s_aux", "sinks", "indices", "block_indices")


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _causal_band(q_len: int, kv_len: int, window_left: int, device) -> torch.Tensor:
    """[q_len, kv_len] boolean: query i sees the keys up to its own position bottom-right
    aligned, and when window_left >= 0 only the window_left keys before it."""
    band = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
    return band.triu(kv_len - q_len - window_left) if window_left >= 0 else band


def _is_causal_band(mask: torch.Tensor, q_len: int, kv_len: int, window_left: int) -> bool:
    """Whether a boolean mask [B or 1, 1 or H, Sq, Sk] is, in every batch and head, the
    bottom-right causal pattern, limited to `window_left` keys before the diagonal when >= 0
    (reads the mask: not done while compiling)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-2:] != (q_len, kv_len):
        return False
    return bool((mask == _causal_band(q_len, kv_len, window_left, mask.device)).all())


def hf_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                         scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention-function signature (as sdpa_attention_forward): query [B, Hq, S, D],
    key / value [B, Hkv, Sk, D] -> (attn_output [B, S, Hq, D], None). Runs trainscale.attention
    on BSHD views (no copies, grouped-query heads in place) when the call is plain attention:
    no mask (causal from is_causal / module.is_causal, as sdpa decides it) or a boolean mask that
    is exactly the causal pattern, also with a causal sliding window (Mistral, Gemma: query i sees
    the `sliding_window` keys up to its own) and a logit softcap (Gemma 2); sequences packed into a
    batch of one with transformers' FlashAttention kwargs (cu_seq_lens_q / _k, max_length_q / _k)
    run trainscale.attention_varlen, each sequence attended alone. Anything else (padding or
    other masks, dropout > 0, position bias, attention sinks, sparse key indices, a different
    value head dim, and on CUDA a dtype / head dim the kernel lacks) falls back to
    transformers' sdpa_attention_forward (a softcap, sinks, a position bias or key indices, which
    sdpa lacks, to the model module's eager_attention_forward) with a one-time warning per reason."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    reason = None
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    softcap, sliding_window = kwargs.get("softcap"), kwargs.get("sliding_window")
    window_left = sliding_window - 1 if sliding_window is not None else -1
    # Padding-free batches: the FlashAttention kwargs transformers passes through (e.g. from
    # DataCollatorWithFlattening(return_flash_attn_kwargs=True)) pack sequences into one row.
    packing = tuple(kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"))
    packed = all(x is not None for x in packing)
    # Arguments neither ours nor sdpa runs: such calls go to the model's eager attention.
    beyond_sdpa = any(kwargs.get(name) is not None for name in _UNSUPPORTED_KWARGS)
    if dropout:
        reason = "dropout > 0 is not supported"
    elif sliding_window is not None and not (causal and sliding_window >= 1):
        reason = "a sliding window without a causal mask is not supported"
    elif beyond_sdpa:
        reason = "position bias, attention sinks and sparse (indexed) attention are not supported"
    elif key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        reason = "query, key and value head dims differ"
    elif query.shape[1] % key.shape[1] != 0:
        reason = "query heads are not a multiple of key/value heads"
    elif query.is_cuda and (query.dtype not in (torch.bfloat16, torch.float16) or query.shape[-1] not in (64, 128, 256)):
        reason = "the CUDA kernel needs bfloat16 / float16 and head dim 64, 128 or 256"
    elif packed and (query.shape[0] != 1 or attention_mask is not None):
        reason = "packed sequences (cu_seq_lens_q / _k) need a batch of one and no attention mask"
    elif attention_mask is not None:
        if not causal or _is_compiling() or not _is_causal_band(attention_mask, q_len, kv_len, window_left):
            reason = "attention masks other than the causal (sliding-window) one, e.g. padding, are not supported"
    if reason is not None:
        _warn_once(reason)
        # sdpa cannot express a softcap, sinks, a position bias or key indices: such calls go to
        # the model's own eager attention.
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if (beyond_sdpa or softcap is not None) and eager is not None:
            if attention_mask is None and causal and q_len > 1:
                # sdpa's mask function leaves out a plain causal mask (sdpa takes is_causal);
                # eager attention needs it written, bottom-right aligned as transformers' masks.
                attention_mask = _causal_band(q_len, kv_len, window_left, query.device)[None, None]
            if attention_mask is not None and attention_mask.dtype == torch.bool:
                # transformers builds sdpa's boolean mask for us; eager attention adds its mask, and
                # takes its softmax in float32: the most negative value finite in both dtypes, so that
                # a fully masked (padding) row comes out uniform, not NaN.
                masked = max(torch.finfo(query.dtype).min, torch.finfo(torch.float32).min)
                attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(~attention_mask, masked)
            return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)

    if packed:
        cu_q, cu_k, max_q, max_k = packing
        out = attention_varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                               cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k), causal=bool(causal),
                               scale=scaling, window_size=(window_left, -1), softcap=softcap or 0.0)
        return out[None], None
    # As sdpa: one query attends to every key; without a mask, a longer key/value (an empty
    # static cache's prefill) is cut to the query length (sdpa's causal mask is top-left aligned).
    causal = bool(causal) and q_len > 1
    if causal and attention_mask is None and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=causal,
                    scale=scaling, window_size=(window_left, -1), softcap=softcap or 0.0)
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
