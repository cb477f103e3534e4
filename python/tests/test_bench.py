"""python -m trainscale.bench on the CPU (smoke suite, short timing; --device cpu, so the same on a
GPU machine): the JSON of
docs/bench-json.md with ours and the PyTorch baselines gated and timed, CSV / Markdown from the
C++ reporters, the suites from the C++ registry, usage errors; the flce suite measured in Python
(gate, OOM rows, memory table)."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as tF

import trainscale as ts
from conftest import cuda
from trainscale import _C, bench
from trainscale.bench import baselines, flce, mlp, report, varlen

# A 200 ms cap: a row whose CPU call takes 10+ ms on a loaded machine still reaches --min-samples.
FAST = ["--timeout-ms", "200", "--min-time-ms", "2", "--min-samples", "3", "--warmup-ms", "1", "--quiet"]
CPU = FAST + ["--device", "cpu"]
OPS = "rmsnorm_forward,rmsnorm_backward,fused_add_rmsnorm_forward,layernorm_forward,layernorm_backward,gelu_forward,gelu_backward," \
      "gelu_backward_tanh,silu_backward,swiglu_forward,swiglu_backward,swiglu_forward_packed,swiglu_backward_packed,rope_forward,rope_backward," \
      "fp8_quantize_row,fp8_quantize_1x128,softmax_forward,softmax_backward,cross_entropy_forward,cross_entropy_forward_with_grad"


def test_registry_through_binding():
    assert "smoke" in _C.suite_names() and "llama" in _C.suite_names()
    configs = _C.suite_configs(["smoke"])
    assert ("rmsnorm_forward", (64, 512), "bfloat16") in configs
    assert {op for op, _, _ in configs} >= set(OPS.split(","))
    with pytest.raises(ValueError, match="suite_configs: argument 'suites': unknown suite 'nope'"):
        _C.suite_configs(["nope"])


def test_smoke_json(tmp_path):
    out = tmp_path / "smoke.json"
    rc = bench.main(["--suite", "smoke", "--ops", OPS, "--impl", "cpu-ref,torch", "--json", str(out),
                     "--csv", str(tmp_path / "s.csv"), "--md", str(tmp_path / "s.md")] + CPU)
    doc = json.load(open(out))
    assert doc["schema"] == "trainscale-bench" and doc["schema_version"] == 1
    assert doc["meta"]["suite"] == "smoke" and doc["meta"]["env"]["device"] == "cpu"
    assert doc["meta"]["env"]["command_line"].startswith("python -m trainscale.bench")
    rows = doc["rows"]
    failed = [(r["case"], r["impl"], r["message"]) for r in rows if r["status"] != "ok"]
    assert rc == 0 and not failed, failed
    for op in OPS.split(","):
        for dtype in ("float32", "bfloat16"):
            impls = {r["impl"] for r in rows if r["op"] == op and r["dtype"] == dtype}
            assert impls == {"cpu-ref", "torch"}, (op, dtype, impls)
    for r in rows:
        assert r["timer"] == "host" and r["ms"]["count"] >= 3 and r["ms"]["median"] > 0 and r["gbps"] > 0
        assert r["gate"]["rel_l2"] <= r["gate"]["tolerance"]
        assert r["baseline"] == (r["impl"] == "torch")
    assert (tmp_path / "s.csv").read_text().startswith("case,")
    assert "rmsnorm_forward" in (tmp_path / "s.md").read_text()


def test_gate_catches_wrong_baseline(tmp_path, monkeypatch):
    monkeypatch.setitem(baselines._TORCH, "gelu_forward", lambda t, _: t["x"] * 2)
    out = tmp_path / "bad.json"
    rc = bench.main(["--ops", "gelu_forward", "--dtype", "fp32", "--impl", "torch", "--json", str(out)] + CPU)
    (row,) = json.load(open(out))["rows"]
    # Reported FAILED; only a failure of ours fails the run.
    assert rc == 0 and row["status"] == "failed" and row["gate"]["rel_l2"] > row["gate"]["tolerance"]


def test_torch_compile_row(tmp_path):
    out = tmp_path / "compile.json"
    rc = bench.main(["--ops", "swiglu_forward", "--dtype", "fp32", "--impl", "torch-compile", "--json", str(out)] + CPU)
    (row,) = json.load(open(out))["rows"]
    if row["status"] == "failed" and ("Inductor" in row["message"] or "compiler" in row["message"]):
        pytest.skip(f"inductor cannot compile on this CPU: {row['message'][:200]}")
    assert rc == 0 and row["status"] == "ok" and row["impl"] == "torch-compile"


def test_torch_compile_baseline_compiles_every_shape(monkeypatch):
    from torch._dynamo.testing import CompileCounter
    counter, real = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=counter, **kw))
    make = baselines._torch_baseline(compiled=True)
    for n in range(1, 13):  # more shapes than dynamo's recompile limit
        run = make("gelu_forward", (n, 8), "float32")({"x": torch.randn(n, 8)})
        run()
    assert counter.frame_count == 12


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    bench.main(["--ops", "gelu_forward", "--impl", "cpu-ref,torch", "--plot", str(png)] + CPU)
    assert png.read_bytes()[:4] == b"\x89PNG"


@cuda
def test_gpu_rows(tmp_path):
    """On the GPU: ours and the PyTorch baselines (fp8 included: bit-exact) pass the gate and are
    timed with CUDA events."""
    out = tmp_path / "gpu.json"
    ops = "rmsnorm_forward,layernorm_backward,swiglu_forward,rope_forward,fp8_quantize_row,fp8_quantize_1x128,softmax_forward," \
          "softmax_backward,cross_entropy_forward_with_grad"
    rc = bench.main(["--suite", "smoke", "--ops", ops, "--dtype", "bf16", "--impl", "trainscale,torch",
                     "--json", str(out)] + FAST)
    doc = json.load(open(out))
    assert doc["meta"]["env"]["device"] == "cuda"
    rows = doc["rows"]
    failed = [(r["case"], r["impl"], r["message"]) for r in rows if r["status"] != "ok"]
    assert rc == 0 and not failed, failed
    assert {(r["op"], r["impl"]) for r in rows} == {(op, impl) for op in ops.split(",")
                                                     for impl in ("trainscale", "torch")}
    assert all(r["timer"] in ("cuda-events", "cuda-graph") for r in rows)


def test_cli_usage_errors():
    run = subprocess.run([sys.executable, "-m", "trainscale.bench", "--ops", "nope", "--quiet"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "run_bench: argument 'ops': unknown op 'nope'" in run.stderr
    run = subprocess.run([sys.executable, "-m", "trainscale.bench", "--list", "--suite", "smoke"],
                         capture_output=True, text=True)
    assert run.returncode == 0 and "rmsnorm_forward 64x512 bfloat16" in run.stdout


def flce_rows(tmp_path, *options):
    out = tmp_path / "flce.json"
    rc = bench.main(["--suite", "flce", "--json", str(out)] + list(options) + CPU)
    return rc, json.load(open(out))


def test_flce_cpu(tmp_path):
    """The flce suite (forward + backward through autograd, measured in Python) on its CPU shapes:
    every implementation on the same inputs, gated on sampled rows, timed, in the JSON schema the
    C++ reporters read."""
    md = tmp_path / "flce.md"
    rc, doc = flce_rows(tmp_path, "--impl", "cpu-ref,torch", "--md", str(md))
    assert rc == 0 and doc["meta"]["suite"] == "flce" and doc["meta"]["env"]["device"] == "cpu"
    rows = doc["rows"]
    assert [(r["shape"], r["impl"]) for r in rows] == [(s, i) for s in ("64x32x500", "37x24x1001")
                                                       for i in ("cpu-ref", "torch")]
    for r in rows:
        assert r["status"] == "ok", r["message"]
        assert r["op"] == flce.FLCE_OP and r["dtype"] == "bfloat16" and r["baseline"] == (r["impl"] == "torch")
        assert r["gate"]["rel_l2"] <= r["gate"]["tolerance"] == 1e-2 and r["gate"]["rows"] == "all"
        t, h, v = map(int, r["shape"].split("x"))
        assert r["flops"] == 6 * t * h * v and r["bound"] == "compute" and r["tflops"] > 0
        assert r["timer"] == "host" and r["ms"]["count"] >= 1 and not r["cold"]
    assert "## fused_linear_cross_entropy_forward_with_grad" in md.read_text()
    run = subprocess.run([sys.executable, "-m", "trainscale.bench", "--suite", "flce", "--list", "--device", "cpu"],
                         capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.splitlines() == [
        f"{flce.FLCE_OP} 64x32x500 bfloat16", f"{flce.FLCE_OP} 37x24x1001 bfloat16"]


def test_mlp_cpu(tmp_path):
    """The mlp suite on its CPU shape: ours (the activation recomputed in the backward), the
    unfused chain, eager and torch.compile on the same inputs, gated, timed; ours keeps a third
    less for the backward than the unfused chain (gate and up, not their product)."""
    out = tmp_path / "mlp.json"
    rc = bench.main(["--suite", "mlp", "--impl", "cpu-ref,unfused,torch", "--json", str(out)] + CPU)
    doc = json.load(open(out))
    assert rc == 0 and doc["meta"]["suite"] == "mlp"
    rows = {(r["op"], r["impl"]): r for r in doc["rows"]}
    assert set(rows) == {(op, i) for op in mlp.MLP_OPS for i in ("cpu-ref", "unfused", "torch")}
    for r in rows.values():
        assert r["status"] == "ok", r["message"]
        assert r["shape"] == "64x32x96" and r["gate"]["rel_l2"] <= mlp.MLP_TOLERANCE and r["ms"]["count"] >= 1
    t, f, elem = 64, 96, 2
    assert rows[("swiglu_mlp_forward", "cpu-ref")]["extra_memory_bytes"] == 2 * t * f * elem
    assert rows[("swiglu_mlp_forward", "unfused")]["extra_memory_bytes"] == 3 * t * f * elem
    run = subprocess.run([sys.executable, "-m", "trainscale.bench", "--suite", "mlp", "--list", "--device", "cpu"],
                         capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.splitlines() == [f"{op} 64x32x96 bfloat16" for op in mlp.MLP_OPS]


def test_varlen_cpu(tmp_path):
    """The varlen suite on its CPU shape: ours against our batched kernel on the padded batch and
    SDPA with the block-diagonal causal mask, on the same packed inputs, gated on out and dq
    against every sequence alone, timed."""
    assert varlen._varlen_lengths(40, 8) == [4, 12, 2, 14, 4, 4]
    out = tmp_path / "varlen.json"
    rc = bench.main(["--suite", "varlen", "--impl", "cpu-ref,trainscale-padded,torch-sdpa-mask", "--json", str(out)]
                    + CPU)
    doc = json.load(open(out))
    assert rc == 0 and doc["meta"]["suite"] == "varlen"
    rows = {(r["op"], r["impl"]): r for r in doc["rows"]}
    assert set(rows) == {(op, i) for op in varlen.VARLEN_OPS
                         for i in ("cpu-ref", "trainscale-padded", "torch-sdpa-mask")}
    for r in rows.values():
        assert r["status"] == "ok", r["message"]
        assert r["shape"] == "40x4x2x16x8" and r["gate"]["rel_l2"] <= varlen.VARLEN_TOLERANCE and r["ms"]["count"] >= 1
    run = subprocess.run([sys.executable, "-m", "trainscale.bench", "--suite", "varlen", "--list", "--device", "cpu"],
                         capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.splitlines() == [f"{op} 40x4x2x16x8 bfloat16" for op in varlen.VARLEN_OPS]


def test_flce_gate_oom_and_usage(tmp_path, monkeypatch):
    monkeypatch.setattr(flce, "_flce_eager", lambda h, w, t: 2 * tF.cross_entropy(tF.linear(h, w), t))
    rc, doc = flce_rows(tmp_path, "--impl", "torch", "--configs", "37x24x1001")
    (row,) = doc["rows"]
    # A baseline failing its gate is reported, not timed, and does not fail the run.
    assert rc == 0 and row["status"] == "failed" and "(loss)" in row["message"] and "ms" not in row

    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
    monkeypatch.setattr(flce, "flce_implementations",
                        lambda use_gpu: [("cpu-ref", True, lambda: ts.linear_cross_entropy),
                                         ("torch", False, out_of_memory)])
    rc, doc = flce_rows(tmp_path, "--configs", "37x24x1001")
    assert rc == 0 and [r["status"] for r in doc["rows"]] == ["ok", "unsupported"]
    assert doc["rows"][1]["message"].startswith("skipped (OOM): CUDA out of memory")

    for options, error in ((["--suite", "flce,smoke"], "runs alone"), (["--suite", "flce", "--ops", "softmax_forward"],
                                                                       "has one op"),
                           (["--suite", "flce", "--impl", "nope"], "--impl")):
        run = subprocess.run([sys.executable, "-m", "trainscale.bench"] + options + ["--device", "cpu"],
                             capture_output=True, text=True)
        assert run.returncode == 2 and error in run.stderr, run.stderr


def test_flce_memory_table():
    rows = [{"op": flce.FLCE_OP, "device": "cuda", "case": c, "impl": i, "message": m, **extra}
            for c, i, m, extra in (("a", "trainscale", "", {"extra_memory_bytes": 3 << 29}),
                                   ("a", "torch", "", {"extra_memory_bytes": 5 << 30}),
                                   ("b", "trainscale", "", {"extra_memory_bytes": 1 << 30}),
                                   ("b", "torch", "skipped (OOM): CUDA out of memory", {}))]
    text = report.memory_table({"rows": rows}, markdown=False)
    assert text.splitlines()[0] == "Peak memory beyond inputs and outputs (GiB):"
    assert [line.split() for line in text.splitlines()[3:]] == [["a", "|", "1.50", "|", "5.00"],
                                                               ["b", "|", "1.00", "|", "OOM"]]
    md = report.memory_table({"rows": rows}, markdown=True)
    assert "| Case | trainscale | torch |" in md and "| b | 1.00 | OOM |" in md
    assert report.memory_table({"rows": [dict(rows[0], device="cpu")]}, markdown=False) == ""


@cuda
def test_flce_gpu(tmp_path):
    """On the GPU: the smallest sweep shape, ours and eager PyTorch gated, timed with CUDA events,
    and their peak memory beyond inputs and outputs. Ours holds one chunk of bf16 logits (here
    all 2048 tokens fit in one) and cuBLASLt's workspace, under 1.5 logits; eager PyTorch at least the
    logits (its measured peak beyond inputs and outputs is one logits-sized buffer at this shape)."""
    md = tmp_path / "flce.md"
    rc = bench.main(["--suite", "flce", "--configs", "2048x4096x32000", "--impl", "trainscale,torch",
                     "--json", str(tmp_path / "g.json"), "--md", str(md)] + FAST)
    doc = json.load(open(tmp_path / "g.json"))
    rows = {r["impl"]: r for r in doc["rows"]}
    assert rc == 0 and all(r["status"] == "ok" for r in rows.values()), [r["message"] for r in rows.values()]
    assert all(r["timer"] == "cuda-events" and r["cold"] for r in rows.values())
    logits_bytes = 2048 * 32000 * 2
    assert rows["trainscale"]["extra_memory_bytes"] < 1.5 * logits_bytes
    assert rows["torch"]["extra_memory_bytes"] >= logits_bytes
    assert "Peak memory beyond inputs and outputs" in md.read_text()
