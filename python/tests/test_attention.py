"""trainscale.attention (torch.ops.trainscale.attention_forward / attention_backward) against a
float64 math reference on the CPU, its gradients (gradcheck), fake-tensor and torch.compile
tracing, argument errors, and the Hugging Face attention function: a tiny Llama with
attn_implementation="trainscale" matches "sdpa" in loss and gradients. GPU: the CUDA forward
against PyTorch SDPA in bf16."""
import sys
import warnings

import pytest
import torch

import trainscale as ts

from conftest import cuda

ops = torch.ops.trainscale


def reference(q, k, v, causal=False, scale=None):
    """Math attention in BSHD, GQA by repeating kv heads, bottom-right causal mask; (out, lse)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    rep = hq // hkv
    kk = k.repeat_interleave(rep, dim=2).transpose(1, 2)
    vv = v.repeat_interleave(rep, dim=2).transpose(1, 2)
    s = (q.transpose(1, 2) @ kk.transpose(-1, -2)) * scale  # [B, H, Sq, Sk]
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
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


def test_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(2, 5, 4, 8), torch.empty(2, 7, 2, 8), torch.empty(2, 7, 2, 8)
        out, lse = ops.attention_forward(q, k, v, True, 0.0)
        assert out.shape == (2, 5, 4, 8) and lse.shape == (2, 4, 5) and lse.dtype == torch.float32
        dq, dk, dv = ops.attention_backward(out, q, k, v, out, lse, True, 0.0)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    torch.library.opcheck(ops.attention_forward, make(1, 3, 4, 2, 1, 4), {"causal": True, "scale": 0.5})


def test_torch_compile_fullgraph():
    q, k, v = make(1, 6, 6, 4, 2, 8, requires_grad=True)

    def f(q, k, v):
        return (ts.attention(q, k, v, causal=True) * 2).sum()

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


def test_hf_padding_mask_falls_back_to_sdpa():
    ref_model, model = _tiny_llama("sdpa", torch.float64), _tiny_llama("trainscale", torch.float64)
    ids = torch.randint(0, 97, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    sys.modules["trainscale.attention"]._warned.clear()
    with pytest.warns(UserWarning, match="falling back to transformers' sdpa"):
        logits = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, ref_model(input_ids=ids, attention_mask=mask).logits)


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
def test_cuda_backward_raises():
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in make(1, 64, 64, 2, 2, 64, dtype=torch.float32))
    with pytest.raises((RuntimeError, ValueError), match="attention_backward"):
        ts.attention(q, k, v, causal=True).sum().backward()
