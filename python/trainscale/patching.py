"""trainscale.patch(model): swaps the parts of a Hugging Face Llama-style model that trainscale
implements (Liger-style monkey patching). Parameters are shared, not copied, so optimizers and
state dicts are unaffected; the swapped parts follow trainscale.config like the rest."""
import ast
import functools
import inspect
import sys
import textwrap
from typing import Dict, List

import torch
from torch import nn

from .activation import geglu, swiglu
from .functional import apply_rotary, cross_entropy, linear_cross_entropy
from .linear import group_projections
from .modules import Embedding, GeGLUMLP, RMSNorm, SwiGLUMLP
from .selection import config


def _dump(tree) -> str:
    """tree dumped without docstrings, decorators, type annotations and a class's own name: the
    code transformers copies from model to model (its "Copied from" / modular classes and
    functions) dumps the same."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            node.decorator_list = []
            node.body = [b for b in node.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
        if isinstance(node, ast.FunctionDef):
            node.returns = None
        if isinstance(node, ast.arg):
            node.annotation = None
    if isinstance(tree, ast.ClassDef):
        tree.name = ""
    return ast.dump(tree)


@functools.lru_cache(maxsize=None)
def _code(cls, method: str = ""):
    """_dump of cls (or of its method); None without a source."""
    try:
        return _dump(ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, method) if method else cls))).body[0])
    except (AttributeError, OSError, TypeError, SyntaxError, IndexError):
        return None


@functools.lru_cache(maxsize=1)
def _hf_references():
    """The code (_code) of transformers' classes patch() swaps others by: RMSNorm -> weight offset,
    and the forwards of LlamaMLP and of causal LMs; empty without transformers."""
    try:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.gemma2.modeling_gemma2 import Gemma2ForCausalLM
        from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaMLP, LlamaRMSNorm
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM
        from transformers.models.mixtral.modeling_mixtral import MixtralForCausalLM
    except ImportError:
        return {}
    return {"rms_norm_offset": {_code(LlamaRMSNorm): 0.0, _code(GemmaRMSNorm): 1.0},
            "mlp_forward": _code(LlamaMLP, "forward"),
            # `logits = self.lm_head(hidden_states)`, then with labels `self.loss_function(...)`,
            # nothing between but (Gemma 2's) config.final_logit_softcapping, which the fused
            # loss applies instead (the forward runs with it set to None), or (Mixtral's, the
            # mixture-of-experts models') the router's load-balancing loss, which the fused loss
            # adds as the forward would have (_router_aux_loss); DeepSeek-V3's is Llama's with
            # the router logits passed on.
            "causal_lm_forward": (_code(LlamaForCausalLM, "forward"), _code(Gemma2ForCausalLM, "forward"),
                                  _code(MixtralForCausalLM, "forward"), _code(DeepseekV3ForCausalLM, "forward"))}


def _rms_norm_offset(cls):
    """0 for an RMSNorm class of LlamaRMSNorm's code (x * rsqrt(mean(x^2) + eps) * weight), 1 for
    one of GemmaRMSNorm's (the same times 1 + weight, from float32 x to one rounding, as
    trainscale.RMSNorm does), else None: by code, not by name, since other norms named so differ
    (OLMo 2 multiplies before rounding, Gemma 3n has no weight offset)."""
    code = _code(cls)
    return None if code is None else _hf_references().get("rms_norm_offset", {}).get(code)


@functools.lru_cache(maxsize=None)
def _rope_functions(path: str):
    """_dump of apply_rotary_pos_emb and rotate_half in the Python file at path (read from the
    file: the module's names may have been replaced, by us or by transformers' kernels)."""
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    return {node.name: _dump(node) for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name in ("apply_rotary_pos_emb", "rotate_half")}


def _rope_is_llamas(module) -> bool:
    """Whether module's apply_rotary_pos_emb and rotate_half are Llama's code, what
    hf_apply_rotary_pos_emb computes: other models rotate interleaved pairs (Cohere, GLM) or treat
    part of the head their own way (GPT-NeoX, Phi-3, OLMo), and keep theirs."""
    try:
        from transformers.models.llama import modeling_llama
        ours, llama = inspect.getsourcefile(module), inspect.getsourcefile(modeling_llama)
    except (ImportError, TypeError):
        return False
    return ours is not None and llama is not None and _rope_functions(ours) == _rope_functions(llama) is not None


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


def _causal_lm_loss(loss_of, labels, device, num_items_in_batch, ignore_index, shift_labels):
    """transformers' causal-LM reduction of loss_of(target, reduction): token s predicts label
    s + 1 (or shift_labels), mean over the tokens not ignored, or the sum divided by
    num_items_in_batch when given."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(device)
    if num_items_in_batch is None:
        return loss_of(target, "mean")
    loss = loss_of(target, "sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def hf_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None,
                      ignore_index: int = -100, shift_labels=None, **kwargs):
    """Drop-in for transformers' ForCausalLMLoss: token s predicts label s + 1 (or shift_labels),
    mean over the tokens not ignored, or the sum divided by num_items_in_batch when given. The
    logits are not upcast first: trainscale.cross_entropy reads them as they are and computes
    in float32."""
    logits = logits.reshape(-1, vocab_size)
    return _causal_lm_loss(lambda target, reduction: cross_entropy(logits, target, ignore_index=ignore_index,
                                                                   reduction=reduction),
                           labels, logits.device, num_items_in_batch, ignore_index, shift_labels)


