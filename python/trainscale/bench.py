"""python -m trainscale.bench: trainscale-bench's engine (gate against the fp64 reference, CUDA
events, L2 flush, stopping rule, statistics, JSON / CSV / Markdown reporters) run from Python,
with PyTorch eager, torch.compile(dynamic=False) and, when importable, Liger-Kernel and QuACK
timed next to ours on the same cases (the C++ registry's suites and shapes).

Each baseline gets the case's input tensors by name and returns its outputs in the case's
order; work it needs before the timed call (compilation, tables, the forward pass of a
backward) happens in its untimed setup. PyTorch callables are timed one call per CUDA event
pair (no CUDA graphs), so tiny shapes include their launch overhead.

The flce suite (fused linear cross-entropy, forward and backward through autograd) is measured
here in Python rather than by the engine's cases: it also reports each implementation's peak
memory, and its gate is a float32 reference on sampled rows (section "flce" below). So is the
muon suite (Newton-Schulz against eager and torch.compile, a Muon step over the 2-D parameters
of 4 Llama-3-8B decoder layers against torch.optim.Muon; section "muon"). Under torchrun the
muon suite times the Muon step of one process against the distributed one
(trainscale-distributed: each rank orthogonalizes its share, then all-gathers), every rank in
lockstep; rank 0 reports. So is the mlp suite (the Llama MLP with the activation recomputed in
the backward against the unfused chain, eager and torch.compile, with what autograd keeps for
the backward; section "mlp"), and the varlen suite (attention over packed sequences against our
batched kernel on the padded batch and PyTorch's SDPA; section "varlen").
"""
import argparse
import contextlib
import gc
import inspect
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from . import _C
from . import reference as ref

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


def _compile_fresh(fn):
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
            fn = _compile_fresh(eager) if compiled else eager
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


# ---- flce: fused linear cross-entropy, forward + backward ----------------------------------------

FLCE_SUITE = "flce"
FLCE_OP = "fused_linear_cross_entropy_forward_with_grad"  # loss and both gradients in one call
# (T, H, V): the Llama-3 8B head, then T x V at H 4096. On the CPU, where ours is the fp64
# reference, small shapes with the same code path.
FLCE_SHAPES = [(8192, 4096, 128256)] + [(t, 4096, v) for t in (2048, 8192, 32768) for v in (32000, 128256, 256000)
                                        if (t, v) != (8192, 128256)]
FLCE_CPU_SHAPES = [(64, 32, 500), (37, 24, 1001)]
FLCE_DTYPE = torch.bfloat16
FLCE_TOLERANCE = 1e-2  # the engine's bf16 tolerance (relative L2 error), src/bench/gate.cc
_FLCE_SAMPLE = 64  # tokens whose grad_hidden rows, and about as many classes whose grad_weight rows, are gated


def _flce_eager(h, w, t):
    return F.cross_entropy(F.linear(h, w), t)


def _flce_implementations(use_gpu):
    """(name, is ours, make) of each implementation available here; make() -> loss_fn(h, w, t)."""
    from .loss import linear_cross_entropy

    out = [("trainscale" if use_gpu else "cpu-ref", True, lambda: linear_cross_entropy),
           ("torch", False, lambda: _flce_eager),
           ("torch-compile", False, lambda: _compile_fresh(_flce_eager))]
    if hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        def torch_chunked():
            options = torch.nn.LinearCrossEntropyOptions()
            return lambda h, w, t: F.linear_cross_entropy(h, w, t, options=options)
        out.append(("torch-linear-ce", False, torch_chunked))
    if use_gpu:
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError:
            pass
        else:
            def liger():
                loss = LigerFusedLinearCrossEntropyLoss()
                return lambda h, w, t: loss(w, h, t)
            out.append(("liger", False, liger))
    return out


def _flce_run(loss_fn, h, w, t):
    """A call of forward and backward: (loss, grad_hidden, grad_weight), as training does it."""
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()

    def run():
        loss = loss_fn(h, w, t)
        return (loss.detach(), *torch.autograd.grad(loss, (h, w)))
    return run


