"""trainscale.embedding and trainscale.Embedding against F.embedding / nn.Embedding: the
forward and the weight's gradient (duplicated ids, rows no id names, padding_idx counted from
either end, int32 and int64 ids, ids of any shape, grad_output not contiguous), the bits
run to run, out-of-range ids, argument errors, the op's schema (opcheck) and torch.compile.
CUDA tests skip without a GPU."""
import pytest
import torch
import torch.nn.functional as F

import trainscale as ts
from conftest import cuda

ops = torch.ops.trainscale


def _ids(shape, vocab, device, dtype=torch.int64):
    # Half the ids on the first three rows (long runs), the rest anywhere.
    ids = torch.randint(0, vocab, shape)
    ids[..., ::2] = torch.randint(0, min(vocab, 3), ids[..., ::2].shape)
    return ids.to(device, dtype)


def _exact_grad(ids, grad, vocab, padding_idx=None):
    """The weight's gradient summed in float64 (rounded once when cast)."""
    hidden = grad.shape[-1]
    out = torch.zeros(vocab, hidden, dtype=torch.float64, device=grad.device)
    out.index_add_(0, ids.reshape(-1).long(), grad.reshape(-1, hidden).double())
    if padding_idx is not None:
        out[padding_idx] = 0
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_matches_torch(device, dtype, padding_idx):
    vocab, hidden = 50, 24
    for id_dtype in (torch.int64, torch.int32):
        weight = torch.randn(vocab, hidden, device=device, dtype=dtype, requires_grad=True)
        ids = _ids((3, 17), vocab, device, id_dtype)
        grad = torch.randn(3, 17, hidden, device=device, dtype=dtype)
        out = ts.embedding(ids, weight, padding_idx=padding_idx)
        assert torch.equal(out, F.embedding(ids, weight, padding_idx=padding_idx))
        out.backward(grad)
        exact = _exact_grad(ids, grad, vocab, None if padding_idx is None else padding_idx % vocab)
        # float64 sums on the CPU rounded once: exactly the rounded sum; float32 sums on CUDA.
        tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
        if device == "cpu":
            assert torch.equal(weight.grad, exact.to(dtype))
        torch.testing.assert_close(weight.grad.double(), exact, rtol=tol, atol=tol)
        assert torch.equal(weight.grad == 0, exact == 0)


@cuda
def test_llama_shape_and_bits():
    vocab, hidden = 128256, 256
    weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = _ids((1, 8192), vocab, "cuda")
    grad = torch.randn(1, 8192, hidden, device="cuda", dtype=torch.bfloat16)
    gws = []
    for _ in range(2):
        weight.grad = None
        ts.embedding(ids, weight).backward(grad)
        gws.append(weight.grad)
    assert torch.equal(gws[0], gws[1])
    torch.testing.assert_close(gws[0].double(), _exact_grad(ids, grad, vocab), rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_grad_output_not_contiguous(device):
    weight = torch.randn(9, 8, device=device, requires_grad=True)
    ids = _ids((5,), 9, device)
    big = torch.randn(5, 16, device=device)
    ts.embedding(ids, weight).backward(big[:, :8])  # rows 16 apart
    ref = torch.zeros(9, 8, device=device).index_add_(0, ids, big[:, :8])
    torch.testing.assert_close(weight.grad, ref)


def test_out_of_range_ids_cpu():
    weight = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"embedding_forward: argument 'ids'.*\[0, 6\).*6 at position 1"):
        ts.embedding(torch.tensor([1, 6]), weight)
    with pytest.raises(ValueError, match=r"embedding_backward: argument 'ids'.*-1 at position 0"):
        ops.embedding_backward(torch.randn(2, 4), torch.tensor([-1, 0]), 6, -1)


@cuda
def test_out_of_range_ids_cuda_give_nan():
    weight = torch.randn(6, 4, device="cuda", requires_grad=True)
    out = ts.embedding(torch.tensor([1, 6], device="cuda"), weight)
    assert torch.equal(out[0], weight[1].detach()) and out[1].isnan().all()
    out.sum().backward()
    assert weight.grad.isnan().all()


def test_argument_errors():
    weight = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"trainscale.embedding: argument 'padding_idx'.*\[-6, 6\).*got 6"):
        ts.embedding(torch.tensor([1]), weight, padding_idx=6)
    with pytest.raises(ValueError, match="embedding_forward: argument 'ids'.*int64.*float32"):
        ts.embedding(torch.tensor([1.0]), weight)
    with pytest.raises(ValueError, match="embedding_backward: argument 'padding_idx'"):
        ops.embedding_backward(torch.randn(2, 4), torch.tensor([1, 0]), 6, 7)
    with pytest.raises(ValueError, match="embedding_backward: argument 'grad_output'.*ids.shape"):
        ops.embedding_backward(torch.randn(2, 4), torch.tensor([[1, 0]]), 6, -1)


def test_opcheck():
    weight = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(ops.embedding_forward, (weight, torch.tensor([[1, 3], [3, 0]]), -1))
    torch.library.opcheck(ops.embedding_forward, (weight, torch.tensor([2, 2, 6]), 2))
    torch.library.opcheck(ops.embedding_backward, (torch.randn(3, 5, dtype=torch.float64), torch.tensor([2, 2, 6]), 7, -1))


def test_module_and_compile():
    torch.manual_seed(0)
    ref = torch.nn.Embedding(20, 6, padding_idx=4).double()
    ours = ts.Embedding(20, 6, padding_idx=4).double()
    ours.weight = ref.weight
    ids = torch.tensor([[4, 1, 1, 19]])
    torch.testing.assert_close(ours(ids), ref(ids))
    compiled = torch.compile(lambda i, w: ts.embedding(i, w, 4), fullgraph=True)
    w = ref.weight.detach().clone().requires_grad_()
    compiled(ids, w).sum().backward()
    expected = torch.zeros_like(w).index_add_(0, ids.view(-1), torch.ones(4, 6, dtype=w.dtype))
    expected[4] = 0
    torch.testing.assert_close(w.grad, expected)
    # Options nn.Embedding keeps to itself: its own forward, so the gradient is scaled by the
    # ids' frequency (row 1 appears twice: half its plain gradient), which ours does not do.
    scaled = ts.Embedding(20, 6, scale_grad_by_freq=True).double()
    scaled(ids).sum().backward()
    plain = torch.zeros(20, 6, dtype=torch.float64).index_add_(0, ids.view(-1), torch.ones(4, 6, dtype=torch.float64))
    torch.testing.assert_close(scaled.weight.grad, plain / plain.clamp(min=1))


def test_switch_off_is_torch(monkeypatch):
    calls = []
    monkeypatch.setattr(ts.embedding.__globals__["_ref"], "embedding",
                        lambda *a: calls.append(a) or F.embedding(*a))
    monkeypatch.setattr(ts.config, "use_embedding", False)
    weight = torch.randn(5, 3)
    torch.testing.assert_close(ts.embedding(torch.tensor([4, 0]), weight), weight[[4, 0]])
    assert len(calls) == 1
