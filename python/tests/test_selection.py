"""trainscale.config switches and the automatic selection: the cache file (written, read back,
location overrides), the fallback to PyTorch when ours raises, print_selection, and the engine's
timing of a Python callable."""
import io
import json
import os

import pytest
import torch

import trainscale as ts
from trainscale import _C, activation, norm, reference, selection


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    """Each test starts with the default switches, no choices in memory, its own cache dir."""
    monkeypatch.delenv("TRAINSCALE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    selection.reset()
    yield
    ts.config.set_all(True)
    ts.config.cache_dir = None
    selection.reset()


def cache_files(d):
    return sorted(p for p in os.listdir(d) if p.startswith("selection-")) if os.path.isdir(d) else []


def test_switch_validation():
    with pytest.raises(ValueError, match="use_rmsnorm.*True, False or 'auto'"):
        ts.config.use_rmsnorm = "fast"
    with pytest.raises(AttributeError, match="unknown switch 'use_attention'"):
        ts.config.use_attention = True
    with pytest.raises(AttributeError, match="unknown attribute"):
        ts.config.cache = "/tmp"


def test_false_uses_pytorch(monkeypatch):
    calls = []
    monkeypatch.setattr(norm, "_rms_norm", lambda *a: calls.append("ours"))
    x = torch.randn(4, 32)
    ts.config.use_rmsnorm = False
    torch.testing.assert_close(ts.rms_norm(x), reference.rms_norm(x))
    assert calls == []
    ts.config.use_rmsnorm = True
    ts.rms_norm(x)
    assert calls == ["ours"]


def test_auto_on_cpu_writes_cache(tmp_path):
    ts.config.use_rmsnorm = "auto"
    ts.config.cache_dir = str(tmp_path / "cfg")
    x, w = torch.randn(8, 64), torch.randn(64)
    y = ts.rms_norm(x, w)
    torch.testing.assert_close(y, reference.rms_norm(x, w))
    (name,) = cache_files(tmp_path / "cfg")
    assert name.startswith("selection-cpu-ts") and name.endswith(".json")
    doc = json.load(open(tmp_path / "cfg" / name))
    assert doc["schema"] == "trainscale-selection"
    (key, choice), = doc["choices"].items()
    assert key.startswith("rms_norm|8x64,64|float32|cpu|fwd")
    # On the CPU ours is the fp64 reference: PyTorch's is chosen, with the reason.
    assert choice["impl"] == "torch" and "cpu" in choice["reason"]
    # Training (inputs that need grad) is a separate choice: forward and backward.
    ts.rms_norm(x.requires_grad_(), w).sum().backward()
    doc = json.load(open(tmp_path / "cfg" / name))
    assert any("|fwd+bwd" in k for k in doc["choices"])


def test_cache_is_read_back(tmp_path, monkeypatch):
    """A choice in the file is used as is (here: ours, as a GPU would have chosen)."""
    monkeypatch.setenv("TRAINSCALE_CACHE_DIR", str(tmp_path / "env"))
    ts.config.use_gelu = "auto"
    x = torch.randn(4, 16)
    path = selection.cache_path(x.device)
    assert os.path.dirname(path) == str(tmp_path / "env")
    key = selection._key("gelu", (x, "none"), {}, False)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump({"schema": "trainscale-selection", "choices": {key: {"impl": "trainscale", "reason": "test"}}}, f)
    calls = []
    monkeypatch.setattr(torch.ops.trainscale, "gelu_forward", lambda *a: calls.append(a) or a[0])
    ts.gelu(x)
    assert len(calls) == 1


def test_default_location(tmp_path):
    ts.config.use_silu = "auto"
    ts.silu(torch.randn(3, 8))
    assert cache_files(tmp_path / "xdg" / "trainscale")


def test_fallback_when_ours_raises(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel for this")
    monkeypatch.setattr(activation, "_swiglu", broken)
    ts.config.use_swiglu = "auto"
    ts.config.cache_dir = str(tmp_path)
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(ts.swiglu(a, b), reference.swiglu(a, b))
    (name,) = cache_files(tmp_path)
    (choice,) = json.load(open(tmp_path / name))["choices"].values()
    assert choice["impl"] == "torch" and "trainscale raised RuntimeError: no kernel for this" in choice["reason"]


def test_forced_ours_raises(monkeypatch):
    """True means ours: its errors reach the caller (no silent fallback)."""
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="rmsnorm_forward: argument 'weight'"):
        ts.rms_norm(x, torch.randn(15))


def test_print_selection(tmp_path):
    ts.config.use_layernorm = "auto"
    ts.config.cache_dir = str(tmp_path)
    ts.layer_norm(torch.randn(2, 16))
    out = io.StringIO()
    ts.print_selection(file=out)
    text = out.getvalue()
    assert "use_layernorm='auto'" in text
    assert "layer_norm|2x16|float32|cpu|fwd" in text and "-> torch (cpu:" in text


def test_modules_follow_config(tmp_path):
    ts.config.set_all(False)
    m = ts.RMSNorm(16)
    x = torch.randn(3, 16)
    torch.testing.assert_close(m(x), reference.rms_norm(x, m.weight))


def test_reference_matches_ours():
    """What "PyTorch" means for each switch computes what ours does."""
    x = torch.randn(6, 256, dtype=torch.float64)
    w = torch.randn(256, dtype=torch.float64)
    torch.testing.assert_close(reference.rms_norm(x, w, weight_offset=1.0), ts.rms_norm(x, w, weight_offset=1.0))
    torch.testing.assert_close(reference.layer_norm(x, w, w), ts.layer_norm(x, w, w))
    q, k = torch.randn(2, 5, 4, 32, dtype=torch.float64), torch.randn(2, 5, 2, 32, dtype=torch.float64)
    offs = torch.tensor([0, 3])
    for kw in ({}, {"interleaved": True}, {"rotary_dim": 16}, {"position_offsets": offs}):
        for a, b in zip(reference.apply_rotary(q, k, **kw), ts.apply_rotary(q, k, **kw)):
            torch.testing.assert_close(a, b)
    xf = torch.randn(8, 300) * 50
    xf[1] = 0
    for g in ("row", "1x128"):
        for p2 in (False, True):
            for mm in ((False, True) if g == "1x128" else (False,)):
                a, b = reference.fp8_quantize(xf, granularity=g, power_of_two_scales=p2, scales_m_major=mm), \
                    ts.fp8_quantize(xf, granularity=g, power_of_two_scales=p2, scales_m_major=mm)
                assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_time_callable_host():
    calls = []
    stats = _C.time_callable(lambda: calls.append(1), -1, {"min_samples": 7, "min_time_ms": 1.0,
                                                          "warmup_ms": 0.0, "timeout_ms": 100.0})
    assert stats["timer"] == "host" and stats["count"] >= 7 and len(calls) >= stats["count"]
    assert stats["throttle_retakes"] == 0 and stats["throttle_reasons"] == "" and not stats["throttled"]
    assert 0 <= stats["min"] <= stats["median"] <= stats["max"]
    with pytest.raises(ValueError, match="time_callable: argument 'timing': unknown option 'nope'"):
        _C.time_callable(lambda: None, -1, {"nope": 1})
    with pytest.raises(ZeroDivisionError):
        _C.time_callable(lambda: 1 / 0, -1, {})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_gpu_times_both(tmp_path):
    ts.config.use_rmsnorm = "auto"
    ts.config.cache_dir = str(tmp_path)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    ts.rms_norm(x)
    (name,) = cache_files(tmp_path)
    (choice,) = json.load(open(tmp_path / name))["choices"].values()
    assert choice["impl"] in ("trainscale", "torch") and set(choice["ms"]) == {"trainscale", "torch"}
    stats = _C.time_callable(lambda: x.mul(2), 0, {})
    assert stats["timer"] == "cuda-events" and stats["median"] > 0
