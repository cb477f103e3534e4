"""Vocabulary-parallel cross-entropy (Megatron-style) over torch.distributed: the vocabulary is
sharded over a tensor-parallel process group, each rank holding the logits (or the lm_head rows)
of its own contiguous slice of it. Pure PyTorch (no op of ours), for gloo on the CPU and NCCL on
CUDA.

Sharding rule: with p ranks in ``group`` and a shard width of S columns on every rank, the rank
of group rank r holds the global vocabulary ids [r * S, (r + 1) * S). Every rank must hold the
same S (not checked: it would cost a collective per call). A vocabulary V that p does not divide
is padded to p * S = p * ceil(V / p) columns and ``vocab_size=V`` given: the padding columns
(global id >= V) are then left out of the softmax (as -inf: zero probability, zero gradient).

Communication per call (over ``group``; none when it has one rank or torch.distributed is not
initialized): forward, one all-reduce MAX of [T] and one all-reduce SUM of [2, T] (3, T with
label smoothing) in the statistics' dtype (float32; float64 for float64 inputs); backward of
vocab_parallel_cross_entropy, none; backward of vocab_parallel_linear_cross_entropy, one
all-reduce SUM of grad_hidden [T, H] in the statistics' dtype.
"""
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy"]

# Elements of one float32 logits chunk [rows, S] (64 Mi: 256 MiB) when chunk_size is not given.
_CHUNK_ELEMENTS = 1 << 26


