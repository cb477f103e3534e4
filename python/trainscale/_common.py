"""What the family modules (norm.py, activation.py, rope.py, fp8.py) share."""
import torch

ops = torch.ops.trainscale


def like(t):
    """A contiguous tensor of t's shape and dtype: the fake of an output allocated like t."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)
