"""trainscale.attention (torch.ops.trainscale.attention_forward / attention_backward) against a
float64 math reference on the CPU, its gradients (gradcheck), fake-tensor and torch.compile
tracing, argument errors, and the Hugging Face attention function: a tiny Llama with
attn_implementation="trainscale" matches "sdpa" in loss and gradients. GPU: the CUDA forward
and backward against PyTorch SDPA in bf16."""
import sys
import warnings

import pytest
import torch

import trainscale as ts

from conftest import cuda

ops = torch.ops.trainscale


def reference(q, k, v, causal=False, scale=None, window_size=(-1, -1), softcap=0.0):
    """Math attention in BSHD, GQA by repeating kv heads, bottom-right causal mask and window,
    softcap on the scaled scores; (out, lse)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    rep = hq // hkv
    kk = k.repeat_interleave(rep, dim=2).transpose(1, 2)
    vv = v.repeat_interleave(rep, dim=2).transpose(1, 2)
    s = (q.transpose(1, 2) @ kk.transpose(-1, -2)) * scale  # [B, H, Sq, Sk]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    left, right = window_size
    right = 0 if causal else right
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        keep = keep.tril(sk - sq + right)
    if left >= 0:
        keep = keep.triu(sk - sq - left)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows that see no key: 0
    return (p @ vv).transpose(1, 2), lse


def make(b, sq, sk, hq, hkv, d, dtype=torch.float64, requires_grad=False):
    q = torch.randn(b, sq, hq, d, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(b, sk, hkv, d, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(b, sk, hkv, d, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


SHAPES = [  # (B, Sq, Sk, Hq, Hkv, D)
    (2, 16, 16, 4, 4, 32),
    (2, 16, 16, 4, 2, 16),  # GQA 4/2
    (1, 7, 13, 3, 1, 5),  # odd sizes, MQA, Sq < Sk
    (2, 9, 5, 2, 2, 8),  # Sq > Sk: causal queries that see no key
    (1, 1, 11, 2, 1, 64),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_reference(shape, causal):
    b, sq, sk, hq, hkv, d = shape
    q, k, v = make(b, sq, sk, hq, hkv, d)
    out, lse = ts.attention_with_lse(q, k, v, causal=causal)
    ref_out, ref_lse = reference(q, k, v, causal)
    assert out.shape == (b, sq, hq, d) and out.dtype == torch.float64
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_forward_float32_scale_and_strided_heads():
    q, k, v = make(2, 10, 12, 4, 2, 16, dtype=torch.float32)
    # [B, H, S, D] tensors transposed to BSHD views: strided heads, no copies.
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out = ts.attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), causal=True, scale=0.3)
    assert out.dtype == torch.float32 and out.is_contiguous()
    ref, _ = reference(q.double(), k.double(), v.double(), True, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_sdpa_agrees_when_square():
    q, k, v = make(2, 12, 12, 4, 2, 8)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(ts.attention(q, k, v, causal=True), sdpa, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape,causal", [((1, 3, 3, 2, 2, 4), True), ((2, 3, 5, 4, 2, 3), True),
                                          ((1, 4, 3, 2, 1, 3), False)])
def test_gradcheck(shape, causal):
    q, k, v = make(*shape, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: ts.attention(q, k, v, causal=causal, scale=0.7), (q, k, v))


@pytest.mark.parametrize("shape", [(2, 6, 9, 4, 2, 8), (1, 5, 3, 2, 2, 4)])
def test_backward_matches_reference(shape):
    q, k, v = make(*shape, requires_grad=True)
    dout = torch.randn(shape[0], shape[1], shape[3], shape[5], dtype=torch.float64)
    grads = torch.autograd.grad(ts.attention(q, k, v, causal=True), (q, k, v), dout)
    ref = torch.autograd.grad(reference(q, k, v, True)[0], (q, k, v), dout)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


WINDOW_MODES = [  # (causal, window_size, softcap)
    (True, (3, -1), 0.0),  # causal local attention (Mistral)
    (False, (2, 1), 0.0),
    (False, (0, 0), 0.0),
    (True, (-1, -1), 1.5),  # softcap (Gemma 2)
    (True, (4, 0), 2.0),
]


@pytest.mark.parametrize("causal,window,softcap", WINDOW_MODES)
@pytest.mark.parametrize("shape", [(2, 9, 9, 4, 2, 8), (1, 5, 11, 2, 1, 4), (1, 11, 6, 2, 2, 3)])
def test_window_and_softcap_match_reference(shape, causal, window, softcap):
    q, k, v = make(*shape, requires_grad=True)
    out, lse = ts.attention_with_lse(q, k, v, causal=causal, scale=0.8, window_size=window, softcap=softcap)
    ref_out, ref_lse = reference(q, k, v, causal, 0.8, window, softcap)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(ref_out, (q, k, v), dout)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_autocast_casts_float32_inputs_as_sdpa():
    q, k, v = (torch.randn(2, 8, 4, 16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ts.attention(q, k, v, causal=True)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert ts.attention(q, k, v, causal=True).dtype == torch.float32  # autocast off: as given


def test_window_and_softcap_gradcheck():
    q, k, v = make(1, 5, 6, 2, 1, 3, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: ts.attention(q, k, v, causal=True, window_size=(2, 0), softcap=0.9), (q, k, v))


def _packed(q_lens, k_lens, hq=4, hkv=2, d=6, dtype=torch.float64):
    cu_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + k_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(int(cu_k[-1]), hkv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(int(cu_k[-1]), hkv, d, dtype=dtype, requires_grad=True)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0)] + WINDOW_MODES[:2])
def test_varlen_equals_each_sequence(causal, window, softcap):
    q_lens, k_lens = [4, 0, 9, 1], [6, 3, 9, 0]
    q, k, v, cu_q, cu_k = _packed(q_lens, k_lens)
    out, lse = ts.attention_varlen_with_lse(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal,
                                            window_size=window, softcap=softcap)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, ref_lse, ref_terms = [], [], 0
    for b in range(len(q_lens)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l_ = reference(q[None, qs], k[None, ks], v[None, ks], causal, None, window, softcap)
        ref_out.append(o[0])
        ref_lse.append(l_[0])
        ref_terms = ref_terms + (o[0] * dout[qs]).sum()
    torch.testing.assert_close(out, torch.cat(ref_out), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, torch.cat(ref_lse, dim=1), rtol=1e-10, atol=1e-10)
    for g, r in zip(grads, torch.autograd.grad(ref_terms, (q, k, v))):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_varlen_gradcheck_compile_and_errors():
    q, k, v, cu_q, cu_k = _packed([2, 3], [3, 2], hq=2, hkv=1, d=3)
    assert torch.autograd.gradcheck(
        lambda q, k, v: ts.attention_varlen(q, k, v, cu_q, cu_k, 3, 3, causal=True, softcap=1.0), (q, k, v))

    def f(q, k, v):
        return ts.attention_varlen(q, k, v, cu_q, cu_k, 3, 3, causal=True).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v))
    with pytest.raises(ValueError, match=r"attention_varlen_forward: argument 'cu_seqlens_q'.*non-decreasing"):
        ts.attention_varlen(q, k, v, torch.tensor([0, 6, 5], dtype=torch.int32), cu_k, 6, 3)
    with pytest.raises(ValueError, match=r"attention_varlen_forward: argument 'cu_seqlens_k'.*max_seqlen_k = 2"):
        ts.attention_varlen(q, k, v, cu_q, cu_k, 3, 2)


def test_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(2, 5, 4, 8), torch.empty(2, 7, 2, 8), torch.empty(2, 7, 2, 8)
        out, lse = ops.attention_forward(q, k, v, True, 0.0)
        assert out.shape == (2, 5, 4, 8) and lse.shape == (2, 4, 5) and lse.dtype == torch.float32
        dq, dk, dv = ops.attention_backward(out, q, k, v, out, lse, True, 0.0)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    torch.library.opcheck(ops.attention_forward, make(1, 3, 4, 2, 1, 4), {"causal": True, "scale": 0.5})
    torch.library.opcheck(ops.attention_forward, make(1, 3, 4, 2, 1, 4),
                          {"causal": False, "scale": 0.5, "window_left": 1, "window_right": 0, "softcap": 2.0})


def test_torch_compile_fullgraph():
    q, k, v = make(1, 6, 6, 4, 2, 8, requires_grad=True)

    def f(q, k, v):
        return (ts.attention(q, k, v, causal=True) * 2).sum() + ts.attention(
            q, k, v, causal=True, window_size=(2, -1), softcap=3.0).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref = torch.autograd.grad(f(q, k, v), (q, k, v))
    torch.testing.assert_close(loss, f(q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)


def test_argument_errors():
    q, k, v = make(2, 5, 7, 4, 2, 8)
    with pytest.raises(ValueError, match=r"attention_forward: argument 'q'"):
        ts.attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"attention_forward: argument 'k'"):
        ts.attention(q, k.float(), v)
    with pytest.raises(ValueError, match=r"attention_forward: argument 'k'"):
        ts.attention(q, torch.randn(2, 7, 3, 8, dtype=torch.float64), v)
    with pytest.raises(ValueError, match=r"attention_forward: argument 'v'"):
        ts.attention(q, k, v[:, :6])
    with pytest.raises(ValueError, match=r"attention_forward: argument 'options.window_right'"):
        ts.attention(q, k, v, causal=True, window_size=(4, 2))
    with pytest.raises(ValueError, match=r"attention_forward: argument 'options.softcap'"):
        ts.attention(q, k, v, softcap=-1.0)


# --- Hugging Face ---------------------------------------------------------------------------------


def _tiny_llama(impl, dtype):
    transformers = pytest.importorskip("transformers")
    ts.register_hf_attention()
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation=impl)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _loss_and_grads(model, ids, **kwargs):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_hf_llama_matches_sdpa(dtype, tol):
    """The issue's acceptance test: attn_implementation="trainscale" vs "sdpa", loss and gradients."""
    ref_model, model = _tiny_llama("sdpa", dtype), _tiny_llama("trainscale", dtype)
    assert model.config._attn_implementation == "trainscale"
    ids = torch.randint(0, 97, (2, 12))
    ref_loss, ref_grads = _loss_and_grads(ref_model, ids)
    calls = []
    from transformers import AttentionInterface

    registered = AttentionInterface._global_mapping["trainscale"]
    AttentionInterface._global_mapping["trainscale"] = lambda *a, **kw: calls.append(1) or registered(*a, **kw)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="trainscale attention")  # no sdpa fallback
            loss, grads = _loss_and_grads(model, ids)
    finally:
        AttentionInterface._global_mapping["trainscale"] = registered
    assert len(calls) == 2  # one call per layer
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=tol, atol=tol, msg=name)


