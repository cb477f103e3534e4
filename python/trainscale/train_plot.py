"""python -m trainscale.train --plot out.png a.jsonl b.jsonl ...: the runs' loss per step on one
axis, their tokens/s per step (warm-up steps left out) and their peak memory per step (GPU
max_memory_allocated, solid, and max_memory_reserved, dashed; the process's peak RSS for CPU
runs)."""
import json
import os


def read_log(path: str):
    """(run record, step records, summary or None) of a trainscale.train JSONL log."""
    run, steps, summary = None, [], None
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except ValueError as e:
                raise SystemExit(f"--plot: {path}:{number}: not JSON ({e})") from e
            kind = record.get("type")
            if kind == "run":
                run = record
            elif kind == "step":
                steps.append(record)
            elif kind == "summary":
                summary = record
    if run is None or not steps:
        raise SystemExit(f"--plot: {path}: expected a trainscale.train JSONL log (a run record and steps)")
    return run, steps, summary


def _label(path: str, run: dict, others) -> str:
    label = run["impl"]
    if sum(1 for r in others if r["impl"] == run["impl"]) > 1:  # same impl twice: tell them apart by file
        label += f" ({os.path.basename(path)})"
    return label


def plot(png: str, paths):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = [(path,) + read_log(path) for path in paths]
    runs = [run for _, run, _, _ in logs]
    fig, (loss_ax, speed_ax, mem_ax) = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for path, run, steps, _ in logs:
        label = _label(path, run, runs)
        xs = [s["step"] for s in steps]
        (line,) = loss_ax.plot(xs, [s["loss"] for s in steps], label=label)
        timed = [s for s in steps if not s["warmup"]]
        speed_ax.plot([s["step"] for s in timed], [s["tokens_per_s"] for s in timed], color=line.get_color(),
                      label=label)
        if steps[0]["peak_mem_allocated_gib"] is not None:
            mem_ax.plot(xs, [s["peak_mem_allocated_gib"] for s in steps], color=line.get_color(),
                        label=f"{label} allocated")
            mem_ax.plot(xs, [s["peak_mem_reserved_gib"] for s in steps], color=line.get_color(), linestyle="--",
                        label=f"{label} reserved")
        else:
            mem_ax.plot(xs, [s["peak_rss_gib"] for s in steps], color=line.get_color(), label=f"{label} RSS")
    first = runs[0]
    loss_ax.set_title(f"{first['preset']}, {first['data']} data, seq {first['seq_len']}, "
                      f"global batch {first['global_batch']}, {first['device']}")
    loss_ax.set_ylabel("loss")
    speed_ax.set_ylabel("tokens/s")
    mem_ax.set_ylabel("peak memory (GiB)")
    mem_ax.set_xlabel("step")
    for ax in (loss_ax, speed_ax, mem_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
