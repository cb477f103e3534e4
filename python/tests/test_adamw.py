"""trainscale.optim.AdamW against torch.optim.AdamW: the update over several steps (float32 and
bfloat16 parameters, float32 moments, groups with their own lr), clipping against
torch.nn.utils.clip_grad_norm_ (the norm, the update, gradients left unwritten, NaN), the
state_dict round trip both ways, the update moved into the backward (step_in_backward), and
argument errors; the device-factor scaling op. CUDA tests
skip without a GPU."""
import pytest
import torch

import trainscale as ts
from conftest import cuda


def _params(dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (33,), (1,), (4, 3, 2)]
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in shapes]


def _set_grads(params, seed, nan_at=None):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
    if nan_at is not None:
        params[nan_at].grad.view(-1)[0] = float("nan")


def _run(make_opt, params, steps, clip=None):
    opt = make_opt(params)
    norms = []
    for s in range(steps):
        _set_grads(params, 100 + s)
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(params, clip))
        opt.step()
    return opt, norms


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12), (torch.bfloat16, 1e-2)])
def test_matches_torch_adamw(dtype, tol):
    kw = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ours, ref = _params(dtype), _params(dtype)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.01}]  # noqa: E731
    _run(lambda ps: ts.optim.AdamW(groups(ps), **kw), ours, 4)
    # torch's fused path: float32 math, one rounding per output, as ours (its single-tensor
    # path rounds bfloat16 after every op).
    _run(lambda ps: torch.optim.AdamW(groups(ps), fused=True, **kw), ref, 4)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach().double(), b.detach().double(), rtol=tol, atol=tol)


def test_float32_moments():
    ours, ref = _params(torch.bfloat16), [p.detach().float().requires_grad_() for p in _params(torch.bfloat16)]
    opt, _ = _run(lambda ps: ts.optim.AdamW(ps, lr=0.05, moments_dtype=torch.float32), ours, 3)
    _run(lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=False), ref, 3)
    assert opt.state[ours[0]]["exp_avg"].dtype == torch.float32
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach().float(), b.detach().to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("clip", [0.5, 1e6])
def test_clipping_matches_clip_grad_norm(clip):
    ours, ref = _params(torch.float32), _params(torch.float32)
    opt = ts.optim.AdamW(ours, lr=0.05, max_grad_norm=clip)
    ref_opt = torch.optim.AdamW(ref, lr=0.05, foreach=False)
    for s in range(3):
        _set_grads(ours, 100 + s)
        _set_grads(ref, 100 + s)
        grads = [p.grad.clone() for p in ours]
        opt.step()
        norm = torch.nn.utils.clip_grad_norm_(ref, clip)
        ref_opt.step()
        torch.testing.assert_close(opt.grad_norm, norm, rtol=1e-6, atol=0)
        assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads))  # not written
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)


def test_nan_gradient_reaches_every_parameter_when_clipping():
    params = _params(torch.float32)
    opt = ts.optim.AdamW(params, max_grad_norm=1.0)
    _set_grads(params, 1, nan_at=1)
    opt.step()
    assert torch.isnan(opt.grad_norm)
    assert all(torch.isnan(p).all() for p in params)
    params = _params(torch.float32)
    opt = ts.optim.AdamW(params)  # without clipping: only the element it sits in
    _set_grads(params, 1, nan_at=1)
    opt.step()
    assert torch.isnan(params[1]).sum() == 1 and not torch.isnan(params[0]).any()


def test_state_dict_round_trip_with_torch():
    a, b, c = _params(torch.float32), _params(torch.float32), _params(torch.float32)
    ours, _ = _run(lambda ps: ts.optim.AdamW(ps, lr=0.02), a, 2)
    theirs, _ = _run(lambda ps: torch.optim.AdamW(ps, lr=0.02, foreach=False), b, 2)
    # torch's state into ours and ours into torch: the next step agrees with continuing as before.
    ours_from_torch = ts.optim.AdamW(b, lr=0.02)
    ours_from_torch.load_state_dict(theirs.state_dict())
    torch_from_ours = torch.optim.AdamW(a, lr=0.02, foreach=False)
    torch_from_ours.load_state_dict(ours.state_dict())
    cont, _ = _run(lambda ps: ts.optim.AdamW(ps, lr=0.02), c, 2)
    for opt, ps in ((ours_from_torch, b), (torch_from_ours, a)):
        _set_grads(ps, 7)
        opt.step()
    _set_grads(c, 7)
    cont.step()
    for x, y, z in zip(a, b, c):
        torch.testing.assert_close(x.detach(), z.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(y.detach(), z.detach(), rtol=1e-6, atol=1e-6)


def _backward_steps(opt, params, steps):
    """`steps` backward passes of a loss whose gradients are fixed random tensors, each followed
    by opt.step(); the grad norms."""
    norms = []
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        targets = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]
        sum((p * t).sum() for p, t in zip(params, targets)).backward()
        opt.step()
        norms.append(opt.grad_norm)
        opt.zero_grad(set_to_none=True)
    return norms


