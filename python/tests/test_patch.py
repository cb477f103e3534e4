"""trainscale.patch on a tiny Hugging Face Llama (CPU, fp64 and fp32): the swapped model computes
the same loss and gradients as the original, in evaluation mode (logits, then the loss) and in
training (the loss from the hidden states, without logits). Skipped when transformers is not
installed."""
import copy
import sys

import pytest
import torch

import trainscale as ts
from trainscale.bench.measure import saved_bytes

transformers = pytest.importorskip("transformers")
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")


def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg).double().eval()


def loss_and_grads(model, ids, position_ids=None, labels=None, **kwargs):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids if labels is None else labels, position_ids=position_ids, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(loss, grads, ref_loss, ref_grads, loss_rtol=1e-6, grad_rtol=1e-5):
    """The loss to loss_rtol; every parameter's gradient to grad_rtol, absolutely to 1e-5 of its
    largest reference entry."""
    torch.testing.assert_close(loss, ref_loss, rtol=loss_rtol, atol=0, check_dtype=False)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=grad_rtol, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("per_batch_positions", [False, True])
def test_patched_llama_matches(monkeypatch, capsys, per_batch_positions):
    # patch() replaces the modeling module's apply_rotary_pos_emb; restore it after the test.
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    torch.manual_seed(0)
    model = tiny_llama()
    original = copy.deepcopy(model)
    ids = torch.randint(0, 97, (2, 12))
    positions = torch.stack([torch.arange(12), torch.arange(5, 17)]) if per_batch_positions else None
    ref_loss, ref_grads = loss_and_grads(original, ids, positions)

    report = ts.patch(model)
    assert "trainscale.patch:" in capsys.readouterr().out
    assert len(report["rms_norm"]) == 2 * 2 + 1  # two per layer and the final norm
    assert len(report["swiglu_mlp"]) == 2
    assert report["rope"] == ["transformers.models.llama.modeling_llama.apply_rotary_pos_emb"]
    assert report["cross_entropy"] == ["LlamaForCausalLM"] and model.loss_function is ts.hf_causal_lm_loss
    assert isinstance(model.model.norm, ts.RMSNorm) and isinstance(model.model.layers[0].mlp, ts.SwiGLUMLP)
    # On the CPU, attention goes through trainscale (forward and backward have the reference).
    assert report["attention"] == ["LlamaForCausalLM.config._attn_implementation = 'trainscale'"]
    assert model.config._attn_implementation == "trainscale"
    assert original.config._attn_implementation == "eager"
    assert report["embedding"] == ["model.embed_tokens"] and isinstance(model.model.embed_tokens, ts.Embedding)
    assert report["qkv_projections"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    # Parameters are shared, not copied.
    assert model.model.norm.weight is dict(model.named_parameters())["model.norm.weight"]

    loss, grads = loss_and_grads(model, ids, positions)
    # LlamaRMSNorm computes in float32 even for float64 inputs, and transformers' loss casts the
    # logits to float32 (ours stays in float64), so the two agree to float32 rounding, not
    # float64's.
    assert_same(loss, grads, ref_loss, ref_grads)


def test_patch_fp32_and_idempotent(monkeypatch):
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    torch.manual_seed(0)
    model = tiny_llama().float()
    original = copy.deepcopy(model)
    ids = torch.randint(0, 97, (1, 9))
    ts.patch(model, verbose=False)
    again = ts.patch(model, verbose=False)
    assert again["rms_norm"] == [] and again["swiglu_mlp"] == [] and again["rope"] == []
    assert again["cross_entropy"] == [] and again["linear_cross_entropy"] == [] and again["attention"] == []
    assert again["embedding"] == [] and again["qkv_projections"] == []
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_training_loss_without_logits(monkeypatch, dtype):
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    monkeypatch.setattr(ts.config, "use_fused_linear_cross_entropy", True)
    torch.manual_seed(0)
    model = tiny_llama().to(dtype).train()
    original = copy.deepcopy(model)
    ids = torch.randint(0, 97, (2, 11))
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt that is not trained on
    report = ts.patch(model, verbose=False)
    assert report["linear_cross_entropy"] == ["LlamaForCausalLM"]
    assert model.lm_head.weight is dict(model.named_parameters())["lm_head.weight"]

    # transformers computes the loss from float32 logits; ours from the hidden states in the
    # model's dtype (float64 stays float64).
    rtol = 1e-6 if dtype == torch.float64 else 1e-5
    for kwargs in ({"num_items_in_batch": torch.tensor(9)}, {}):
        ref_loss, ref_grads = loss_and_grads(original, ids, labels=labels, **kwargs)
        loss, grads = loss_and_grads(model, ids, labels=labels, **kwargs)
        assert_same(loss, grads, ref_loss, ref_grads, loss_rtol=rtol)

    assert model(input_ids=ids, labels=labels).logits is None
    as_tuple = model(input_ids=ids, labels=labels, return_dict=False)
    torch.testing.assert_close(as_tuple[0], loss)  # the mean; transformers' order: the loss first
    # Without labels, in evaluation, or with the switch off: the logits as before.
    with torch.no_grad():
        ref_logits = original(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, ref_logits)
        model.eval()
        out = model(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.logits, ref_logits)
        torch.testing.assert_close(out.loss, loss, rtol=rtol, atol=0)
        model.train()
        monkeypatch.setattr(ts.config, "use_fused_linear_cross_entropy", False)
        torch.testing.assert_close(model(input_ids=ids, labels=labels).logits, ref_logits)
        monkeypatch.setattr(ts.config, "use_fused_linear_cross_entropy", True)
        model.lm_head = original.lm_head  # replaced after patching (as resize_token_embeddings does)
        out = model(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.logits, ref_logits)
        torch.testing.assert_close(out.loss, loss, rtol=rtol, atol=0)


def test_patch_rejects_non_modules():
    with pytest.raises(TypeError, match="trainscale.patch: argument 'model'"):
        ts.patch("not a model")


def test_patch_leaves_attention_off_the_cpu(monkeypatch):
    # Parameters neither on the CPU nor on a Hopper GPU (meta here): patch keeps the model's
    # attention; attention=False keeps it anywhere.
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    model = tiny_llama().to("meta")
    assert ts.patch(model, verbose=False)["attention"] == []
    assert model.config._attn_implementation == "eager"
    model = tiny_llama()
    assert ts.patch(model, attention=False, verbose=False).get("attention") is None
    assert model.config._attn_implementation == "eager"


def test_patch_leaves_latent_attention_and_other_attention_code(monkeypatch):
    # Multi-head latent attention with value heads narrower than the query's (DeepSeek-V3's
    # widths) and a model whose attention does not go through transformers' interface (StableLM)
    # keep their attention.
    skip_reason = ts.patching._attention_skip_reason
    dsv3 = {"num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
    model, *_ = tiny_family_model(monkeypatch, "deepseek_v3", dtype=torch.float32, **dsv3)
    assert "head dim 24 and value head dim 16 differ" in skip_reason(model)
    assert ts.patch(model, verbose=False)["attention"] == []
    model, *_ = tiny_family_model(monkeypatch, "stablelm")
    assert "AttentionInterface" in skip_reason(model)


def test_attention_sinks_fall_back_to_the_models_eager_attention(monkeypatch):
    # Selected by hand, trainscale's attention function passes gpt-oss's calls (sinks; no mask on
    # its full-attention layers, where sdpa would take is_causal) to its eager attention with the
    # causal mask written out: the model computes what its eager attention does.
    model, ids, ref_loss, ref_grads = tiny_family_model(monkeypatch, "gpt_oss", dtype=torch.float32,
                                                        sliding_window=5)
    assert "sinks" in ts.patching._attention_skip_reason(model)
    ts.register_hf_attention()
    model.set_attn_implementation("trainscale")
    loss, grads = loss_and_grads(model, ids)
    assert_same(loss, grads, ref_loss, ref_grads, loss_rtol=1e-6, grad_rtol=1e-4)


def tiny_family_model(monkeypatch, family, config_name=None, model_name=None, training=True,
                      dtype=torch.float64, **config):
    """A two-layer model of transformers' `family` (its `*Config` and `*ForCausalLM` unless named)
    with its norm weights and biases moved off their initial values, so that a dropped one shows,
    and its unpatched loss and gradients on random ids: (model, ids, ref_loss, ref_grads). The
    family's apply_rotary_pos_emb is restored after the test (patch() replaces it)."""
    import importlib
    try:
        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        pytest.skip(f"transformers has no {family}")
    if hasattr(modeling, "apply_rotary_pos_emb"):
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)
    package = importlib.import_module(f"transformers.models.{family}")
    config_class = getattr(package, config_name) if config_name else \
        next(getattr(package, n) for n in dir(package) if n.endswith("Config"))
    model_class = getattr(package, model_name) if model_name else \
        next(getattr(modeling, n) for n in dir(modeling) if n.endswith("ForCausalLM"))
    torch.manual_seed(0)
    cfg = config_class(**{**dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2), **config})
    cfg._attn_implementation = "eager"
    model = model_class(cfg).to(dtype).train(training)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(3, 97, (2, 12))
    return (model, ids) + loss_and_grads(copy.deepcopy(model), ids)


