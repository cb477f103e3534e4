"""The baselines of the C++ engine's cases (the registry's suites): PyTorch eager, torch.compile
and, when importable, Liger-Kernel, QuACK and PyTorch's fused attention kernels (SDPA), each a
make(op, shape, dtype) -> setup(inputs) -> timed callable, or None for an op it does not have."""
import inspect

import torch
import torch.nn.functional as F

from .. import reference as ref

_aten = torch.ops.aten


def _rms_bwd(dy, x, w, rstd):
    # The case's saved rstd is an input (as in training), so the backward is written out rather
    # than taken from autograd, which would recompute it.
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    dyf, xf, r = dy.to(acc), x.to(acc), rstd.to(acc)[:, None]
    xhat = xf * r
    wdy = dyf * w.to(acc)
    dx = r * (wdy - xhat * (wdy * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(0).to(w.dtype)


def _swiglu_bwd(dy, a, b):
    return _aten.silu_backward(dy * b, a), dy * F.silu(a)


def _rope(t, cos, sin):
    return ref.apply_rotary(t["q"], t["k"], cos, sin)


def _layer_norm_bwd(dy, x, w, bias, mean, rstd):
    if not x.is_cuda:  # PyTorch's CPU kernel takes the statistics in x's dtype
        mean, rstd = mean.to(x.dtype), rstd.to(x.dtype)
    return _aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean[:, None], rstd[:, None], w, bias,
                                            [True, True, True])


def _fused_add_rms(x, residual, w):
    s = x + residual
    y, rstd = ref.rms_norm_with_rstd(s, w)
    return y, s, rstd


def _layer_norm_fwd(x, w, b):
    y, mean, rstd = _aten.native_layer_norm(x, [x.shape[-1]], w, b, 1e-5)
    if mean.dtype != torch.float32 and x.dtype != torch.float64:
        # PyTorch's CPU kernel returns bfloat16 / float16 statistics; training keeps them in float32.
        return ref.layer_norm_with_stats(x, w, b)
    return y, mean.reshape(-1), rstd.reshape(-1)


def _cross_entropy(logits, targets, with_grad):
    """(loss, lse[, grad_logits]) of the cases (mean over rows, no ignored target), float32 math."""
    x = logits.float()
    lse = torch.logsumexp(x, -1)
    loss = (lse - x.gather(1, targets[:, None])[:, 0]).mean()
    if not with_grad:
        return loss, lse
    grad = torch.exp(x - lse[:, None])
    grad.scatter_add_(1, targets[:, None], -torch.ones_like(lse)[:, None])
    return loss, lse, (grad / logits.shape[0]).to(logits.dtype)


# op -> (inputs, untimed state) -> outputs, in PyTorch. `prep` (optional) builds the state once.
_TORCH = {
    "rmsnorm_forward": lambda t, _: ref.rms_norm_with_rstd(t["x"], t["weight"]),
    "rmsnorm_backward": lambda t, _: _rms_bwd(t["dy"], t["x"], t["weight"], t["rstd"]),
    "fused_add_rmsnorm_forward": lambda t, _: _fused_add_rms(t["x"], t["residual"], t["weight"]),
    "layernorm_forward": lambda t, _: _layer_norm_fwd(t["x"], t["weight"], t["bias"]),
    "layernorm_backward": lambda t, bias: _layer_norm_bwd(t["dy"], t["x"], t["weight"], bias, t["mean"], t["rstd"]),
    "gelu_forward": lambda t, _: F.gelu(t["x"]),
    "gelu_backward": lambda t, _: _aten.gelu_backward(t["dy"], t["x"]),
    "gelu_forward_tanh": lambda t, _: F.gelu(t["x"], approximate="tanh"),
    "gelu_backward_tanh": lambda t, _: _aten.gelu_backward(t["dy"], t["x"], approximate="tanh"),
    "silu_forward": lambda t, _: F.silu(t["x"]),
    "silu_backward": lambda t, _: _aten.silu_backward(t["dy"], t["x"]),
    "swiglu_forward": lambda t, _: F.silu(t["a"]) * t["b"],
    "swiglu_backward": lambda t, _: _swiglu_bwd(t["dy"], t["a"], t["b"]),
    "swiglu_forward_packed": lambda t, _: ref.swiglu(t["ab"]),
    "swiglu_backward_packed": lambda t, _: torch.cat(_swiglu_bwd(t["dy"], *t["ab"].chunk(2, -1)), -1),
    "rope_forward": lambda t, cs: _rope(t, *cs),
    "rope_backward": lambda t, cs: _rope(t, cs[0], -cs[1]),  # rotation by -angle
    "softmax_forward": lambda t, _: torch.softmax(t["x"], -1),
    "softmax_backward": lambda t, _: _aten._softmax_backward_data(t["dy"], t["y"], -1, t["dy"].dtype),
    "cross_entropy_forward": lambda t, _: _cross_entropy(t["logits"], t["targets"], False),
    "cross_entropy_forward_with_grad": lambda t, _: _cross_entropy(t["logits"], t["targets"], True),
    "fp8_quantize_row": lambda t, _: ref.fp8_quantize(t["x"], granularity="row"),
    "fp8_quantize_1x128": lambda t, _: ref.fp8_quantize(t["x"], granularity="1x128"),
    # What F.embedding's autograd runs (the table's row count is the case's second dim).
    "embedding_backward": lambda t, vocab: _aten.embedding_dense_backward(t["grad_output"], t["ids"], vocab, -1, False),
}


_FP32_WEIGHT = "_fp32_weight"


def _base_op(op):
    """The op a case computes: "<op>_fp32_weight" (the training suite's norms with fp32 weight and
    bias, as mixed-precision training keeps them) is <op> on such tensors; the baselines take them
    as given (dw / db come back in the weight's dtype)."""
    return op[:-len(_FP32_WEIGHT)] if op.endswith(_FP32_WEIGHT) else op


def _prep(op, t, shape):
    """Untimed state of an op: RoPE's cos / sin tables (ours computes angles in the kernel; a
    PyTorch model keeps tables); a bias for LayerNorm's backward (whose db PyTorch computes only
    when given one; its values are not read); the embedding table's row count."""
    if op == "embedding_backward":
        return shape[1]
    if op.startswith("rope"):
        q = t["q"]
        return ref.rope_angles(torch.arange(q.shape[1], device=q.device), q.shape[-1], 10000.0)
    if op == "layernorm_backward":
        return torch.zeros_like(t["weight"])
    return None


def compile_fresh(fn):
    """torch.compile(fn, dynamic=False) for one case: dynamo is reset first, since past its
    recompile limit (8 shapes of one function) torch.compile would silently run the rest eagerly."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def _torch_baseline(compiled):
    def make(op, shape, dtype):
        op = _base_op(op)
        eager = _TORCH.get(op)
        if eager is None:
            return None

        def setup(t):
            fn = compile_fresh(eager) if compiled else eager
            state = _prep(op, t, shape)
            fn(t, state)  # compiles (torch.compile) and warms up, untimed
            return lambda: fn(t, state)
        return setup
    return make


def _by_name(fn, **values):
    """fn called with the parameters it declares, by name: Liger's internal signatures change
    between releases. Declared parameters without a default that are not given get None."""
    params = inspect.signature(fn).parameters
    return fn(**{n: values.get(n) for n, p in params.items() if p.default is inspect.Parameter.empty or n in values})


def _liger_baseline():
    """Liger-Kernel's Triton kernels through its internal functions (they take saved statistics
    like the cases do): RMSNorm, fused add + RMSNorm and LayerNorm forward / backward, SwiGLU
    forward / backward, RoPE forward / backward and softmax forward / backward (its
    cross-entropy returns no lse, which the cases compare). Liger's SwiGLU backward and RoPE work in
    place, so each runs on copies made once, untimed, in setup: the gated (first) call sees the
    case's inputs; later timed calls move the same bytes."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward
        from liger_kernel.ops.layer_norm import layer_norm_backward, layer_norm_forward
        from liger_kernel.ops.rms_norm import rms_norm_backward, rms_norm_forward
        from liger_kernel.ops.rope import rope_backward, rope_forward
        from liger_kernel.ops.swiglu import swiglu_backward, swiglu_forward
    except ImportError:
        return None
    try:
        from liger_kernel.ops.softmax import _softmax_backward, _softmax_forward
    except ImportError:  # releases before its softmax
        _softmax_forward = _softmax_backward = None

    def forward(t):
        return _by_name(rms_norm_forward, X=t["x"], W=t["weight"], eps=1e-6, offset=0.0, casting_mode="llama")

    def rms_fwd(t):
        def run():
            out = forward(t)
            return out[0], out[2]
        return run

    def rms_bwd(t):
        fwd = forward(t)  # Liger's launch settings for this shape (BLOCK_SIZE, num_warps)
        settings = dict(BLOCK_SIZE=fwd[3], num_warps=fwd[4]) if len(fwd) > 5 else {}
        return lambda: tuple(_by_name(rms_norm_backward, dY=t["dy"], X=t["x"], W=t["weight"], RSTD=t["rstd"],
                                      offset=0.0, casting_mode=fwd[-1], in_place=False, **settings)[:2])

    def fused_add_fwd(t):
        def run():
            y, s, rstd = _by_name(fused_add_rms_norm_forward, X=t["x"], R=t["residual"], W=t["weight"], eps=1e-6,
                                  offset=0.0, casting_mode="llama")[:3]
            return y, s, rstd
        return run

    def ln_fwd(t):
        def run():
            y, _, mean, rstd = layer_norm_forward(t["x"], t["weight"], t["bias"], 1e-5)[:4]
            return y, mean, rstd
        return run

    def ln_bwd(t):
        bias = torch.zeros_like(t["weight"])  # its values are not read
        return lambda: tuple(_by_name(layer_norm_backward, dY=t["dy"], X=t["x"], W=t["weight"], B=bias,
                                      Mean=t["mean"], RSTD=t["rstd"])[:3])

    def swiglu_bwd(t):
        a, b = t["a"].clone(), t["b"].clone()
        return lambda: swiglu_backward(a, b, t["dy"])

    def rope(backward):
        def setup(t):
            cos, sin = _prep("rope", t, None)  # [S, D/2] float32, NeoX halves: Liger takes [S, D]
            cos, sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
            q, k = t["q"].clone(), t["k"].clone()  # [B, S, H, D]; Liger takes the [B, H, S, D] view
            fn = rope_backward if backward else rope_forward

            def run():
                fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
                return q, k
            return run
        return setup

    setups = {"rmsnorm_forward": rms_fwd, "rmsnorm_backward": rms_bwd, "fused_add_rmsnorm_forward": fused_add_fwd,
              "layernorm_forward": ln_fwd, "layernorm_backward": ln_bwd,
              "swiglu_forward": lambda t: (lambda: swiglu_forward(t["a"], t["b"])[2]), "swiglu_backward": swiglu_bwd,
              "rope_forward": rope(False), "rope_backward": rope(True)}
    if _softmax_forward is not None:
        def softmax_backward(t):
            settings = _softmax_forward(t["y"])[1:]  # Liger's launch settings for this shape
            return lambda: _softmax_backward(t["dy"], t["y"], *settings)
        setups["softmax_forward"] = lambda t: (lambda: _softmax_forward(t["x"])[0])
        setups["softmax_backward"] = softmax_backward
    return lambda op, shape, dtype: setups.get(_base_op(op))


