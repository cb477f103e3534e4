"""python -m trainscale.bench on the CPU (smoke suite, short timing; --device cpu, so the same on a
GPU machine): the JSON of
docs/bench-json.md with ours and the PyTorch baselines gated and timed, CSV / Markdown from the
C++ reporters, the suites from the C++ registry, usage errors."""
import json
import subprocess
import sys

import pytest

from conftest import cuda
from trainscale import _C, bench

FAST = ["--timeout-ms", "30", "--min-time-ms", "2", "--min-samples", "3", "--warmup-ms", "1", "--quiet"]
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
    monkeypatch.setitem(bench._TORCH, "gelu_forward", lambda t, _: t["x"] * 2)
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