# The other model families patch() names: Mistral (a sliding window shorter than the sequence),
# Qwen2 (biases on q, k, v) and Qwen3 (RMSNorms over each head's q and k).
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}, 5),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, 5),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, 9),  # with q_norm and k_norm
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("training", [False, True])
def test_patched_model_families_match(monkeypatch, family, training):
    config_name, model_name, extra, norms = FAMILIES[family]
    monkeypatch.setattr(ts.config, "use_fused_linear_cross_entropy", True)
    model, ids, ref_loss, ref_grads = tiny_family_model(monkeypatch, family, config_name, model_name, training, **extra)

    report = ts.patch(model, verbose=False)
    assert report["cross_entropy"] == [model_name]
    assert report["linear_cross_entropy"] == [model_name]
    assert len(report["rms_norm"]) == norms and len(report["swiglu_mlp"]) == 2 and report["rope"]
    assert report["qkv_projections"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert model.config._attn_implementation == "trainscale"
    loss, grads = loss_and_grads(model, ids)
    assert_same(loss, grads, ref_loss, ref_grads)


def test_patch_recognizes_norms_and_mlps_by_their_code():
    # patch() swaps an RMSNorm whose class is LlamaRMSNorm's code (offset 0) or GemmaRMSNorm's
    # (offset 1), and an MLP whose forward is LlamaMLP's, whatever the model calls them; classes
    # of other code keep theirs.
    import importlib

    def cls(family, name):
        try:
            return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
        except (ImportError, AttributeError):
            pytest.skip(f"transformers has no {family}.{name}")
    offset = ts.patching._rms_norm_offset
    for family, name, want in [("llama", "LlamaRMSNorm", 0.0), ("mistral", "MistralRMSNorm", 0.0),
                               ("qwen3_moe", "Qwen3MoeRMSNorm", 0.0), ("deepseek_v3", "DeepseekV3RMSNorm", 0.0),
                               ("gemma2", "Gemma2RMSNorm", 1.0), ("gemma3", "Gemma3RMSNorm", 1.0),
                               ("olmo2", "Olmo2RMSNorm", None)]:  # OLMo 2 multiplies by the weight, then rounds
        assert offset(cls(family, name)) == want, name
    mlp = ts.patching._code(cls("llama", "LlamaMLP"), "forward")
    assert ts.patching._code(cls("qwen2", "Qwen2MLP"), "forward") == mlp
    assert ts.patching._code(cls("gemma", "GemmaMLP"), "forward") == mlp
    assert ts.patching._code(cls("bitnet", "BitNetMLP"), "forward") != mlp  # a norm of the product


# Families patch() names no part of: it swaps what is Llama's code in them and leaves the rest
# (OLMo 2's norms, BitNet's MLP, Phi-3's packed MLP and partial RoPE, GLM-4's interleaved RoPE),
# and the model computes what it did (its loss in float32, as transformers' loss upcasts).
# Attention is ours in every model whose attention goes through transformers' interface (not
# StableLM's) and has no sinks (not gpt-oss's): Granite's scale, Ministral's and VaultGemma's
# sliding windows and softcap.
OTHER_FAMILIES = {"olmo2": {}, "bitnet": {}, "phi3": {}, "granite": {}, "glm4": {}, "stablelm": {}, "exaone4": {},
                  "ministral": {"head_dim": 16, "sliding_window": 5}, "vaultgemma": {"sliding_window": 5},
                  "gpt_oss": {"sliding_window": 5, "dtype": torch.float32}}  # experts: no float64 grouped products


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_patch_other_families_keep_their_results(monkeypatch, family):
    model, ids, ref_loss, ref_grads = tiny_family_model(monkeypatch, family, **OTHER_FAMILIES[family])
    report = ts.patch(model, verbose=False)
    assert bool(report["attention"]) == (family not in ("stablelm", "gpt_oss"))
    loss, grads = loss_and_grads(model, ids)
    assert_same(loss, grads, ref_loss, ref_grads, loss_rtol=1e-6, grad_rtol=1e-4)


# Mixture-of-experts causal LMs. With MixtralForCausalLM's forward the fused loss adds the
# router's load-balancing loss (weighted 0.5 here so that leaving it out shows) as the forward
# does, in a dict and in a tuple; DeepSeek-V3's forward (its first layer dense here) has none.
# The attention is ours (DeepSeek-V3's with query and value heads of one width), and so is every experts block's
# SwiGLU (transformers' grouped_mm experts call its _apply_gate). Float32: the experts' grouped
# products take no float64.
MOE_FAMILIES = {
    "mixtral": ({"sliding_window": 5}, [0, 1]),
    "qwen3_moe": ({"head_dim": 16}, [0, 1]),
    "olmoe": ({}, [0, 1]),
    "deepseek_v3": ({"num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}, [1]),
}


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
@pytest.mark.parametrize("return_dict", [True, False])
def test_patched_moe_models_match(monkeypatch, family, return_dict):
    config, expert_layers = MOE_FAMILIES[family]
    router_loss = family != "deepseek_v3"
    if router_loss:
        config = {**config, "output_router_logits": True, "router_aux_loss_coef": 0.5}
    model, ids, ref_loss, ref_grads = tiny_family_model(monkeypatch, family, dtype=torch.float32, **config)
    assert not router_loss or model.router_aux_loss_coef == 0.5
    report = ts.patch(model, verbose=False)
    assert report["linear_cross_entropy"] and report["attention"]  # DeepSeek-V3's heads here are one width
    assert report["experts_gate"] == [f"model.layers.{i}.mlp.experts" for i in expert_layers]
    assert model.config._experts_implementation == "grouped_mm"
    assert model.model.layers[expert_layers[0]].mlp.experts._apply_gate is ts.swiglu
    model.zero_grad()
    out = model(input_ids=ids, labels=ids, return_dict=return_dict)
    loss = out.loss if return_dict else out[0]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_same(loss.detach(), grads, ref_loss, ref_grads, loss_rtol=1e-5, grad_rtol=1e-4)
    if return_dict:
        assert (getattr(out, "aux_loss", None) is not None) == router_loss and out.logits is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [64, 256])
def test_cuda_patched_mixtral_matches(monkeypatch, head_dim):
    # On the GPU in bfloat16: the experts' SwiGLU, the fused loss with the router term and (on
    # Hopper) the attention run our kernels. Against the unpatched model in float32,
    # the patched one is as close as the unpatched one in bfloat16. Every token takes every expert:
    # with a top-2 of 8, rounding alone can move a token to another expert, whose gradients then
    # differ by far more than rounding (one token of the second layer did so here, in our
    # rounding and not in the unpatched model's). The CPU tests cover sparse routing exactly.
    model, ids, _, _ = tiny_family_model(monkeypatch, "mixtral", dtype=torch.bfloat16, hidden_size=256,
                                          head_dim=head_dim, num_local_experts=4, num_experts_per_tok=4,
                                          output_router_logits=True, router_aux_loss_coef=0.5)
    model, ids = model.cuda(), ids.cuda()
    exact_loss, exact_grads = loss_and_grads(copy.deepcopy(model).float(), ids)
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), ids)
    report = ts.patch(model, verbose=False)
    assert report["experts_gate"] and report["linear_cross_entropy"]
    assert bool(report["attention"]) == (torch.cuda.get_device_capability() == (9, 0))
    loss, grads = loss_and_grads(model, ids)
    assert abs(loss.float() - exact_loss) <= max(2 * abs(ref_loss.float() - exact_loss), 1e-2 * exact_loss)
    for name, g in exact_grads.items():
        ours, theirs = (grads[name].float() - g).norm(), (ref_grads[name].float() - g).norm()
        assert ours <= max(2 * theirs, 1e-2 * g.norm()), f"{name}: {ours} against bfloat16's {theirs}"