def _tiny_gemma2(impl, dtype=torch.float64):
    transformers = pytest.importorskip("transformers")
    ts.register_hf_attention()
    cfg = transformers.Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=64, sliding_window=4, attn_logit_softcapping=5.0,
                                    query_pre_attn_scalar=16, attn_implementation=impl)
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(cfg).to(dtype)


def test_hf_gemma2_window_and_softcap_match_eager():
    """Gemma 2: a sliding-window layer and a global one, both with a logit softcap; the model's
    own eager attention is the reference."""
    ref_model, model = _tiny_gemma2("eager"), _tiny_gemma2("trainscale")
    assert "sliding_attention" in model.config.layer_types
    ids = torch.randint(0, 97, (2, 12))
    ref_loss, ref_grads = _loss_and_grads(ref_model, ids)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="trainscale attention")  # no fallback
        loss, grads = _loss_and_grads(model, ids)
    # Gemma 2's eager attention takes its softmax in float32 (then back to float64): 1e-7 relative.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


# A padding mask falls back: to sdpa (Llama), or, with a softcap, which sdpa lacks, to the model's
# own eager attention (Gemma 2), which adds its mask: the boolean mask transformers builds for us
# is handed over additive. (Gemma 2 in float32: its own eager float64 masks turn padding rows to
# NaN in its float32 softmax.)
PADDING_FALLBACKS = {"llama": (lambda impl: _tiny_llama(impl, torch.float64), "sdpa", "transformers' sdpa"),
                     "gemma2": (lambda impl: _tiny_gemma2(impl, torch.float32), "eager", "eager attention for options sdpa lacks")}


