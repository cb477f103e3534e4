"""flce: fused linear cross-entropy, forward + backward."""
import math
import sys

import torch
import torch.nn.functional as F

from .baselines import compile_fresh
from .measure import free_memory, recorded, result_row, suite_run, time_row

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


def flce_implementations(use_gpu):
    """(name, is ours, make) of each implementation available here; make() -> loss_fn(h, w, t)."""
    from ..loss import linear_cross_entropy

    out = [("trainscale" if use_gpu else "cpu-ref", True, lambda: linear_cross_entropy),
           ("torch", False, lambda: _flce_eager),
           ("torch-compile", False, lambda: compile_fresh(_flce_eager))]
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


def _flce_row(shape, impl, ours, device, cold):
    t, h, v = shape
    elem = torch.tensor([], dtype=FLCE_DTYPE).element_size()
    return result_row(FLCE_OP, "loss", f"{t}x{h}x{v}", FLCE_DTYPE, impl, ours, device, cold,
                       2 * (t + v) * h * elem + t * 8 + 4, 6 * t * h * v,
                       {"tolerance": FLCE_TOLERANCE, "rows_checked": min(t, _FLCE_SAMPLE), "rows_total": t,
                        "rows": "all" if t <= _FLCE_SAMPLE else "sample"})


def _flce_measure(row, make, inputs, ref, device, timing, gemm_tflops):
    """Fills row: gate, then (CUDA) peak memory beyond inputs and outputs of one call, then time."""
    run = _flce_run(make(), *inputs)
    run()  # compiles / tunes / warms up, untimed
    free_memory(device)
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
    row["gate"].update(rel_l2=rel, max_abs_err=max_abs)  # non-finite: null in the JSON (report.finite)
    del outs
    if not rel <= FLCE_TOLERANCE:
        row.update(status="failed", message=f"relative L2 error {rel:.3g} > tolerance {FLCE_TOLERANCE:g} ({worst})")
        return
    time_row(row, run, device, timing, gemm_tflops)


def flce_configs(use_gpu, configs=()):
    """The suite's (T, H, V) here, only those named in configs ("TxHxV") when given."""
    shapes = FLCE_SHAPES if use_gpu else FLCE_CPU_SHAPES
    return [s for s in shapes if not configs or "x".join(map(str, s)) in configs]


def run_flce(result, shapes, impls, device, timing, seed, progress):
    """Appends the flce rows of these shapes and implementations (all when impls is empty) to
    result (the JSON document of docs/bench-json.md): each implementation on the same inputs,
    gated against _flce_reference, its peak memory measured (CUDA), then timed. A baseline that
    runs out of memory is reported unsupported ("skipped (OOM)"), and the run goes on. Ctrl-C
    stops it with the rows so far (meta.interrupted)."""
    gemm_tflops = (result.get("roofline") or {}).get("gemm_bf16_tflops")
    available = [i for i in flce_implementations(device.type == "cuda") if not impls or i[0] in impls]
    generator = torch.Generator(device=device).manual_seed(seed)  # inputs made where they are used
    sampler = torch.Generator().manual_seed(seed)  # the gated rows
    with suite_run(result):
        for n, shape in enumerate(shapes):
            t, h, v = shape
            hidden = torch.randn(t, h, generator=generator, device=device, dtype=FLCE_DTYPE)
            weight = torch.randn(v, h, generator=generator, device=device, dtype=FLCE_DTYPE).mul_(h ** -0.5)
            target = torch.randint(0, v, (t,), generator=generator, device=device)
            ref = _flce_reference(hidden, weight, target, sampler)
            free_memory(device)
            for name, ours, make in available:
                row = _flce_row(shape, name, ours, device, device.type == "cuda" and timing["flush_l2"])
                if progress:
                    print(f"[flce {n + 1}/{len(shapes)}] {row['case']} [{name}]", file=sys.stderr, flush=True)
                with recorded(row, ours, result, device):
                    _flce_measure(row, make, (hidden, weight, target), ref, device, timing, gemm_tflops)
            del hidden, weight, target, ref
