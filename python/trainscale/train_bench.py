"""python -m trainscale.train_bench: runs python -m trainscale.train once per implementation,
back to back, each in its own process with the same arguments (so the same model, data order,
steps and warm-up), and writes one table of their summaries: tokens/s, step time, model
TFLOP/s, MFU and peak memory over the steps after the warm-up, and the final loss (the mean of
the last five steps).

    python -m trainscale.train_bench --out-dir runs --impls eager,compile,liger,trainscale \\
        --preset llama3-8b-4layers --data random --seq-len 8192 --steps 30 --warmup-steps 5

Arguments other than --out-dir, --impls and --nproc-per-node go to trainscale.train; with
--nproc-per-node N > 1 each run is `torchrun --standalone --nproc-per-node N -m trainscale.train`
(add --parallel fsdp2 or ddp), and the table adds tokens/s per GPU. Writes
<out-dir>/<impl>.jsonl (each run's log), <out-dir>/<impl>.out (its terminal output),
<out-dir>/train-bench.json and .md (the table) and <out-dir>/train-bench.png (--plot of the
runs). An implementation that fails (e.g. liger without Liger-Kernel) gets a row with its
error; the exit status is then 1.
"""
import argparse
import json
import os
import subprocess
import sys

from .train import IMPLS
from .train_plot import plot, read_log

_COLUMNS = (("impl", "impl", "{}"), ("tokens_per_s", "tokens/s", "{:,.0f}"), ("step_time_s", "step ms", "{:.1f}"),
            ("tflops", "TFLOP/s", "{:.3g}"), ("mfu", "MFU %", "{:.3g}"),
            ("mfu_measured", "% of GEMM peak", "{:.3g}"),
            ("peak_mem_allocated_gib", "alloc GiB", "{:.2f}"), ("peak_mem_reserved_gib", "reserved GiB", "{:.2f}"),
            ("final_loss", "final loss", "{:.4f}"), ("loss_gap_pct", "max loss gap %", "{:.2f}"),
            ("status", "status", "{}"))
LOSS_WINDOW = 10  # steps averaged before two runs' losses are compared


def loss_gap(steps: list, reference: list) -> float:
    """The largest relative difference, in %, between the mean losses of two runs over the same
    windows of LOSS_WINDOW steps (of the steps both runs logged; the last window may be shorter)."""
    n = min(len(steps), len(reference))

    def window_sum(records, i):  # both windows hold the same steps, so sums compare as means
        return sum(r["loss"] for r in records[i:min(i + LOSS_WINDOW, n)])

    gaps = [abs(window_sum(steps, i) / window_sum(reference, i) - 1.0) for i in range(0, n, LOSS_WINDOW)]
    return 100.0 * max(gaps) if gaps else float("nan")


def _cell(key: str, fmt: str, row: dict) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if key == "step_time_s":
        value *= 1e3
    elif key in ("mfu", "mfu_measured"):
        value *= 100
    return fmt.format(value)


