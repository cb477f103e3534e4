"""trainscale.newton_schulz and trainscale.optim.Muon: the batch form against one call per matrix,
Muon's formula in fp64, AdamW for the other parameters against torch.optim.AdamW, groups with
use_muon=False, the state_dict round trip, the update against torch.optim.Muon for each lr rule,
argument errors, and the distributed optimizer in 2 gloo processes (DDP and FSDP2) against one
process (python/tests/distributed_muon_check.py). CUDA tests skip without a GPU."""
import io
import os
import subprocess
import sys

import pytest
import torch

import trainscale as ts

A, B, C = ts.optim.DEFAULT_NS_COEFFICIENTS
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def ns_torch(g, steps=5, eps=1e-7):
    """Newton-Schulz in torch ops, in g's dtype (the header's formula)."""
    x = g.mT if g.size(-2) > g.size(-1) else g
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for _ in range(steps):
        a = x @ x.mT
        x = A * x + (B * a + C * a @ a) @ x
    return x.mT if g.size(-2) > g.size(-1) else x


@pytest.mark.parametrize("shape", [(3, 6, 9), (3, 9, 6), (2, 1, 5)])
def test_newton_schulz_batch_is_one_call_per_matrix(shape):
    g = torch.randn(shape, dtype=torch.float64)
    out = ts.newton_schulz(g)
    for n in range(shape[0]):
        assert torch.equal(out[n], ts.newton_schulz(g[n]))
    torch.testing.assert_close(out, ns_torch(g), rtol=1e-10, atol=1e-12)


def test_gram_method_is_the_standard_iteration_on_the_cpu():
    """method picks how the CUDA path runs the steps; the CPU reference computes the standard ones."""
    g = torch.randn(2, 5, 17, dtype=torch.float64)
    assert torch.equal(ts.newton_schulz(g, method="gram"), ts.newton_schulz(g))


@cuda
def test_cuda_gram_method_matches_the_standard_iteration():
    """The Gram steps (a matrix with max(R, C) >= 3 min(R, C)) against fp64, a batch against one
    call per matrix, and a Muon step's update against the standard steps'."""
    g = torch.randn(3, 320, 96, device="cuda", dtype=torch.bfloat16)
    out = ts.newton_schulz(g, method="gram")
    for n in range(3):
        assert torch.equal(out[n], ts.newton_schulz(g[n], method="gram"))
    ref = ns_torch(g.double())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-2
    # Parameters of 1e-3, so that rounding the new parameter stays far below the update.
    start = torch.randn(400, 96, device="cuda", dtype=torch.bfloat16) * 1e-3
    grad = torch.randn(400, 96, device="cuda")
    updates = []
    for method in ("standard", "gram"):
        p = torch.nn.Parameter(start.clone())
        p.grad = grad.to(p.dtype)
        ts.optim.Muon([p], lr=0.5, ns_method=method).step()
        updates.append(p.detach().double() - start.double())
    assert ((updates[1] - updates[0]).norm() / updates[0].norm()).item() < 5e-2


def muon_by_hand(p, g, buf, lr, momentum, wd, nesterov, scale):
    """The step in fp64; the buffer is kept in float32 (u is the unrounded new buffer)."""
    buf = momentum * buf + g
    u = g + momentum * buf if nesterov else buf
    return p * (1 - lr * wd) - lr * scale * ns_torch(u), buf.float().double()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("rule", ["original", "match_rms_adamw", "spectral_unclamped"])
def test_muon_matches_its_formula(nesterov, rule):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 10, dtype=torch.float64)),
              torch.nn.Parameter(torch.randn(10, 6, dtype=torch.float64)),
              torch.nn.Parameter(torch.randn(6, 10, dtype=torch.float64))]
    want = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in want]
    opt = ts.optim.Muon(params, lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=rule)
    for _ in range(3):
        for i, p in enumerate(params):
            p.grad = torch.randn_like(p)
            r, c = p.shape
            scale = {"original": max(1, r / c) ** 0.5, "match_rms_adamw": 0.2 * max(r, c) ** 0.5,
                     "spectral_unclamped": (r / c) ** 0.5}[rule]
            want[i], bufs[i] = muon_by_hand(want[i], p.grad, bufs[i], 0.05, 0.9, 0.1, nesterov, scale)
        opt.step()
        for p, w in zip(params, want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-10, atol=1e-12)


