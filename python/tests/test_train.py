"""python -m trainscale.train on the CPU: the tiny preset learns the standard-library corpus, runs
are reproducible, --impl trainscale follows eager, --optimizer-in-backward takes the same steps,
gradient accumulation and 2-process gloo
runs (DDP, FSDP2) train on the same global batch as one process, and the JSONL log, --plot,
--profile-step (with its idle-gap summary on a synthetic trace) and train_bench write what they
promise. Skipped when transformers is not installed."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")

from trainscale import step_profile  # noqa: E402
from trainscale import train as ts_train  # noqa: E402

STEP_KEYS = {"type", "step", "warmup", "loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s",
             "tokens_per_s_per_process", "tflops",
             "mfu", "mfu_measured", "peak_mem_allocated_gib", "peak_mem_reserved_gib", "peak_rss_gib"}
SUMMARY_KEYS = {"type", "timed_steps", "final_loss", "step_time_s", "tokens_per_s", "tokens_per_s_per_process",
                "tflops", "mfu", "mfu_measured",
                "peak_mem_allocated_gib", "peak_mem_reserved_gib", "peak_rss_gib"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One tokenizer for the module: 1 MB of the corpus keeps its training to a second or two."""
    return ["--cache-dir", str(tmp_path_factory.mktemp("cache")), "--corpus-mb", "1", "--quiet", "--no-wandb"]


@pytest.fixture
def restore_rope(monkeypatch):
    # trainscale.patch replaces the modeling module's apply_rotary_pos_emb for the process.
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)


def run(*argv):
    return ts_train.train(ts_train.parse_args([str(a) for a in argv]))


def losses(result):
    return [s["loss"] for s in result["steps"]]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tiny_run(cache, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "eager.jsonl"
    return run("--preset", "tiny", "--steps", 20, "--jsonl", log, *cache), log


def test_tiny_loss_falls(tiny_run):
    result, _ = tiny_run
    loss = losses(result)
    assert len(loss) == 20 and all(map(torch.isfinite, torch.tensor(loss)))
    first, last = sum(loss[:3]) / 3, sum(loss[-3:]) / 3
    assert last < first - 0.5, loss


def test_jsonl_keys(tiny_run):
    result, log = tiny_run
    records = read_jsonl(log)
    assert [r["type"] for r in records] == ["run"] + ["step"] * 20 + ["summary"]
    run_record = records[0]
    assert run_record["impl"] == "eager" and run_record["preset"] == "tiny" and run_record["device"] == "cpu"
    assert run_record["model_flops_per_token"] > 6 * run_record["params"] * 0.5
    for r in records[1:-1]:
        assert set(r) == STEP_KEYS
        assert r["warmup"] == (r["step"] <= 2)
        assert r["tokens"] == 8 * 128 and r["peak_mem_allocated_gib"] is None
    assert set(records[-1]) == SUMMARY_KEYS and records[-1]["timed_steps"] == 18
    assert records[-1] == {"type": "summary", **result["summary"]}


def test_same_seed_same_losses(tiny_run, cache):
    again = run("--preset", "tiny", "--steps", 3, *cache)
    assert losses(again) == losses(tiny_run[0])[:3]


SMALL = ("--preset", "tiny", "--seq-len", 32, "--warmup-steps", 0)


@pytest.fixture(scope="module")
def small_run(cache):
    """3 steps of 2 sequences of 32 tokens: the reference of the runs that split them differently."""
    return run(*SMALL, "--batch-size", 2, "--steps", 3, *cache)


def test_trainscale_follows_eager(small_run, cache, restore_rope):
    # fp32 on the CPU: trainscale's ops run their fp64 references, eager PyTorch's fp32 kernels.
    ours = losses(run(*SMALL, "--batch-size", 2, "--steps", 3, "--impl", "trainscale", *cache))
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses(small_run)), rtol=0.01, atol=0)


def test_muon_trains_the_decoder_matrices(cache, tiny_run):
    result = run("--preset", "tiny", "--steps", 20, "--optimizer", "muon", *cache)
    loss = losses(result)
    assert result["run"]["optimizer"] == "muon"
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.5, loss
    assert loss[:1] == losses(tiny_run[0])[:1]  # same model and data; the steps then differ
    assert loss[1:] != losses(tiny_run[0])[1:]


