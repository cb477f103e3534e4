"""trainscale.linear_cross_entropy: loss and gradients against plain PyTorch in fp64 (F.linear,
then test_softmax_ce's cross-entropy) for every option and reduction, the per-token upstream
gradient of 'none', all targets ignored, NaN in hidden, gradcheck, the dispatcher checks,
torch.compile(fullgraph=True) with backward, LinearCrossEntropyLoss, the config switch, argument
errors, and the CUDA path against the CPU reference (skipped without a GPU)."""
import pytest
import torch
import torch.nn.functional as tF
from torch.autograd import gradcheck

import trainscale as ts
from conftest import cuda
from test_softmax_ce import OPTIONS, ref_ce

ops = torch.ops.trainscale


def ref_lce(hidden, weight, target, bias=None, reduction="mean", **options):
    """The loss of plain PyTorch on the full logits, in float64."""
    b = None if bias is None else bias.double()
    logits = tF.linear(hidden.double(), weight.double(), b)
    v = logits.shape[-1]
    loss = ref_ce(logits.reshape(-1, v), target.reshape(-1), reduction=reduction, **options)
    return loss.reshape(target.shape) if reduction == "none" else loss


def problem(shape=(2, 4), h=5, v=11, bias=True, dtype=torch.float64, ignore_index=-100):
    hidden = torch.randn(*shape, h, dtype=dtype) * 2
    weight = torch.randn(v, h, dtype=dtype)
    b = torch.randn(v, dtype=dtype) if bias else None
    target = torch.randint(0, v, shape)
    target.view(-1)[1] = ignore_index
    return hidden, weight, b, target


def grads_of(fn, tensors, upstream):
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(upstream)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients(options, reduction, bias):
    # Odd sizes; hidden [2, 4, H] is flattened to 8 tokens.
    hidden, weight, b, target = problem(bias=bias, ignore_index=options.get("ignore_index", -100))
    tensors = [hidden, weight] + ([b] if bias else [])

    def ours(h, w, *bb):
        return ts.linear_cross_entropy(h, w, target, *bb, reduction=reduction, **options)

    def ref(h, w, *bb):
        return ref_lce(h, w, target, *bb, reduction=reduction, **options)

    upstream = torch.randn(target.shape if reduction == "none" else (), dtype=torch.float64)
    loss, grads = grads_of(ours, tensors, upstream)
    ref_loss, ref_grads = grads_of(ref, tensors, upstream)
    torch.testing.assert_close(loss, ref_loss)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradcheck(reduction):
    hidden, weight, b, target = problem(shape=(5,), h=3, v=7)

    def f(h, w, bb):
        return ts.linear_cross_entropy(h, w, target, bb, reduction=reduction, label_smoothing=0.1, z_loss=1e-2,
                                       softcap=4.0)
    assert gradcheck(f, tuple(t.requires_grad_() for t in (hidden, weight, b)))


def test_per_token_upstream_gradient_with_ignored_tokens():
    """'none' with ignore_index and a weighted sum of the tokens: the backward runs the op with the
    per-token gradient, so ignored tokens contribute nothing and the weights are exact."""
    hidden, weight, _, target = problem(shape=(9,), h=4, v=6)
    target[::3] = -100
    upstream = torch.rand(9, dtype=torch.float64) * 3
    loss, (gh, gw) = grads_of(lambda h, w: ts.linear_cross_entropy(h, w, target, reduction="none"),
                              [hidden, weight], upstream)
    ref_loss, (rh, rw) = grads_of(lambda h, w: ref_lce(h, w, target, reduction="none"), [hidden, weight], upstream)
    torch.testing.assert_close(loss, ref_loss)
    assert (loss[::3] == 0).all() and (gh[::3] == 0).all()
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gw, rw)


