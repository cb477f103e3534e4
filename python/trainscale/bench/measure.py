"""Helpers shared by the suites measured in Python (flce, muon, mlp, varlen): a result row
(docs/bench-json.md), its gate, timing with the engine's stopping rule, what autograd keeps,
and the measuring loop that records failures and Ctrl-C in the rows."""
import contextlib
import gc
import math
import time

import torch

from .. import _C


def result_row(op, family, dims, dtype, impl, ours, device, cold, nbytes, flops, gate):
    """A result row of a suite measured in Python (docs/bench-json.md), before measurement."""
    dtype = str(dtype).replace("torch.", "")
    return {"case": f"{op} {dims} {dtype}", "op": op, "family": family, "shape": dims, "dtype": dtype,
            "impl": impl, "baseline": not ours, "device": device.type, "status": "ok", "message": "",
            "timer": "", "batch": 1, "cold": cold, "rotate": 1, "stop_reason": "",
            "bytes": nbytes, "flops": flops, "bound": "compute", "gate": gate}


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_row(row, run, device, timing, gemm_tflops):
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


@contextlib.contextmanager
def suite_run(result):
    """The measuring loop of a suite run in Python: Ctrl-C stops it with the rows so far
    (meta.interrupted), and its wall time adds to meta.wall_seconds."""
    started = time.monotonic()
    try:
        yield
    except KeyboardInterrupt:
        result["meta"]["interrupted"] = True
    result["meta"]["wall_seconds"] = result["meta"].get("wall_seconds", 0.0) + time.monotonic() - started


@contextlib.contextmanager
def recorded(row, ours, result, device):
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
        free_memory(device)


def rel_l2(got, want):
    rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
    return math.inf if math.isnan(rel) else rel


def saved_bytes(fn, inputs):
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


def gate_call(row, call, ref_out, grad, ref_grad, tolerance):
    """Runs call() once (compiles / warms up, untimed) and gates its output, and with ref_grad
    the gradient grad() then returns, on the relative L2 error; False, the row failed, when it
    exceeds tolerance."""
    out = call()
    rel = rel_l2(out.detach(), ref_out)
    if ref_grad is not None:
        rel = max(rel, rel_l2(grad(), ref_grad))
    row["gate"].update(rel_l2=rel)
    if not rel <= tolerance:
        row.update(status="failed", message=f"relative L2 error {rel:.3g} > tolerance {tolerance:g}")
        return False
    return True