def _flce_reference(h, w, t, sampler):
    """The mean cross-entropy of h @ w.T in float32 (tokens in chunks, so no [T, V] logits), with
    the rows of grad_hidden of sampled tokens and of grad_weight of sampled classes (the targets
    of some of those tokens and as many random classes): (loss, tokens, grad_hidden[tokens],
    classes, grad_weight[classes])."""
    tokens_n, vocab = h.shape[0], w.shape[0]
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32
    try:
        hf, wf = h.float(), w.float()
        chunk = max(1, (1 << 28) // vocab)  # 1 GiB of float32 logits at a time
        lse = torch.cat([torch.logsumexp(hf[i:i + chunk] @ wf.T, -1) for i in range(0, tokens_n, chunk)])
        loss = (lse - (hf * wf[t]).sum(-1)).mean()
        perm = torch.randperm(tokens_n, generator=sampler).to(h.device)
        tokens = perm[:_FLCE_SAMPLE].sort().values
        probs = torch.softmax(hf[tokens] @ wf.T, -1)
        probs[torch.arange(len(tokens), device=h.device), t[tokens]] -= 1
        grad_hidden = probs @ wf / tokens_n
        random_classes = torch.randint(0, vocab, (_FLCE_SAMPLE // 2,), generator=sampler)
        classes = torch.cat([t[tokens[:_FLCE_SAMPLE // 2]], random_classes.to(h.device)]).unique()
        g = torch.exp(hf @ wf[classes].T - lse[:, None]) - (t[:, None] == classes[None, :]).float()
        grad_weight = g.T @ hf / tokens_n
        return loss, tokens, grad_hidden, classes, grad_weight
    finally:
        torch.set_float32_matmul_precision(precision)


def _flce_gate(outs, ref):
    """(rel_l2, max_abs_err, name of the worst output) of (loss, grad_hidden, grad_weight) against
    the reference's rows; NaN counts as an infinite error."""
    loss, grad_hidden, grad_weight = outs
    ref_loss, tokens, ref_hidden, classes, ref_weight = ref
    errors, max_abs = [], 0.0
    for name, got, want in (("loss", loss.reshape(1), ref_loss.reshape(1)),
                            ("grad_hidden", grad_hidden[tokens], ref_hidden),
                            ("grad_weight", grad_weight[classes], ref_weight)):
        diff = got.double() - want.double()
        rel = (diff.norm() / want.double().norm()).item()
        errors.append((math.inf if math.isnan(rel) else rel, name))
        max_abs = max(max_abs, diff.abs().max().item())
    rel, name = max(errors)
    return rel, max_abs, name


def _nbytes(tensors):
    return sum(x.numel() * x.element_size() for x in tensors)


def _row(op, family, dims, dtype, impl, ours, device, cold, nbytes, flops, gate):
    """A result row of a suite measured in Python (docs/bench-json.md), before measurement."""
    dtype = str(dtype).replace("torch.", "")
    return {"case": f"{op} {dims} {dtype}", "op": op, "family": family, "shape": dims, "dtype": dtype,
            "impl": impl, "baseline": not ours, "device": device.type, "status": "ok", "message": "",
            "timer": "", "batch": 1, "cold": cold, "rotate": 1, "stop_reason": "",
            "bytes": nbytes, "flops": flops, "bound": "compute", "gate": gate}


def _flce_row(shape, impl, ours, device, cold):
    t, h, v = shape
    elem = torch.tensor([], dtype=FLCE_DTYPE).element_size()
    return _row(FLCE_OP, "loss", f"{t}x{h}x{v}", FLCE_DTYPE, impl, ours, device, cold,
                2 * (t + v) * h * elem + t * 8 + 4, 6 * t * h * v,
                {"tolerance": FLCE_TOLERANCE, "rows_checked": min(t, _FLCE_SAMPLE), "rows_total": t,
                 "rows": "all" if t <= _FLCE_SAMPLE else "sample"})


def _free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _flce_measure(row, make, inputs, ref, device, timing, gemm_tflops):
    """Fills row: gate, then (CUDA) peak memory beyond inputs and outputs of one call, then time."""
    run = _flce_run(make(), *inputs)
    run()  # compiles / tunes / warms up, untimed
    _free_memory(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    outs = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out_bytes = _nbytes(outs)
        row["extra_memory_bytes"] = torch.cuda.max_memory_allocated(device) - base - out_bytes
        row["peak_memory_bytes"] = row["extra_memory_bytes"] + out_bytes
    rel, max_abs, worst = _flce_gate(outs, ref)
    row["gate"].update(rel_l2=rel, max_abs_err=max_abs)  # non-finite: null in the JSON (_finite)
    del outs
    if not rel <= FLCE_TOLERANCE:
        row.update(status="failed", message=f"relative L2 error {rel:.3g} > tolerance {FLCE_TOLERANCE:g} ({worst})")
        return
    _time_row(row, run, device, timing, gemm_tflops)


def _time_row(row, run, device, timing, gemm_tflops):
    """Times run() with the engine's stopping rule and fills row's time, rates and clocks."""
    stats = _C.time_callable(run, device.index if device.type == "cuda" else -1, timing)
    ms = stats["median"]
    row.update(timer=stats["timer"], stop_reason=stats["stop_reason"],
               ms={k: stats[k] for k in ("count", "median", "mean", "std", "min", "max", "p5", "p95", "p99",
                                         "rel_noise")},
               gbps=row["bytes"] / ms / 1e6, tflops=row["flops"] / ms / 1e9,
               pct_roofline=100 * row["flops"] / ms / 1e9 / gemm_tflops if gemm_tflops else None,
               clocks={"sm_mhz_min": stats["sm_mhz_min"], "sm_mhz_max": stats["sm_mhz_max"],
                       "throttle_retakes": stats["throttle_retakes"], "throttled": stats["throttled"],
                       "throttle_reasons": stats["throttle_reasons"]})


MUON_LOCKSTEP_WARMUP = 3
MUON_LOCKSTEP_SAMPLES = 20


def _time_row_lockstep(row, run, device, gemm_tflops, gpus):
    """Times run() on every rank of torch.distributed the same number of times (the engine's
    adaptive stopping rule could stop the ranks at different counts, and a collective inside
    run() would then wait forever): MUON_LOCKSTEP_WARMUP untimed calls, then
    MUON_LOCKSTEP_SAMPLES samples, each started together after a barrier; a sample is this
    rank's time for the call (CUDA events on a GPU). The engine's statistics on rank 0's samples;
    the % of roofline is against the GEMM peak of the `gpus` GPUs the call runs on."""
    import torch.distributed as dist
    cuda = device.type == "cuda"
    for _ in range(MUON_LOCKSTEP_WARMUP):
        run()
    samples = []
    for _ in range(MUON_LOCKSTEP_SAMPLES):
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            samples.append(1e3 * (time.perf_counter() - t0))
    stats = _C.summarize(samples)
    ms = stats["median"]
    row.update(timer=("cuda-events" if cuda else "host") + f", lockstep over {dist.get_world_size()} ranks",
               stop_reason="fixed count",
               ms={k: stats[k] for k in ("count", "median", "mean", "std", "min", "max", "p5", "p95", "p99",
                                         "rel_noise")},
               gbps=row["bytes"] / ms / 1e6, tflops=row["flops"] / ms / 1e9,
               pct_roofline=100 * row["flops"] / ms / 1e9 / (gemm_tflops * gpus) if gemm_tflops else None)


def flce_configs(use_gpu, configs=()):
    """The suite's (T, H, V) here, only those named in configs ("TxHxV") when given."""
    shapes = FLCE_SHAPES if use_gpu else FLCE_CPU_SHAPES
    return [s for s in shapes if not configs or "x".join(map(str, s)) in configs]


@contextlib.contextmanager
def _suite_run(result):
    """The measuring loop of a suite run in Python: Ctrl-C stops it with the rows so far
    (meta.interrupted), and its wall time adds to meta.wall_seconds."""
    started = time.monotonic()
    try:
        yield
    except KeyboardInterrupt:
        result["meta"]["interrupted"] = True
    result["meta"]["wall_seconds"] = result["meta"].get("wall_seconds", 0.0) + time.monotonic() - started


@contextlib.contextmanager
def _recorded(row, ours, result, device):
    """One row's measurement: a failure goes into the row as the engine reports it (out of memory:
    failed for ours, whose memory is bounded, unsupported for a baseline; NotImplementedError:
    unsupported), Ctrl-C marks it interrupted and goes on up; the row is appended and the
    memory freed either way."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        row.update(status="failed" if ours else "unsupported", message=f"skipped (OOM): {str(e).splitlines()[0]}")
    except NotImplementedError as e:
        row.update(status="unsupported", message=str(e))
    except KeyboardInterrupt:
        row.update(status="interrupted", message="interrupted")
        raise
    except Exception as e:  # noqa: BLE001 (reported in the row, like the engine does)
        row.update(status="failed", message=f"{type(e).__name__}: {e}"[:500])
    finally:
        result["rows"].append(row)
        _free_memory(device)


def run_flce(result, shapes, impls, device, timing, seed, progress):
    """Appends the flce rows of these shapes and implementations (all when impls is empty) to
    result (the JSON document of docs/bench-json.md): each implementation on the same inputs,
    gated against _flce_reference, its peak memory measured (CUDA), then timed. A baseline that
    runs out of memory is reported unsupported ("skipped (OOM)"), and the run goes on. Ctrl-C
    stops it with the rows so far (meta.interrupted)."""
    gemm_tflops = (result.get("roofline") or {}).get("gemm_bf16_tflops")
    available = [i for i in _flce_implementations(device.type == "cuda") if not impls or i[0] in impls]
    generator = torch.Generator(device=device).manual_seed(seed)  # inputs made where they are used
    sampler = torch.Generator().manual_seed(seed)  # the gated rows
    with _suite_run(result):
        for n, shape in enumerate(shapes):
            t, h, v = shape
            hidden = torch.randn(t, h, generator=generator, device=device, dtype=FLCE_DTYPE)
            weight = torch.randn(v, h, generator=generator, device=device, dtype=FLCE_DTYPE).mul_(h ** -0.5)
            target = torch.randint(0, v, (t,), generator=generator, device=device)
            ref = _flce_reference(hidden, weight, target, sampler)
            _free_memory(device)
            for name, ours, make in available:
                row = _flce_row(shape, name, ours, device, device.type == "cuda" and timing["flush_l2"])
                if progress:
                    print(f"[flce {n + 1}/{len(shapes)}] {row['case']} [{name}]", file=sys.stderr, flush=True)
                with _recorded(row, ours, result, device):
                    _flce_measure(row, make, (hidden, weight, target), ref, device, timing, gemm_tflops)
            del hidden, weight, target, ref


# ---- muon: Newton-Schulz and the Muon step against eager PyTorch, torch.compile and
# torch.optim.Muon, measured here in Python (each implementation's own call, gated on its
# relative L2 error against a float32 computation on the same inputs).

MUON_SUITE = "muon"
MUON_DTYPE = torch.bfloat16
MUON_TOLERANCE = 5e-2  # bfloat16 Newton-Schulz (tests/newton_schulz_cuda_test.cc)
MUON_NS_SHAPES = [(4096, 4096), (8192, 8192), (4096, 14336)]
MUON_NS_CPU_SHAPES = [(64, 128), (96, 48)]
# The 2-D parameters of one decoder layer: q, k, v, o, gate, up, down (Llama-3-8B; on the CPU a
# tiny one of the same proportions).
MUON_LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
MUON_CPU_LAYER = [(64, 64), (16, 64), (16, 64), (64, 64), (224, 64), (224, 64), (64, 224)]
MUON_LAYERS = 4


def ns_flops(rows, cols):
    """FLOPs that 5 Newton-Schulz steps on a rows x cols matrix must do, one triangle of each
    symmetric product (X X^T, A A): 5 (3 p^2 q + p^3), p = min, q = max (dense: 5 (4 p^2 q + 2 p^3))."""
    p, q = min(rows, cols), max(rows, cols)
    return 5 * (3 * p * p * q + p ** 3)


def ns_eager(g, steps=5, eps=1e-7):
    """Newton-Schulz in eager PyTorch as Muon implementations write it (torch.optim.Muon's
    _zeropower_via_newtonschulz): bfloat16 products, addmm for B and X'."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    if g.size(0) > g.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.size(0) > g.size(1) else x


def _ns_float32(g, steps=5):
    """The gate's reference: the same iteration in float32 without TF32."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        x = g.float()
        x = x.T if g.size(0) > g.size(1) else x
        x = x / (x.norm() + 1e-7)
        for _ in range(steps):
            gram = x @ x.T
            x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
        return x.T if g.size(0) > g.size(1) else x
    finally:
        torch.set_float32_matmul_precision(precision)


def _rel_l2(got, want):
    rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
    return math.inf if math.isnan(rel) else rel


def _muon_implementations(use_gpu, distributed=False):
    """(op, name, is ours, make) per implementation; newton_schulz: make() -> fn(g); muon_step:
    make(params) -> optimizer; with distributed (torch.distributed initialized) also ours over
    every rank."""
    from .optim import Muon, newton_schulz

    ours = "trainscale" if use_gpu else "cpu-ref"
    out = [("newton_schulz", ours, True, lambda: newton_schulz), ("newton_schulz", "torch", False, lambda: ns_eager),
           ("newton_schulz", "torch-compile", False, lambda: _compile_fresh(ns_eager))]
    if distributed:
        # The distributed step is ours here and the one-process step its baseline, so that the
        # report's speedup column is the distributed gain.
        out.append(("muon_step", f"{ours}-distributed", True,
                    lambda params: Muon(params, lr=0.02, weight_decay=0.1, distributed=True)))
    out.append(("muon_step", ours, not distributed, lambda params: Muon(params, lr=0.02, weight_decay=0.1)))
    if hasattr(torch.optim, "Muon"):
        out.append(("muon_step", "torch-muon", False, lambda params: torch.optim.Muon(params, lr=0.02, weight_decay=0.1)))
    return out


def muon_configs(use_gpu):
    """(op, dims, shapes) of the suite here: newton_schulz per shape, muon_step over the 2-D
    parameters of MUON_LAYERS decoder layers."""
    layer = MUON_LAYER if use_gpu else MUON_CPU_LAYER
    out = [("newton_schulz", f"{r}x{c}", [(r, c)]) for r, c in (MUON_NS_SHAPES if use_gpu else MUON_NS_CPU_SHAPES)]
    out.append(("muon_step", f"{MUON_LAYERS}-layers-{layer[0][0]}-{layer[4][0]}", layer * MUON_LAYERS))
    return out


def _muon_case(op, shapes, device, generator):
    """Inputs, the gate's reference output and a run factory for one config: newton_schulz gets
    a matrix; muon_step fresh parameters (and gradients) per implementation, and its output is
    the first step's update of every parameter, concatenated."""
    if op == "newton_schulz":
        (r, c), = shapes
        g = torch.randn(r, c, generator=generator, device=device, dtype=MUON_DTYPE)
        return _ns_float32(g).reshape(-1), lambda make: (lambda fn: (lambda: fn(g), lambda: fn(g).reshape(-1)))(make())
    # Parameters of 1e-3: the gate compares each implementation's update (new minus old bfloat16
    # parameter) with the float32 one, and at the usual 0.02 the update (about lr / sqrt(n)) is
    # within a few bfloat16 ulps of the parameter, so rounding the new parameter alone moved it by
    # 10-25 % (torch.optim.Muon's as much as ours); at 1e-3 rounding costs about 1 %.
    start = [torch.randn(s, generator=generator, device=device, dtype=MUON_DTYPE).mul_(1e-3) for s in shapes]
    grads = [torch.randn(s, generator=generator, device=device, dtype=MUON_DTYPE) for s in shapes]
    # The first step from a zero buffer: u = (1 + momentum) g (Nesterov), update -lr (s NS(u) + wd p).
    ref = torch.cat([(p.float() * (1 - 0.02 * 0.1) - 0.02 * max(1, p.size(0) / p.size(1)) ** 0.5
                      * _ns_float32(1.95 * g) - p.float()).reshape(-1) for p, g in zip(start, grads)])

    def make_run(make):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        for p, g in zip(params, grads):
            p.grad = g
        opt = make(params)

        def first_update():
            before = [p.detach().clone() for p in params]
            opt.step()
            return torch.cat([(p.detach().float() - b.float()).reshape(-1) for p, b in zip(params, before)])
        return opt.step, first_update
    return ref, make_run


def run_muon(result, configs, impls, device, timing, seed, progress):
    """Appends the muon suite's rows (result: the JSON document of docs/bench-json.md): each
    implementation gated on its first call against the float32 reference, then timed."""
    import torch.distributed as dist
    distributed = dist.is_available() and dist.is_initialized()
    gemm_tflops = (result.get("roofline") or {}).get("gemm_bf16_tflops")
    available = [i for i in _muon_implementations(device.type == "cuda", distributed) if not impls or i[1] in impls]
    generator = torch.Generator(device=device).manual_seed(seed)
    elem = torch.tensor([], dtype=MUON_DTYPE).element_size()
    with _suite_run(result):
        for n, (op, dims, shapes) in enumerate(configs):
            ref, make_run = _muon_case(op, shapes, device, generator)
            numel = sum(r * c for r, c in shapes)
            # newton_schulz: g read, out written; muon_step: param read and written, grad read,
            # a float32 buffer read and written.
            nbytes = 2 * numel * elem if op == "newton_schulz" else numel * (3 * elem + 8)
            flops = sum(ns_flops(r, c) for r, c in shapes)
            for _, name, ours, make in (i for i in available if i[0] == op):
                row = _row(op, "newton_schulz", dims, MUON_DTYPE, name, ours, device,
                           device.type == "cuda" and timing["flush_l2"], nbytes, flops,
                           {"tolerance": MUON_TOLERANCE, "rows_checked": len(shapes), "rows_total": len(shapes),
                            "rows": "all"})
                if progress:
                    print(f"[muon {n + 1}/{len(configs)}] {row['case']} [{name}]", file=sys.stderr, flush=True)
                with _recorded(row, ours, result, device):
                    run, first = make_run(make)
                    rel = _rel_l2(first(), ref)
                    row["gate"].update(rel_l2=rel)
                    if not rel <= MUON_TOLERANCE:
                        # Every rank gates the same inputs, so all of them skip the timing together.
                        row.update(status="failed", message=f"relative L2 error {rel:.3g} > tolerance {MUON_TOLERANCE:g}")
                    elif distributed:
                        gpus = dist.get_world_size() if name.endswith("-distributed") else 1
                        _time_row_lockstep(row, run, device, gemm_tflops, gpus)
                    else:
                        _time_row(row, run, device, timing, gemm_tflops)


# ---- mlp: the Llama MLP (gate / up / down projections around SwiGLU), forward and forward +
# backward through autograd: ours with the activation recomputed in the backward
# (SwiGLUMLP(fused=True)) against the unfused chain of cuBLAS GEMMs and our SwiGLU kernel,
# eager PyTorch and torch.compile; measured here in Python, each gated on its relative L2 error
# against a float32 run of the same inputs, with what autograd keeps for the backward.

MLP_SUITE = "mlp"
MLP_DTYPE = torch.bfloat16
MLP_TOLERANCE = 1e-2  # the engine's bf16 tolerance (relative L2 error)
MLP_SHAPES = [(8192, 4096, 14336), (4096, 4096, 14336), (8192, 2048, 8192)]  # (T, H, F)
MLP_CPU_SHAPES = [(64, 32, 96)]
MLP_OPS = ("swiglu_mlp_forward", "swiglu_mlp_forward_backward")


def _mlp_eager(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def _mlp_implementations(use_gpu):
    """(name, is ours, make) per implementation; make() -> fn(x, w_gate, w_up, w_down)."""
    from .activation import swiglu_mlp

    def unfused(x, wg, wu, wd):
        return F.linear(torch.ops.trainscale.swiglu_forward(F.linear(x, wg), F.linear(x, wu)), wd)

    return [("trainscale" if use_gpu else "cpu-ref", True, lambda: swiglu_mlp), ("unfused", False, lambda: unfused),
            ("torch", False, lambda: _mlp_eager),
            ("torch-compile", False, lambda: _compile_fresh(_mlp_eager))]


def _saved_bytes(fn, inputs):
    """Bytes of the distinct tensors autograd keeps for fn(*inputs)'s backward, the inputs
    themselves (and views of them) excluded."""
    skip = {t.untyped_storage().data_ptr() for t in inputs}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(seen.values())


def _gate_call(row, call, ref_out, grad, ref_grad, tolerance):
    """Runs call() once (compiles / warms up, untimed) and gates its output, and with ref_grad
    the gradient grad() then returns, on the relative L2 error; False, the row failed, when it
    exceeds tolerance."""
    out = call()
    rel = _rel_l2(out.detach(), ref_out)
    if ref_grad is not None:
        rel = max(rel, _rel_l2(grad(), ref_grad))
    row["gate"].update(rel_l2=rel)
    if not rel <= tolerance:
        row.update(status="failed", message=f"relative L2 error {rel:.3g} > tolerance {tolerance:g}")
        return False
    return True


def _mlp_float32(x, wg, wu, wd, dy):
    """The gate's reference: y, and x's gradient for dy, in float32 without TF32."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        x32 = x.float().requires_grad_()
        y = _mlp_eager(x32, wg.float(), wu.float(), wd.float())
        y.backward(dy.float())
        return y.detach(), x32.grad
    finally:
        torch.set_float32_matmul_precision(precision)


def run_mlp(result, configs, impls, device, timing, seed, progress):
    """Appends the mlp suite's rows (result: the JSON document of docs/bench-json.md). Forward
    rows time a training forward (autograd recording) and report as extra memory what autograd
    keeps for the backward beyond the input and weights; forward + backward rows time both and
    report the peak memory of the call beyond the inputs, gradients included (CUDA). The gate: y
    (forward), y and x's gradient (forward + backward)."""
    gemm_tflops = (result.get("roofline") or {}).get("gemm_bf16_tflops")
    available = [i for i in _mlp_implementations(device.type == "cuda") if not impls or i[0] in impls]
    generator = torch.Generator(device=device).manual_seed(seed)
    elem = torch.tensor([], dtype=MLP_DTYPE).element_size()
    with _suite_run(result):
        for n, (op, (t, h, f)) in enumerate(configs):
            x = torch.randn(t, h, generator=generator, device=device, dtype=MLP_DTYPE)
            weights = [torch.randn(shape, generator=generator, device=device, dtype=MLP_DTYPE).mul_(shape[1] ** -0.5)
                       .requires_grad_() for shape in ((f, h), (f, h), (h, f))]
            dy = torch.randn(t, h, generator=generator, device=device, dtype=MLP_DTYPE)
            ref_y, ref_dx = _mlp_float32(x, *[w.detach() for w in weights], dy)
            backward = op == "swiglu_mlp_forward_backward"
            x.requires_grad_()
            for name, ours, make in available:
                row = _row(op, "activation", f"{t}x{h}x{f}", MLP_DTYPE, name, ours, device,
                           device.type == "cuda" and timing["flush_l2"], (2 * t * h + 3 * h * f) * elem * (3 if backward else 1),
                           (18 if backward else 6) * t * h * f,
                           {"tolerance": MLP_TOLERANCE, "rows_checked": t, "rows_total": t, "rows": "all"})
                if progress:
                    print(f"[mlp {n + 1}/{len(configs)}] {row['case']} [{name}]", file=sys.stderr, flush=True)
                with _recorded(row, ours, result, device):
                    fn = make()
                    inputs = (x, *weights)

                    def clear():
                        for t in inputs:
                            t.grad = None

                    def call():
                        clear()
                        y = fn(*inputs)
                        if backward:
                            y.backward(dy)
                        return y
                    if not _gate_call(row, call, ref_y, lambda: x.grad, ref_dx if backward else None, MLP_TOLERANCE):
                        continue
                    if not backward:
                        row["extra_memory_bytes"] = _saved_bytes(fn, inputs)
                    elif device.type == "cuda":
                        clear()
                        _free_memory(device)
                        torch.cuda.synchronize(device)
                        torch.cuda.reset_peak_memory_stats(device)
                        base = torch.cuda.memory_allocated(device)
                        call()
                        torch.cuda.synchronize(device)
                        row["extra_memory_bytes"] = torch.cuda.max_memory_allocated(device) - base
                    _time_row(row, call, device, timing, gemm_tflops)
            x.requires_grad_(False)
            del x, weights, dy, ref_y, ref_dx


# ---- varlen: attention over packed sequences (a padding-free batch), causal, forward and forward
# + backward through autograd: ours (attention_varlen) against our batched kernel on the batch
# padded to the longest sequence, PyTorch's SDPA on nested (jagged) tensors (FlashAttention's
# varlen kernel on CUDA) and SDPA with a block-diagonal causal mask over the packed row (what a
# model's sdpa attention does with such a mask); each gated on the relative L2 error of out (and
# dq) against a float32 run of every sequence alone.

VARLEN_SUITE = "varlen"
VARLEN_DTYPE = torch.bfloat16
VARLEN_TOLERANCE = 1e-2  # the engine's bf16 tolerance (relative L2 error)
# (tokens, query heads, kv heads, head dim, mean sequence length): Llama-3 8B's heads.
VARLEN_SHAPES = [(16384, 32, 8, 128, 2048), (16384, 32, 8, 128, 512), (16384, 32, 8, 128, 128)]
VARLEN_CPU_SHAPES = [(40, 4, 2, 16, 8)]
VARLEN_OPS = ("attention_varlen_forward", "attention_varlen_forward_backward")


def _varlen_lengths(tokens, mean):
    """Sequence lengths cycling through 1/2, 3/2, 1/4 and 7/4 of the mean, the last one cut so
    that they sum to `tokens`."""
    pattern = [max(1, mean * k // 4) for k in (2, 6, 1, 7)]
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(pattern[len(lengths) % 4], tokens - sum(lengths)))
    return lengths


def _varlen_implementations(use_gpu):
    """(name, is ours, fn) per implementation; fn(q, k, v, lengths, cu) -> out [T, Hq, D] for the
    packed q [T, Hq, D], k / v [T, Hkv, D], cu the int32 offsets on q's device."""
    from .attention import attention, attention_varlen

    def varlen(q, k, v, lengths, cu):
        return attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)

    def padded(q, k, v, lengths, cu):
        # Causal: a query never sees the keys padded after its sequence's end.
        batch = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                        torch.tensor(lengths, device=q.device))
        position = torch.arange(q.shape[0], device=q.device) - cu.long()[batch]

        def pad(t):
            out = t.new_zeros(len(lengths), max(lengths), *t.shape[1:])
            return out.index_put((batch, position), t)
        return attention(pad(q), pad(k), pad(v), causal=True)[batch, position]

    def nested(q, k, v, lengths, cu):
        group = q.shape[1] // k.shape[1]
        offsets = cu.long()
        qn, kn, vn = (torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2)
                      for t in (q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)))
        return F.scaled_dot_product_attention(qn, kn, vn, is_causal=True).transpose(1, 2).values()

    def masked(q, k, v, lengths, cu):
        batch = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                        torch.tensor(lengths, device=q.device))
        mask = (batch[:, None] == batch[None, :]).tril()
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)
    return [("trainscale" if use_gpu else "cpu-ref", True, varlen), ("trainscale-padded", False, padded),
            ("torch-sdpa-nested", False, nested), ("torch-sdpa-mask", False, masked)]


def _varlen_float32(q, k, v, lengths, cu, dout):
    """The gate's reference: out, and q's gradient for dout, every sequence alone in float32."""
    q32, k32, v32 = (t.detach().float().requires_grad_(t is q) for t in (q, k, v))
    outs = []
    for b, n in enumerate(lengths):
        s = slice(int(cu[b]), int(cu[b]) + n)
        outs.append(F.scaled_dot_product_attention(q32[s].transpose(0, 1)[None], k32[s].transpose(0, 1)[None],
                                                   v32[s].transpose(0, 1)[None], is_causal=True,
                                                   enable_gqa=True)[0].transpose(0, 1))
    out = torch.cat(outs)
    out.backward(dout.float())
    return out.detach(), q32.grad


def run_varlen(result, configs, impls, device, timing, seed, progress):
    """Appends the varlen suite's rows (result: the JSON document of docs/bench-json.md): each
    implementation on the same packed inputs, gated on out (and dq for forward + backward), then
    timed. FLOPs: the causal half of 4 L^2 D per query head and sequence (x 3.5 with the
    backward)."""
    gemm_tflops = (result.get("roofline") or {}).get("gemm_bf16_tflops")
    available = [i for i in _varlen_implementations(device.type == "cuda") if not impls or i[0] in impls]
    generator = torch.Generator(device=device).manual_seed(seed)
    elem = torch.tensor([], dtype=VARLEN_DTYPE).element_size()
    with _suite_run(result):
        for n, (op, (tokens, hq, hkv, d, mean)) in enumerate(configs):
            lengths = _varlen_lengths(tokens, mean)
            cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
            q = torch.randn(tokens, hq, d, generator=generator, device=device, dtype=VARLEN_DTYPE)
            k, v = (torch.randn(tokens, hkv, d, generator=generator, device=device, dtype=VARLEN_DTYPE)
                    for _ in range(2))
            dout = torch.randn(tokens, hq, d, generator=generator, device=device, dtype=VARLEN_DTYPE)
            ref_out, ref_dq = _varlen_float32(q, k, v, lengths, cu, dout)
            backward = op == "attention_varlen_forward_backward"
            forward_flops = sum(2 * n_ * n_ * d * hq for n_ in lengths)
            for x in (q, k, v):
                x.requires_grad_(backward)
            for name, ours, fn in available:
                row = _row(op, "attention", f"{tokens}x{hq}x{hkv}x{d}x{mean}", VARLEN_DTYPE, name, ours, device,
                           device.type == "cuda" and timing["flush_l2"],
                           (2 * hq + 2 * hkv) * tokens * d * elem * (2 if backward else 1),
                           forward_flops * (3.5 if backward else 1.0),
                           {"tolerance": VARLEN_TOLERANCE, "rows_checked": tokens, "rows_total": tokens, "rows": "all"})
                if progress:
                    print(f"[varlen {n + 1}/{len(configs)}] {row['case']} [{name}]", file=sys.stderr, flush=True)
                with _recorded(row, ours, result, device):
                    def call():
                        for x in (q, k, v):
                            x.grad = None
                        out = fn(q, k, v, lengths, cu)
                        if backward:
                            out.backward(dout)
                        return out
                    if not _gate_call(row, call, ref_out, lambda: q.grad, ref_dq if backward else None,
                                      VARLEN_TOLERANCE):
                        continue
                    _time_row(row, call, device, timing, gemm_tflops)
            del q, k, v, dout, ref_out, ref_dq


def _format_gib(n):
    return f"{n / 2**30:.2f}"


def memory_table(result, markdown):
    """Peak memory beyond inputs and outputs per case and implementation (flce rows on CUDA;
    "" when there are none)."""
    rows = [r for r in result["rows"] if r["op"] == FLCE_OP and r["device"] == "cuda"]
    if not rows:
        return ""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    cell = {(r["case"], r["impl"]): "OOM" if r["message"].startswith("skipped (OOM)") else
            _format_gib(r["extra_memory_bytes"]) if "extra_memory_bytes" in r else "-" for r in rows}
    lines = [["Case"] + impls] + [[c] + [cell.get((c, i), "-") for i in impls] for c in cases]
    title = "Peak memory beyond inputs and outputs (GiB)"
    if markdown:
        out = [f"## {title}", "", "| " + " | ".join(lines[0]) + " |", "|---" + "|---:" * len(impls) + "|"]
        out += ["| " + " | ".join(line) + " |" for line in lines[1:]]
        return "\n".join(out) + "\n"
    widths = [max(len(line[k]) for line in lines) for k in range(len(lines[0]))]
    text = [title + ":"]
    for k, line in enumerate(lines):
        text.append(" | ".join([line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:])]))
        if k == 0:
            text.append("-" * len(text[-1]))
    return "\n".join(text) + "\n"


def plot(result, path):
    """GB/s (TFLOP/s for compute-bound ops such as flce's) per shape and implementation, one panel
    per (op, dtype)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["status"] == "ok"]
    panels = sorted({(r["op"], r["dtype"]) for r in rows})
    if not panels:
        raise SystemExit("trainscale.bench: --plot: no timed rows to plot")
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for ax, (op, dtype) in zip(axes[:, 0], panels):
        sel = [r for r in rows if r["op"] == op and r["dtype"] == dtype]
        shapes = list(dict.fromkeys(r["shape"] for r in sel))
        impls = list(dict.fromkeys(r["impl"] for r in sel))
        width = 0.8 / len(impls)
        metric, unit = ("tflops", "TFLOP/s") if sel[0]["bound"] == "compute" else ("gbps", "GB/s")
        for k, impl in enumerate(impls):
            values = {r["shape"]: r[metric] for r in sel if r["impl"] == impl}
            xs = [i + k * width for i, s in enumerate(shapes) if s in values]
            ax.bar(xs, [values[s] for s in shapes if s in values], width, label=impl)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], shapes, fontsize=8)
        ax.set_title(f"{op} {dtype}")
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _csv_list(text):
    return [s for s in text.split(",") if s] if text else []


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m trainscale.bench", description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 when every implementation of ours passed its gate and ran; 1 when one of ours "
               "failed or errored (a baseline that fails its gate is reported FAILED but does not fail the run); "
               "130 when interrupted (Ctrl-C writes the results so far). On a GPU, ops that have only their CPU "
               "reference are listed as such and not run.")
    p.add_argument("--suite", default=None, help="suites, comma-separated (default: llama on a GPU, smoke on the CPU); "
                                                 f"{FLCE_SUITE}, {MUON_SUITE}, {MLP_SUITE} and {VARLEN_SUITE} run "
                                                 "alone")
    p.add_argument("--ops", default="", help="only these ops (--list shows them)")
    p.add_argument("--dtype", default="", help="only these dtypes (fp32, fp16, bf16, ...)")
    p.add_argument("--configs", default="", help="only these shapes (dims joined by x)")
    p.add_argument("--impl", default="", help="only these implementations (trainscale / cpu-ref, torch, "
                                               "torch-compile, liger, quack; flce: also torch-linear-ce)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--gpu", type=int, default=0, help="CUDA device index")
    p.add_argument("--json"), p.add_argument("--csv"), p.add_argument("--md")
    p.add_argument("--plot", help="PNG of GB/s (TFLOP/s) per shape and implementation (needs matplotlib)")
    p.add_argument("--target-noise", type=float, default=0.005)
    p.add_argument("--min-samples", type=int, default=10)
    p.add_argument("--min-time-ms", type=float, default=50.0)
    p.add_argument("--timeout-ms", type=float, default=3000.0)
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--warm", action="store_true", help="no L2 flush before samples")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-roofline", action="store_true")
    p.add_argument("--list", action="store_true", help="print the selected configs and exit")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    if args.device == "cuda" and not (torch.cuda.is_available() and _C.has_cuda):
        p.error("--device cuda: no CUDA device, or trainscale was built without CUDA")
    use_gpu = args.device != "cpu" and torch.cuda.is_available() and _C.has_cuda
    suites = _csv_list(args.suite or ("llama" if use_gpu else "smoke"))
    timing = {"target_rel_noise": args.target_noise, "min_samples": args.min_samples,
              "min_time_ms": args.min_time_ms, "timeout_ms": args.timeout_ms, "warmup_ms": args.warmup_ms,
              "flush_l2": not args.warm}
    command_line = " ".join(["python -m trainscale.bench"] + sys.argv[1:])
    for python_suite, run in ((FLCE_SUITE, _main_flce), (MUON_SUITE, _main_muon), (MLP_SUITE, _main_mlp),
                              (VARLEN_SUITE, _main_varlen)):
        if python_suite in suites:
            if len(suites) > 1:
                p.error(f"--suite {python_suite} runs alone (measured in Python, not by the engine)")
            return run(p, args, use_gpu, timing, command_line)
    if args.list:
        ops = set(_csv_list(args.ops))
        try:
            configs = _C.suite_configs(suites)
        except ValueError as e:
            p.error(str(e))
        for op, shape, dtype in configs:
            if not ops or op in ops:
                print(f"{op} {'x'.join(map(str, shape))} {dtype}")
        return 0
    try:
        text = _C.run_bench(suites, _csv_list(args.ops), _csv_list(args.dtype), _csv_list(args.configs),
                            _csv_list(args.impl), baselines(use_gpu), use_gpu, args.gpu, timing, args.seed,
                            not args.no_roofline, command_line, not args.quiet)
    except ValueError as e:
        p.error(str(e))
    return _report(args, text)


def _run_python_suite(suite, run, configs, impls, args, use_gpu, timing, command_line):
    """A suite measured here in Python: the engine's empty run (environment, roofline), then
    run(result, configs, impls, device, timing, seed, progress) adds its rows; reported as the
    engine's runs are."""
    result = json.loads(_C.empty_run(suite, use_gpu, args.gpu, timing, args.seed,
                                     use_gpu and not args.no_roofline, command_line))
    device = torch.device("cuda", args.gpu) if use_gpu else torch.device("cpu")
    run(result, configs, impls, device, timing, args.seed, not args.quiet)
    return _report(args, json.dumps(_finite(result), indent=2))


def _main_flce(p, args, use_gpu, timing, command_line):
    ops, impls = _csv_list(args.ops), _csv_list(args.impl)
    if any(op != FLCE_OP for op in ops):
        p.error(f"--ops: the {FLCE_SUITE} suite has one op, {FLCE_OP}")
    known = [name for name, _, _ in _flce_implementations(use_gpu)]
    if any(impl not in known for impl in impls):
        p.error(f"--impl: the {FLCE_SUITE} suite has {', '.join(known)} here")
    dtypes = _csv_list(args.dtype)
    wanted = not dtypes or any(d in ("bf16", "bfloat16") for d in dtypes)
    shapes = flce_configs(use_gpu, _csv_list(args.configs)) if wanted else []
    if args.list:
        for t, h, v in shapes:
            print(f"{FLCE_OP} {t}x{h}x{v} bfloat16")
        return 0
    return _run_python_suite(FLCE_SUITE, run_flce, shapes, impls, args, use_gpu, timing, command_line)


def _main_muon(p, args, use_gpu, timing, command_line):
    ops, impls = _csv_list(args.ops), _csv_list(args.impl)
    known_ops = {"newton_schulz", "muon_step"}
    if any(op not in known_ops for op in ops):
        p.error(f"--ops: the {MUON_SUITE} suite has {', '.join(sorted(known_ops))}")
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    known = {name for _, name, _, _ in _muon_implementations(use_gpu, distributed)}
    if any(impl not in known for impl in impls):
        p.error(f"--impl: the {MUON_SUITE} suite has {', '.join(sorted(known))} here")
    dtypes, configs = _csv_list(args.dtype), _csv_list(args.configs)
    wanted = not dtypes or any(d in ("bf16", "bfloat16") for d in dtypes)
    selected = [c for c in muon_configs(use_gpu) if wanted and (not ops or c[0] in ops) and (not configs or c[1] in configs)
                and (not distributed or c[0] == "muon_step")]  # Newton-Schulz has no distributed form
    if args.list:
        for op, dims, _ in selected:
            print(f"{op} {dims} bfloat16")
        return 0
    if distributed:
        _run_distributed_muon(args, use_gpu, selected, impls, timing, command_line)  # does not return
    return _run_python_suite(MUON_SUITE, run_muon, selected, impls, args, use_gpu, timing, command_line)


def _main_bf16_suite(suite, ops_of_suite, implementations, shapes, cpu_shapes, run):
    """main() of a bf16 suite measured in Python whose configs are its ops times its shapes (on the
    CPU its CPU shapes): checks --ops / --impl, selects by --dtype / --configs, lists or runs."""
    def main_suite(p, args, use_gpu, timing, command_line):
        ops, impls = _csv_list(args.ops), _csv_list(args.impl)
        if any(op not in ops_of_suite for op in ops):
            p.error(f"--ops: the {suite} suite has {', '.join(ops_of_suite)}")
        known = [name for name, _, _ in implementations(use_gpu)]
        if any(impl not in known for impl in impls):
            p.error(f"--impl: the {suite} suite has {', '.join(known)} here")
        dtypes, configs = _csv_list(args.dtype), _csv_list(args.configs)
        wanted = not dtypes or any(d in ("bf16", "bfloat16") for d in dtypes)
        selected = [(op, s) for op in ops_of_suite for s in (shapes if use_gpu else cpu_shapes)
                    if wanted and (not ops or op in ops) and (not configs or "x".join(map(str, s)) in configs)]
        if args.list:
            for op, s in selected:
                print(f"{op} {'x'.join(map(str, s))} bfloat16")
            return 0
        return _run_python_suite(suite, run, selected, impls, args, use_gpu, timing, command_line)
    return main_suite


_main_mlp = _main_bf16_suite(MLP_SUITE, MLP_OPS, _mlp_implementations, MLP_SHAPES, MLP_CPU_SHAPES, run_mlp)
_main_varlen = _main_bf16_suite(VARLEN_SUITE, VARLEN_OPS, _varlen_implementations, VARLEN_SHAPES, VARLEN_CPU_SHAPES,
                                run_varlen)


def _run_distributed_muon(args, use_gpu, selected, impls, timing, command_line):
    """The muon suite under torchrun: NCCL on GPUs (one per rank, the LOCAL_RANK-th), gloo on the
    CPU. Rank 0 reports as _run_python_suite does; every rank then leaves through exit_worker."""
    import torch.distributed as dist

    from ._distributed import exit_worker
    if use_gpu:
        args.gpu = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(args.gpu)
    dist.init_process_group("nccl" if use_gpu else "gloo")
    rank = dist.get_rank()
    if rank != 0:
        args.json = args.csv = args.md = args.plot = None
        args.no_roofline = args.quiet = True
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            status = _run_python_suite(MUON_SUITE, run_muon, selected, impls, args, use_gpu, timing, command_line)
    else:
        status = _run_python_suite(MUON_SUITE, run_muon, selected, impls, args, use_gpu, timing, command_line)
    exit_worker(status)


def _finite(obj):
    """obj with NaN / Inf replaced by None, as the C++ writer does (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _report(args, text):
    """Writes the run's JSON text and its reports; returns the exit status."""
    # The measurements first: nothing after this can lose them.
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    result = json.loads(text)
    memory = memory_table(result, markdown=False)
    print(_C.report(text, "terminal") + ("\n" + memory if memory else ""), end="")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(_C.report(text, "csv"))
    if args.md:
        memory = memory_table(result, markdown=True)
        with open(args.md, "w") as f:
            f.write(_C.report(text, "markdown") + ("\n" + memory if memory else ""))
    if args.plot:
        plot(result, args.plot)
    if result["meta"]["interrupted"]:
        return 130
    # Ours failing fails the run; a baseline failing its gate is reported FAILED only.
    return 1 if any(r["status"] == "failed" and not r.get("baseline") for r in result["rows"]) else 0

if __name__ == "__main__":
    sys.exit(main())