def test_muon_groups():
    model = ts_train.build_model(ts_train.PRESETS["tiny"], 97, 32, 0, torch.device("cpu"), torch.float32)
    args = ts_train.parse_args(["--optimizer", "muon", "--lr", "0.01"])
    params = list(model.parameters())
    opt = ts_train.build_optimizer(model, params, args, torch.device("cpu"), ts_train.Dist())
    muon, adamw = opt.param_groups
    embedding = model.get_input_embeddings().weight
    assert muon["use_muon"] and all(p.ndim == 2 for p in muon["params"])
    assert any(p is embedding for p in adamw["params"]) and not any(p is embedding for p in muon["params"])
    assert len(muon["params"]) == 7 * ts_train.PRESETS["tiny"]["layers"]  # q, k, v, o, gate, up, down
    assert muon["lr"] == adamw["adamw_lr"] == 0.01
    assert muon["ns_method"] == "standard"
    args = ts_train.parse_args(["--optimizer", "muon", "--ns-method", "gram"])
    assert ts_train.build_optimizer(model, params, args, torch.device("cpu"), ts_train.Dist()).param_groups[0][
        "ns_method"] == "gram"


def test_trainscale_skip(restore_rope, capsys):
    model = ts_train.build_model(ts_train.PRESETS["tiny"], 97, 32, 0, torch.device("cpu"), torch.float32)
    ts_train.apply_impl(model, "trainscale", verbose=False, skip=("embedding", "qkv_projections"))
    attention = model.model.layers[0].self_attn
    assert type(model.get_input_embeddings()) is torch.nn.Embedding and type(attention.q_proj) is torch.nn.Linear
    assert type(model.model.norm).__module__ == "trainscale.modules"  # the other parts are in
    assert ts_train.parse_args(["--trainscale-skip", "embedding,rope"]).trainscale_skip == ("embedding", "rope")
    with pytest.raises(SystemExit):
        ts_train.parse_args(["--trainscale-skip", "embedding,norms"])
    assert "unknown part(s) norms" in capsys.readouterr().err


def test_gc_every(cache, monkeypatch):
    import gc
    calls = []
    collect = gc.collect
    monkeypatch.setattr(ts_train.gc, "collect", lambda *a: calls.append((a, gc.isenabled())) or collect(*a))
    result = run("--preset", "tiny", "--steps", 5, "--gc-every", 2, *cache)
    assert result["run"]["gc_every"] == 2 and gc.isenabled()
    # A full collection before the loop, then generation 1 at steps 2 and 4 with automatic collection off.
    assert calls == [((), True), ((1,), False), ((1,), False)], calls
    with pytest.raises(SystemExit):
        ts_train.parse_args(["--gc-every", "-1"])


def test_sync_every_windows(small_run, cache, monkeypatch):
    # Steps queued in windows of 2 (steps 1-2, 3): the same losses; each window's steps share
    # its time per step; the host synchronizes once per window.
    syncs = []
    monkeypatch.setattr(ts_train, "_window_ends", lambda step, args, ends=ts_train._window_ends:
                        ends(step, args) and (syncs.append(step) or True))
    result = run(*SMALL, "--batch-size", 2, "--steps", 3, "--sync-every", 2, *cache)
    assert result["run"]["sync_every"] == 2 and syncs == [2, 3]
    assert losses(result) == losses(small_run)
    times = [s["step_time_s"] for s in result["steps"]]
    assert times[0] == times[1] and times[2] > 0
    with pytest.raises(SystemExit):
        ts_train.parse_args(["--sync-every", "0"])


def test_sync_windows_end_at_the_warm_up_the_profiled_step_and_the_end():
    args = ts_train.parse_args(["--sync-every", "3", "--warmup-steps", "1", "--profile-step", "5", "--steps", "7"])
    assert [s for s in range(1, 8) if ts_train._window_ends(s, args)] == [1, 3, 4, 5, 6, 7]


def test_grad_accumulation_same_step(small_run, cache):
    accumulated = run(*SMALL, "--batch-size", 1, "--grad-accum", 2, "--steps", 3, *cache)
    torch.testing.assert_close(torch.tensor(losses(accumulated)), torch.tensor(losses(small_run)), rtol=1e-5, atol=0)


def test_optimizer_in_backward_same_steps(cache, restore_rope):
    flags = (*SMALL, "--batch-size", 2, "--steps", 3, "--impl", "trainscale", "--max-grad-norm", 0, *cache)
    after = run(*flags)
    during = run(*flags, "--optimizer-in-backward")
    assert during["run"]["optimizer_in_backward"] and not after["run"]["optimizer_in_backward"]
    assert losses(during) == losses(after)  # the same updates, one parameter at a time
    torch.testing.assert_close(torch.tensor([s["grad_norm"] for s in during["steps"]]),
                               torch.tensor([s["grad_norm"] for s in after["steps"]]), rtol=1e-5, atol=0)
    eager = run(*SMALL, "--batch-size", 2, "--steps", 1, "--max-grad-norm", 0, "--optimizer-in-backward", *cache)
    assert not eager["run"]["optimizer_in_backward"]  # other impls step after the backward
    for bad in (("--max-grad-norm", "1"), ("--grad-accum", "2")):
        with pytest.raises(SystemExit):
            ts_train.parse_args(["--optimizer-in-backward", "--max-grad-norm", "0", *bad])