def markdown(result: dict) -> str:
    run = result["run"]
    world = run.get("world_size") or 1
    columns = _COLUMNS if world == 1 else \
        _COLUMNS[:2] + (("tokens_per_s_per_process", "tokens/s per GPU", "{:,.0f}"),) + _COLUMNS[2:]
    placement = f"{run['device']}" if world == 1 else f"{world} x {run['device']}, {run['parallel']}"
    lines = [f"# trainscale.train: {run['preset']}, {run['data']} data, seq {run['seq_len']}, global batch "
             f"{run['global_batch']}, {run['steps']} steps ({run['warmup_steps']} warm-up), {run['precision']}, "
             f"{placement}", "", f"Commit `{run.get('commit') or 'unknown'}`.", "",
             f"`{result['command']}`", "",
             "| " + " | ".join(title for _, title, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in result["rows"]:
        lines.append("| " + " | ".join(_cell(key, fmt, row) for key, _, fmt in columns) + " |")
    measured = run.get("measured_peak_tflops")
    lines += ["", f"max loss gap: the largest difference between the row's loss and {run['reference_impl']}'s, "
                  f"both averaged over the same windows of {LOSS_WINDOW} steps.",
              "", f"MFU against {run['peak_tflops']} TFLOP/s"
                  + (f", % of GEMM peak against {measured:.0f} TFLOP/s measured by each run "
                     "(--measured-peak-tflops)" if measured else "")
                  + f"; model FLOPs per token {run['model_flops_per_token']:.4g} (6 N + 6 L H d S, docs/train.md)."]
    return "\n".join(lines) + "\n"


def assemble(command: str, rows: list, logs: list) -> dict:
    """The table's record: the first log's run settings, and each row with its loss gap to the first
    successful run (logs: the successful runs' JSONL logs, in row order)."""
    runs = [read_log(log) for log in logs]
    run, reference = runs[0][0], runs[0][1]
    ok = [row for row in rows if row["status"] == "ok"]
    for row, (_, steps, _) in zip(ok, runs):
        row["loss_gap_pct"] = loss_gap(steps, reference)
    return {"command": command, "run": {**{k: v for k, v in run.items() if k not in ("type", "impl")},
                                        "reference_impl": run["impl"]}, "rows": rows}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m trainscale.train_bench", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated, of {', '.join(IMPLS)}; an entry may add flags of its own run as "
                        "@flag=value (e.g. eager@perturb-init=4e-3), so an implementation can run twice")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes (GPUs) per run, through torchrun")
    args, train_args = p.parse_known_args(argv)
    impls = [s for s in args.impls.split(",") if s]
    unknown = [s for s in impls if s.split("@")[0] not in IMPLS or any("=" not in f for f in s.split("@")[1:])]
    if unknown or not impls or len(set(impls)) != len(impls):
        p.error(f"--impls: expected distinct entries of {', '.join(IMPLS)}, each optionally with @flag=value, "
                f"got {args.impls!r}")
    taken = [a for a in train_args if a.split("=")[0] in ("--impl", "--jsonl", "--plot")]
    if taken:
        p.error(f"{taken[0]}: set per run by train_bench; remove it")
    os.makedirs(args.out_dir, exist_ok=True)

    rows, run, logs = [], None, []
    for entry in impls:
        impl, *flags = entry.split("@")
        own_args = [a for f in flags for a in ("--" + f.split("=", 1)[0], f.split("=", 1)[1])]
        name = entry.replace("@", "_").replace("=", "-")  # its files
        log = os.path.join(args.out_dir, f"{name}.jsonl")
        if os.path.exists(log):
            os.remove(log)  # a stale log must not pass for this run's
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc_per_node)] \
            if args.nproc_per_node > 1 else []
        command = [sys.executable, *launcher, "-m", "trainscale.train", *train_args, *own_args, "--impl", impl,
                   "--jsonl", log]
        print(f"[train_bench] {entry}: {' '.join(command[1:])}", flush=True)
        with open(os.path.join(args.out_dir, f"{name}.out"), "w") as out:
            rc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
        summary = read_log(log)[2] if os.path.exists(log) else None
        if rc != 0 or summary is None:
            with open(os.path.join(args.out_dir, f"{name}.out")) as f:
                tail = f.read().strip().splitlines()[-1:] or ["no output"]
            rows.append({"impl": entry, "status": f"failed (exit {rc}): {tail[0]}"})
            print(f"[train_bench] {entry}: {rows[-1]['status']}", flush=True)
            continue
        run = run or read_log(log)[0]
        logs.append(log)
        rows.append({"impl": entry, "status": "ok", **summary})
        print(f"[train_bench] {entry}: {summary['tokens_per_s']:,.0f} tokens/s, final loss "
              f"{summary['final_loss']:.4f}", flush=True)
    if run is None:
        raise SystemExit("[train_bench] every run failed; see the .out files in " + args.out_dir)

    result = assemble(" ".join(["python -m trainscale.train_bench"] + (argv or sys.argv[1:])), rows, logs)
    stem = os.path.join(args.out_dir, "train-bench")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(result)
    with open(stem + ".md", "w") as f:
        f.write(text)
    plot(stem + ".png", logs)
    print(text, end="")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