class _LMHead(nn.Linear):
    """A causal LM's lm_head (the same Parameters) that, while `hidden` is a list, appends its
    input there and returns None instead of the logits: the model's forward then runs to its
    end without them, and the loss comes from those hidden states (_fused_loss_hook)."""

    hidden = None

    def forward(self, x):
        if self.hidden is None:
            return super().forward(x)
        self.hidden.append(x)
        return None


def _fused_loss_pre_hook(model, args, kwargs):
    # Labels by keyword, as Trainer and transformers pass them; anything else (no labels,
    # evaluation, the switch off, an lm_head replaced since) runs the model unchanged, logits
    # included.
    head = model.lm_head
    fused = (model.training and kwargs.get("labels") is not None and isinstance(head, _LMHead) and
             config.use_fused_linear_cross_entropy is not False)
    if isinstance(head, _LMHead):
        head.hidden = [] if fused else None
    model._trainscale_labels = kwargs["labels"] if fused else None
    cfg = getattr(model, "config", None)
    model._trainscale_softcap = getattr(cfg, "final_logit_softcapping", None) if fused else None
    if model._trainscale_softcap is not None:
        cfg.final_logit_softcapping = None  # put back by _fused_loss_hook, also when forward raises
    if fused:
        return args, {**kwargs, "labels": None}
    return None


def _router_aux_loss(model, kwargs, output):
    """The load-balancing loss a mixture-of-experts causal LM (MixtralForCausalLM's forward) adds
    to its loss when given labels, skipped for the fused loss's labels=None; None for other models
    or without router logits. In a tuple (return_dict=False, the None fields dropped) it comes
    first, the loss being None."""
    if not hasattr(model, "router_aux_loss_coef"):
        return None
    if not isinstance(output, tuple):
        return output.get("aux_loss")
    router = kwargs.get("output_router_logits")
    if router is None:
        router = getattr(model.config, "output_router_logits", False)
    return output[0] if router else None


def _fused_loss_hook(model, args, kwargs, output):
    labels, model._trainscale_labels = model._trainscale_labels, None
    softcap, model._trainscale_softcap = model._trainscale_softcap, None
    if softcap is not None:
        model.config.final_logit_softcapping = softcap
    if labels is None or output is None:  # no fused loss, or forward raised
        return None
    head = model.lm_head
    hidden, head.hidden = head.hidden, None
    if len(hidden) != 1:
        raise RuntimeError(f"trainscale.patch: {type(model).__name__}'s forward ran lm_head {len(hidden)} times; "
                           "the fused loss expects once")
    h = hidden[0].reshape(-1, hidden[0].shape[-1])
    ignore_index = kwargs.get("ignore_index", -100)
    accumulation = model._trainscale_grad_weight_accumulation
    loss = _causal_lm_loss(lambda target, reduction: linear_cross_entropy(h, head.weight, target, head.bias,
                                                                          ignore_index=ignore_index,
                                                                          softcap=softcap or 0.0,
                                                                          reduction=reduction,
                                                                          grad_weight_accumulation=accumulation),
                           labels, h.device, kwargs.get("num_items_in_batch"), ignore_index,
                           kwargs.get("shift_labels"))
    aux_loss = _router_aux_loss(model, kwargs, output)
    if aux_loss is not None:
        loss = loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
    if isinstance(output, tuple):  # return_dict=False: transformers puts the loss first
        return (loss,) + output
    return type(output)(loss=loss, **{k: v for k, v in output.items() if k != "loss"})


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _gelu_form(act):
    """'none' or 'tanh' for a GELU activation module (torch's or transformers'), else None."""
    if isinstance(act, nn.GELU):
        return act.approximate
    return {"GELUActivation": "none", "GELUTanh": "tanh", "PytorchGELUTanh": "tanh"}.get(type(act).__name__)


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


