"""mlp: the Llama MLP (gate / up / down projections around SwiGLU), forward and forward +
backward through autograd: ours with the activation recomputed in the backward
(SwiGLUMLP(fused=True)) against the unfused chain of cuBLAS GEMMs and our SwiGLU kernel,
eager PyTorch and torch.compile; measured here in Python, each gated on its relative L2 error
against a float32 run of the same inputs, with what autograd keeps for the backward."""
import sys

import torch
import torch.nn.functional as F

from .baselines import compile_fresh
from .measure import free_memory, gate_call, recorded, result_row, saved_bytes, suite_run, time_row

MLP_SUITE = "mlp"
MLP_DTYPE = torch.bfloat16
MLP_TOLERANCE = 1e-2  # the engine's bf16 tolerance (relative L2 error)
MLP_SHAPES = [(8192, 4096, 14336), (4096, 4096, 14336), (8192, 2048, 8192)]  # (T, H, F)
MLP_CPU_SHAPES = [(64, 32, 96)]
MLP_OPS = ("swiglu_mlp_forward", "swiglu_mlp_forward_backward")


def _mlp_eager(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def mlp_implementations(use_gpu):
    """(name, is ours, make) per implementation; make() -> fn(x, w_gate, w_up, w_down)."""
    from ..activation import swiglu_mlp

    def unfused(x, wg, wu, wd):
        return F.linear(torch.ops.trainscale.swiglu_forward(F.linear(x, wg), F.linear(x, wu)), wd)

    return [("trainscale" if use_gpu else "cpu-ref", True, lambda: swiglu_mlp), ("unfused", False, lambda: unfused),
            ("torch", False, lambda: _mlp_eager),
            ("torch-compile", False, lambda: compile_fresh(_mlp_eager))]


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
    available = [i for i in mlp_implementations(device.type == "cuda") if not impls or i[0] in impls]
    generator = torch.Generator(device=device).manual_seed(seed)
    elem = torch.tensor([], dtype=MLP_DTYPE).element_size()
    with suite_run(result):
        for n, (op, (t, h, f)) in enumerate(configs):
            x = torch.randn(t, h, generator=generator, device=device, dtype=MLP_DTYPE)
            weights = [torch.randn(shape, generator=generator, device=device, dtype=MLP_DTYPE).mul_(shape[1] ** -0.5)
                       .requires_grad_() for shape in ((f, h), (f, h), (h, f))]
            dy = torch.randn(t, h, generator=generator, device=device, dtype=MLP_DTYPE)
            ref_y, ref_dx = _mlp_float32(x, *[w.detach() for w in weights], dy)
            backward = op == "swiglu_mlp_forward_backward"
            x.requires_grad_()
            for name, ours, make in available:
                row = result_row(op, "activation", f"{t}x{h}x{f}", MLP_DTYPE, name, ours, device,
                                  device.type == "cuda" and timing["flush_l2"],
                                  (2 * t * h + 3 * h * f) * elem * (3 if backward else 1),
                                  (18 if backward else 6) * t * h * f,
                                  {"tolerance": MLP_TOLERANCE, "rows_checked": t, "rows_total": t, "rows": "all"})
                if progress:
                    print(f"[mlp {n + 1}/{len(configs)}] {row['case']} [{name}]", file=sys.stderr, flush=True)
                with recorded(row, ours, result, device):
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
                    if not gate_call(row, call, ref_y, lambda: x.grad, ref_dx if backward else None, MLP_TOLERANCE):
                        continue
                    if not backward:
                        row["extra_memory_bytes"] = saved_bytes(fn, inputs)
                    elif device.type == "cuda":
                        clear()
                        free_memory(device)
                        torch.cuda.synchronize(device)
                        torch.cuda.reset_peak_memory_stats(device)
                        base = torch.cuda.memory_allocated(device)
                        call()
                        torch.cuda.synchronize(device)
                        row["extra_memory_bytes"] = torch.cuda.max_memory_allocated(device) - base
                    time_row(row, call, device, timing, gemm_tflops)
            x.requires_grad_(False)
            del x, weights, dy, ref_y, ref_dx
