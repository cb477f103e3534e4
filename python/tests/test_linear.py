"""trainscale.linear: shared_input_linear's outputs and gradients against separate F.linear
calls (biases, outputs left unused, x without grad), its backward summing x's gradient without
add kernels, and the projection group patch() puts in attention modules (the first call computes
all, the others hand theirs over, any other input is a plain Linear)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainscale.linear import group_projections, shared_input_linear


def _params(bias):
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(o, 8, dtype=torch.float64, requires_grad=True) for o in (8, 4, 4)]
    bs = [torch.randn(w.shape[0], dtype=torch.float64, requires_grad=True) if bias else None for w in ws]
    return x, ws, bs


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2), (1,)])
def test_matches_separate_linears(bias, used):
    x, ws, bs = _params(bias)
    leaves = [x, *ws, *[b for b in bs if b is not None]]
    outs = shared_input_linear(x, ws, bs)
    refs = [F.linear(x, w, b) for w, b in zip(ws, bs)]
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, rtol=0, atol=0)
    grads = [torch.randn_like(r) for r in refs]
    got = torch.autograd.grad([outs[i] for i in used], leaves, [grads[i] for i in used], allow_unused=True)
    want = torch.autograd.grad([refs[i] for i in used], leaves, [grads[i] for i in used], allow_unused=True)
    for g, w in zip(got, want):
        if w is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_no_add_kernels_in_backward():
    x, ws, bs = _params(False)
    ops = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    outs = shared_input_linear(x, ws, bs)
    grads = [torch.ones_like(o) for o in outs]
    with Record():
        torch.autograd.backward(outs, grads)
    assert "add" not in ops and "add_" not in ops and ops.count("addmm_") == 2, ops


def test_x_without_grad():
    x, ws, bs = _params(False)
    x = x.detach()
    outs = shared_input_linear(x, ws)
    sum(o.sum() for o in outs).backward()
    for w in ws:
        torch.testing.assert_close(w.grad, torch.ones(w.shape[0], 2 * 5, dtype=x.dtype) @ x.reshape(-1, 8))


def test_group_hands_outputs_over():
    m = nn.Module()
    m.q_proj, m.k_proj, m.v_proj = nn.Linear(8, 8, bias=False), nn.Linear(8, 4), nn.Linear(8, 4, bias=False)
    plain = [m.q_proj, m.k_proj, m.v_proj]
    assert group_projections(m, ("q_proj", "k_proj", "v_proj"))
    assert not group_projections(m, ("q_proj", "k_proj", "v_proj"))  # already grouped
    assert m.k_proj.weight is plain[1].weight and m.k_proj.bias is plain[1].bias
    x, other = torch.randn(3, 8), torch.randn(3, 8)
    q, k, v = m.q_proj(x), m.k_proj(x), m.v_proj(x)
    for got, layer in zip((q, k, v), plain):
        torch.testing.assert_close(got, layer(x))
    assert m.k_proj._trainscale_group.pending is None
    torch.testing.assert_close(m.q_proj(x), plain[0](x))
    torch.testing.assert_close(m.k_proj(other), plain[1](other))  # another input: computed by itself
    torch.testing.assert_close(m.v_proj(x), plain[2](x))  # still handed over
    # Not all plain nn.Linear of one input width: left alone.
    n = nn.Module()
    n.q_proj, n.k_proj, n.v_proj = nn.Linear(8, 8), nn.Linear(6, 4), nn.Linear(8, 4)
    assert not group_projections(n, ("q_proj", "k_proj", "v_proj")) and type(n.q_proj) is nn.Linear


def test_bias_count_error():
    x, ws, _ = _params(False)
    with pytest.raises(ValueError, match="shared_input_linear: argument 'biases'.*3.*got 2"):
        shared_input_linear(x, ws, [None, None])
