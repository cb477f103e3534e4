"""The optimizers in PyTorch: AdamW with gradient clipping folded in (include/trainscale/optim.h),
and the Newton-Schulz family (include/trainscale/newton_schulz.h): newton_schulz and the Muon
optimizer, on one process or distributed over torch.distributed.

Muon (``ts.optim.Muon``) updates 2-D parameters with the orthogonalized momentum
(torch.ops.trainscale.muon_step_: the CUDA kernels on the GPU, the fp64 reference on the CPU) and
every other parameter, and those of groups with ``use_muon=False`` (embeddings, the LM head), with
AdamW, the usual recipe (Keller Jordan's Muon, Moonlight).
"""
import math
from collections import defaultdict
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.library import register_fake

from ._common import like as _like
from ._common import ops

__all__ = ["AdamW", "Muon", "newton_schulz", "DEFAULT_NS_COEFFICIENTS"]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_LR_RULES = ("original", "match_rms_adamw", "spectral_unclamped")
_NS_METHODS = ("standard", "gram")


@register_fake("trainscale::newton_schulz")
def _(g, steps, a, b, c, eps, method):
    return _like(g)


def newton_schulz(g: torch.Tensor, steps: int = 5,
                  coefficients: Tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
                  eps: float = 1e-7, method: str = "standard") -> torch.Tensor:
    """Newton-Schulz orthogonalization of a matrix [R, C] or of each matrix of a batch [N, R, C]:
    X = G / (||G||_F + eps), transposed when R > C, then ``steps`` times
    X <- a X + (b A + c A A) X with A = X X^T. On CUDA, X and the Gram products are stored in g's
    dtype between the products (float32 accumulation) and each matrix of a batch gets the bits a
    call on it alone gives; on the CPU the fp64 reference. ``method="gram"`` runs the CUDA steps as
    Gram Newton-Schulz (on [p, p] polynomials of X X^T, where max(R, C) >= 3 min(R, C); the same
    iteration in exact arithmetic; NewtonSchulzMethod in include/trainscale/newton_schulz.h)."""
    a, b, c = coefficients
    return ops.newton_schulz(g, steps, a, b, c, eps, method)


