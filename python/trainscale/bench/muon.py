"""muon: Newton-Schulz and the Muon step against eager PyTorch, torch.compile and
torch.optim.Muon, measured here in Python (each implementation's own call, gated on its
relative L2 error against a float32 computation on the same inputs)."""
import sys
import time

import torch

from .. import _C
from .baselines import compile_fresh
from .measure import recorded, rel_l2, result_row, suite_run, time_row

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
MUON_LOCKSTEP_WARMUP = 3
MUON_LOCKSTEP_SAMPLES = 20


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


def muon_implementations(use_gpu, distributed=False):
    """(op, name, is ours, make) per implementation; newton_schulz: make() -> fn(g); muon_step:
    make(params) -> optimizer; with distributed (torch.distributed initialized) also ours over
    every rank."""
    from ..optim import Muon, newton_schulz

    ours = "trainscale" if use_gpu else "cpu-ref"
    out = [("newton_schulz", ours, True, lambda: newton_schulz), ("newton_schulz", "torch", False, lambda: ns_eager),
           ("newton_schulz", "torch-compile", False, lambda: compile_fresh(ns_eager))]
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
    available = [i for i in muon_implementations(device.type == "cuda", distributed) if not impls or i[1] in impls]
    generator = torch.Generator(device=device).manual_seed(seed)
    elem = torch.tensor([], dtype=MUON_DTYPE).element_size()
    with suite_run(result):
        for n, (op, dims, shapes) in enumerate(configs):
            ref, make_run = _muon_case(op, shapes, device, generator)
            numel = sum(r * c for r, c in shapes)
            # newton_schulz: g read, out written; muon_step: param read and written, grad read,
            # a float32 buffer read and written.
            nbytes = 2 * numel * elem if op == "newton_schulz" else numel * (3 * elem + 8)
            flops = sum(ns_flops(r, c) for r, c in shapes)
            for _, name, ours, make in (i for i in available if i[0] == op):
                row = result_row(op, "newton_schulz", dims, MUON_DTYPE, name, ours, device,
                                  device.type == "cuda" and timing["flush_l2"], nbytes, flops,
                                  {"tolerance": MUON_TOLERANCE, "rows_checked": len(shapes), "rows_total": len(shapes),
                                   "rows": "all"})
                if progress:
                    print(f"[muon {n + 1}/{len(configs)}] {row['case']} [{name}]", file=sys.stderr, flush=True)
                with recorded(row, ours, result, device):
                    run, first = make_run(make)
                    rel = rel_l2(first(), ref)
                    row["gate"].update(rel_l2=rel)
                    if not rel <= MUON_TOLERANCE:
                        # Every rank gates the same inputs, so all of them skip the timing together.
                        row.update(status="failed", message=f"relative L2 error {rel:.3g} > tolerance {MUON_TOLERANCE:g}")
                    elif distributed:
                        gpus = dist.get_world_size() if name.endswith("-distributed") else 1
                        _time_row_lockstep(row, run, device, gemm_tflops, gpus)
                    else:
                        time_row(row, run, device, timing, gemm_tflops)
