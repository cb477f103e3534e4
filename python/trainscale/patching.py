"""trainscale.patch(model): swaps the parts of a Hugging Face Llama-style model that trainscale
implements (Liger-style monkey patching). Parameters are shared, not copied, so optimizers and
state dicts are unaffected; the swapped parts follow trainscale.config like the rest."""
import sys
from typing import Dict, List

import torch
from torch import nn

from .functional import apply_rotary, cross_entropy
from .modules import RMSNorm, SwiGLUMLP

# RMSNorms computing x * rsqrt(mean(x^2) + eps) * weight (Gemma's adds 1 to the weight: not these).
_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Drop-in for transformers' apply_rotary_pos_emb (rotate-half RoPE). q / k: [B, H, S, D]
    (unsqueeze_dim=1) or [B, S, H, D] (2); cos / sin: [B or 1, S, rotary_dim] with both halves
    equal, as Llama's rotary embedding makes them."""
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"trainscale.hf_apply_rotary_pos_emb: argument 'unsqueeze_dim': expected 1 or 2, "
                         f"got {unsqueeze_dim}")
    if cos.dim() != 3 or cos.shape != sin.shape:
        raise ValueError(f"trainscale.hf_apply_rotary_pos_emb: argument 'cos': expected cos and sin "
                         f"[B, S, rotary_dim], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    qv, kv = (q.transpose(1, 2), k.transpose(1, 2)) if unsqueeze_dim == 1 else (q, k)
    b, s, d = cos.shape
    half = d // 2
    if b == 1:  # token s uses table row s
        cos_t, sin_t, offsets = cos[0, :, :half], sin[0, :, :half], None
    else:  # per-batch positions: one table of B * S rows, batch b starting at row b * S
        cos_t, sin_t = cos[..., :half].reshape(b * s, half), sin[..., :half].reshape(b * s, half)
        offsets = torch.arange(b, device=cos.device) * s
    q_out, k_out = apply_rotary(qv, kv, cos_t, sin_t, offsets, rotary_dim=d)
    return (q_out.transpose(1, 2), k_out.transpose(1, 2)) if unsqueeze_dim == 1 else (q_out, k_out)


def hf_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None,
                      ignore_index: int = -100, shift_labels=None, **kwargs):
    """Drop-in for transformers' ForCausalLMLoss: token s predicts label s + 1 (or shift_labels),
    mean over the tokens not ignored, or the sum divided by num_items_in_batch when given. The
    logits are not upcast first: trainscale.cross_entropy reads them as they are and computes
    in float32."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    target = shift_labels.reshape(-1).to(logits.device)
    logits = logits.reshape(-1, vocab_size)
    if num_items_in_batch is None:
        return cross_entropy(logits, target, ignore_index=ignore_index, reduction="mean")
    loss = cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _swap(model: nn.Module, make) -> List[str]:
    """Replaces each submodule for which make(module) returns a module; returns their names."""
    swapped = []
    for name, module in list(model.named_modules()):
        new = make(module)
        if new is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        swapped.append(name)
    return swapped


def _rms_norm(m):
    if type(m).__name__ not in _RMS_NORMS:
        return None
    new = RMSNorm(m.weight.shape[0], eps=m.variance_epsilon, device="meta")
    new.weight = m.weight
    return new


def _mlp(m):
    if not all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")) or not _is_silu(m.act_fn):
        return None
    if isinstance(m, SwiGLUMLP):
        return None
    new = SwiGLUMLP(m.gate_proj.in_features, m.gate_proj.out_features, device="meta")
    new.gate_proj, new.up_proj, new.down_proj = m.gate_proj, m.up_proj, m.down_proj
    return new


class PatchReport(Dict[str, List[str]]):
    """What trainscale.patch swapped: part -> names of the modules (or functions) replaced."""

    def __str__(self):
        lines = ["trainscale.patch:"]
        for part, names in self.items():
            shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
            lines.append(f"  {part}: {shown or 'nothing matched'}")
        return "\n".join(lines)


def patch(model: nn.Module, rms_norm: bool = True, swiglu: bool = True, rope: bool = True,
          cross_entropy: bool = True, verbose: bool = True) -> PatchReport:
    """Swaps in trainscale, in place: Llama-style RMSNorms -> trainscale.RMSNorm, SiLU-gated MLPs
    (gate_proj / up_proj / down_proj) -> trainscale.SwiGLUMLP (same Linear layers, fused
    activation), apply_rotary_pos_emb of the model's modeling module -> hf_apply_rotary_pos_emb
    (that module's function, so every model of that type in the process uses it), and the
    causal-LM loss of each submodule with a settable `loss_function` (transformers' models) ->
    hf_causal_lm_loss. Returns (and with verbose prints) a report of what was swapped."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"trainscale.patch: argument 'model': expected a torch.nn.Module, got {type(model).__name__}")
    report = PatchReport()
    if rms_norm:
        report["rms_norm"] = _swap(model, _rms_norm)
    if swiglu:
        report["swiglu_mlp"] = _swap(model, _mlp)
    if rope:
        report["rope"] = []
        for mod_name in sorted({type(m).__module__ for m in model.modules()}):
            mod = sys.modules.get(mod_name)
            if mod is not None and callable(getattr(mod, "apply_rotary_pos_emb", None)) and \
                    mod.apply_rotary_pos_emb is not hf_apply_rotary_pos_emb:
                mod.apply_rotary_pos_emb = hf_apply_rotary_pos_emb
                report["rope"].append(f"{mod_name}.apply_rotary_pos_emb")
    if cross_entropy:
        report["cross_entropy"] = []
        for name, m in model.named_modules():
            if getattr(m, "loss_type", None) == "ForCausalLM" and \
                    getattr(m, "loss_function", hf_causal_lm_loss) is not hf_causal_lm_loss:
                m.loss_function = hf_causal_lm_loss  # transformers' settable property
                report["cross_entropy"].append(name or type(m).__name__)
    if verbose:
        print(report)
    return report