def test_step_in_backward_matches_step():
    kw = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.01}]  # noqa: E731
    ours, ref = _params(torch.float32), _params(torch.float32)
    opt = ts.optim.AdamW(groups(ours), **kw)
    opt.step_in_backward()
    opt.step_in_backward()  # a second call adds no second hook
    seen = []
    for p in ours:  # the gradient is freed once the parameter is updated
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is None))
    norms = _backward_steps(opt, ours, 3)
    assert seen and all(seen)
    ref_opt = ts.optim.AdamW(groups(ref), **kw)
    ref_norms = []
    for s in range(3):
        g = torch.Generator().manual_seed(100 + s)
        targets = [torch.randn(p.shape, generator=g) for p in ref]
        sum((p * t).sum() for p, t in zip(ref, targets)).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref, float("inf")))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)  # the same update, bit for bit
    torch.testing.assert_close(torch.stack(norms), torch.stack(ref_norms), rtol=1e-6, atol=0)
    assert all(opt.state[p]["step"].item() == 3 for p in ours)


def test_step_in_backward_errors():
    with pytest.raises(ValueError, match="max_grad_norm must be None"):
        ts.optim.AdamW([torch.zeros(3, requires_grad=True)], max_grad_norm=1.0).step_in_backward()


def test_argument_errors():
    p = [torch.zeros(3, requires_grad=True)]
    for kw, msg in ((dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.9)), "betas"), (dict(max_grad_norm=0.0), "max_grad_norm"),
                    (dict(moments_dtype=torch.float16), "moments_dtype")):
        with pytest.raises(ValueError, match=msg):
            ts.optim.AdamW(p, **kw)
    q = torch.zeros(4, 4, requires_grad=True)
    q.grad = torch.zeros(4, 4).t()  # a transposed gradient: the op needs contiguous tensors
    with pytest.raises(ValueError, match="contiguous"):
        ts.optim.AdamW([q]).step()


@cuda
@pytest.mark.parametrize("moments", [None, torch.float32])
def test_cuda_matches_torch_fused_adamw_with_clipping(moments):
    ours, ref = _params(torch.bfloat16, "cuda"), _params(torch.bfloat16, "cuda")
    big = [torch.randn(4096, 1031, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    ours, ref = ours + big, ref + [b.detach().clone().requires_grad_() for b in big]
    opt = ts.optim.AdamW(ours, lr=0.01, max_grad_norm=20.0, moments_dtype=moments)
    ref_opt = torch.optim.AdamW(ref, lr=0.01, fused=True)
    for s in range(3):
        _set_grads(ours, 100 + s)
        _set_grads(ref, 100 + s)
        opt.step()
        norm = torch.nn.utils.clip_grad_norm_(ref, 20.0)
        ref_opt.step()
        # clip_grad_norm_ returns bfloat16 norms of bfloat16 gradients: compare with float32's.
        exact = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in ours]))
        torch.testing.assert_close(opt.grad_norm, exact, rtol=1e-5, atol=0)
        assert abs(opt.grad_norm.item() / norm.item() - 1) < 1e-2
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_scale_by_device_factor(device):
    """The op the fused linear cross-entropy's backward scales its saved gradients with: a no-op
    at exactly 1, the product otherwise, NaN kept; errors name the op and the argument."""
    ops = torch.ops.trainscale
    xs = [torch.randn(1000, 3, device=device), torch.randn(77, device=device).bfloat16()]
    xs[0][5, 1] = float("nan")
    before = [x.clone() for x in xs]
    ops.scale_by_device_factor_(xs, torch.tensor(1.0, device=device))
    for x, b in zip(xs, before):
        assert torch.equal(x.isnan(), b.isnan()) and torch.equal(x.nan_to_num(), b.nan_to_num())
    ops.scale_by_device_factor_(xs, torch.tensor(-2.5, device=device))
    for x, b in zip(xs, before):
        torch.testing.assert_close(x, b * -2.5, equal_nan=True)
    with pytest.raises(ValueError, match="scale_by_device_factor: argument 'factor'.*float64"):
        ops.scale_by_device_factor_(xs, torch.tensor(1.0, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match=r"scale_by_device_factor: argument 'tensors\[1\]'.*disjoint"):
        ops.scale_by_device_factor_([xs[0], xs[0][1:]], torch.tensor(2.0, device=device))
