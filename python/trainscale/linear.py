"""Linear projections of one input (attention's q, k and v of the same hidden states): the
forward is the separate F.linear products; the backward sums the input's gradient inside the
products (each after the first accumulates into it, beta = 1 in the GEMM) instead of autograd's
separate add of every further gradient, a pass over [T, H] read twice and written once per
extra projection."""
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .norm import save_input, saved_input


class _SharedInputLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *params):
        n = len(params) // 2
        weights, biases = params[:n], params[n:]
        save_input(ctx, x, *weights)  # x rebuilt in the backward when it is a norm's output
        ctx.set_materialize_grads(False)  # an unused output gets no zero gradient
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, weights = saved_input(ctx)
        n = len(weights)
        need = ctx.needs_input_grad
        x2 = x.reshape(-1, x.shape[-1])
        dx = None
        dws, dbs = [None] * n, [None] * n
        for i, (dy, w) in enumerate(zip(grads, weights)):
            if dy is None:
                continue
            # The products in the forward's dtype (under autocast its dtype, not the weights' or
            # x's; autograd casts each gradient back to its input's dtype).
            dy, w, x2 = dy.reshape(-1, dy.shape[-1]), w.to(dy.dtype), x2.to(dy.dtype)
            if need[0]:
                dx = dy @ w if dx is None else dx.addmm_(dy, w)
            if need[1 + i]:
                dws[i] = dy.t() @ x2
            if need[1 + n + i]:
                dbs[i] = dy.sum(0)
        return (None if dx is None else dx.reshape(x.shape), *dws, *dbs)


def shared_input_linear(x: torch.Tensor, weights: Sequence[torch.Tensor],
                        biases: Optional[Sequence[Optional[torch.Tensor]]] = None):
    """(F.linear(x, w, b) for each weight and bias): the same outputs; in the backward x's
    gradient is summed by the products themselves (see the module's doc)."""
    biases = list(biases) if biases is not None else [None] * len(weights)
    if len(biases) != len(weights):
        raise ValueError(f"trainscale.shared_input_linear: argument 'biases': expected one per weight "
                         f"({len(weights)}), got {len(biases)}")
    return _SharedInputLinear.apply(x, *weights, *biases)


class _Group:
    """The projections of one module and the outputs the first one computed for the others."""

    def __init__(self):
        self.members = []
        self.pending = None  # (x, [outputs not yet handed over])


class SharedInputProjection(nn.Linear):
    """One of a group of nn.Linear layers that a module applies to the same input in a fixed order
    (q_proj, k_proj, v_proj of a Llama attention): the first computes every member's output
    through shared_input_linear and the others hand theirs over when called with that same
    tensor; any other call is a plain nn.Linear. The same Parameters as the layers replaced."""

    def forward(self, x):
        group, index = self._trainscale_group, self._trainscale_index
        if index == 0:
            members = group.members
            if any(hasattr(m.weight, "full_tensor") for m in members):  # sharded weights: one by one
                group.pending = None
                return super().forward(x)
            outs = shared_input_linear(x, [m.weight for m in members], [m.bias for m in members])
            group.pending = (x, list(outs))
            return outs[0]
        pending = group.pending
        if pending is not None and pending[0] is x and pending[1][index] is not None:
            out, pending[1][index] = pending[1][index], None
            if all(o is None for o in pending[1][1:]):
                group.pending = None
            return out
        return super().forward(x)


def group_projections(module: nn.Module, names: Sequence[str]) -> bool:
    """Replaces module's nn.Linear attributes `names` (applied in that order to one input) by a
    group of SharedInputProjection sharing their Parameters; False (nothing changed) unless each
    is exactly an nn.Linear of the same in_features."""
    layers = [getattr(module, n, None) for n in names]
    if not all(type(m) is nn.Linear for m in layers) or len({m.in_features for m in layers}) != 1:
        return False
    group = _Group()
    for i, (name, old) in enumerate(zip(names, layers)):
        new = SharedInputProjection(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
        new.weight, new.bias = old.weight, old.bias
        object.__setattr__(new, "_trainscale_group", group)  # not a submodule
        new._trainscale_index = i
        group.members.append(new)
        setattr(module, name, new)
    return True