def test_inference_frozen_weight_and_recomputed_gradients():
    hidden, weight, b, target = problem()
    with torch.no_grad():
        torch.testing.assert_close(ts.linear_cross_entropy(hidden, weight, target, b),
                                   ref_lce(hidden, weight, target, b))
    # Only hidden requires grad: only its gradient is computed (the weight stays frozen).
    h = hidden.clone().requires_grad_()
    ts.linear_cross_entropy(h, weight, target, b).backward()
    _, (rh,) = grads_of(lambda x: ref_lce(x, weight, target, b), [hidden], torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(h.grad, rh)
    # The op called without gradients in the forward: the backward computes them from grad_loss.
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = ops.fused_linear_cross_entropy_forward(h.reshape(-1, 5), w, None, target.reshape(-1), None, -100, 0.0,
                                                  0.0, 0.0, "sum", False, False, False, torch.float32, 0)[0]
    (2 * loss).backward()
    _, (rh, rw) = grads_of(lambda x, y: ref_lce(x, y, target, reduction="sum"), [hidden, weight],
                           torch.tensor(2.0, dtype=torch.float64))
    torch.testing.assert_close(h.grad, rh)
    torch.testing.assert_close(w.grad, rw)


def test_all_targets_ignored():
    hidden, weight, b, target = problem()
    target.fill_(-100)
    for reduction in ("mean", "sum", "none"):
        tensors = [hidden, weight, b]
        upstream = torch.ones(target.shape if reduction == "none" else (), dtype=torch.float64)
        loss, grads = grads_of(lambda h, w, bb: ts.linear_cross_entropy(h, w, target, bb, reduction=reduction),
                               tensors, upstream)
        # As torch: the mean over no token is NaN, the sum 0; no token contributes a gradient.
        torch.testing.assert_close(loss, ref_lce(hidden, weight, target, b, reduction=reduction), equal_nan=True)
        for g in grads:
            assert (g == 0).all(), reduction


def test_nan_in_hidden():
    hidden, weight, b, target = problem(shape=(6,))
    hidden[2, 1] = float("nan")
    loss = ts.linear_cross_entropy(hidden, weight, target, b, reduction="none")
    torch.testing.assert_close(loss, ref_lce(hidden, weight, target, b, reduction="none"), equal_nan=True)
    assert loss[2].isnan() and not loss[[0, 3, 4, 5]].isnan().any()
    upstream = torch.tensor(1.0, dtype=torch.float64)
    loss, (gh, gw) = grads_of(lambda h, w: ts.linear_cross_entropy(h, w, target, b), [hidden, weight], upstream)
    assert loss.isnan()
    # Every class's logit of token 2 is NaN: so is its row of grad_hidden and all of grad_weight.
    assert gh[2].isnan().all() and not gh[[0, 3, 4, 5]].isnan().any() and gw.isnan().all()


def test_float32_and_accumulation_options():
    hidden, weight, b, target = problem(shape=(3, 5), h=8, v=13, dtype=torch.float32)
    ref = ref_lce(hidden, weight, target, b)
    for accumulation in (torch.float32, weight.dtype):
        loss = ts.linear_cross_entropy(hidden, weight, target, b, grad_weight_accumulation=accumulation,
                                       chunk_tokens=4)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss.double(), ref)


def test_module():
    hidden, weight, b, target = problem()
    loss_fn = ts.LinearCrossEntropyLoss(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, reduction="sum")
    assert "softcap=5.0" in repr(loss_fn)
    torch.testing.assert_close(loss_fn(hidden, weight, target, b),
                               ref_lce(hidden, weight, target, b, reduction="sum", label_smoothing=0.1, z_loss=1e-3,
                                       softcap=5.0))


def test_config_switch(monkeypatch, tmp_path):
    monkeypatch.setattr(ts.config, "cache_dir", str(tmp_path))
    hidden, weight, b, target = problem()
    for mode in (False, "auto"):  # PyTorch's; on the CPU "auto" chooses PyTorch's too
        monkeypatch.setattr(ts.config, "use_fused_linear_cross_entropy", mode)
        torch.testing.assert_close(ts.linear_cross_entropy(hidden, weight, target, b),
                                   ref_lce(hidden, weight, target, b))


