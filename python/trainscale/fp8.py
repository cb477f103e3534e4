"""The fp8 family (include/trainscale/fp8.h) as PyTorch functions: the fake implementation of
torch.ops.trainscale.fp8_quantize (python/csrc/fp8_ops.cc), and fp8_quantize."""
from typing import Tuple

import torch
from torch.library import register_fake

from . import reference as _ref
from ._common import contiguous_rows
from ._common import ops
from .selection import dispatch as _dispatch


# ---- fake implementations (shapes and dtypes only; torch.compile traces through these) ------

@register_fake("trainscale::fp8_quantize")
def _(x, dtype, granularity, power_of_two_scales, scales_m_major):
    m, n = x.shape
    if granularity == "row":
        s = (m,)
    else:
        tiles = (n + 127) // 128
        s = (tiles, (m + 3) // 4 * 4) if scales_m_major else (m, tiles)
    return x.new_empty((m, n), dtype=dtype), x.new_empty(s, dtype=torch.float32)


# ---- functions ------------------------------------------------------------------------------

def fp8_quantize(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                 granularity: str = "row", power_of_two_scales: bool = False,
                 scales_m_major: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantizes x [M, N] to fp8 with float32 dequantization scales per row ('row', [M]) or per
    1x128 tile ('1x128', [M, ceil(N/128)], or [ceil(N/128), align4(M)] when scales_m_major).
    Returns (q, scales) with x ~= q.float() * scales (broadcast per group)."""
    return _dispatch("fp8", "fp8_quantize", lambda x, *options: ops.fp8_quantize(contiguous_rows(x), *options),
                     _ref.fp8_quantize, x, dtype, granularity,
                     power_of_two_scales, scales_m_major)