def _group_info(group):
    """(rank in the group, group size); (0, 1) when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _stat_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _chunks(rows, width, chunk_size):
    step = chunk_size if chunk_size else max(1, _CHUNK_ELEMENTS // max(width, 1))
    return [(i, min(i + step, rows)) for i in range(0, rows, step)]


def _shift(m):
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


class _Plan:
    """What one call needs to know about its shard: where it starts, its valid columns, the
    owned targets."""

    def __init__(self, target, width, group, ignore_index, vocab_size, label_smoothing, reduction, device):
        rank, size = _group_info(group)
        self.group, self.ranks = group, size
        self.width, self.start = width, rank * width
        self.total = vocab_size if vocab_size is not None else width * size
        if not 0 < self.total <= width * size:
            raise ValueError(f"vocab_parallel: vocab_size={vocab_size} outside (0, {width * size}] "
                             f"(shard width {width} x {size} ranks)")
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"vocab_parallel: reduction must be 'mean', 'sum' or 'none', not {reduction!r}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"vocab_parallel: label_smoothing must lie in [0, 1], not {label_smoothing}")
        self.ignore_index, self.smoothing, self.reduction = ignore_index, float(label_smoothing), reduction
        # Columns of this shard past the vocabulary (padding), left out of the softmax.
        self.valid = max(0, min(width, self.total - self.start))
        self.kept = target != ignore_index
        bad = self.kept & ((target < 0) | (target >= self.total))
        if target.is_cuda:
            torch._assert_async(~bad.any(), "vocab_parallel: a target outside [0, vocab_size)")
        elif bool(bad.any()):
            raise IndexError(f"vocab_parallel: a target outside [0, {self.total}) that is not ignore_index "
                             f"({ignore_index})")
        local = target - self.start
        self.owned = self.kept & (local >= 0) & (local < self.valid)
        self.local = torch.where(self.owned, local, torch.zeros_like(local))

    def all_reduce(self, t, op):
        if self.ranks > 1:
            dist.all_reduce(t, op=op, group=self.group)
        return t

    def prepare(self, x):
        """A chunk of logits, in the statistics' dtype, with padding columns at -inf."""
        if self.valid < self.width:
            x = x.clone()
            x[:, self.valid:] = float("-inf")
        return x

    def forward_stats(self, spans, chunk_logits, rows, dtype, device):
        """lse [T] and the per-row loss [T] from the logits of rows [a, b) (chunk_logits(a, b), in
        the statistics' dtype) for every span, with the two all-reduces."""
        local_max = torch.empty(rows, dtype=dtype, device=device)
        local_sum = torch.empty(rows, dtype=dtype, device=device)
        # SUM-reduced rows: the (shift-rescaled) sum of exp, the target logit, the sum of the logits.
        summed = torch.zeros(3 if self.smoothing else 2, rows, dtype=dtype, device=device)
        for a, b in spans:
            x = self.prepare(chunk_logits(a, b))
            m = x.amax(dim=1) if self.width else torch.full((b - a,), float("-inf"), dtype=dtype, device=device)
            # A row of -inf shifts by 0 (no -inf - -inf); a +inf maximum gives NaN, as F.cross_entropy.
            shift = _shift(m)
            local_max[a:b], local_sum[a:b] = m, torch.exp(x - shift[:, None]).sum(dim=1)
            picked = x.gather(1, self.local[a:b, None]).squeeze(1) if self.width else torch.zeros_like(m)
            summed[1, a:b] = torch.where(self.owned[a:b], picked, torch.zeros_like(picked))
            if self.smoothing:
                summed[2, a:b] = x[:, :self.valid].sum(dim=1)
        global_max = self.all_reduce(local_max.clone(), dist.ReduceOp.MAX)
        local_shift, global_shift = _shift(local_max), _shift(global_max)
        summed[0] = local_sum * torch.exp(local_shift - global_shift)
        self.all_reduce(summed, dist.ReduceOp.SUM)
        lse = global_shift + torch.log(summed[0])
        loss = lse - (1.0 - self.smoothing) * summed[1]
        if self.smoothing:
            loss = loss - self.smoothing / self.total * summed[2]
        return lse, torch.where(self.kept, loss, torch.zeros_like(loss))

    def reduce(self, per_row):
        if self.reduction == "none":
            return per_row
        total = per_row.sum()
        return total / self.kept.sum() if self.reduction == "mean" else total

    def row_scale(self, grad_loss, dtype):
        """The upstream gradient of each row's loss: 0 on ignored rows, / count for a mean."""
        g = grad_loss.to(dtype)
        if self.reduction == "mean":
            g = g / self.kept.sum()
        return torch.where(self.kept, g.expand(self.kept.shape), torch.zeros((), dtype=dtype, device=g.device))

    def grad_logits(self, x, lse, scale, a, b):
        """d loss / d logits of rows [a, b) of this shard, x in the statistics' dtype."""
        g = torch.exp(self.prepare(x) - lse[a:b, None])
        if self.width:
            # minus (1 - smoothing) at the target's column of the rows this shard owns (no host sync)
            hit = self.owned[a:b, None].to(g.dtype) * -(1.0 - self.smoothing)
            g.scatter_add_(1, self.local[a:b, None], hit)
        if self.smoothing:
            g[:, :self.valid] -= self.smoothing / self.total
        return g * scale[a:b, None]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, reduction, vocab_size, chunk_size):
        dtype = _stat_dtype(logits)
        rows, width = logits.shape
        plan = _Plan(target, width, group, ignore_index, vocab_size, label_smoothing, reduction, logits.device)
        spans = _chunks(rows, width, chunk_size)
        lse, per_row = plan.forward_stats(spans, lambda a, b: logits[a:b].to(dtype), rows, dtype,
                                          logits.device)
        ctx.plan, ctx.spans = plan, spans
        ctx.save_for_backward(logits, lse)
        ctx.mark_non_differentiable(lse)
        return plan.reduce(per_row), lse

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):
        logits, lse = ctx.saved_tensors
        plan = ctx.plan
        scale = plan.row_scale(grad_loss, lse.dtype)
        grad = torch.empty_like(logits)
        for a, b in ctx.spans:
            grad[a:b] = plan.grad_logits(logits[a:b].to(lse.dtype), lse, scale, a, b)
        return grad, None, None, None, None, None, None, None


class _VocabParallelLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, group, ignore_index, label_smoothing, reduction, vocab_size,
                chunk_size):
        dtype = _stat_dtype(hidden)
        rows, width = hidden.shape[0], weight.shape[0]
        plan = _Plan(target, width, group, ignore_index, vocab_size, label_smoothing, reduction, hidden.device)
        spans = _chunks(rows, width, chunk_size)
        lse, per_row = plan.forward_stats(spans, lambda a, b: (hidden[a:b] @ weight.t()).to(dtype),
                                          rows, dtype, hidden.device)
        ctx.plan, ctx.spans = plan, spans
        ctx.save_for_backward(hidden, weight, lse)
        ctx.mark_non_differentiable(lse)
        return plan.reduce(per_row), lse

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):
        hidden, weight, lse = ctx.saved_tensors
        plan = ctx.plan
        dtype = lse.dtype
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        scale = plan.row_scale(grad_loss, dtype)
        grad_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if want_weight else None
        for a, b in ctx.spans:
            # The chunk's logits again (one GEMM), then its gradient in the inputs' dtype for the two GEMMs.
            h = hidden[a:b]
            g = plan.grad_logits((h @ weight.t()).to(dtype), lse, scale, a, b).to(hidden.dtype)
            if want_hidden:
                grad_hidden[a:b] = g @ weight
            if want_weight:
                grad_weight += g.t() @ h
        if want_hidden:
            # hidden is replicated over the group: its gradient is the sum of every shard's part.
            plan.all_reduce(grad_hidden, dist.ReduceOp.SUM)
            grad_hidden = grad_hidden.to(hidden.dtype)
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _check_target(target, rows, name):
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: target must be an int64 or int32 tensor, not {target.dtype}")
    if target.numel() != rows:
        raise ValueError(f"{name}: target has {target.numel()} elements for {rows} rows")
    return target.reshape(-1).long()