def test_opcheck():
    from torch.library import opcheck
    hidden, weight, b, target = problem(shape=(6,), dtype=torch.float32)
    for reduction, with_grads in (("mean", True), ("none", False), ("sum", False)):
        args = (hidden.requires_grad_(), weight.requires_grad_(), b.requires_grad_(), target, None, -100, 0.1, 1e-3,
                0.0, reduction, with_grads, with_grads, with_grads, torch.float32, 0)
        opcheck(ops.fused_linear_cross_entropy_forward, args)
    grad_loss = torch.rand(6)
    opcheck(ops.fused_linear_cross_entropy_forward,
            (hidden, weight, None, target, grad_loss, -100, 0.0, 0.0, 0.0, "none", True, True, False, torch.float32, 0),
            test_utils=("test_schema", "test_faketensor"))


def test_compile_fullgraph_with_backward():
    def f(h, w, t):
        per_token = ts.linear_cross_entropy(h, w, t, reduction="none", z_loss=1e-3)
        return ts.linear_cross_entropy(h, w, t, label_smoothing=0.1) + (per_token * torch.arange(t.numel())).sum()

    hidden, weight, _, target = problem(shape=(6,), h=8, v=10, bias=False, dtype=torch.float32)
    try:
        cf = torch.compile(f, fullgraph=True)
        hg, wg = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = cf(hg, wg, target)
    except Exception as e:  # inductor needs a working C++ toolchain for its CPU backend
        if "graph break" in str(e).lower() or "Unsupported" in type(e).__name__:
            raise
        pytest.skip(f"inductor's CPU backend cannot compile here: {type(e).__name__}: {e}"[:300])
    out.backward()
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = f(hr, wr, target)
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(hg.grad, hr.grad)
    torch.testing.assert_close(wg.grad, wr.grad)