def _rms_norm(m, rebuildable_output):
    if not type(m).__name__.endswith("RMSNorm"):
        return None
    offset = _rms_norm_offset(type(m))
    if offset is None:
        return None
    eps = m.variance_epsilon if hasattr(m, "variance_epsilon") else m.eps
    new = RMSNorm(m.weight.shape[0], eps=eps, weight_offset=offset, device="meta",
                  rebuildable_output=rebuildable_output)
    new.weight = m.weight
    return new


def _embedding(m):
    # Exactly nn.Embedding (subclasses may change its forward); options trainscale.Embedding
    # hands back to nn.Embedding leave the module as it is.
    if type(m) is not nn.Embedding or m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
        return None
    new = Embedding(m.num_embeddings, m.embedding_dim, padding_idx=m.padding_idx, device="meta")
    new.weight = m.weight
    return new


def _gated_mlp(m, make):
    """make(in_features, out_features) built over m's projections, for a module m whose forward is
    LlamaMLP's code, down_proj(act_fn(gate_proj(x)) * up_proj(x)) (others with those parts differ:
    BitNet's normalizes the product, Falcon-H1's scales it)."""
    if isinstance(m, (SwiGLUMLP, GeGLUMLP)) or \
            not all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return None
    code = _code(type(m), "forward")
    if code is None or code != _hf_references().get("mlp_forward"):
        return None
    new = make(m.gate_proj.in_features, m.gate_proj.out_features)
    if new is not None:
        new.gate_proj, new.up_proj, new.down_proj = m.gate_proj, m.up_proj, m.down_proj
    return new


def _swiglu_mlp(m, fused):
    return _gated_mlp(m, lambda h, f: SwiGLUMLP(h, f, device="meta", fused=fused) if _is_silu(m.act_fn) else None)


def _geglu_mlp(m):
    def make(h, f):
        form = _gelu_form(m.act_fn)
        return None if form is None else GeGLUMLP(h, f, device="meta", approximate=form)
    return _gated_mlp(m, make)