@pytest.mark.parametrize("family", sorted(PADDING_FALLBACKS))
def test_hf_padding_mask_falls_back(family):
    make, reference_impl, warning = PADDING_FALLBACKS[family]
    ref_model, model = make(reference_impl), make("trainscale")
    ids = torch.randint(0, 97, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    sys.modules["trainscale.attention"]._warned.clear()
    with pytest.warns(UserWarning, match=warning):
        logits = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, ref_model(input_ids=ids, attention_mask=mask).logits)


def test_hf_packed_sequences_run_varlen():
    """A padding-free batch (DataCollatorWithFlattening's FlashAttention kwargs): every sequence
    attended alone, as the same model on each sequence by itself gives it, gradients included."""
    model = _tiny_llama("trainscale", torch.float64)
    lens = [5, 7]
    ids = torch.randint(0, 97, (1, sum(lens)))
    position_ids = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    kwargs = dict(position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="trainscale attention")  # no sdpa fallback
        logits = model(input_ids=ids, **kwargs).logits
    alone = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in ((0, 5), (5, 12))], dim=1)
    torch.testing.assert_close(logits, alone, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(logits)
    grads = torch.autograd.grad((model(input_ids=ids, **kwargs).logits * weights).sum(), list(model.parameters()))
    ref = torch.autograd.grad((alone * weights).sum(), list(model.parameters()))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10)