def test_errors():
    hidden, weight, b, target = problem(shape=(6,))
    with pytest.raises(ValueError, match="argument 'weight': expected size 5 in dim 1"):
        ts.linear_cross_entropy(hidden, torch.randn(11, 4, dtype=torch.float64), target)
    with pytest.raises(ValueError, match="argument 'bias'"):
        ts.linear_cross_entropy(hidden, weight, target, torch.randn(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="argument 'targets'"):
        ts.linear_cross_entropy(hidden, weight, torch.full((6,), 11))  # V = 11: out of range
    with pytest.raises(ValueError, match="argument 'targets'"):
        ts.linear_cross_entropy(hidden, weight, torch.zeros(5, dtype=torch.long))  # one per token
    with pytest.raises(ValueError, match="argument 'targets'"):
        ts.linear_cross_entropy(hidden, weight, target.double())
    with pytest.raises(ValueError, match="argument 'weight'"):
        ts.linear_cross_entropy(hidden, weight.float(), target)
    with pytest.raises(ValueError, match="argument 'reduction'"):
        ts.linear_cross_entropy(hidden, weight, target, reduction="max")
    with pytest.raises(ValueError, match="label_smoothing"):
        ts.linear_cross_entropy(hidden, weight, target, label_smoothing=1.5)
    with pytest.raises(ValueError, match="argument 'grad_weight_accumulation'"):
        ts.linear_cross_entropy(hidden, weight, target, grad_weight_accumulation=torch.float16)
    with pytest.raises(ValueError, match="argument 'with_grad_bias'"):
        ops.fused_linear_cross_entropy_forward(hidden, weight, None, target, None, -100, 0.0, 0.0, 0.0, "mean",
                                               False, False, True, torch.float32, 0)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu(dtype):
    """Every option and reduction on the GPU, in several token chunks, against the fp64 CPU path."""
    t, h, v = 200, 64, 1000
    hidden, weight, b = torch.randn(t, h) * 0.5, torch.randn(v, h) * 0.2, torch.randn(v)
    hidden, weight, b = (x.to(dtype) for x in (hidden, weight, b))
    # The project's tolerances (docs/contract.md): relative L2 error per tensor. The logits are
    # rounded to the inputs' dtype between the GEMM and the loss, so single elements of a
    # bf16 gradient may differ by more than the rounding of their own value.
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for options in OPTIONS:
        target = torch.randint(0, v, (t,))
        target[::7] = options.get("ignore_index", -100)
        for reduction in ("mean", "sum", "none"):
            upstream = torch.rand(t if reduction == "none" else ()) + 0.5
            outs = {}
            for device in ("cuda", "cpu"):
                leaves = [x.detach().to(device).requires_grad_() for x in (hidden, weight, b)]
                loss = ts.linear_cross_entropy(*leaves[:2], target.to(device), leaves[2], reduction=reduction,
                                               chunk_tokens=64, **options)
                loss.backward(upstream.to(device))
                outs[device] = [loss.detach()] + [x.grad for x in leaves]
            for got, want in zip(outs["cuda"], outs["cpu"]):
                got, want = got.cpu().double(), want.double()
                assert torch.equal(got.isnan(), want.isnan())
                finite = ~want.isnan()
                err = ((got[finite] - want[finite]).norm() / want[finite].norm().clamp_min(1e-30)).item()
                assert err <= tol, (options, reduction, err)


@cuda
def test_cuda_accumulation_compile_memory_and_errors():
    t, h, v = 8192, 128, 32768
    hidden = (torch.randn(t, h, device="cuda") * 0.5).bfloat16()
    weight = (torch.randn(v, h, device="cuda") * 0.1).bfloat16()
    target = torch.randint(0, v, (t,), device="cuda")
    with torch.no_grad():
        ref = [x.float() for x in (hidden, weight)]
    ref = [r.requires_grad_() for r in ref]
    tF.cross_entropy(tF.linear(*ref), target).backward()

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()
    # grad_weight summed over 64 chunks of 128 tokens in float32, or in bfloat16 (a rounding each).
    for accumulation, tolerance in ((torch.float32, 1e-2), (torch.bfloat16, 5e-2)):
        hg, wg = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ts.linear_cross_entropy(hg, wg, target, grad_weight_accumulation=accumulation, chunk_tokens=128).backward()
        # A chunk of logits, cuBLASLt's workspace, the float32 accumulator and the gradients:
        # a fraction of the [T, V] bf16 logits.
        assert torch.cuda.max_memory_allocated() - base < t * v * 2 // 4
        assert rel(hg.grad, ref[0].grad) < 1e-2 and rel(wg.grad, ref[1].grad) < tolerance, accumulation
    cf = torch.compile(lambda x, w, y: ts.linear_cross_entropy(x, w, y, z_loss=1e-4), fullgraph=True)
    hg, wg = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = cf(hg, wg, target)
    out.backward()
    he, we = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    eager = ts.linear_cross_entropy(he, we, target, z_loss=1e-4)
    eager.backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(hg.grad, he.grad)
    torch.testing.assert_close(wg.grad, we.grad)
    with pytest.raises(ValueError, match=r"fused_linear_cross_entropy_forward: argument 'weight'.* on cpu"):
        ts.linear_cross_entropy(hidden, weight.cpu(), target)


def test_backward_fills_nothing():
    # The outputs that take no gradient (lse, the saved gradients) get no zero tensor in the
    # backward: at Llama-3 8B's head grad_weight's would be a 1 GiB fill per step.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] in ("zeros", "zeros_like", "zero_", "fill_", "new_zeros"):
                self.sizes.append(out.numel())
            return out

    h = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    loss = ts.linear_cross_entropy(h, w, torch.randint(0, 11, (6,)))
    with Fills() as fills:
        loss.backward()
    assert w.numel() not in fills.sizes and h.numel() not in fills.sizes, fills.sizes
