"""Forward values vs plain PyTorch, gradcheck in fp64 on the CPU reference, modules vs torch.nn,
torch.compile, error messages. GPU variants at the end (skipped without a GPU)."""
import pytest
import torch
import torch.nn.functional as tF
from torch.autograd import gradcheck

import trainscale as ts
from trainscale.bench.measure import saved_bytes
from conftest import cuda

ts_ops = torch.ops.trainscale

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def close(out, ref, dtype):
    assert rel_err(out, ref) <= TOL[dtype], rel_err(out, ref)


# ---- plain-torch references ----------------------------------------------------------------

def ref_rms(x, w=None, eps=1e-6, off=0.0):
    xf = x.double()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * (w.double() + off)
    return y


def ref_rope(x, cos, sin, interleaved, rotary_dim=None):
    d = x.shape[-1] if rotary_dim is None else rotary_dim
    S = x.shape[1]
    c = cos[:S].double()[None, :, None, :]
    s = sin[:S].double()[None, :, None, :]
    xr, rest = x[..., :d].double(), x[..., d:].double()
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        o = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2)
    else:
        x0, x1 = xr[..., : d // 2], xr[..., d // 2:]
        o = torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], -1)
    return torch.cat([o, rest], -1)


# ---- forward values vs torch (CPU, fp32 / bf16) ----------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_values(dtype):
    x = torch.randn(6, 10, 64).to(dtype)
    w = (torch.randn(64) * 0.1 + 1).to(dtype)
    b = torch.randn(64).to(dtype)
    close(ts.rms_norm(x, w), ref_rms(x, w), dtype)
    close(ts.rms_norm(x, w, weight_offset=1.0), ref_rms(x, w, off=1.0), dtype)
    close(ts.layer_norm(x, w, b), tF.layer_norm(x.double(), (64,), w.double(), b.double(), 1e-5),
          dtype)
    close(ts.gelu(x), tF.gelu(x.double()), dtype)
    close(ts.gelu(x, "tanh"), tF.gelu(x.double(), approximate="tanh"), dtype)
    close(ts.silu(x), tF.silu(x.double()), dtype)
    a, g = torch.randn(2, 2, 3, 64).to(dtype).unbind(0)
    close(ts.swiglu(a, g), tF.silu(a.double()) * g.double(), dtype)
    ab = torch.cat([a, g], -1)
    close(ts.swiglu(ab), tF.silu(a.double()) * g.double(), dtype)
    for approximate in ("none", "tanh"):
        want = tF.gelu(a.double(), approximate=approximate) * g.double()
        close(ts.geglu(a, g, approximate), want, dtype)
        close(ts.geglu(ab, approximate=approximate), want, dtype)
        close(ts.GeGLU(approximate)(a, g), want, dtype)
    r = torch.randn_like(x)
    x0, r0 = x.clone(), r.clone()
    out, res = ts.fused_add_rms_norm(x, r, w)
    assert torch.equal(x, x0) and torch.equal(r, r0)  # out of place
    s = (x.float() + r.float()).to(dtype)
    close(res, s, dtype)
    close(out, ref_rms(s, w), dtype)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_forward(interleaved):
    q, k = torch.randn(2, 5, 4, 32), torch.randn(2, 5, 2, 32)
    cos, sin = ts.rope_tables(16, 32)
    qo, ko = ts.apply_rotary(q, k, cos, sin, interleaved=interleaved)
    close(qo, ref_rope(q, cos, sin, interleaved), torch.float32)
    close(ko, ref_rope(k, cos, sin, interleaved), torch.float32)
    # angles from theta, partial rotary dim, position offsets
    qo = ts.apply_rotary(q, rotary_dim=16)
    c16, s16 = ts.rope_tables(16, 16)
    close(qo, ref_rope(q, c16, s16, False, 16), torch.float32)
    off = torch.tensor([0, 3])
    qo = ts.apply_rotary(q, cos=cos, sin=sin, position_offsets=off)
    close(qo[1], ref_rope(q[1:], cos[3:], sin[3:], False)[0], torch.float32)


def test_fused_add_rms_norm_in_place():
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    x0, r0 = x.clone(), r.clone()
    xo, ro = ts.fused_add_rms_norm_(x, r, w)
    assert xo is x and ro is r
    close(r, x0 + r0, torch.float32)
    close(x, ref_rms(x0 + r0, w), torch.float32)