def _experts_gates(model: nn.Module, swiglu_on: bool, geglu_on: bool) -> List[str]:
    """Mixture-of-experts blocks under transformers' experts interface (grouped_mm, batched_mm)
    apply `self._apply_gate` to each token's concatenated [gate | up] projection; where that is
    transformers' default (act_fn(gate) * up) with a SiLU or GELU act_fn, the instance gets
    trainscale.swiglu / geglu on the packed halves instead (one pass forward and backward for
    the chunk, activation and product). The eager experts forward does not call it and stays
    as it is."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return []
    swapped = []
    for name, m in model.named_modules():
        if getattr(type(m), "_apply_gate", None) is not _default_apply_gate or "_apply_gate" in vars(m) or \
                not getattr(m, "is_concatenated", False) or not getattr(m, "has_gate", False):
            continue
        act, form = getattr(m, "act_fn", None), _gelu_form(getattr(m, "act_fn", None))
        if swiglu_on and _is_silu(act):
            m._apply_gate = swiglu
        elif geglu_on and form is not None:
            m._apply_gate = functools.partial(geglu, approximate=form)
        else:
            continue
        swapped.append(name)
    return swapped


def _attention_skip_reason(model: nn.Module):
    """Why patch() leaves model's attention as it is, or None when it switches it to trainscale:
    any Hugging Face model that declares its attention goes through transformers'
    AttentionInterface (_supports_attention_backend); per call, hf_attention_forward falls back
    to sdpa for what it does not run (masks, sinks, position bias, sparse indices)."""
    cfg = getattr(model, "config", None)
    is_compatible = getattr(type(model), "is_backend_compatible", None)
    if cfg is None or is_compatible is None or not is_compatible():
        return "not a Hugging Face model whose attention goes through transformers' AttentionInterface"
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    # Multi-head latent attention (DeepSeek-V3) has value heads narrower than the query's.
    v_head_dim, qk_head_dim = getattr(text, "v_head_dim", None), getattr(text, "qk_head_dim", None)
    if v_head_dim is not None and qk_head_dim is not None and v_head_dim != qk_head_dim:
        return f"query / key head dim {qk_head_dim} and value head dim {v_head_dim} differ"
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        return "attention sinks (every call would fall back to the model's eager attention)"
    devices = {p.device for p in model.parameters()}
    if all(d.type == "cpu" for d in devices):
        return None
    if any(d.type != "cuda" for d in devices):
        return "parameters neither all on the CPU nor all on CUDA"
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    # patch() swaps in what is faster: the Hopper backward (D 64 / 128 / 256) is near cuDNN's and
    # faster than PyTorch SDPA's flash backend; elsewhere our sm_80 backward is slower than SDPA's
    # (docs/perf/attention.md has the figures).
    if head_dim not in (64, 128, 256):
        return f"head dim {head_dim} (the fast CUDA attention backward has head dims 64, 128 and 256)"
    if any(torch.cuda.get_device_capability(d) != (9, 0) for d in devices):
        return "not a Hopper GPU (the fast CUDA attention backward needs compute capability 9.0)"
    return None


def _patch_attention(model: nn.Module) -> List[str]:
    from .attention import register_hf_attention

    if _attention_skip_reason(model) is not None or model.config._attn_implementation == "trainscale":
        return []
    register_hf_attention()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("trainscale")
    else:
        model.config._attn_implementation = "trainscale"
    return [f"{type(model).__name__}.config._attn_implementation = 'trainscale'"]


class PatchReport(Dict[str, List[str]]):
    """What trainscale.patch swapped: part -> names of the modules (or functions) replaced."""

    def __str__(self):
        lines = ["trainscale.patch:"]
        for part, names in self.items():
            shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
            lines.append(f"  {part}: {shown or 'nothing matched'}")
        return "\n".join(lines)


def _fuse_loss(m, grad_weight_accumulation) -> bool:
    """Makes a causal LM (one of the forwards _hf_references names) compute its training loss
    with linear_cross_entropy."""
    if type(getattr(m, "lm_head", None)) is not nn.Linear or \
            _code(type(m), "forward") not in _hf_references().get("causal_lm_forward", ()):
        return False
    old = m.lm_head
    head = _LMHead(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
    head.weight, head.bias = old.weight, old.bias
    m.lm_head = head
    m._trainscale_grad_weight_accumulation = grad_weight_accumulation
    m.register_forward_pre_hook(_fused_loss_pre_hook, with_kwargs=True)
    m._trainscale_labels = m._trainscale_softcap = None
    m.register_forward_hook(_fused_loss_hook, with_kwargs=True, always_call=True)
    return True


def patch(model: nn.Module, rms_norm: bool = True, swiglu: bool = True, geglu: bool = True, rope: bool = True,
          cross_entropy: bool = True, linear_cross_entropy: bool = True, attention: bool = True,
          embedding: bool = True, qkv_projections: bool = True, fused_mlp: bool = True,
          rebuild_norm_outputs: bool = True, loss_grad_weight_accumulation: torch.dtype = torch.float32,
          verbose: bool = True) -> PatchReport:
    """Swaps in trainscale, in place: Llama-style RMSNorms (and Gemma's, weight + 1) ->
    trainscale.RMSNorm, SiLU-gated MLPs (gate_proj / up_proj / down_proj) -> trainscale.SwiGLUMLP
    (same Linear layers, fused activation; with fused_mlp its backward recomputes the activation
    instead of keeping it, a third less saved MLP activation beside the input), with geglu
    GELU-gated ones (Gemma's) -> trainscale.GeGLUMLP, apply_rotary_pos_emb of the model's
    modeling module, where it is Llama's code -> hf_apply_rotary_pos_emb (that module's function,
    so every model of that type in the process uses it), the
    causal-LM loss of each submodule with a settable `loss_function` (transformers' models) ->
    hf_causal_lm_loss, and, in causal LMs whose forward is LlamaForCausalLM's,
    Gemma2ForCausalLM's, MixtralForCausalLM's or DeepseekV3ForCausalLM's code (Llama, Mistral,
    Qwen2/3, Gemma 1-3, Phi-3, OLMo, ...; Gemma's final logit softcap applied in the loss; Mixtral,
    Qwen2/3-MoE, OLMoE, gpt-oss, ... with their router's load-balancing loss added as their
    forward adds it; DeepSeek-V2/V3, GLM-4.5 MoE, ...), the
    training loss
    (labels given, model.training) -> linear_cross_entropy of the last hidden states and
    lm_head's weight, without the logits (the output's `logits` is then None; its
    grad_weight_accumulation is loss_grad_weight_accumulation: the weight's dtype sums the
    weight gradient in place over chunks of at most 512 MiB of logits, as Liger-Kernel does,
    instead of all tokens' logits or a float32 buffer), and, in models whose attention goes
    through transformers' AttentionInterface (_attention_skip_reason: not latent attention with
    narrower value heads, no sinks) and whose parameters are all on the CPU, or all on Hopper
    GPUs with head dim 64, 128 or 256, attention -> trainscale.hf_attention_forward
    (config._attn_implementation = "trainscale"; masks other than the causal (sliding-window)
    one and dropout fall back to sdpa per call). On other GPUs and head dims attention is left as
    it is, since training through our sm_80 attention backward is slower than through PyTorch
    SDPA's; load the model with attn_implementation="trainscale" to run the CUDA kernels there.
    With embedding, each nn.Embedding (the token embedding) -> trainscale.Embedding, the same
    weight: its backward writes the table's gradient in one pass instead of a zero fill and a
    scatter-add. With qkv_projections, the q_proj, k_proj and v_proj nn.Linear layers of each
    module holding all three (Llama-family attention) -> a group of
    trainscale.linear.SharedInputProjection (same Parameters): the backward sums the hidden
    states' gradient inside the three products instead of two separate adds. With
    rebuild_norm_outputs (and rms_norm) each norm's output is rebuildable
    (trainscale.RMSNorm's rebuildable_output): the q/k/v group and the fused MLP after it keep the
    norm's input, which the norm keeps anyway, instead of its output, and rebuild the output in
    their backward (the same bits): two [T, H] tensors less per decoder layer until the backward
    (64 MiB each at T 8192, H 4096) for one rms_norm pass each there.
    Returns (and with verbose prints) a report of what was swapped."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"trainscale.patch: argument 'model': expected a torch.nn.Module, got {type(model).__name__}")
    report = PatchReport()
    if rms_norm:
        report["rms_norm"] = _swap(model, lambda m: _rms_norm(m, rebuild_norm_outputs))
    if swiglu:
        report["swiglu_mlp"] = _swap(model, lambda m: _swiglu_mlp(m, fused_mlp))
    if geglu:
        report["geglu_mlp"] = _swap(model, _geglu_mlp)
    if swiglu or geglu:
        report["experts_gate"] = _experts_gates(model, swiglu, geglu)
    if rope:
        report["rope"] = []
        for mod_name in sorted({type(m).__module__ for m in model.modules()}):
            mod = sys.modules.get(mod_name)
            if mod is not None and callable(getattr(mod, "apply_rotary_pos_emb", None)) and \
                    mod.apply_rotary_pos_emb is not hf_apply_rotary_pos_emb and _rope_is_llamas(mod):
                mod.apply_rotary_pos_emb = hf_apply_rotary_pos_emb
                report["rope"].append(f"{mod_name}.apply_rotary_pos_emb")
    if cross_entropy:
        report["cross_entropy"] = []
        for name, m in model.named_modules():
            if getattr(m, "loss_type", None) == "ForCausalLM" and \
                    getattr(m, "loss_function", hf_causal_lm_loss) is not hf_causal_lm_loss:
                m.loss_function = hf_causal_lm_loss  # transformers' settable property
                report["cross_entropy"].append(name or type(m).__name__)
    if linear_cross_entropy:
        report["linear_cross_entropy"] = [name or type(m).__name__ for name, m in list(model.named_modules())
                                          if _fuse_loss(m, loss_grad_weight_accumulation)]
    if attention:
        report["attention"] = _patch_attention(model)
    if embedding:
        report["embedding"] = _swap(model, _embedding)
    if qkv_projections:
        report["qkv_projections"] = [name for name, m in list(model.named_modules())
                                     if group_projections(m, ("q_proj", "k_proj", "v_proj"))]
    if verbose:
        print(report)
    return report
