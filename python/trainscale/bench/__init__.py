"""python -m trainscale.bench: trainscale-bench's engine (gate against the fp64 reference, CUDA
events, L2 flush, stopping rule, statistics, JSON / CSV / Markdown reporters) run from Python,
with PyTorch eager, torch.compile(dynamic=False) and, when importable, Liger-Kernel and QuACK
timed next to ours on the same cases (the C++ registry's suites and shapes).

Each baseline gets the case's input tensors by name and returns its outputs in the case's
order; work it needs before the timed call (compilation, tables, the forward pass of a
backward) happens in its untimed setup. PyTorch callables are timed one call per CUDA event
pair (no CUDA graphs), so tiny shapes include their launch overhead.

The flce suite (fused linear cross-entropy, forward and backward through autograd) is measured
here in Python rather than by the engine's cases: it also reports each implementation's peak
memory, and its gate is a float32 reference on sampled rows (flce.py). So is the muon suite
(Newton-Schulz against eager and torch.compile, a Muon step over the 2-D parameters of 4
Llama-3-8B decoder layers against torch.optim.Muon; muon.py). Under torchrun the muon suite
times the Muon step of one process against the distributed one (trainscale-distributed: each
rank orthogonalizes its share, then all-gathers), every rank in lockstep; rank 0 reports. So is
the mlp suite (the Llama MLP with the activation recomputed in the backward against the unfused
chain, eager and torch.compile, with what autograd keeps for the backward; mlp.py), and the
varlen suite (attention over packed sequences against our batched kernel on the padded batch
and PyTorch's SDPA; varlen.py).

The modules: cli (main: the command line, the engine's run or one suite measured in Python),
baselines (the engine's cases in PyTorch, torch.compile, Liger-Kernel, QuACK and SDPA), measure
(what the suites measured in Python share: result rows, gate, timing, saved-tensor bytes, the
measuring loop), flce, muon, mlp and varlen (one suite each), report (the reports, the memory
table, --plot and the exit status).
"""
from .cli import main

__all__ = ["main"]