def model(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 12), torch.nn.LayerNorm(12),
                               torch.nn.Linear(12, 8)).to(device=device, dtype=dtype)


def backward(m, device="cpu"):
    tokens = torch.arange(10, device=device) % 16
    m.zero_grad()
    m(tokens).square().mean().backward()


def test_other_parameters_get_adamw():
    m, ref = model(), model()
    muon_like = [p for p in ref.parameters() if p.ndim == 2 and p is not ref[0].weight]
    others = [p for p in ref.parameters() if p.ndim != 2] + [ref[0].weight]
    opt = ts.optim.Muon([{"params": [m[0].weight], "use_muon": False},
                         {"params": [p for layer in list(m)[1:] for p in layer.parameters()]}],
                        adamw_lr=1e-2, adamw_betas=(0.8, 0.9), adamw_eps=1e-8, adamw_weight_decay=0.1)
    adamw = torch.optim.AdamW(others, lr=1e-2, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)
    muon_ref = ts.optim.Muon(muon_like)
    for _ in range(3):
        backward(m)
        backward(ref)
        opt.step()
        adamw.step()
        muon_ref.step()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert set(opt.state[m[0].weight]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(opt.state[m[1].weight]) == {"momentum_buffer"}
    assert opt.state[m[1].weight]["momentum_buffer"].dtype == torch.float32


def test_state_dict_round_trip():
    m = model()
    opt = ts.optim.Muon(m.parameters(), lr=0.03, weight_decay=0.01)
    for _ in range(2):
        backward(m)
        opt.step()
    file = io.BytesIO()  # through torch.save, as a checkpoint (an in-memory state_dict shares its tensors)
    torch.save(opt.state_dict(), file)
    file.seek(0)
    saved = torch.load(file)
    m2 = model()
    m2.load_state_dict(m.state_dict())
    opt2 = ts.optim.Muon(m2.parameters())
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"] == 0.03
    backward(m)
    backward(m2)
    opt.step()
    opt2.step()
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("rule", ["original", "match_rms_adamw", "spectral_unclamped"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_update_matches_torch_muon(rule, nesterov):
    # torch.optim.Muon keeps momentum as an average ((1 - momentum) times this buffer), clamps the
    # norm at eps instead of adding it, and runs Newton-Schulz in bfloat16: the updates agree to
    # bfloat16's Newton-Schulz error.
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    torch.manual_seed(0)
    shapes = [(32, 48), (48, 32)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    options = dict(lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=rule)
    try:
        ref = torch.optim.Muon(theirs, **options)
    except ValueError as e:  # the rules torch knows vary by version
        pytest.skip(f"torch {torch.__version__}: {e}")
    opt = ts.optim.Muon(ours, **options)
    for _ in range(3):
        before = [p.detach().clone() for p in ours]
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        for p, q, b in zip(ours, theirs, before):
            update, expected = p.detach() - b, q.detach() - b
            assert (update - expected).norm() / expected.norm() < 2e-2
            p.data.copy_(q.detach())  # the next step from the same point


def test_argument_errors():
    m = model()
    with pytest.raises(ValueError, match="lr must be finite and >= 0"):
        ts.optim.Muon(m.parameters(), lr=-1)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        ts.optim.Muon(m.parameters(), adjust_lr_fn="none")
    with pytest.raises(ValueError, match="use_muon=True"):
        ts.optim.Muon([{"params": list(m.parameters()), "use_muon": True}])
    with pytest.raises(ValueError, match="distributed=True needs torch.distributed"):
        ts.optim.Muon(m.parameters(), distributed=True)
    with pytest.raises(ValueError, match="muon_step"):
        ops = torch.ops.trainscale
        p = torch.zeros(4, 6)
        ops.muon_step_([p], [torch.zeros(4, 5)], [torch.zeros(4, 6)], 0.1, 0.9, 0.0, True, "original", 5, A, B, C,
                       1e-7, "standard")
    with pytest.raises(ValueError, match="ns_method"):
        ts.optim.Muon(m.parameters(), ns_method="fast")
    with pytest.raises(ValueError, match="'method'.*standard or gram, got fast"):
        ts.newton_schulz(torch.zeros(4, 6), method="fast")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(ts.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_distributed(parallel, device, optimizer="muon"):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_muon_check.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script,
               "--parallel", parallel, "--device", device, "--optimizer", optimizer]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"OK {parallel} {device}" in done.stdout


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_distributed_gloo_matches_one_process(parallel):
    run_distributed(parallel, "cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_distributed_nccl_matches_one_process(parallel):
    run_distributed(parallel, "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"))])
def test_adamw_clipping_on_fsdp2_shards_matches_one_process(device):
    """ts.optim.AdamW(max_grad_norm=...) on FSDP2 shards: the norm all-reduced over the ranks."""
    run_distributed("fsdp2", device, optimizer="adamw")


@cuda
def test_cuda_batch_and_muon():
    g = torch.randn(5, 96, 160, device="cuda", dtype=torch.bfloat16)
    out = ts.newton_schulz(g)
    for n in range(5):
        assert torch.equal(out[n], ts.newton_schulz(g[n]))
    torch.testing.assert_close(out.double(), ns_torch(g.double()), rtol=0, atol=0.1)
    m = model(torch.bfloat16, "cuda")
    m_cpu = model(torch.float64)
    opt, opt_cpu = ts.optim.Muon(m.parameters(), lr=0.5), ts.optim.Muon(m_cpu.parameters(), lr=0.5)
    for p, q in zip(m.parameters(), m_cpu.parameters()):
        q.data.copy_(p.detach().double())
        q.grad = torch.randn_like(q)
        p.grad = q.grad.to(p)
        q.grad.copy_(p.grad.double())
    before = [q.detach().clone() for q in m_cpu.parameters()]
    opt.step()
    opt_cpu.step()
    for p, q, b in zip(m.parameters(), m_cpu.parameters(), before):
        if p.ndim == 2 and p is not m[0].weight:
            update, expected = p.detach().double().cpu() - b, q.detach() - b
            assert (update - expected).norm() / expected.norm() < 5e-2


def test_bench_muon_suite(tmp_path, capsys):
    from trainscale import bench
    from trainscale.bench import muon
    assert bench.main(["--suite", "muon", "--device", "cpu", "--list"]) == 0
    listed = capsys.readouterr().out.split("\n")
    assert "newton_schulz 96x48 bfloat16" in listed and any(line.startswith("muon_step 4-layers") for line in listed)
    out = tmp_path / "muon.json"
    assert bench.main(["--suite", "muon", "--device", "cpu", "--ops", "newton_schulz", "--configs", "96x48",
                       "--min-time-ms", "1", "--min-samples", "2", "--timeout-ms", "50", "--warmup-ms", "1",
                       "--quiet", "--json", str(out)]) == 0
    import json
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows} == {"cpu-ref", "torch", "torch-compile"}
    assert all(r["status"] == "ok" and r["gate"]["rel_l2"] <= muon.MUON_TOLERANCE for r in rows)
    assert rows[0]["flops"] == muon.ns_flops(96, 48) == 5 * (3 * 48 * 48 * 96 + 48 ** 3)


def test_bench_muon_suite_two_processes(tmp_path):
    # Under torchrun the suite times the distributed step against the one-process step (its
    # baseline there), all ranks in lockstep; rank 0 writes the report.
    from trainscale.bench import muon
    out = tmp_path / "muon2.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "trainscale.bench", "--suite", "muon", "--device", "cpu", "--impl", "cpu-ref,cpu-ref-distributed",
               "--quiet", "--json", str(out)]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import json
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["baseline"]) for r in rows] == [("cpu-ref-distributed", False), ("cpu-ref", True)]
    assert all(r["op"] == "muon_step" and r["status"] == "ok" and r["gate"]["rel_l2"] <= muon.MUON_TOLERANCE
               for r in rows)
    assert all(r["ms"]["count"] == muon.MUON_LOCKSTEP_SAMPLES and "lockstep over 2 ranks" in r["timer"] for r in rows)
