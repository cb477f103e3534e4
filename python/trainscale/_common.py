"""What the family modules (norm.py, activation.py, rope.py, fp8.py) share."""
import torch

ops = torch.ops.trainscale


def like(t):
    """A contiguous tensor of t's shape and dtype: the fake of an output allocated like t."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def contiguous_rows(x):
    """x when it is rows as the kernels take them (leading dims that flatten evenly strided, a row
    stride of at least the row length, unit stride within a row); otherwise a contiguous copy, so
    that the functions take any layout PyTorch's do (a view transposed across its leading dims,
    like Gemma 3's q / k before their norm, a transposed matrix, an expanded row)."""
    if x.is_contiguous():
        return x
    lead = [(n, st) for n, st in zip(x.shape[:-1], x.stride()[:-1]) if n != 1]
    flat = all(lead[i][1] == lead[i + 1][1] * lead[i + 1][0] for i in range(len(lead) - 1))
    rows_apart = not lead or lead[-1][1] >= x.shape[-1]
    unit = x.shape[-1] == 1 or x.stride(-1) == 1
    return x if x.numel() == 0 or (flat and rows_apart and unit) else x.contiguous()


def autocast_inputs(*tensors):
    """tensors, with the float32 ones cast to autocast's dtype while autocast is on for the first
    one's device, as autocast casts the inputs of the products it covers (F.linear, sdpa); None
    passes through."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t is not None and t.dtype == torch.float32 else t for t in tensors)