def test_patch_keeps_rope_that_is_not_llamas(monkeypatch):
    # Cohere rotates interleaved pairs: its apply_rotary_pos_emb is not Llama's code, so patch()
    # leaves it (ours would rotate the wrong pairs), and the patched model computes what it did.
    modeling = pytest.importorskip("transformers.models.cohere.modeling_cohere")
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)
    theirs = modeling.apply_rotary_pos_emb
    assert ts.patching._rope_is_llamas(modeling_llama) and not ts.patching._rope_is_llamas(modeling)
    torch.manual_seed(0)
    cfg = transformers.CohereConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    attn_implementation="eager", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.CohereForCausalLM(cfg).double().train()
    original = copy.deepcopy(model)
    ids = torch.randint(0, 97, (2, 12))
    ref_loss, ref_grads = loss_and_grads(original, ids)
    report = ts.patch(model, verbose=False)
    assert report["rope"] == [] and modeling.apply_rotary_pos_emb is theirs
    loss, grads = loss_and_grads(model, ids)
    assert_same(loss, grads, ref_loss, ref_grads, loss_rtol=1e-6)  # Cohere's logits are float32


# Gemma: RMSNorms of weight + 1 and a GELU(tanh)-gated MLP; Gemma 2 adds norms around the MLP,
# attention and final logit softcaps (small enough here to change the loss; the fused loss
# applies the latter), a query scale of its own and a sliding window on every other layer;
# Gemma 3 adds q / k norms. Attention is ours (on the CPU here) in every call.
GEMMA_FAMILIES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}, 5),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 5, "final_logit_softcapping": 0.5,
                                                    "attn_logit_softcapping": 0.5}, 9),
    "gemma2-no-final-softcap": ("Gemma2Config", "Gemma2ForCausalLM", {"final_logit_softcapping": None}, 9),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 5}, 13),
}