def test_random_data_and_checkpointing(cache):
    plain = run(*SMALL, "--data", "random", "--vocab-size", 512, "--batch-size", 2, "--steps", 2, *cache)
    assert plain["run"]["vocab"] == 512 and plain["run"]["data"] == "random"
    checkpointed = run(*SMALL, "--data", "random", "--vocab-size", 512, "--batch-size", 2, "--steps", 2,
                       "--checkpointing", *cache)
    torch.testing.assert_close(torch.tensor(losses(checkpointed)), torch.tensor(losses(plain)), rtol=1e-5, atol=0)


def test_flag_errors(cache):
    with pytest.raises(SystemExit):
        ts_train.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        ts_train.parse_args(["extra.jsonl"])  # logs only with --plot
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="--impl liger: Liger-Kernel is not importable"):
            run(*SMALL, "--impl", "liger", "--steps", 1, *cache)


def test_profile_step(cache, tmp_path):
    prefix = tmp_path / "prof" / "step"
    result = run(*SMALL, "--data", "random", "--vocab-size", 512, "--steps", 3, "--warmup-steps", 0,
                 "--profile-step", 2, "--profile-prefix", prefix, *cache)
    with open(f"{prefix}.trace.json") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name") == step_profile.STEP_RANGE for e in events)
    summary = open(f"{prefix}.summary.txt").read()
    assert summary.startswith("step: ") and ("no GPU activity" in summary or "GPU: " in summary)
    assert [s.get("profiled", False) for s in result["steps"]] == [False, True, False]
    assert result["summary"]["timed_steps"] == 2  # the profiled step is left out
    with pytest.raises(SystemExit):
        ts_train.parse_args(["--steps", "3", "--profile-step", "4"])


def test_step_profile_summary_finds_idle_gaps():
    """Synthetic trace: kernel A, a 50 us gap, kernel B launched by rmsnorm after A ended
    (starved), then kernel C launched while B ran (no gap)."""
    def x(name, cat, ts, dur, tid=1, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}
    events = [
        x(step_profile.STEP_RANGE, "user_annotation", 0, 400),
        x("model.py(10): forward", "python_function", 5, 300),
        x("trainscale::rmsnorm_forward", "cpu_op", 140, 20),
        x("cudaLaunchKernel", "cuda_runtime", 10, 5, correlation=1),
        x("cudaLaunchKernel", "cuda_runtime", 150, 5, correlation=2),
        x("cudaLaunchKernel", "cuda_runtime", 170, 5, correlation=3),
        x("kernel_a", "kernel", 20, 100, tid=7, correlation=1),
        x("kernel_b", "kernel", 170, 40, tid=7, correlation=2),
        x("kernel_c", "kernel", 210, 30, tid=7, correlation=3),
    ]
    text = step_profile.summarize_trace(events)
    assert "busy 0.17 ms, idle 0.05 ms in 1 gaps" in text
    gap_line = next(line for line in text.splitlines() if line.strip().startswith("50.0 |"))
    assert "kernel_a" in gap_line and "kernel_b" in gap_line and "starved" in gap_line
    assert "model.py(10): forward > trainscale::rmsnorm_forward" in gap_line
    assert "0.040 ms  kernel_b" in text


