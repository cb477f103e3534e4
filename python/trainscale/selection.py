"""Which implementation each trainscale function uses: ours, PyTorch's (trainscale.reference),
or the faster of the two per (op, shapes, dtype, device, fwd / fwd+bwd), measured once with the
C++ benchmark engine and remembered in a JSON file.

    trainscale.config.use_rmsnorm = "auto"     # or True (trainscale, the default) / False (PyTorch)
    trainscale.config.set_all("auto")
    trainscale.print_selection()

The file is ``selection-<device>-<versions>.json`` in ``config.cache_dir``, else
``$TRAINSCALE_CACHE_DIR``, else ``$XDG_CACHE_HOME/trainscale``, else ``~/.cache/trainscale``.
"""
import json
import os
import re
import sys
from typing import Any, Callable, Dict, Optional

import torch

from . import _C

FAMILIES = ("rmsnorm", "layernorm", "swiglu", "geglu", "gelu", "silu", "rope", "fp8", "softmax",
            "cross_entropy", "fused_linear_cross_entropy", "embedding")
_SCHEMA = "trainscale-selection"


class Config:
    """Per op family: ``use_<family>`` is True (trainscale), False (PyTorch) or "auto".

    ``cache_dir``: where the selection file lives (None: see the module doc). ``timing``: the
    engine's options for the measurement (a short stopping rule; the choice only needs the
    faster of two). ``verbose``: print each new choice to stderr."""

    def __init__(self):
        for family in FAMILIES:
            setattr(self, "use_" + family, True)
        self.cache_dir: Optional[str] = None
        self.timing = {"warmup_ms": 5.0, "min_time_ms": 10.0, "timeout_ms": 300.0, "min_samples": 5,
                       "target_rel_noise": 0.02}
        self.verbose = False

    def __setattr__(self, name, value):
        if name.startswith("use_"):
            if name[4:] not in FAMILIES:
                raise AttributeError(f"trainscale.config: unknown switch '{name}' "
                                     f"(known: {', '.join('use_' + f for f in FAMILIES)})")
            if not (value is True or value is False or value == "auto"):
                raise ValueError(f"trainscale.config.{name}: expected True, False or 'auto', got {value!r}")
        elif name not in ("cache_dir", "timing", "verbose"):
            raise AttributeError(f"trainscale.config: unknown attribute '{name}'")
        object.__setattr__(self, name, value)

    def set_all(self, value):
        """Sets every use_<family> switch to value."""
        for family in FAMILIES:
            setattr(self, "use_" + family, value)

    def __repr__(self):
        switches = ", ".join(f"use_{f}={getattr(self, 'use_' + f)!r}" for f in FAMILIES)
        return f"trainscale.Config({switches}, cache_dir={self.cache_dir!r})"


config = Config()