@pytest.mark.parametrize("variant", sorted(GEMMA_FAMILIES))
@pytest.mark.parametrize("training", [False, True])
def test_patched_gemma_families_match(monkeypatch, variant, training):
    config_name, model_name, extra, norms = GEMMA_FAMILIES[variant]
    monkeypatch.setattr(ts.config, "use_fused_linear_cross_entropy", True)
    model, ids, ref_loss, ref_grads = tiny_family_model(monkeypatch, variant.split("-")[0], config_name, model_name,
                                                        training, head_dim=16, **extra)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    monkeypatch.setattr(sys.modules["trainscale.attention"], "_warn_once", pytest.fail)  # no call falls back
    report = ts.patch(model, verbose=False)
    assert len(report["rms_norm"]) == norms and report["swiglu_mlp"] == []
    assert report["geglu_mlp"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert model.model.layers[0].mlp.approximate == "tanh" and model.model.norm.weight_offset == 1.0
    assert report["rope"] and report["cross_entropy"] == [model_name] and report["attention"]
    assert report["linear_cross_entropy"] == [model_name]
    loss, grads = loss_and_grads(model, ids)
    assert_same(loss, grads, ref_loss, ref_grads)
    assert getattr(model.config, "final_logit_softcapping", None) == softcap  # put back after the forward
    if training and softcap:  # the loss with the softcap is eval mode's (logits, then loss); put back after a raise
        assert abs(loss.item() - loss_and_grads(model.train(False), ids)[0].item()) < 1e-9
        model.train(True)
        with pytest.raises(ValueError):
            model(input_ids=ids, labels=ids[:, :5])
        assert model.config.final_logit_softcapping == softcap


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_patched_llama_under_activation_checkpointing(monkeypatch, use_reentrant):
    # Recomputing a layer in the backward runs the grouped q/k/v projections and every patched op
    # again: the gradients are those of the plain model without checkpointing.
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    monkeypatch.setattr(ts.config, "use_fused_linear_cross_entropy", True)
    torch.manual_seed(0)
    model = tiny_llama().train()
    original = copy.deepcopy(model)
    ids = torch.randint(0, 97, (2, 12))
    ref_loss, ref_grads = loss_and_grads(original, ids)
    ts.patch(model, verbose=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    if use_reentrant:
        model.enable_input_require_grads()  # reentrant checkpointing needs an input that requires grad
    assert model.is_gradient_checkpointing
    calls = []
    grouped = ts.linear._SharedInputLinear.apply
    monkeypatch.setattr(ts.linear._SharedInputLinear, "apply", lambda *a: calls.append(1) or grouped(*a))
    loss, grads = loss_and_grads(model, ids)
    assert len(calls) == 2 * 2  # each layer's q/k/v: forward, then recomputed in the backward
    assert_same(loss, grads, ref_loss, ref_grads)


def test_patched_llama_under_torch_compile(monkeypatch):
    # The patched model traced by Dynamo (aot_eager: the same graphs without Inductor's codegen),
    # the fused loss included: same loss and gradients as the plain eager model.
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    monkeypatch.setattr(ts.config, "use_fused_linear_cross_entropy", True)
    torch.manual_seed(0)
    model = tiny_llama().float().train()
    original = copy.deepcopy(model)
    ids = torch.randint(0, 97, (2, 12))
    ref_loss, ref_grads = loss_and_grads(original, ids)
    ts.patch(model, verbose=False)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    loss, grads = loss_and_grads(compiled, ids)
    assert counters["stats"]["unique_graphs"] >= 1  # traced, not run eagerly
    grads = {name.removeprefix("_orig_mod."): g for name, g in grads.items()}
    assert_same(loss, grads, ref_loss, ref_grads, loss_rtol=1e-5, grad_rtol=1e-4)


def test_patched_llama_under_autocast(monkeypatch):
    # Mixed precision as Trainer(bf16=True) runs it: float32 parameters, bfloat16 autocast. The
    # fused MLP, the q/k/v group and the fused loss compute in autocast's dtype, and their
    # backwards too, as the unpatched model's autocast products do; float32 gradients.
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    monkeypatch.setattr(ts.config, "use_fused_linear_cross_entropy", True)
    torch.manual_seed(0)
    model = tiny_llama().float().train()
    original = copy.deepcopy(model)
    ids = torch.randint(0, 97, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = loss_and_grads(original, ids)
    report = ts.patch(model, verbose=False)
    assert report["swiglu_mlp"] and report["qkv_projections"] and report["linear_cross_entropy"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = loss_and_grads(model, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=0)
    for name, g in ref_grads.items():
        assert grads[name].dtype == torch.float32, name
        assert (grads[name] - g).norm() <= 3e-2 * g.norm(), name  # bfloat16 products, rounded apart


def test_patched_gemma2_under_torch_compile(monkeypatch):
    # Traced, the attention mask cannot be read: calls with a mask and a softcap go to Gemma 2's
    # eager attention (its additive mask from our boolean one); the final softcap's config switch
    # in the fused loss's hooks traces too.
    monkeypatch.setattr(ts.config, "use_fused_linear_cross_entropy", True)
    model, ids, ref_loss, ref_grads = tiny_family_model(
        monkeypatch, "gemma2", head_dim=16, sliding_window=5, final_logit_softcapping=0.5, attn_logit_softcapping=0.5)
    ts.patch(model, verbose=False)
    torch._dynamo.reset()
    loss, grads = loss_and_grads(torch.compile(model, backend="aot_eager"), ids)
    grads = {name.removeprefix("_orig_mod."): g for name, g in grads.items()}
    assert_same(loss, grads, ref_loss, ref_grads, loss_rtol=1e-6, grad_rtol=1e-4)
    assert model.config.final_logit_softcapping == 0.5


def test_rebuilt_norm_outputs_same_gradients_less_kept(monkeypatch):
    # patch()'s norms hand the q/k/v group and the fused MLP their input to rebuild their output
    # from: the same bits as keeping it, two [B, T, H] tensors less per layer.
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    monkeypatch.setattr(ts.config, "use_fused_linear_cross_entropy", True)
    torch.manual_seed(0)
    base = tiny_llama().float().train()
    ids = torch.randint(0, 97, (2, 12))
    results = []
    for rebuild in (False, True):
        model = copy.deepcopy(base)
        ts.patch(model, rebuild_norm_outputs=rebuild, verbose=False)
        kept = saved_bytes(lambda ids, m=model: m(input_ids=ids, labels=ids).loss, (ids,))
        results.append((kept, *loss_and_grads(model, ids)))
    (kept_plain, loss_plain, grads_plain), (kept_rebuilt, loss_rebuilt, grads_rebuilt) = results
    assert torch.equal(loss_rebuilt, loss_plain)
    assert all(torch.equal(grads_rebuilt[n], grads_plain[n]) for n in grads_plain)
    assert kept_plain - kept_rebuilt == 2 * 2 * (2 * 12 * 64 * 4)  # layers x norms x [B, T, H] float32