def test_plot(tiny_run, cache, tmp_path):
    other = tmp_path / "seed1.jsonl"
    seed1 = run("--preset", "tiny", "--steps", 3, "--seed", 1, "--jsonl", other, *cache)
    assert losses(seed1) != losses(tiny_run[0])[:3]  # the seed sets the initialization and the data order
    png = tmp_path / "runs.png"
    assert ts_train.main(["--plot", str(png), str(tiny_run[1]), str(other)]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    # The trainscale imported here (an installed package or a PYTHONPATH entry) for the children too.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(ts_train.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


@pytest.mark.parametrize("parallel,optimizer,flags", [("ddp", "adamw", ()), ("fsdp2", "adamw", ()), ("fsdp2", "muon", ()),
                                                      ("fsdp2", "adamw", ("--fsdp2-keep-gathered",))])
def test_two_process_gloo_matches_one(small_run, cache, tmp_path, parallel, optimizer, flags):
    # The same global batch (2 sequences) as 1 process x 2 or 2 processes x 1.
    single = small_run if optimizer == "adamw" else run(*SMALL, "--batch-size", 2, "--steps", 3,
                                                        "--optimizer", optimizer, *cache)
    log = tmp_path / f"{parallel}.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "trainscale.train", *map(str, SMALL), "--batch-size", "1", "--steps", "3",
               "--parallel", parallel, "--optimizer", optimizer, *flags, "--jsonl", str(log), *cache]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = read_jsonl(log)
    assert records[0]["world_size"] == 2 and records[0]["parallel"] == parallel and records[0]["global_batch"] == 2
    steps = [r for r in records if r["type"] == "step"]
    # Rates per process: tokens/s halved, TFLOP/s (and so MFU) per GPU.
    for s in steps:
        assert s["tokens_per_s_per_process"] == pytest.approx(s["tokens_per_s"] / 2)
        assert s["tflops"] == pytest.approx(records[0]["model_flops_per_token"] * s["tokens"] / s["step_time_s"] / 2e12)
    summary = records[-1]
    assert summary["type"] == "summary" and summary["tokens_per_s_per_process"] == pytest.approx(summary["tokens_per_s"] / 2)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in steps]), torch.tensor(losses(single)),
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in steps]),
                               torch.tensor([s["grad_norm"] for s in single["steps"]]), rtol=1e-4, atol=0)


def test_train_bench_table_of_distributed_runs():
    from trainscale import train_bench
    run_record = {"preset": "tiny", "data": "random", "seq_len": 32, "global_batch": 2, "steps": 3, "warmup_steps": 0,
                  "precision": "bf16", "device": "GPU", "world_size": 2, "parallel": "fsdp2", "commit": "abc",
                  "peak_tflops": 989, "model_flops_per_token": 1e6, "reference_impl": "eager"}
    row = {"impl": "eager", "status": "ok", "tokens_per_s": 2000.0, "tokens_per_s_per_process": 1000.0}
    table = train_bench.markdown({"command": "c", "run": run_record, "rows": [row]})
    assert "2 x GPU, fsdp2" in table and "| impl | tokens/s | tokens/s per GPU | step ms |" in table
    assert "| eager | 2,000 | 1,000 |" in table


def test_train_bench_table(cache, tmp_path, monkeypatch):
    from trainscale import train_bench
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])  # for its trainscale.train subprocess
    out = tmp_path / "bench"
    # eager again with its initial weights perturbed (a flag of its own run): a second row, its
    # loss off eager's.
    argv = ["--out-dir", str(out), "--impls", "eager,eager@perturb-init=0.05", *map(str, SMALL), "--batch-size", "2",
            "--steps", "2", *cache]
    assert train_bench.main(argv) == 0
    with open(out / "train-bench.json") as f:
        result = json.load(f)
    assert [r["impl"] for r in result["rows"]] == ["eager", "eager@perturb-init=0.05"]
    assert all(r["status"] == "ok" for r in result["rows"])
    assert result["run"]["seq_len"] == 32 and "impl" not in result["run"] and result["run"]["perturb_init"] == 0
    with open(out / "train-bench.md") as f:
        table = f.read()
    assert "| impl | tokens/s |" in table and "| eager |" in table and "| eager@perturb-init=0.05 |" in table
    assert result["rows"][0]["loss_gap_pct"] == 0.0 and result["run"]["reference_impl"] == "eager"
    assert result["rows"][1]["loss_gap_pct"] > 0.0
    assert (out / "train-bench.png").exists() and (out / "eager.jsonl").exists()
    assert read_jsonl(out / "eager_perturb-init-0.05.jsonl")[0]["perturb_init"] == 0.05
    with pytest.raises(SystemExit):
        train_bench.main(["--out-dir", str(out), "--impls", "eager,eager"])
    with pytest.raises(SystemExit):
        train_bench.main(["--out-dir", str(out), "--impls", "eager@perturb-init"])


def test_loss_gap_compares_window_means():
    from trainscale.train_bench import loss_gap
    reference = [{"loss": 2.0}] * 20
    steps = [{"loss": 2.0}] * 10 + [{"loss": 1.0}, {"loss": 3.0}] * 4 + [{"loss": 2.2}, {"loss": 2.2}]
    # Windows: [0, 10) equal; [10, 20) mean 2.04 against 2.0 -> 2 %. A lone 50 % step averages out.
    assert abs(loss_gap(steps, reference) - 2.0) < 1e-9
    assert loss_gap(steps[:11], reference) == 50.0  # a short last window: step 10 alone
