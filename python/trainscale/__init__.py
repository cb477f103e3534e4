"""TrainScale as PyTorch ops: fused LLM-training kernels (CUDA) with fp64 CPU references.

The ops live in ``torch.ops.trainscale`` (registered with the dispatcher for CPU and CUDA, with
fake implementations for torch.compile and autograd formulas); this package wraps them as
functions and ``torch.nn`` modules.
"""
import glob as _glob
import os as _os

import torch as _torch


def _load_extension():
    here = _os.path.dirname(_os.path.abspath(__file__))
    libs = sorted(_glob.glob(_os.path.join(here, "_C*.so")))
    if not libs:
        raise ImportError(
            f"trainscale: the compiled extension (_C.so) is missing from {here}; "
            "install the package with `pip install .` from the repository root")
    _torch.ops.load_library(libs[0])


_load_extension()

from . import _ops  # noqa: E402,F401  (fake impls and autograd registrations)
from .functional import (  # noqa: E402
    apply_rotary,
    fp8_quantize,
    fused_add_rms_norm,
    fused_add_rms_norm_,
    gelu,
    layer_norm,
    rms_norm,
    rope_tables,
    silu,
    swiglu,
)
from .modules import (  # noqa: E402
    FusedAddRMSNorm,
    LayerNorm,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    SwiGLUMLP,
)

__version__ = "0.1.0"
__all__ = [
    "apply_rotary", "fp8_quantize", "fused_add_rms_norm", "fused_add_rms_norm_", "gelu",
    "layer_norm", "rms_norm", "rope_tables", "silu", "swiglu", "FusedAddRMSNorm", "LayerNorm",
    "RMSNorm", "RotaryEmbedding", "SwiGLU", "SwiGLUMLP",
]
