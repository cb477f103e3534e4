"""TrainScale as PyTorch ops: fused LLM-training kernels (CUDA) with fp64 CPU references.

The ops live in ``torch.ops.trainscale`` (registered with the dispatcher for CPU and CUDA, with
fake implementations for torch.compile and autograd formulas); this package wraps them as
functions and ``torch.nn`` modules.
"""
import torch as _torch  # noqa: F401  (loads libtorch before the extension)

try:
    # Registers torch.ops.trainscale (dispatcher ops) and is the engine's Python module.
    from . import _C  # noqa: F401
except ImportError as _e:
    raise ImportError(
        f"trainscale: the compiled extension (_C.so) cannot be imported ({_e}); "
        "install the package with `pip install .` from the repository root") from _e

# The family modules register the ops' fake implementations and autograd formulas.
from . import activation, attention, embedding, fp8, loss, norm, optim, rope, softmax  # noqa: E402,F401
# (trainscale.attention is the function below; the module stays in sys.modules as trainscale.attention.)
from .attention import (attention, attention_varlen, attention_varlen_with_lse, attention_with_lse,  # noqa: E402
                        hf_attention_forward, register_hf_attention)
from .functional import (  # noqa: E402
    apply_rotary,
    cross_entropy,
    embedding,
    fp8_quantize,
    fused_add_rms_norm,
    fused_add_rms_norm_,
    geglu,
    gelu,
    layer_norm,
    linear_cross_entropy,
    rms_norm,
    rope_tables,
    silu,
    softmax,
    swiglu,
)
from .optim import newton_schulz  # noqa: E402
from .modules import (  # noqa: E402
    CrossEntropyLoss,
    Embedding,
    FusedAddRMSNorm,
    GeGLU,
    GeGLUMLP,
    LayerNorm,
    LinearCrossEntropyLoss,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    SwiGLUMLP,
)
from .patching import hf_apply_rotary_pos_emb, hf_causal_lm_loss, patch  # noqa: E402
from .selection import config, print_selection  # noqa: E402
from .vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "apply_rotary", "attention", "attention_varlen", "attention_varlen_with_lse", "attention_with_lse",
    "config", "cross_entropy", "embedding", "fp8_quantize", "fused_add_rms_norm", "fused_add_rms_norm_",
    "geglu", "gelu", "hf_apply_rotary_pos_emb", "hf_attention_forward", "hf_causal_lm_loss", "layer_norm",
    "linear_cross_entropy", "newton_schulz", "optim", "patch", "print_selection", "register_hf_attention",
    "rms_norm", "rope_tables", "silu", "softmax", "swiglu", "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
    "CrossEntropyLoss", "Embedding", "FusedAddRMSNorm", "GeGLU", "GeGLUMLP", "LayerNorm",
    "LinearCrossEntropyLoss", "RMSNorm", "RotaryEmbedding", "SwiGLU", "SwiGLUMLP",
]
