"""What the family modules (norm.py, activation.py, rope.py, fp8.py) share."""
import torch

ops = torch.ops.trainscale


def like(t):
    """A contiguous tensor of t's shape and dtype: the fake of an output allocated like t."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def contiguous_rows(x):
    """x when its rows flatten into evenly strided rows of unit stride, as the row kernels take
    them; otherwise a contiguous copy (a view transposed across its leading dims, like
    Gemma 3's q / k before their norm)."""
    lead = [(n, st) for n, st in zip(x.shape[:-1], x.stride()[:-1]) if n != 1]
    flat = all(lead[i][1] == lead[i + 1][1] * lead[i + 1][0] for i in range(len(lead) - 1))
    return x if x.numel() == 0 or (flat and (x.shape[-1] == 1 or x.stride(-1) == 1)) else x.contiguous()
