"""One training step under torch.profiler (``python -m trainscale.train --profile-step N``): its
chrome trace (open it in Perfetto or chrome://tracing) and a text summary of where the step's
time went: kernel time by name and, on CUDA, the GPU's idle gaps between kernels with the host
call stack that launched the kernel after each gap. A host synchronization inside the step shows
there as a run of gaps whose kernels were launched after the GPU had run dry ("starved"): the
GPU then waits on the host kernel by kernel until the queue fills again."""
import collections
import contextlib
import json
import os
from typing import Iterator, List

import torch
from torch.profiler import ProfilerActivity, profile, record_function

STEP_RANGE = "trainscale.step"
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_HOST_CATS = ("cpu_op", "python_function", "user_annotation")


@contextlib.contextmanager
def profiled_step(stem: str, cuda: bool) -> Iterator[None]:
    """Profiles the body (one step, host and, with cuda, device activity with Python stacks) and
    writes ``stem.trace.json`` and ``stem.summary.txt``."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=True) as prof:
        with record_function(STEP_RANGE):
            yield
        if cuda:
            torch.cuda.synchronize()
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    prof.export_chrome_trace(stem + ".trace.json")
    with open(stem + ".trace.json") as f:
        events = json.load(f)["traceEvents"]
    with open(stem + ".summary.txt", "w") as f:
        f.write(summarize_trace(events))


def _short_stack(frames: List[str], depth: int = 5) -> str:
    """The innermost frames of the model's code and of the ops (not built-ins, nor nn.Module's call
    machinery)."""
    keep = [f for f in frames if "<built-in" not in f and not f.startswith("torch/nn/modules/module.py")]
    return " > ".join(f.split("/")[-1][:70] for f in keep[-depth:]) or "?"


def summarize_trace(events: list, top: int = 25) -> str:
    """The text summary of a chrome trace's events (profiled_step's; any torch.profiler trace with
    a ``trainscale.step`` range, or without one: then the whole trace)."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in complete if e.get("name") == STEP_RANGE and e.get("cat") == "user_annotation"]
    host = [e for e in complete if e.get("cat") in _HOST_CATS]
    device = sorted((e for e in complete if e.get("cat") in _DEVICE_CATS), key=lambda e: e["ts"])
    lines = []
    if steps:
        lines.append(f"step: {steps[0]['dur'] / 1e3:.2f} ms of host time (profiled)")
    if not device:
        lines.append("no GPU activity: host operators by inclusive time (nested operators count in each)")
        ops = collections.Counter()
        for e in host:
            if e.get("cat") == "cpu_op":
                ops[e["name"]] += e["dur"]
        lines += [f"{us / 1e3:9.3f} ms  {name[:110]}" for name, us in ops.most_common(top)]
        return "\n".join(lines) + "\n"

    launches = {e["args"].get("correlation"): e for e in complete if e.get("cat") in _LAUNCH_CATS and "args" in e}
    host_by_thread = collections.defaultdict(list)
    for e in host:
        host_by_thread[e.get("tid")].append(e)

    def stack_at(ts, tid):
        frames = sorted((e for e in host_by_thread[tid] if e["ts"] <= ts <= e["ts"] + e["dur"]), key=lambda e: e["ts"])
        return [e["name"] for e in frames]

    busy, end, gaps = 0.0, device[0]["ts"], []
    for i, e in enumerate(device):
        start, stop = e["ts"], e["ts"] + e["dur"]
        if start > end:
            gaps.append((start - end, i))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - device[0]["ts"]
    idle = sum(g for g, _ in gaps)
    lines.append(f"GPU: {span / 1e3:.2f} ms from the first kernel to the last, busy {busy / 1e3:.2f} ms, "
                 f"idle {idle / 1e3:.2f} ms in {len(gaps)} gaps")
    rows, by_stack = [], collections.Counter()
    for gap, i in gaps:
        launch = launches.get(device[i].get("args", {}).get("correlation"))
        before = device[i - 1]
        starved = launch is not None and launch["ts"] > before["ts"] + before["dur"]
        where = _short_stack(stack_at(launch["ts"], launch.get("tid"))) if launch else "?"
        rows.append((gap, before["name"], device[i]["name"], starved, where))
        by_stack[(where, starved)] += gap
    lines.append("largest gaps: us | kernel before | kernel after | launched after the GPU ran dry | launching stack")
    for gap, before, after, starved, where in sorted(rows, key=lambda r: -r[0])[:top]:
        lines.append(f"{gap:9.1f} | {before[:45]} | {after[:45]} | {'starved' if starved else 'waiting'} | {where}")
    lines.append("idle time by launching stack:")
    for (where, starved), gap in by_stack.most_common(top):
        lines.append(f"{gap / 1e3:9.3f} ms  {'starved' if starved else 'waiting'}  {where}")
    kernels = collections.Counter()
    for e in device:
        kernels[e["name"]] += e["dur"]
    lines.append("device time by kernel:")
    lines += [f"{us / 1e3:9.3f} ms  {name[:110]}" for name, us in kernels.most_common(top)]
    return "\n".join(lines) + "\n"