def cache_dir() -> str:
    if config.cache_dir:
        return config.cache_dir
    if os.environ.get("TRAINSCALE_CACHE_DIR"):
        return os.environ["TRAINSCALE_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "trainscale")


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def cache_path(device: torch.device) -> str:
    """The selection file for this device (GPU model, or cpu) and these versions."""
    from . import __version__
    versions = f"ts{__version__}-torch{torch.__version__.split('+')[0]}"
    if device.type == "cuda":
        versions += f"-cuda{torch.version.cuda}"
    return os.path.join(cache_dir(), f"selection-{_slug(_device_name(device))}-{versions}.json")


# path -> {key: choice}; a file is read on its first use in this process.
_loaded: Dict[str, Dict[str, Dict[str, Any]]] = {}


def _choices(path: str) -> Dict[str, Dict[str, Any]]:
    if path not in _loaded:
        choices = {}
        try:
            with open(path) as f:
                doc = json.load(f)
            if doc.get("schema") == _SCHEMA:
                choices = dict(doc.get("choices", {}))
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:  # unreadable or corrupt: measure again, rewrite it
            print(f"trainscale: ignoring the selection file {path}: {e}", file=sys.stderr)
        _loaded[path] = choices
    return _loaded[path]


def _save(path: str, device: torch.device):
    doc = {"schema": _SCHEMA, "version": 1, "device": _device_name(device), "torch": torch.__version__,
           "choices": _loaded[path]}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: concurrent processes never see half a file


def reset():
    """Forgets the choices read in this process (the files stay)."""
    _loaded.clear()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _key(op: str, args, kwargs, grad: bool) -> str:
    ts = _tensors(list(args) + list(kwargs.values()))
    shapes = ",".join("x".join(map(str, t.shape)) or "scalar" for t in ts)
    other = [repr(a) for a in list(args) + list(kwargs.values()) if not isinstance(a, torch.Tensor) and a is not None]
    return "|".join([op, shapes, str(ts[0].dtype).replace("torch.", ""), ts[0].device.type,
                     "fwd+bwd" if grad else "fwd"] + other)


def _detached(a):
    return a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a


def _timed(fn: Callable, args, kwargs, grad: bool) -> Callable[[], Any]:
    """A call of fn on detached copies of the arguments (so the caller's graph is untouched);
    with grad, forward and backward (torch.autograd.grad, no accumulation)."""
    args = [_detached(a) for a in args]
    kwargs = {k: _detached(v) for k, v in kwargs.items()}
    if not grad:
        def forward():
            with torch.no_grad():
                fn(*args, **kwargs)
        return forward
    leaves = [t for t in _tensors(args) + _tensors(list(kwargs.values())) if t.requires_grad]
    grads = [torch.ones_like(o) for o in _tensors(fn(*args, **kwargs)) if o.requires_grad]

    def forward_backward():
        outs = [o for o in _tensors(fn(*args, **kwargs)) if o.requires_grad]
        torch.autograd.grad(outs, leaves, grads)
    return forward_backward


def _decide(ours: Callable, torch_fn: Callable, args, kwargs, grad: bool, device: torch.device):
    try:
        ours_call = _timed(ours, args, kwargs, grad)
        ours_call()
    except Exception as e:  # noqa: BLE001 (any failure of ours means PyTorch's is used)
        return {"impl": "torch", "reason": f"trainscale raised {type(e).__name__}: {e}"}
    if device.type != "cuda":
        return {"impl": "torch", "reason": "cpu: trainscale runs its fp64 reference there"}
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch_call = _timed(torch_fn, args, kwargs, grad)
        torch_ms = _C.time_callable(torch_call, index, config.timing)["median"]
    except Exception as e:  # noqa: BLE001
        return {"impl": "trainscale", "reason": f"PyTorch raised {type(e).__name__}: {e}"}
    ours_ms = _C.time_callable(ours_call, index, config.timing)["median"]
    impl = "trainscale" if ours_ms <= torch_ms else "torch"
    return {"impl": impl, "reason": f"faster: trainscale {ours_ms:.4f} ms, torch {torch_ms:.4f} ms",
            "ms": {"trainscale": ours_ms, "torch": torch_ms}}


def _record(path, key, choice, device):
    _choices(path)[key] = choice
    _save(path, device)
    if config.verbose:
        print(f"trainscale: {key} -> {choice['impl']} ({choice['reason']})", file=sys.stderr)


def dispatch(family: str, op: str, ours: Callable, torch_fn: Callable, *args, **kwargs):
    """Calls ours or torch_fn(*args, **kwargs) as config.use_<family> says."""
    mode = getattr(config, "use_" + family)
    if mode is True:
        return ours(*args, **kwargs)
    if mode is False:
        return torch_fn(*args, **kwargs)
    # "auto". While compiling there is no real tensor to time: ours, which compiles as one op.
    if torch.compiler.is_compiling():
        return ours(*args, **kwargs)
    ts = _tensors(list(args) + list(kwargs.values()))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in ts)
    device = ts[0].device
    path, key = cache_path(device), _key(op, args, kwargs, grad)
    choice = _choices(path).get(key)
    if choice is None:
        choice = _decide(ours, torch_fn, args, kwargs, grad, device)
        _record(path, key, choice, device)
    if choice["impl"] == "torch":
        return torch_fn(*args, **kwargs)
    try:
        return ours(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (a cached choice that no longer holds: fall back)
        _record(path, key, {"impl": "torch", "reason": f"trainscale raised {type(e).__name__}: {e}"}, device)
        return torch_fn(*args, **kwargs)


def print_selection(file=None):
    """Prints the switches and every choice read or made in this process, per selection file."""
    file = file or sys.stdout
    print(repr(config), file=file)
    if not _loaded:
        print("no automatic choices yet (switches set to 'auto' choose on first use)", file=file)
    for path, choices in _loaded.items():
        print(f"{path}:", file=file)
        for key in sorted(choices):
            print(f"  {key} -> {choices[key]['impl']} ({choices[key]['reason']})", file=file)