@pytest.mark.parametrize("granularity", ["row", "1x128"])
@pytest.mark.parametrize("fdtype,fmax", [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)])
def test_fp8_quantize(granularity, fdtype, fmax):
    x = torch.randn(8, 300) * 3
    q, s = ts.fp8_quantize(x, fdtype, granularity)
    assert q.dtype == fdtype and s.dtype == torch.float32
    if granularity == "row":
        assert s.shape == (8,)
        amax = x.abs().amax(1)
        s_full = s[:, None].expand(8, 300)
    else:
        assert s.shape == (8, 3)
        amax = tF.pad(x.abs(), (0, 84)).view(8, 3, 128).amax(-1)
        s_full = s.repeat_interleave(128, 1)[:, :300]
    torch.testing.assert_close(s, amax / fmax, rtol=0, atol=0)
    # q is exactly saturate_rn(x / s) in float32
    torch.testing.assert_close(q.float(), (x / s_full).to(fdtype).float(), rtol=0, atol=0)
    _, sm = ts.fp8_quantize(x, fdtype, "1x128", scales_m_major=True) if granularity == "1x128" \
        else (None, None)
    if sm is not None:
        assert sm.shape == (3, 8)
        torch.testing.assert_close(sm, s.t().contiguous())


# ---- gradcheck, fp64, CPU reference ----------------------------------------------------------

def d(*shape, grad=True):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=grad)


def test_gradcheck_norms():
    x, w, b = d(3, 8), d(8), d(8)
    assert gradcheck(lambda x, w: ts.rms_norm(x, w, 1e-6, 0.5), (x, w))
    assert gradcheck(lambda x: ts.rms_norm(x), (x,))
    assert gradcheck(lambda x, w, b: ts.layer_norm(x, w, b), (x, w, b))
    assert gradcheck(lambda x: ts.layer_norm(x), (x,))
    r = d(3, 8)
    assert gradcheck(lambda x, r, w: ts.fused_add_rms_norm(x, r, w), (x, r, w))
    assert gradcheck(lambda x, r: ts.fused_add_rms_norm(x, r)[0], (x, r))


def _layouts():
    """Tensors whose rows the kernels do not take as they are: heads moved ahead of the tokens
    (Gemma 3 normalizes q and k so), a transposed last dim, an expanded row."""
    return {"heads first": d(2, 5, 3, 8).transpose(1, 2), "last dim strided": d(2, 5, 8, 3).transpose(2, 3),
            "expanded": d(1, 8).expand(4, 8)}


def test_functions_take_any_layout():
    # The functions copy such inputs into rows: values and gradients as for the contiguous tensor.
    w, b = d(8), d(8)
    fns = {
        "rms_norm": lambda x: ts.rms_norm(x, w, 1e-6, 1.0), "layer_norm": lambda x: ts.layer_norm(x, w, b),
        "gelu": lambda x: ts.gelu(x, "tanh"), "silu": ts.silu, "softmax": ts.softmax,
        "swiglu": lambda x: ts.swiglu(x, x * 2), "swiglu packed": ts.swiglu,
        "geglu": lambda x: ts.geglu(x, x * 2), "geglu packed": lambda x: ts.geglu(x, approximate="tanh"),
        "cross_entropy": lambda x: ts.cross_entropy(x, torch.zeros(x.shape[:-1], dtype=torch.long)),
    }
    for layout, x in _layouts().items():
        for name, f in fns.items():
            y = f(x)
            xc = x.detach().contiguous().requires_grad_()
            torch.testing.assert_close(y, f(xc), msg=f"{name}, {layout}")
            g = torch.randn_like(y)
            gx, = torch.autograd.grad(y, x, g)
            gxc, = torch.autograd.grad(f(xc), xc, g)
            torch.testing.assert_close(gx, gxc, msg=f"{name}, {layout}")
        if layout != "expanded":  # gradcheck takes no overlapping input
            assert gradcheck(lambda x: ts.rms_norm(x, w), (x,)), layout
    x = _layouts()["last dim strided"].float().detach().reshape(-1, 3, 8)[:, 0]  # [10, 8], rows 24 apart
    q, s = ts.fp8_quantize(x.t().contiguous().t())
    q_ref, s_ref = ts.fp8_quantize(x.contiguous())
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_gradcheck_activations():
    x, a, b = d(3, 7), d(2, 5), d(2, 5)
    assert gradcheck(ts.gelu, (x,))
    assert gradcheck(lambda x: ts.gelu(x, "tanh"), (x,))
    assert gradcheck(ts.silu, (x,))
    assert gradcheck(ts.swiglu, (a, b))
    assert gradcheck(lambda ab: ts.swiglu(ab), (d(2, 3, 10),))
    for approximate in ("none", "tanh"):
        assert gradcheck(lambda a, b: ts.geglu(a, b, approximate), (a, b))
        assert gradcheck(lambda ab: ts.geglu(ab, approximate=approximate), (d(2, 3, 10),))


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_rope(interleaved):
    q, k = d(2, 3, 2, 8), d(2, 3, 1, 8)
    cos, sin = ts.rope_tables(8, 8, dtype=torch.float64)
    off = torch.tensor([0, 2])
    assert gradcheck(lambda q, k: ts.apply_rotary(q, k, cos, sin, off, interleaved), (q, k))
    assert gradcheck(lambda q: ts.apply_rotary(q, rotary_dim=4, interleaved=interleaved), (q,))