def test_hf_plain_causal_mask_runs_trainscale():
    pytest.importorskip("transformers")
    q, k, v = (torch.randn(2, 4, 6, 8, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA 4/2, [B, H, S, D]

    class Module(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2

    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].expand(2, 1, 6, 6)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="trainscale attention")
        out, weights = ts.hf_attention_forward(Module(), q, k, v, mask, scaling=0.5)
    assert weights is None and out.shape == (2, 6, 4, 8)
    ref, _ = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True, 0.5)
    torch.testing.assert_close(out, ref)


# --- GPU ------------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_forward_matches_sdpa(d, causal):
    q, k, v = (t.cuda().bfloat16() for t in make(2, 200, 200, 8, 2, d, dtype=torch.float32))
    out = ts.attention(q, k, v, causal=causal)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), is_causal=causal,
        enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@cuda
@pytest.mark.parametrize("causal,window,softcap", WINDOW_MODES + [(False, (40, 17), 0.0), (True, (64, -1), 30.0)])
def test_cuda_window_and_softcap_match_reference(causal, window, softcap):
    q, k, v = make(2, 300, 300, 8, 2, 128, dtype=torch.float32, requires_grad=True)
    dout = torch.randn(2, 300, 8, 128)
    ref_out = reference(q, k, v, causal, None, window, softcap)[0]
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    qc, kc, vc = (t.detach().cuda().bfloat16().requires_grad_() for t in (q, k, v))
    out = ts.attention(qc, kc, vc, causal=causal, window_size=window, softcap=softcap)
    grads = torch.autograd.grad(out, (qc, kc, vc), dout.cuda().bfloat16())
    torch.testing.assert_close(out.float().cpu(), ref_out.detach(), rtol=2e-2, atol=2e-2)
    # Absolute tolerance on the scale of the largest gradient: with window (0, 0) every query sees
    # one key, so dQ and dK are exactly 0 and only rounding remains.
    scale = max(r.abs().max().item() for r in ref_grads)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float().cpu(), r, rtol=3e-2, atol=3e-2 * scale)


@cuda
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_varlen_matches_each_sequence(causal):
    """Packed sequences on CUDA (empty ones included) against ts.attention on each sequence alone."""
    q_lens, k_lens = [70, 0, 129, 1, 0], [70, 5, 129, 0, 0]
    q, k, v, cu_q, cu_k = _packed(q_lens, k_lens, hq=8, hkv=2, d=64, dtype=torch.float32)
    q, k, v = (t.detach().cuda().bfloat16().requires_grad_() for t in (q, k, v))
    cu_q, cu_k = cu_q.cuda(), cu_k.cuda()
    out, lse = ts.attention_varlen_with_lse(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(q_lens)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if qs.stop == qs.start:  # keys no query sees: no gradient
            assert grads[1][ks].eq(0).all() and grads[2][ks].eq(0).all()
            continue
        qb, kb, vb = (t.detach()[None, s].clone().requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks)))
        o, l_ = ts.attention_with_lse(qb, kb, vb, causal=causal)
        torch.testing.assert_close(out[qs], o[0], rtol=0, atol=0)  # the same kernel on the same rows
        torch.testing.assert_close(lse[:, qs], l_[0], rtol=0, atol=0)
        g = torch.autograd.grad(o, (qb, kb, vb), dout[None, qs])
        # dQ's accumulation order may differ between runs (not deterministic by default).
        for got, ref in zip((grads[0][qs], grads[1][ks], grads[2][ks]), g):
            scale = ref.abs().max().item() if ref.numel() else 0.0  # a query with no keys has none
            torch.testing.assert_close(got, ref[0], rtol=1e-2, atol=1e-2 * max(scale, 1e-3))


@cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_backward_matches_sdpa(d, causal):
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in make(2, 200, 200, 8, 2, d, dtype=torch.float32))
    dout = torch.randn(2, 200, 8, d, device="cuda", dtype=torch.bfloat16)
    grads = torch.autograd.grad(ts.attention(q, k, v, causal=causal), (q, k, v), dout)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q32.transpose(1, 2), k32.transpose(1, 2), v32.transpose(1, 2), is_causal=causal, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref.transpose(1, 2), (q32, k32, v32), dout.float())
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r, rtol=3e-2, atol=3e-2 * r.abs().max().item())