def _finish(loss, lse, target, reduction, return_lse):
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return (loss, lse.reshape(target.shape)) if return_lse else loss


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor,
                                 group: Optional["dist.ProcessGroup"] = None, ignore_index: int = -100,
                                 reduction: str = "mean", label_smoothing: float = 0.0,
                                 vocab_size: Optional[int] = None, return_lse: bool = False,
                                 chunk_size: Optional[int] = None):
    """Cross-entropy of logits whose vocabulary is sharded over ``group`` (default: the default
    group; one process when torch.distributed is not initialized): the same value on every rank as
    F.cross_entropy(full_logits, target, ignore_index=, reduction=, label_smoothing=) of the
    concatenated shards, and each rank's gradient is the one of its own shard (no communication in
    the backward).

    logits_shard [..., S]: this rank's columns [rank * S, (rank + 1) * S) of the logits, any float
    dtype (math in float32; float64 for float64 logits), read in chunks of ``chunk_size`` rows
    (default: 256 MiB of float32) so that no float32 copy of the whole shard is made. target [...]:
    global vocabulary ids, the same on every rank. Rows whose target is ignore_index give 0 and
    leave the mean (all ignored: NaN). vocab_size: the real vocabulary when the shards are padded
    (see the module's docstring). Returns the loss (float32/float64), and with return_lse=True also
    the log-sum-exp of every row over the whole vocabulary (not differentiable). NaN and Inf in the
    logits propagate as in F.cross_entropy."""
    name = "vocab_parallel_cross_entropy"
    if not logits_shard.is_floating_point() or logits_shard.dim() < 1:
        raise TypeError(f"{name}: logits_shard must be a floating-point tensor [..., S]")
    width, rows = logits_shard.shape[-1], logits_shard.shape[:-1].numel()
    flat_target = _check_target(target, rows, name)
    loss, lse = _VocabParallelCE.apply(logits_shard.reshape(rows, width), flat_target, group, ignore_index,
                                       label_smoothing, reduction, vocab_size, chunk_size)
    return _finish(loss, lse, target, reduction, return_lse)


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor,
                                        group: Optional["dist.ProcessGroup"] = None, ignore_index: int = -100,
                                        reduction: str = "mean", label_smoothing: float = 0.0,
                                        vocab_size: Optional[int] = None, return_lse: bool = False,
                                        chunk_size: Optional[int] = None):
    """vocab_parallel_cross_entropy(hidden @ weight_shard.T, target, ...) without the logits: hidden
    [..., H] is replicated over ``group``, weight_shard [S, H] holds the lm_head rows of this rank's
    vocabulary ids [rank * S, (rank + 1) * S). The logits are made ``chunk_size`` tokens at a time
    (default: 256 MiB of float32 per chunk) by a GEMM in the inputs' dtype, kept for the forward's
    statistics only, and made again in the backward (3 GEMMs there: logits, grad_hidden,
    grad_weight). grad_weight_shard is this rank's own (accumulated over the chunks in float32);
    grad_hidden is all-reduced (SUM) over the group, in float32, so that every rank holds the
    gradient of the whole vocabulary's loss (do not all-reduce it again)."""
    name = "vocab_parallel_linear_cross_entropy"
    if weight_shard.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight_shard.shape[1]:
        raise ValueError(f"{name}: expected hidden [..., H] and weight_shard [S, H], got {tuple(hidden.shape)} "
                         f"and {tuple(weight_shard.shape)}")
    if hidden.dtype != weight_shard.dtype:
        raise TypeError(f"{name}: hidden ({hidden.dtype}) and weight_shard ({weight_shard.dtype}) differ in dtype")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_target = _check_target(target, flat_hidden.shape[0], name)
    loss, lse = _VocabParallelLinearCE.apply(flat_hidden, weight_shard, flat_target, group, ignore_index,
                                             label_smoothing, reduction, vocab_size, chunk_size)
    return _finish(loss, lse, target, reduction, return_lse)