def test_opcheck():
    # The dispatcher-level checks (schema, fake impl vs real, autograd registration).
    from torch.library import opcheck
    x, w = torch.randn(4, 16), torch.randn(16)
    opcheck(torch.ops.trainscale.rmsnorm_forward, (x, w, 1e-6, 0.0))
    opcheck(torch.ops.trainscale.layernorm_forward, (x, w, w, 1e-5))
    opcheck(torch.ops.trainscale.fused_add_rmsnorm_forward, (x.clone(), x.clone(), w, 1e-6, 0.0))
    opcheck(torch.ops.trainscale.fused_add_rmsnorm_forward_out_of_place, (x, x * 0.5, w, 1e-6, 0.0))
    opcheck(torch.ops.trainscale.swiglu_forward_packed, (x,))
    opcheck(torch.ops.trainscale.geglu_forward, (x, x.clone(), "tanh"))
    opcheck(torch.ops.trainscale.geglu_forward_packed, (x, "none"))
    opcheck(torch.ops.trainscale.gelu_forward, (x, "tanh"))
    opcheck(torch.ops.trainscale.rope_forward, (torch.randn(1, 3, 2, 8), None, None, None, None,
                                            False, -1, 10000.0))
    opcheck(torch.ops.trainscale.fp8_quantize, (x, torch.float8_e4m3fn, "1x128", False, False),
            test_utils=("test_schema", "test_faketensor"))


# ---- modules vs torch.nn ---------------------------------------------------------------------

class TorchRMSNorm(torch.nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _compare_modules(ours, theirs, *inputs):
    with torch.no_grad():
        for p, q in zip(ours.parameters(), theirs.parameters()):
            p.copy_(torch.randn_like(p))
            q.copy_(p)
    xs1 = [t.clone().requires_grad_() for t in inputs]
    xs2 = [t.clone().requires_grad_() for t in inputs]
    y1, y2 = ours(*xs1), theirs(*xs2)
    torch.testing.assert_close(y1, y2, rtol=1e-4, atol=1e-4)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    for a, b in zip(xs1 + list(ours.parameters()), xs2 + list(theirs.parameters())):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)


def test_modules_vs_torch():
    x = torch.randn(4, 5, 32)
    _compare_modules(ts.LayerNorm(32), torch.nn.LayerNorm(32), x)
    _compare_modules(ts.RMSNorm(32), TorchRMSNorm(32), x)
    mlp = ts.SwiGLUMLP(32, 48)
    ref = ts.SwiGLUMLP(32, 48)
    ref.forward = lambda x: ref.down_proj(tF.silu(ref.gate_proj(x)) * ref.up_proj(x))
    _compare_modules(mlp, ref, x)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_swiglu_mlp_matches_the_unfused_chain(bias):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 32, requires_grad=True)
    fused = ts.SwiGLUMLP(32, 48, bias=bias, fused=True)
    plain = ts.SwiGLUMLP(32, 48, bias=bias)
    plain.load_state_dict(fused.state_dict())
    x2 = x.detach().clone().requires_grad_()
    y1, y2 = fused(x), plain(x2)
    assert torch.equal(y1, y2)  # the same products and kernel
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    for (name, p1), p2 in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-5, atol=1e-5, msg=name)
    # Frozen weights: only x's gradient is computed.
    x.grad = None
    for p in fused.parameters():
        p.requires_grad_(False)
        p.grad = None
    fused(x).sum().backward()
    assert x.grad is not None and all(p.grad is None for p in fused.parameters())


