"""The command line of python -m trainscale.bench: main() parses it and runs the engine's
suites, or one suite measured in Python (flce, muon, mlp, varlen), and reports."""
import argparse
import contextlib
import json
import os
import sys

import torch

from .. import _C
from . import flce, mlp, muon, varlen
from .baselines import baselines
from .report import finite, report


def _csv_list(text):
    return [s for s in text.split(",") if s] if text else []


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m trainscale.bench", description=sys.modules[__package__].__doc__.split("\n\n")[0],
        epilog="Exit status: 0 when every implementation of ours passed its gate and ran; 1 when one of ours "
               "failed or errored (a baseline that fails its gate is reported FAILED but does not fail the run); "
               "130 when interrupted (Ctrl-C writes the results so far). On a GPU, ops that have only their CPU "
               "reference are listed as such and not run.")
    p.add_argument("--suite", default=None, help="suites, comma-separated (default: llama on a GPU, smoke on the CPU); "
                                                 f"{flce.FLCE_SUITE}, {muon.MUON_SUITE}, {mlp.MLP_SUITE} and "
                                                 f"{varlen.VARLEN_SUITE} run alone")
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
    for python_suite, run in ((flce.FLCE_SUITE, _main_flce), (muon.MUON_SUITE, _main_muon),
                              (mlp.MLP_SUITE, _main_mlp), (varlen.VARLEN_SUITE, _main_varlen)):
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
    return report(args, text)


def _run_python_suite(suite, run, configs, impls, args, use_gpu, timing, command_line):
    """A suite measured here in Python: the engine's empty run (environment, roofline), then
    run(result, configs, impls, device, timing, seed, progress) adds its rows; reported as the
    engine's runs are."""
    result = json.loads(_C.empty_run(suite, use_gpu, args.gpu, timing, args.seed,
                                     use_gpu and not args.no_roofline, command_line))
    device = torch.device("cuda", args.gpu) if use_gpu else torch.device("cpu")
    run(result, configs, impls, device, timing, args.seed, not args.quiet)
    return report(args, json.dumps(finite(result), indent=2))


def _main_flce(p, args, use_gpu, timing, command_line):
    ops, impls = _csv_list(args.ops), _csv_list(args.impl)
    if any(op != flce.FLCE_OP for op in ops):
        p.error(f"--ops: the {flce.FLCE_SUITE} suite has one op, {flce.FLCE_OP}")
    known = [name for name, _, _ in flce.flce_implementations(use_gpu)]
    if any(impl not in known for impl in impls):
        p.error(f"--impl: the {flce.FLCE_SUITE} suite has {', '.join(known)} here")
    dtypes = _csv_list(args.dtype)
    wanted = not dtypes or any(d in ("bf16", "bfloat16") for d in dtypes)
    shapes = flce.flce_configs(use_gpu, _csv_list(args.configs)) if wanted else []
    if args.list:
        for t, h, v in shapes:
            print(f"{flce.FLCE_OP} {t}x{h}x{v} bfloat16")
        return 0
    return _run_python_suite(flce.FLCE_SUITE, flce.run_flce, shapes, impls, args, use_gpu, timing, command_line)


def _main_muon(p, args, use_gpu, timing, command_line):
    ops, impls = _csv_list(args.ops), _csv_list(args.impl)
    known_ops = {"newton_schulz", "muon_step"}
    if any(op not in known_ops for op in ops):
        p.error(f"--ops: the {muon.MUON_SUITE} suite has {', '.join(sorted(known_ops))}")
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    known = {name for _, name, _, _ in muon.muon_implementations(use_gpu, distributed)}
    if any(impl not in known for impl in impls):
        p.error(f"--impl: the {muon.MUON_SUITE} suite has {', '.join(sorted(known))} here")
    dtypes, configs = _csv_list(args.dtype), _csv_list(args.configs)
    wanted = not dtypes or any(d in ("bf16", "bfloat16") for d in dtypes)
    selected = [c for c in muon.muon_configs(use_gpu)
                if wanted and (not ops or c[0] in ops) and (not configs or c[1] in configs)
                and (not distributed or c[0] == "muon_step")]  # Newton-Schulz has no distributed form
    if args.list:
        for op, dims, _ in selected:
            print(f"{op} {dims} bfloat16")
        return 0
    if distributed:
        _run_distributed_muon(args, use_gpu, selected, impls, timing, command_line)  # does not return
    return _run_python_suite(muon.MUON_SUITE, muon.run_muon, selected, impls, args, use_gpu, timing, command_line)


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


_main_mlp = _main_bf16_suite(mlp.MLP_SUITE, mlp.MLP_OPS, mlp.mlp_implementations, mlp.MLP_SHAPES, mlp.MLP_CPU_SHAPES,
                             mlp.run_mlp)
_main_varlen = _main_bf16_suite(varlen.VARLEN_SUITE, varlen.VARLEN_OPS, varlen.varlen_implementations,
                                varlen.VARLEN_SHAPES, varlen.VARLEN_CPU_SHAPES, varlen.run_varlen)


def _run_distributed_muon(args, use_gpu, selected, impls, timing, command_line):
    """The muon suite under torchrun: NCCL on GPUs (one per rank, the LOCAL_RANK-th), gloo on the
    CPU. Rank 0 reports as _run_python_suite does; every rank then leaves through exit_worker."""
    import torch.distributed as dist

    from .._distributed import exit_worker
    if use_gpu:
        args.gpu = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(args.gpu)
    dist.init_process_group("nccl" if use_gpu else "gloo")
    rank = dist.get_rank()
    suite = (muon.MUON_SUITE, muon.run_muon, selected, impls, args, use_gpu, timing, command_line)
    if rank != 0:
        args.json = args.csv = args.md = args.plot = None
        args.no_roofline = args.quiet = True
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            status = _run_python_suite(*suite)
    else:
        status = _run_python_suite(*suite)
    exit_worker(status)