def _local(t):
    """The tensor a rank holds: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _is_dtensor(t):
    return hasattr(t, "full_tensor")


def _owners(sizes: Sequence[int], world: int):
    """Rank owning each matrix: largest first to the least-loaded rank (ties: lowest rank, then
    the earlier matrix), the same on every rank."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def _closure_loss(closure):
    """An optimizer step's closure run with gradients on (its loss), None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _adamw_count_step(state, p, moments_dtype=None):
    """AdamW's state of p (created zero on first use, moments in moments_dtype or p's dtype, a
    DTensor like p's for a DTensor, so distributed checkpoints see its sharding), its step count
    advanced; returns the new step number."""
    if not state:
        dtype = moments_dtype or p.dtype
        like = p.detach() if _is_dtensor(p) else p
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(like, dtype=dtype, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(like, dtype=dtype, memory_format=torch.contiguous_format)
    state["step"] += 1
    return int(state["step"].item())


def _adamw_update(states, params, lr, betas, eps, weight_decay, step, grad_scale=None):
    """One adamw_step_ over params (one device, one step number), each on its local tensor."""
    ops.adamw_step_([_local(p) for p in params], [_local(p.grad) for p in params],
                    [_local(states[p]["exp_avg"]) for p in params], [_local(states[p]["exp_avg_sq"]) for p in params],
                    lr, betas[0], betas[1], eps, weight_decay, step, grad_scale)


def _clip_factor(params, max_norm):
    """(global gradient norm, clip factor), float32 tensors on the gradients' device. Plain
    tensors: grad_norm over them. DTensors sharded over one 1-D mesh (FSDP2): each rank's float64
    sum of squares of its shards, all-reduced over the mesh, then the factor as grad_norm forms it."""
    if len({_local(p).device for p in params}) > 1:
        raise ValueError("AdamW: max_grad_norm needs every gradient on one device "
                         "(clip with torch.nn.utils.clip_grad_norm_ instead)")
    sharded = [_is_dtensor(p) for p in params]
    if not any(sharded):
        return ops.grad_norm([p.grad for p in params], max_norm)
    from torch.distributed.tensor import Shard
    meshes = {p.device_mesh for p in params if _is_dtensor(p)}
    mesh = next(iter(meshes))
    if not all(sharded) or len(meshes) > 1 or mesh.ndim != 1 or not all(
            isinstance(pl, Shard) for p in params for pl in p.placements):
        raise ValueError("AdamW: max_grad_norm needs plain tensors or DTensors sharded over one 1-D mesh "
                         "(clip with torch.nn.utils.clip_grad_norm_ instead)")
    local_norm, _ = ops.grad_norm([_local(p.grad) for p in params], math.inf)
    total = local_norm.double().square()
    dist.all_reduce(total, group=mesh.get_group())
    norm = total.sqrt()
    return norm.float(), (max_norm / (norm + 1e-6)).clamp(max=1.0).float()


@register_fake("trainscale::grad_norm")
def _(grads, max_norm):
    return grads[0].new_empty((), dtype=torch.float32), grads[0].new_empty((), dtype=torch.float32)


@register_fake("trainscale::scale_by_device_factor_")
def _(tensors, factor):
    return None


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments), one pass over
    each parameter (torch.ops.trainscale.adamw_step_: float32 math, each output rounded once;
    the CUDA kernels on the GPU, the fp64 reference on the CPU)::

        g = grad * clip;  m <- m + (1 - beta1) (g - m);  v <- beta2 v + (1 - beta2) g^2
        param <- param (1 - lr weight_decay) - lr / (1 - beta1^t) m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    max_grad_norm: clip the gradients as torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    does, without writing them: the global norm of every gradient of the optimizer
    (torch.ops.trainscale.grad_norm, deterministic) gives clip = min(1, max_grad_norm /
    (norm + 1e-6)), which the update reads on the device (no host synchronization; a NaN norm
    makes the update NaN, as clipping by NaN does). The norm of the last step is ``grad_norm``
    (a float32 tensor on the parameters' device). Needs every gradient on one device; FSDP2
    parameters (DTensors sharded over one 1-D mesh) too: each rank's sum of squares of its
    shards, all-reduced over the mesh; None: no clipping.
    moments_dtype: the dtype of exp_avg and exp_avg_sq, torch.float32 or None (the parameter's,
    as torch.optim.AdamW keeps them). The state (``step``, ``exp_avg``, ``exp_avg_sq``) has
    torch.optim.AdamW's names and layout, so state_dicts load either way.
    step_in_backward() moves the update into the backward pass, one parameter at a time.
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, max_grad_norm: Optional[float] = None,
                 moments_dtype: Optional[torch.dtype] = None):
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"AdamW: {name} must be finite and >= 0, got {value}")
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"AdamW: betas must lie in [0, 1), got {betas}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"AdamW: max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if moments_dtype not in (None, torch.float32):
            raise ValueError(f"AdamW: moments_dtype must be None or torch.float32, got {moments_dtype}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.max_grad_norm = max_grad_norm
        self.moments_dtype = moments_dtype
        self.grad_norm: Optional[torch.Tensor] = None
        self.in_backward = False
        self._grad_square_sum: Optional[torch.Tensor] = None  # step_in_backward's, this step's

    def step_in_backward(self) -> None:
        """Update each parameter as soon as the backward has completed its gradient (a
        post-accumulate-grad hook, with the group's learning rate at that moment), then free the
        gradient: the whole model's gradients never coexist, which takes them off the step's
        peak memory. step() then updates only the parameters that still hold a gradient and sets
        ``grad_norm`` to the global norm of the gradients the backward passed (float64 sum of
        squares). Needs max_grad_norm None (clipping needs every gradient before the first
        update) and plain tensors (not FSDP2's DTensors); one backward per step (gradient
        accumulation would update on every micro-batch) is the caller's to keep."""
        if self.max_grad_norm is not None:
            raise ValueError("AdamW.step_in_backward: max_grad_norm must be None (clipping needs every "
                             "gradient before the first update)")
        groups = {}
        for group in self.param_groups:
            for p in group["params"]:
                if _is_dtensor(p):
                    raise ValueError("AdamW.step_in_backward: plain tensors only (got a DTensor)")
                groups[p] = group
        if self.in_backward:
            return

        @torch.no_grad()
        def update(p):
            group = groups[p]
            step = _adamw_count_step(self.state[p], p, self.moments_dtype)
            norm, _ = ops.grad_norm([p.grad], math.inf)
            square = norm.double().square()
            self._grad_square_sum = square if self._grad_square_sum is None else self._grad_square_sum + square
            _adamw_update(self.state, [p], group["lr"], group["betas"], group["eps"], group["weight_decay"], step)
            p.grad = None

        for p in groups:
            p.register_post_accumulate_grad_hook(update)
        self.in_backward = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        calls = defaultdict(list)  # (group, step, device): parameters updated in one call
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW: sparse gradients are not supported")
                calls[(gi, _adamw_count_step(self.state[p], p, self.moments_dtype), p.device)].append(p)
        if self.in_backward:
            square = self._grad_square_sum
            for p in (p for ps in calls.values() for p in ps):
                norm, _ = ops.grad_norm([p.grad], math.inf)
                square = norm.double().square() if square is None else square + norm.double().square()
            self.grad_norm = torch.zeros((), dtype=torch.float32) if square is None else square.sqrt().float()
            self._grad_square_sum = None
        scale = None
        if self.max_grad_norm is not None and calls:
            self.grad_norm, scale = _clip_factor([p for ps in calls.values() for p in ps], float(self.max_grad_norm))
        for (gi, step, _), ps in calls.items():
            group = self.param_groups[gi]
            _adamw_update(self.state, ps, group["lr"], group["betas"], group["eps"], group["weight_decay"], step, scale)
        return loss


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters, AdamW for the rest, in one torch.optim.Optimizer.

    Muon, per 2-D parameter (torch.ops.trainscale.muon_step_, one batched call per shape and
    dtype)::

        buf <- momentum * buf + grad;  u = nesterov ? grad + momentum * buf : buf
        param <- param * (1 - lr * weight_decay) - lr * s * NS(u)

    with s from ``adjust_lr_fn`` ("original": max(1, R/C)^0.5; "match_rms_adamw":
    0.2 max(R, C)^0.5; "spectral_unclamped": (R/C)^0.5, torch.optim.Muon's rules) and NS the
    Newton-Schulz iteration (``ns_steps``, ``ns_coefficients``, ``eps``; ``ns_method``, "standard"
    or "gram", as ``newton_schulz``'s ``method``). The momentum buffer is kept in float32.

    AdamW (torch.ops.trainscale.adamw_step_, as ``AdamW`` without clipping; moments in the
    parameter's dtype) for the parameters that are not 2-D
    and for every parameter of a group with ``use_muon=False``, with the group's ``adamw_lr``,
    ``adamw_betas``, ``adamw_eps`` and ``adamw_weight_decay``. ``use_muon=True`` asserts that every
    parameter of the group is 2-D. Every option may be set per parameter group.

    distributed=True (torch.distributed initialized; ``process_group`` or the default group):
    each rank runs Muon on its share of the 2-D parameters (largest first to the least-loaded
    rank, the same assignment on every rank) and keeps only their momentum buffers; the updated
    parameters are all-gathered. Parameters may be replicated (DDP) or DTensors (FSDP2): the
    full gradient and parameter of each matrix are gathered (DTensor.full_tensor) on every rank,
    its owner updates it, and each rank copies back its own shard. An update has the bits the
    single-process optimizer gives on the same gradients. AdamW runs on each rank's local
    tensors (replicated or shards) without communication.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = 5,
                 ns_coefficients: Tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS, eps: float = 1e-7,
                 adjust_lr_fn: str = "original", use_muon: Optional[bool] = None, adamw_lr: float = 3e-4,
                 adamw_betas: Tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-10,
                 adamw_weight_decay: float = 0.0, distributed: bool = False, process_group=None,
                 ns_method: str = "standard"):
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay),
                            ("eps", eps), ("adamw_lr", adamw_lr), ("adamw_eps", adamw_eps),
                            ("adamw_weight_decay", adamw_weight_decay)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"Muon: {name} must be finite and >= 0, got {value}")
        if not (isinstance(ns_steps, int) and ns_steps >= 0):
            raise ValueError(f"Muon: ns_steps must be an int >= 0, got {ns_steps}")
        if ns_method not in _NS_METHODS:
            raise ValueError(f"Muon: ns_method must be one of {', '.join(_NS_METHODS)}, got {ns_method!r}")
        if adjust_lr_fn not in _LR_RULES:
            raise ValueError(f"Muon: adjust_lr_fn must be one of {', '.join(_LR_RULES)}, got {adjust_lr_fn!r}")
        if not all(0 <= beta < 1 for beta in adamw_betas):
            raise ValueError(f"Muon: adamw_betas must lie in [0, 1), got {adamw_betas}")
        if distributed and not dist.is_initialized():
            raise ValueError("Muon: distributed=True needs torch.distributed to be initialized")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_method=ns_method,
                        adjust_lr_fn=adjust_lr_fn,
                        use_muon=use_muon, adamw_lr=adamw_lr, adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps,
                        adamw_weight_decay=adamw_weight_decay)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon: a group with use_muon=True holds a parameter that is not 2-D")
        self.distributed = distributed
        self.process_group = process_group

    @staticmethod
    def _uses_muon(group, p):
        return p.ndim == 2 if group["use_muon"] is None else group["use_muon"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        matrices = []  # (group, param) in group and parameter order: the same on every rank
        others = defaultdict(list)  # AdamW's parameters per (group, step, device)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Muon: sparse gradients are not supported")
                if self._uses_muon(group, p):
                    if _is_dtensor(p) and not self.distributed:
                        raise ValueError("Muon: a DTensor (FSDP2) parameter needs Muon(..., distributed=True)")
                    matrices.append((group, p))
                else:
                    others[(id(group), _adamw_count_step(self.state[p], p), p.device)].append((group, p))
        for (_, step, _), entries in others.items():
            group, params = entries[0][0], [p for _, p in entries]
            _adamw_update(self.state, params, group["adamw_lr"], group["adamw_betas"], group["adamw_eps"],
                          group["adamw_weight_decay"], step)
        if self.distributed:
            self._distributed_muon(matrices)
        else:
            self._muon([(group, p, p, p.grad) for group, p in matrices])
        return loss

    def _muon(self, work):
        """work: (group, state key, parameter, gradient) with plain tensors; one muon_step_ per
        group, shape, dtype and device (the op batches same-shape matrices)."""
        batches = defaultdict(list)
        for group, key, param, grad in work:
            state = self.state[key]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
            batches[(id(group), param.shape, param.dtype, param.device)].append(
                (group, param, grad, state["momentum_buffer"]))
        for entries in batches.values():
            group = entries[0][0]
            a, b, c = group["ns_coefficients"]
            ops.muon_step_([e[1] for e in entries], [e[2] for e in entries], [e[3] for e in entries], group["lr"],
                           group["momentum"], group["weight_decay"], group["nesterov"], group["adjust_lr_fn"],
                           group["ns_steps"], a, b, c, group["eps"], group["ns_method"])

    def _distributed_muon(self, matrices):
        pg = self.process_group
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        owner = _owners([p.numel() for _, p in matrices], world)
        full = []  # per matrix: (full parameter, full gradient), kept by its owner only
        for (group, p), r in zip(matrices, owner):
            param = p.full_tensor() if _is_dtensor(p) else p
            grad = p.grad.full_tensor() if _is_dtensor(p.grad) else p.grad
            full.append((param.contiguous(), grad.contiguous()) if r == rank else None)
        mine = [i for i, r in enumerate(owner) if r == rank]
        self._muon([(matrices[i][0], matrices[i][1], full[i][0], full[i][1]) for i in mine])
        # All-gather the updated matrices, one flat buffer per dtype and rank (padded to the
        # largest rank's share), then each rank copies back its parameters or shards.
        by_dtype = defaultdict(list)
        for i, (_, p) in enumerate(matrices):
            by_dtype[p.dtype].append(i)
        for dtype, indices in by_dtype.items():
            sizes = [0] * world
            for i in indices:
                sizes[owner[i]] += matrices[i][1].numel()
            device = _local(matrices[indices[0]][1]).device
            send = torch.zeros(max(sizes), dtype=dtype, device=device)
            at = 0
            for i in indices:
                if owner[i] == rank:
                    n = matrices[i][1].numel()
                    send[at:at + n].copy_(full[i][0].reshape(-1))
                    at += n
            received = [torch.empty_like(send) for _ in range(world)]
            dist.all_gather(received, send, group=pg)
            offsets = [0] * world
            for i in indices:
                p, r = matrices[i][1], owner[i]
                n = p.numel()
                value = received[r][offsets[r]:offsets[r] + n].view(p.shape)
                offsets[r] += n
                if _is_dtensor(p):
                    from torch.distributed.tensor import distribute_tensor
                    shard = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
                    _local(p).copy_(shard.to_local())
                else:
                    p.copy_(value)