def _quack_baseline():
    """QuACK's CuTe-DSL RMSNorm forward (out first, rstd last in what it returns)."""
    try:
        from quack.rmsnorm import rmsnorm_fwd
    except ImportError:
        return None

    def setup(t):
        def run():
            out = rmsnorm_fwd(t["x"], t["weight"], eps=1e-6, store_rstd=True)
            return out[0], out[-1]
        return run
    return lambda op, shape, dtype: setup if _base_op(op) == "rmsnorm_forward" else None


def _sdpa_baseline(backend):
    """PyTorch's fused attention kernels through the aten ops F.scaled_dot_product_attention
    dispatches to, which return (forward) and take (backward) the log-sum-exp the attention cases
    compare: backend "flash" (FlashAttention-2; forward and backward) or "cudnn" (forward; its
    backward is the C++ engine's cudnn baseline). bf16 / fp16 only. The cases' BSHD tensors go in
    as [B, H, S, D] views; with GQA, k and v are repeated to the query heads once in setup (the
    aten ops take equal head counts) and the backward's dk / dv summed back over each group
    (timed)."""
    def make(op, shape, dtype):
        ops = ("attention_forward",) if backend == "cudnn" else ("attention_forward", "attention_backward")
        if op not in ops or dtype not in ("bfloat16", "float16"):
            return None
        batch, q_heads, kv_heads, seq, _, causal = shape
        causal, group = bool(causal), q_heads // kv_heads

        def heads(t, name):
            x = t[name].transpose(1, 2)
            return x.repeat_interleave(group, dim=1) if group > 1 and name in ("k", "v") else x

        def forward(q, k, v):
            if backend == "flash":
                return _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
            return _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)

        def kv_grad(g):  # [B, Hq, S, D] -> [B, S, Hkv, D]
            if group > 1:
                g = g.unflatten(1, (kv_heads, group)).sum(2)
            return g.transpose(1, 2)

        def setup(t):
            q, k, v = heads(t, "q"), heads(t, "k"), heads(t, "v")
            if op == "attention_forward":
                def run():
                    out, lse = forward(q, k, v)[:2]
                    return out.transpose(1, 2), lse.reshape(batch, q_heads, seq)
                return run
            # The backward from the case's dout, out and lse; the rest of what the aten backward
            # takes (sequence offsets, RNG state) from one untimed forward.
            cum_q, cum_k, max_q, max_k, seed, offset = forward(q, k, v)[2:8]
            dout, out, lse = heads(t, "dout"), heads(t, "out"), t["lse"]

            def run():
                dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
                    dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)
                return dq.transpose(1, 2), kv_grad(dk), kv_grad(dv)
            return run
        return setup
    return make


def baselines(use_gpu):
    """(name, make) of every baseline available here; Liger, QuACK and PyTorch's fused attention
    kernels run on GPUs only."""
    out = [("torch", _torch_baseline(False)), ("torch-compile", _torch_baseline(True))]
    if use_gpu:
        out += [(name, make) for name, make in (("liger", _liger_baseline()), ("quack", _quack_baseline()))
                if make is not None]
        out += [("torch-sdpa-flash", _sdpa_baseline("flash")), ("torch-sdpa-cudnn", _sdpa_baseline("cudnn"))]
    return out
