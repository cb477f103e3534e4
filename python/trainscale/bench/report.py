"""The reports of a run: the engine's terminal / CSV / Markdown reporters with the flce suite's
memory table, the JSON file, --plot, and the exit status."""
import json
import math

from .. import _C
from .flce import FLCE_OP


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


def finite(obj):
    """obj with NaN / Inf replaced by None, as the C++ writer does (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


def report(args, text):
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