def test_fused_swiglu_mlp_calls_wrapped_projections():
    # A projection wrapped after patching (as a LoRA adapter wraps it: base layer plus a low-rank
    # delta) is called, so its delta counts; the fused path would read the base weight alone.
    class WithDelta(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base, self.delta = base, torch.nn.Linear(base.in_features, base.out_features, bias=False)

        def forward(self, x):
            return self.base(x) + self.delta(x)

    torch.manual_seed(0)
    mlp = ts.SwiGLUMLP(32, 48, fused=True)
    x = torch.randn(3, 7, 32)
    plain = mlp.down_proj(ts.swiglu(mlp.gate_proj(x), mlp.up_proj(x)))
    torch.testing.assert_close(mlp(x), plain)
    mlp.gate_proj = WithDelta(mlp.gate_proj)
    wrapped = mlp.down_proj(ts.swiglu(mlp.gate_proj(x), mlp.up_proj(x)))
    assert not torch.allclose(wrapped, plain)
    torch.testing.assert_close(mlp(x), wrapped)


def test_fused_swiglu_mlp_under_torch_compile():
    """The in-place backward through torch.compile's functionalization: the same gradients."""
    torch.manual_seed(0)
    fused, plain = ts.SwiGLUMLP(32, 48, fused=True), ts.SwiGLUMLP(32, 48)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(4, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.compile(fused)(x).sum().backward()
    plain(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    for p1, p2 in zip(fused.parameters(), plain.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-5, atol=1e-5)


def _saved_activation_bytes(module, x):
    """Bytes autograd keeps for module(x) beyond x and the parameters (the bench's count)."""
    return saved_bytes(lambda x, *params: module(x), (x, *module.parameters()))


def test_fused_swiglu_mlp_keeps_no_activation_product():
    x = torch.randn(20, 32, requires_grad=True)
    plain, fused = ts.SwiGLUMLP(32, 48), ts.SwiGLUMLP(32, 48, fused=True)
    # Unfused: gate, up and their product h; fused: gate and up.
    assert _saved_activation_bytes(plain, x) == 20 * 3 * 48 * 4
    assert _saved_activation_bytes(fused, x) == 20 * 2 * 48 * 4


class _NormThen(torch.nn.Module):
    """RMSNorm, then the fused MLP and a shared-input projection of its output."""

    def __init__(self, rebuildable):
        super().__init__()
        self.norm = ts.RMSNorm(32, rebuildable_output=rebuildable)
        self.mlp = ts.SwiGLUMLP(32, 48, fused=True)
        self.proj = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x, scale_in_place=False):
        y = self.norm(x)
        if scale_in_place:
            y.mul_(2.0)  # after the tag: the consumers must keep this y, not rebuild the norm's
        return self.mlp(y).sum(-1) + ts.linear.shared_input_linear(y, [self.proj.weight])[0].sum(-1)


@pytest.mark.parametrize("scale_in_place", [False, True])
def test_rebuildable_norm_output_same_gradients_less_kept(scale_in_place):
    torch.manual_seed(0)
    plain, rebuilt = _NormThen(False), _NormThen(True)
    with torch.no_grad():
        for p in plain.parameters():
            p.uniform_(-1, 1)
    rebuilt.load_state_dict(plain.state_dict())
    x = torch.randn(20, 32, requires_grad=True)
    grads = []
    for model in (plain, rebuilt):
        out = model(x, scale_in_place)
        grads.append(torch.autograd.grad(out.sum(), [x, *model.parameters()]))
    for g, ref in zip(grads[1], grads[0]):
        assert torch.equal(g, ref)  # the rebuilt output has the forward's bits
    kept = [saved_bytes(lambda x, *params, m=m: m(x, scale_in_place), (x, *m.parameters()))
            for m in (plain, rebuilt)]
    # Without a change in place the norm's output [20, 32] float32 is no longer kept.
    assert kept[0] - kept[1] == (0 if scale_in_place else 20 * 32 * 4)


@cuda
@pytest.mark.parametrize("use_rmsnorm", [True, "auto"])
def test_cuda_rebuildable_norm_output_same_gradients(monkeypatch, use_rmsnorm):
    # On the GPU in bf16, with the norm chosen per shape too: the rebuilt output must come from
    # the implementation the forward used (the same bits).
    monkeypatch.setattr(ts.config, "use_rmsnorm", use_rmsnorm)
    torch.manual_seed(0)
    plain, rebuilt = _NormThen(False).cuda().bfloat16(), _NormThen(True).cuda().bfloat16()
    rebuilt.load_state_dict(plain.state_dict())
    x = torch.randn(300, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grads = [torch.autograd.grad(m(x).float().sum(), [x, *m.parameters()]) for m in (plain, rebuilt)]
    for g, ref in zip(grads[1], grads[0]):
        assert torch.equal(g, ref)


def test_swiglu_backward_recompute_is_backward_plus_forward():
    a, b, dy = torch.randn(5, 37), torch.randn(5, 37), torch.randn(5, 37)
    da, db = ts_ops.swiglu_backward(dy, a, b)
    y_forward = ts_ops.swiglu_forward(a, b)
    y = ts_ops.swiglu_backward_recompute_(dy, a, b)  # a, b <- da, db
    assert torch.equal(y, y_forward) and torch.equal(a, da) and torch.equal(b, db)
    with pytest.raises(ValueError, match=r"swiglu_backward_recompute: argument 'b'"):
        ts_ops.swiglu_backward_recompute_(dy, a, b[:, :36])


def test_fused_swiglu_mlp_second_backward_raises():
    mlp = ts.SwiGLUMLP(16, 24, fused=True)
    y = mlp(torch.randn(3, 16, requires_grad=True)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_fused_add_module_and_rotary_module():
    m = ts.FusedAddRMSNorm(16)
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    out, res = m(x, r)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(out, TorchRMSNorm(16)(x + r))
    rope = ts.RotaryEmbedding(8, max_positions=4)
    q = torch.randn(1, 6, 2, 8)  # longer than the cache: grows
    out = rope(q)
    assert rope.cos.shape[0] >= 6
    c, s = ts.rope_tables(6, 8)
    close(out, ref_rope(q, c, s, False), torch.float32)
    assert ts.SwiGLU()(torch.randn(2, 8)).shape == (2, 4)


# ---- torch.compile ---------------------------------------------------------------------------

def test_compile_fullgraph():
    def f(x, w, ab):  # a transposed ab: contiguous_rows traced too
        return ts.rms_norm(x, w) * ts.swiglu(ab) + ts.geglu(ab.t().contiguous().t(), approximate="tanh")

    x, w, ab = torch.randn(4, 16), torch.randn(16), torch.randn(4, 32)
    expected = f(x, w, ab)
    try:
        cf = torch.compile(f, fullgraph=True)
        out = cf(x, w, ab)
    except Exception as e:  # inductor needs a working C++ toolchain for its CPU backend
        if "graph break" in str(e).lower() or "Unsupported" in type(e).__name__:
            raise
        pytest.skip(f"inductor's CPU backend cannot compile here: {type(e).__name__}: {e}"[:300])
    torch.testing.assert_close(out, expected)
    # and through autograd (the fake impls and autograd formulas are traced)
    xg = x.clone().requires_grad_()
    cf(xg, w, ab).sum().backward()
    xr = x.clone().requires_grad_()
    f(xr, w, ab).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)


def test_compile_fused_add_and_rope_with_backward():
    def f(x, r, w):
        o, r2 = ts.fused_add_rms_norm(x, r, w)
        return ts.apply_rotary(o.view(1, 4, 2, 8)).sum() + r2.sum()

    x, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        xs = [t.clone().requires_grad_() for t in (x, r, w)]
        try:
            fn(*xs).backward()  # upstream gradients of a sum are expanded (stride 0)
        except Exception as e:
            if fn is f or "graph break" in str(e).lower() or "Unsupported" in type(e).__name__:
                raise
            pytest.skip(f"inductor's CPU backend cannot compile here: {type(e).__name__}"[:300])
        grads.append([t.grad for t in xs])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


# ---- errors ----------------------------------------------------------------------------------

def test_errors_name_op_and_argument():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"rmsnorm_forward.*argument 'weight'"):
        ts.rms_norm(x, torch.randn(15))  # shape
    with pytest.raises(ValueError, match=r"rmsnorm_forward.*argument 'x'"):
        ts.rms_norm(x.to(torch.int32))  # dtype
    with pytest.raises(ValueError, match=r"layernorm_forward.*argument 'bias'"):
        ts.layer_norm(x, torch.randn(16), torch.randn(16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"swiglu_forward.*argument 'b'"):
        ts.swiglu(x, torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"gelu.*argument 'approximate'"):
        ts.gelu(x, "fast")
    with pytest.raises(ValueError, match=r"geglu_forward: argument 'approximate': expected 'none' or 'tanh', got 'fast'"):
        ts.geglu(x, x, "fast")
    with pytest.raises(ValueError, match=r"geglu_forward_packed: argument 'ab': expected an even last dim"):
        ts.geglu(torch.randn(4, 15))
    with pytest.raises(ValueError, match=r"geglu_forward.*argument 'b'"):
        ts.geglu(x, torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"rope_forward.*argument 'q'"):
        ts.apply_rotary(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"fp8_quantize.*argument 'dtype'"):
        ts.fp8_quantize(x, torch.float16)
    with pytest.raises(ValueError, match=r"fp8_quantize.*argument 'x'"):
        ts.fp8_quantize(torch.randn(2, 3, 4))
    # Dtypes no op takes: named after the argument given (not an output allocated like it), with
    # torch's name for the dtype (uint8 is not taken for a one-byte float).
    for dtype in (torch.bool, torch.uint8, torch.int16):
        name = str(dtype).removeprefix("torch.")
        with pytest.raises(ValueError, match=rf"rmsnorm_forward: argument 'x': expected a dtype in .*, got {name}$"):
            ts.rms_norm(x.to(dtype))
    with pytest.raises(ValueError, match=r"embedding_forward: argument 'ids': .*got int16$"):
        ts.embedding(torch.tensor([1, 2], dtype=torch.int16), x)


def _empty_batch_cases(device):
    """(name, function of the inputs, inputs): each op over no rows (no tokens, no queries)."""
    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, dtype=dtype, device=device).requires_grad_()
    none = torch.zeros(0, dtype=torch.long, device=device)
    return [
        ("rms_norm", lambda x, w: ts.rms_norm(x, w), (t(0, 64), t(64))),
        ("layer_norm", lambda x, w, b: ts.layer_norm(x, w, b), (t(0, 64), t(64), t(64))),
        ("fused_add_rms_norm", lambda x, r, w: ts.fused_add_rms_norm(x, r, w)[0], (t(0, 64), t(0, 64), t(64))),
        ("swiglu", lambda a, b: ts.swiglu(a, b), (t(0, 32), t(0, 32))),
        ("geglu", lambda ab: ts.geglu(ab, approximate="tanh"), (t(0, 64),)),
        ("softmax", lambda x: ts.softmax(x), (t(0, 32),)),
        ("cross_entropy", lambda x: ts.cross_entropy(x, none, reduction="sum"), (t(0, 32),)),
        ("linear_cross_entropy", lambda h, w: ts.linear_cross_entropy(h, w, none, reduction="sum"),
         (t(0, 64), t(32, 64))),
        ("embedding", lambda w: ts.embedding(none, w), (t(10, 64),)),
        ("attention", lambda q, k, v: ts.attention(q, k, v, causal=True),
         (t(1, 0, 2, 64), t(1, 8, 2, 64), t(1, 8, 2, 64))),
    ]


def check_empty_batches(device):
    # out.sum().backward() hands each op an empty gradient expanded from a scalar (strides 0),
    # which has no layout to check; gradients of parameters over no rows are zero.
    for name, fn, inputs in _empty_batch_cases(device):
        out = fn(*inputs)
        out.float().sum().backward()
        for i, x in enumerate(inputs):
            assert x.grad is not None and x.grad.shape == x.shape, (name, i)
            assert torch.count_nonzero(x.grad) == 0, (name, i)


def test_empty_batches_forward_and_backward():
    check_empty_batches("cpu")


# ---- GPU (skipped without a device) ----------------------------------------------------------

@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(dtype):
    x = torch.randn(64, 256).to(dtype)
    w = torch.randn(256).to(dtype)
    b = torch.randn(256).to(dtype)
    dev = lambda t: t.cuda()  # noqa: E731
    for fn, args in [
        (lambda x, w, b: ts.rms_norm(x, w), (x, w, b)),
        (lambda x, w, b: ts.layer_norm(x, w, b), (x, w, b)),
        (lambda x, w, b: ts.gelu(x), (x, w, b)),
        (lambda x, w, b: ts.silu(x), (x, w, b)),
        (lambda x, w, b: ts.swiglu(x), (x, w, b)),
        (lambda x, w, b: ts.geglu(x, approximate="tanh"), (x, w, b)),
        (lambda x, w, b: ts.geglu(x[:, :128], x[:, 128:]), (x, w, b)),
        (lambda x, w, b: ts.fused_add_rms_norm(x, x * 0.5, w)[0], (x, w, b)),
        (lambda x, w, b: ts.apply_rotary(x.view(2, 32, 2, 128)), (x, w, b)),
    ]:
        cpu_args = [a.clone().requires_grad_() for a in args]
        gpu_args = [dev(a).requires_grad_() for a in args]
        yc, yg = fn(*cpu_args), fn(*gpu_args)
        close(yg.cpu(), yc, dtype)
        g = torch.randn_like(yc)
        yc.backward(g)
        yg.backward(g.cuda())
        for a, b_ in zip(cpu_args, gpu_args):
            if a.grad is not None:
                close(b_.grad.cpu(), a.grad, dtype)
    q, s = ts.fp8_quantize(x.float().cuda(), granularity="1x128")
    qc, sc = ts.fp8_quantize(x.float(), granularity="1x128")
    assert torch.equal(q.cpu().view(torch.uint8), qc.view(torch.uint8))
    assert torch.equal(s.cpu(), sc)


@cuda
def test_cuda_stream_and_device_errors():
    x = torch.randn(8, 64, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = ts.rms_norm(x)
    s.synchronize()
    close(y.cpu(), ref_rms(x.cpu()), torch.float32)
    with pytest.raises((ValueError, RuntimeError), match=r"rmsnorm_forward.*argument 'weight'"):
        ts.rms_norm(x, torch.ones(64))  # weight on the CPU


@cuda
def test_cuda_compile():
    x, w, ab = (torch.randn(4, 16, device="cuda"), torch.randn(16, device="cuda"),
                torch.randn(4, 32, device="cuda"))
    f = lambda x, w, ab: ts.rms_norm(x, w) * ts.swiglu(ab)  # noqa: E731
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x, w, ab), f(x, w, ab))


@cuda
def test_cuda_fused_swiglu_mlp():
    """bf16 on the GPU: the same forward bits as the unfused chain, gradients within bf16
    rounding of it, a third less kept for the backward, and torch.compile through it."""
    torch.manual_seed(0)
    fused = ts.SwiGLUMLP(256, 688, device="cuda", dtype=torch.bfloat16, fused=True)
    plain = ts.SwiGLUMLP(256, 688, device="cuda", dtype=torch.bfloat16)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(2, 100, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y1, y2 = fused(x), plain(x2)
    assert torch.equal(y1, y2)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=2e-2, atol=2e-2)
    for p1, p2 in zip(fused.parameters(), plain.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=2e-2, atol=2e-2)
    tf_bytes = 200 * 688 * 2  # one [T, F] activation
    assert _saved_activation_bytes(fused, x) == 2 * tf_bytes
    assert _saved_activation_bytes(plain, x) == 3 * tf_bytes
    y3 = torch.compile(fused)(x)
    torch.testing.assert_close(y3, y1, rtol=1e-2, atol=1e-2)


@cuda
def test_cuda_empty_batches_forward_and_backward():
    check_empty_batches("cuda")
