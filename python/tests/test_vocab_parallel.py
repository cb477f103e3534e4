"""trainscale.vocab_parallel_cross_entropy and vocab_parallel_linear_cross_entropy against
F.cross_entropy of the whole logits in float64: in one process (a group of one rank, no
torch.distributed) and in 2 gloo processes (this file run as a script under torchrun, rank r
holding vocabulary ids [r * S, (r + 1) * S)): the loss, each rank's gradient of its shard, the
lse, ignore_index rows, mean / sum / none, label smoothing, an odd number of tokens, chunks, a
padded vocabulary, float32 / bfloat16 logits, NaN and Inf, and for the linear variant grad_hidden
and each rank's grad_weight shard. With 2 CUDA devices the same in 2 NCCL processes, one GPU each.

    torchrun --standalone --nproc-per-node 2 python/tests/test_vocab_parallel.py [--device cuda]
"""
import itertools
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import trainscale as ts

T, H = 13, 5  # an odd token count


def _targets(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, vocab, (T,), generator=g)
    target[[2, 7]] = -100
    return target


def _close(got, want, tol, what):
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=tol, atol=tol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def check_ce(rank, ranks, group=None, device="cpu"):
    """Every case of vocab_parallel_cross_entropy on this rank's shard (on `device`) against the
    whole logits (float64 on the CPU)."""
    cases = itertools.product(["mean", "sum", "none"], [0.0, 0.1], [None, 4], [(6, 0), (6, 1)],
                              [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
    for reduction, smoothing, chunk, (width, padding), (dtype, tol) in cases:
        total = width * ranks
        vocab = total - padding  # padding > 0: the last rank's last columns lie past the vocabulary
        what = f"ce {reduction} smoothing={smoothing} chunk={chunk} width={width} vocab={vocab} {dtype}"
        g = torch.Generator().manual_seed(0)
        full = (3 * torch.randn(T, total, generator=g, dtype=torch.float64)).to(dtype)
        target = _targets(vocab)
        shard = full[:, rank * width:(rank + 1) * width].to(device, copy=True).requires_grad_()
        loss, lse = ts.vocab_parallel_cross_entropy(shard, target.to(device), group=group, reduction=reduction,
                                                    label_smoothing=smoothing, vocab_size=vocab if padding else None,
                                                    return_lse=True, chunk_size=chunk)
        ref_logits = full[:, :vocab].double().requires_grad_()
        ref = F.cross_entropy(ref_logits, target, reduction=reduction, label_smoothing=smoothing)
        _close(loss, ref, tol, what + " loss")
        _close(lse, torch.logsumexp(ref_logits.detach(), 1), tol, what + " lse")
        weight = torch.linspace(0.5, 2.0, T, dtype=torch.float64) if reduction == "none" else torch.tensor(1.5)
        (loss * weight.to(loss.device, loss.dtype)).sum().backward()
        (ref * weight).sum().backward()
        want = torch.zeros(T, total, dtype=torch.float64)
        want[:, :vocab] = ref_logits.grad
        assert shard.grad.dtype == dtype
        _close(shard.grad, want[:, rank * width:(rank + 1) * width], tol, what + " grad")


def check_linear(rank, ranks, group=None, device="cpu"):
    cases = itertools.product(["mean", "sum", "none"], [0.0, 0.1], [None, 3],
                              [(torch.float64, 1e-12), (torch.float32, 1e-5)])
    width = 6
    for reduction, smoothing, chunk, (dtype, tol) in cases:
        what = f"linear {reduction} smoothing={smoothing} chunk={chunk} {dtype}"
        g = torch.Generator().manual_seed(2)
        hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
        weight = torch.randn(width * ranks, H, generator=g, dtype=torch.float64)
        target = _targets(width * ranks)
        h = hidden.to(device, dtype, copy=True).requires_grad_()
        w = weight[rank * width:(rank + 1) * width].to(device, dtype, copy=True).requires_grad_()
        loss = ts.vocab_parallel_linear_cross_entropy(h, w, target.to(device), group=group, reduction=reduction,
                                                      label_smoothing=smoothing, chunk_size=chunk)
        rh, rw = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        ref = F.cross_entropy(rh @ rw.t(), target, reduction=reduction, label_smoothing=smoothing)
        _close(loss, ref, tol, what + " loss")
        up = torch.linspace(0.5, 2.0, T, dtype=torch.float64) if reduction == "none" else torch.tensor(0.7)
        (loss * up.to(loss.device, loss.dtype)).sum().backward()
        (ref * up).sum().backward()
        _close(h.grad, rh.grad, tol, what + " grad_hidden")
        _close(w.grad, rw.grad[rank * width:(rank + 1) * width], tol, what + " grad_weight")


def check_nonfinite(rank, ranks, group=None, device="cpu"):
    """NaN / +Inf on one rank's shard reach the loss on every rank, as in F.cross_entropy; ignored
    rows stay 0; all rows ignored: a NaN mean."""
    width = 4
    full = torch.randn(T, width * ranks, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    last = width * ranks - 1
    full[0, last] = float("nan")
    full[1, last] = float("inf")
    full[3, :] = float("-inf")
    full[2, last] = float("nan")  # an ignored row
    target = _targets(width * ranks)
    got = ts.vocab_parallel_cross_entropy(full[:, rank * width:(rank + 1) * width].to(device), target.to(device),
                                          group=group, reduction="none")
    _close(got, F.cross_entropy(full, target, reduction="none"), 1e-12, "nonfinite")
    assert got[2] == 0
    all_ignored = torch.full((T,), -100)
    assert ts.vocab_parallel_cross_entropy(full[:, :width].to(device), all_ignored.to(device), group=group).isnan()


def check_all(rank, ranks, group=None, device="cpu"):
    check_ce(rank, ranks, group, device)
    check_linear(rank, ranks, group, device)
    check_nonfinite(rank, ranks, group, device)


# ---- pytest: one process, 2 gloo processes, 2 NCCL processes ----

def test_one_process():
    check_all(0, 1)


def test_errors():
    import pytest
    x = torch.randn(4, 6)
    with pytest.raises(IndexError, match="outside"):
        ts.vocab_parallel_cross_entropy(x, torch.tensor([0, 1, 6, 2]))
    with pytest.raises(ValueError, match="reduction"):
        ts.vocab_parallel_cross_entropy(x, torch.tensor([0, 1, 2, 2]), reduction="avg")
    with pytest.raises(ValueError, match="vocab_size"):
        ts.vocab_parallel_cross_entropy(x, torch.tensor([0, 1, 2, 2]), vocab_size=7)
    with pytest.raises(ValueError, match="elements"):
        ts.vocab_parallel_cross_entropy(x, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="weight_shard"):
        ts.vocab_parallel_linear_cross_entropy(torch.randn(4, 5), x, torch.tensor([0, 1, 2, 2]))


def _run_two_processes(*args):
    # NCCL's NVLink multicast stays off (not every multi-GPU host supports it).
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(ts.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.abspath(__file__), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_two_gloo_processes():
    assert "OK vocab_parallel 2 cpu" in _run_two_processes()


def test_two_nccl_processes():
    import pytest
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    assert "OK vocab_parallel 2 cuda" in _run_two_processes("--device", "cuda")


def _main():
    import torch.distributed as dist
    cuda = sys.argv[1:] == ["--device", "cuda"]
    device = "cpu"
    if cuda:
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    check_all(rank, ranks, device=device)  # the default group
    check_ce(rank, ranks, dist.new_group(list(range(ranks))), device)  # an explicit group
    dist.barrier()
    if rank == 0:
        print(f"OK vocab_parallel {ranks} {'cuda' if cuda else 'cpu'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    _main()
