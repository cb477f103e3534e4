"""Functions in the style of torch.nn.functional, backed by torch.ops.trainscale. Each lives in
its family's module (norm.py, activation.py, rope.py, fp8.py, softmax.py, loss.py, embedding.py, beside that
family's fake implementations and autograd formulas) and follows its trainscale.config switch (selection.py):
ours (the default), PyTorch's (trainscale.reference), or the faster of the two per shape
("auto"). docs/python.md maps each to its C++ entry point, bench op and torch op."""
from .activation import geglu, gelu, silu, swiglu, swiglu_mlp  # noqa: F401
from .embedding import embedding  # noqa: F401
from .fp8 import fp8_quantize  # noqa: F401
from .loss import cross_entropy, linear_cross_entropy  # noqa: F401
from .norm import fused_add_rms_norm, fused_add_rms_norm_, layer_norm, rms_norm  # noqa: F401
from .rope import apply_rotary, rope_tables  # noqa: F401
from .softmax import softmax  # noqa: F401
