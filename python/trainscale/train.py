"""python -m trainscale.train: trains a Hugging Face LlamaForCausalLM built from a config (no
weight download) with AdamW, with PyTorch eager, torch.compile, Liger-Kernel or trainscale
(`patch(model)`), and reports the loss, gradient norm, tokens/s, model TFLOP/s, MFU and peak
memory per step (terminal, JSONL, Weights & Biases when importable).

    python -m trainscale.train --preset tiny --steps 20                    # CPU, seconds
    torchrun --nproc-per-node 8 -m trainscale.train --preset llama3-8b-4layers \\
        --impl trainscale --parallel fsdp2 --seq-len 8192 --jsonl ts.jsonl
    python -m trainscale.train --plot runs.png eager.jsonl trainscale.jsonl

Model FLOPs per trained token (forward + backward, no recomputation counted, so MFU and not
HFU under activation checkpointing):

    6 * N  +  6 * L * H * d * S

N: the parameters that multiply activations (every parameter except the input embedding;
lm_head included), L: decoder layers, H * d: attention heads times head dim, S: sequence
length. The second term is attention's QK^T and PV (12 * L * H * d * S for full attention,
halved because the mask is causal). MFU = model TFLOP/s / --peak-tflops.
"""
import argparse
import contextlib
import gc
import json
import math
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

# name -> decoder shape; vocab None: the tokenizer's (or --vocab-size with --data random).
PRESETS = {
    "tiny": dict(hidden=64, ffn=176, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=None, seq_len=128,
                 batch_size=8, lr=3e-3, rope_theta=10000.0, tokenizer_vocab=2048, corpus_mb=4),
    "llama3-8b-4layers": dict(hidden=4096, ffn=14336, layers=4, heads=32, kv_heads=8, head_dim=128,
                              vocab=128256, seq_len=8192, batch_size=1, lr=3e-4, rope_theta=500000.0,
                              tokenizer_vocab=32768, corpus_mb=64),
}
IMPLS = ("eager", "compile", "liger", "trainscale")
H100_BF16_DENSE_TFLOPS = 989.0  # H100 SXM datasheet, bf16 dense (no sparsity)
_GIB = 2.0 ** 30


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def _peak_arg(text: str):
    return text if text == "auto" else float(text)


def gemm_peak_tflops(m: int, k: int, n: int, device: torch.device) -> float:
    """TFLOP/s of a bf16 [m, k] @ [k, n] product: the median of 20 timed after 5 warm-up, on
    fresh operands that are freed (and the allocator's peak statistics reset) afterwards."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return 2.0 * m * k * n / sorted(times)[len(times) // 2] / 1e12


def git_commit() -> Optional[str]:
    """The commit of the source tree: $TRAINSCALE_GIT_COMMIT (a copy without .git is told it), else git's."""
    if os.environ.get("TRAINSCALE_GIT_COMMIT"):
        return os.environ["TRAINSCALE_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                              capture_output=True, text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


# trainscale.patch's switches (--trainscale-skip).
PATCH_PARTS = ("rms_norm", "swiglu", "geglu", "rope", "cross_entropy", "linear_cross_entropy", "attention", "embedding",
               "qkv_projections", "fused_mlp", "rebuild_norm_outputs")


def _patch_parts(text: str):
    parts = tuple(p for p in text.split(",") if p)
    unknown = [p for p in parts if p not in PATCH_PARTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(unknown)} (known: {', '.join(PATCH_PARTS)})")
    return parts


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m trainscale.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--impl", choices=IMPLS, default="eager",
                   help="eager: transformers as is; compile: torch.compile(model); liger: Liger-Kernel's "
                        "Llama patch; trainscale: trainscale.patch(model) (every op it has)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps, warm-up included")
    p.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the timing summary")
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch per process (default: the preset's)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="adamw: torch.optim.AdamW (fused), with --impl trainscale trainscale.optim.AdamW, which "
                        "clips in its step (torch's under FSDP2); muon: trainscale.optim.Muon for the decoder layers' matrices "
                        "(RMS matched to AdamW, so --lr serves both) and AdamW for embeddings, head and norms; "
                        "under torchrun it orthogonalizes each matrix on one rank (distributed=True)")
    p.add_argument("--ns-method", choices=("standard", "gram"), default="standard",
                   help="--optimizer muon: how the GPU runs Newton-Schulz (trainscale.optim.Muon's ns_method)")
    p.add_argument("--lr", type=float, help="learning rate (default: the preset's)")
    p.add_argument("--lr-warmup-steps", type=int, default=0, help="linear learning-rate warm-up")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip to this norm (0: no clipping)")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="with --impl trainscale --optimizer adamw: each parameter updated in the backward as soon "
                        "as its gradient is complete, which is then freed (trainscale.optim.AdamW.step_in_backward): "
                        "the gradients never all coexist; other impls and optimizers step after the backward as "
                        "usual (so train_bench can pass it to all). Needs --max-grad-norm 0, --grad-accum 1, one "
                        "process")
    p.add_argument("--seed", type=int, default=0, help="model initialization and data order")
    p.add_argument("--perturb-init", type=float, default=0.0, metavar="REL",
                   help="each initial parameter times 1 + REL x N(0, 1) (a generator of its own): a control for "
                        "how far a rounding-sized difference moves the loss curve (0: none)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of each decoder layer")
    p.add_argument("--loss-accumulation", choices=("float32", "weight"), default="float32",
                   help="--impl trainscale: the fused loss's weight-gradient sum over token chunks, in a float32 "
                        "buffer (or all tokens' logits at once when that is smaller), or in the weight's dtype in "
                        "place over chunks of at most 512 MiB of logits, as Liger-Kernel does")
    p.add_argument("--trainscale-skip", type=_patch_parts, default=(), metavar="PARTS",
                   help="--impl trainscale: parts of trainscale.patch to leave out, comma-separated ("
                        + ", ".join(PATCH_PARTS) + "), to measure what each part gives")
    p.add_argument("--gc-every", type=int, default=0, metavar="N",
                   help="Python's automatic garbage collection off during training and a young-generation "
                        "collection at the start of every N-th step, inside its time (0: Python's own schedule)")
    p.add_argument("--sync-every", type=int, default=1, metavar="N",
                   help="the host waits for the GPU (reads the loss and gradient norm) after every N-th step, "
                        "queuing the steps in between as a training loop that logs every N steps does; each "
                        "step's time is its window's mean (1: every step timed alone from an idle GPU)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "bf16-autocast"), default="auto",
                   help="bf16: parameters, gradients and optimizer state in bf16; bf16-autocast: fp32 "
                        "parameters, bf16 autocast; auto: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--parallel", choices=("ddp", "fsdp2"), default="ddp",
                   help="under torchrun: DistributedDataParallel, or fully_shard per decoder layer and the root")
    p.add_argument("--fsdp2-keep-gathered", action="store_true",
                   help="--parallel fsdp2: the decoder layers keep their gathered parameters from the forward to "
                        "the backward (fully_shard(reshard_after_forward=False)): no all-gather in the backward, "
                        "every layer's full parameters held through the step")
    p.add_argument("--data", choices=("corpus", "random"), default="corpus",
                   help="corpus: the Python standard library's source, BPE-tokenized (see docs/train.md); "
                        "random: uniform token ids (throughput runs)")
    p.add_argument("--vocab-size", type=int, help="the tokenizer's vocabulary (random data: the model's when the "
                                                   "preset has none; default: the preset's)")
    p.add_argument("--corpus-mb", type=float, help="megabytes of source text read (default: the preset's)")
    p.add_argument("--cache-dir", help="tokenizer and token cache (default: $TRAINSCALE_CACHE_DIR, "
                                       "else ~/.cache/trainscale)")
    p.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS,
                   help="the peak for MFU (default: H100 SXM bf16 dense, 989)")
    p.add_argument("--measured-peak-tflops", type=_peak_arg,
                   help="a measured peak in TFLOP/s, or 'auto': time the model's largest GEMM (tokens x hidden "
                        "by hidden x FFN, bf16) before training; adds mfu_measured")
    p.add_argument("--jsonl", help="JSONL file: one run record, one record per step, one summary")
    p.add_argument("--profile-step", type=int, metavar="N",
                   help="run step N under torch.profiler (rank 0): PREFIX.trace.json (chrome trace) and "
                        "PREFIX.summary.txt (kernel time, the GPU's idle gaps and the host stacks behind them); "
                        "the step is left out of the timing summary")
    p.add_argument("--profile-prefix", default="trainscale-step",
                   help="path prefix of --profile-step's files (default: trainscale-step, in the working directory)")
    p.add_argument("--no-wandb", action="store_true", help="no Weights & Biases logging even if importable")
    p.add_argument("--quiet", action="store_true", help="no per-step progress line")
    p.add_argument("--plot", metavar="PNG", help="plot the JSONL logs given as arguments into PNG and exit")
    p.add_argument("logs", nargs="*", help="with --plot: JSONL logs of runs")
    args = p.parse_args(argv)
    if args.logs and not args.plot:
        p.error(f"unexpected arguments {args.logs}: JSONL logs are read only with --plot PNG")
    if args.plot and not args.logs:
        p.error("--plot: expected one or more JSONL logs after it")
    preset = PRESETS[args.preset]
    for name in ("batch_size", "seq_len", "lr", "corpus_mb"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    for name in ("steps", "batch_size", "grad_accum", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    if args.warmup_steps < 0:
        p.error(f"--warmup-steps: expected 0 or more, got {args.warmup_steps}")
    if args.sync_every < 1:
        p.error(f"--sync-every: expected a positive step count, got {args.sync_every}")
    if args.gc_every < 0:
        p.error(f"--gc-every: expected 0 (Python's schedule) or a step count, got {args.gc_every}")
    if args.optimizer_in_backward:
        needs = {"--max-grad-norm 0": not args.max_grad_norm, "--grad-accum 1": args.grad_accum == 1}
        missing = [flag for flag, ok in needs.items() if not ok]
        if missing:
            p.error("--optimizer-in-backward: needs " + ", ".join(missing))
    if args.profile_step is not None and not 1 <= args.profile_step <= args.steps:
        p.error(f"--profile-step: expected a step from 1 to --steps ({args.steps}), got {args.profile_step}")
    return args


# --- model --------------------------------------------------------------------------------


def build_model(preset: dict, vocab: int, seq_len: int, seed: int, device: torch.device, dtype: torch.dtype):
    """LlamaForCausalLM with the preset's shape, initialized from `seed` on `device`."""
    import transformers
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=preset["hidden"], intermediate_size=preset["ffn"],
        num_hidden_layers=preset["layers"], num_attention_heads=preset["heads"],
        num_key_value_heads=preset["kv_heads"], head_dim=preset["head_dim"], max_position_embeddings=seq_len,
        rope_theta=preset["rope_theta"], tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype)


def perturb(model, rel: float, seed: int):
    """Multiplies each parameter by 1 + rel x N(0, 1), drawn in float32 on the parameter's device
    from a generator seeded by `seed` (the same perturbation for every implementation)."""
    generators = {}
    with torch.no_grad():
        for p in model.parameters():
            g = generators.setdefault(p.device, torch.Generator(p.device).manual_seed(seed * 1_000_003 + 7))
            noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
            p.copy_(p.float() * (1.0 + rel * noise))


def apply_impl(model, impl: str, verbose: bool, loss_accumulation: str = "float32", skip=()):
    """Swaps in the implementation's kernels; returns the module to call (compiled or not).
    loss_accumulation (trainscale): the fused loss's weight-gradient sum, "float32" or "weight"
    (in the weight's dtype, patch's loss_grad_weight_accumulation); skip (trainscale): patch()
    parts left out (PATCH_PARTS)."""
    if impl == "liger":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as e:
            raise SystemExit(f"--impl liger: Liger-Kernel is not importable ({e}); pip install liger-kernel") from e
        apply_liger_kernel_to_llama(rope=True, swiglu=True, rms_norm=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True, model=model)
    elif impl == "trainscale":
        from . import patch
        accumulation = torch.float32 if loss_accumulation == "float32" else next(model.parameters()).dtype
        patch(model, loss_grad_weight_accumulation=accumulation, verbose=verbose, **{part: False for part in skip})
    return model


def model_flops_per_token(model, preset: dict, seq_len: int) -> float:
    """6 * N + 6 * L * H * d * S (module doc)."""
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return 6.0 * n + 6.0 * preset["layers"] * preset["heads"] * preset["head_dim"] * seq_len


# --- data ---------------------------------------------------------------------------------


class Batches:
    """The global batch of each step: `batch_size * grad_accum * world` sequences of seq_len
    tokens, the same for every --impl and process count. Micro-batch m of rank r is its rows
    [(m * world + r) * batch_size, ... + batch_size)."""

    def __init__(self, tokens: Optional[torch.Tensor], vocab: int, seq_len: int, global_batch: int, seed: int):
        self.tokens, self.vocab, self.seq_len, self.global_batch, self.seed = tokens, vocab, seq_len, global_batch, seed
        if tokens is not None:
            self.windows = tokens.numel() // seq_len
            if self.windows < global_batch:
                raise SystemExit(f"--corpus-mb: the corpus has {self.windows} sequences of {seq_len} tokens, "
                                 f"fewer than the {global_batch} of one step; read more text or shorten --seq-len")
            self.per_epoch = self.windows // global_batch
            self._epoch, self._order = None, None

    def step(self, step: int) -> torch.Tensor:
        if self.tokens is None:  # random: a generator per step, so any process computes any step
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            return torch.randint(0, self.vocab, (self.global_batch, self.seq_len), generator=g)
        epoch, k = divmod(step, self.per_epoch)
        if epoch != self._epoch:  # a new seeded permutation of the sequences each epoch
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.windows, generator=g)
        rows = self._order[k * self.global_batch:(k + 1) * self.global_batch]
        starts = rows[:, None] * self.seq_len + torch.arange(self.seq_len)
        return self.tokens[starts].long()


def micro_batch(batch: torch.Tensor, micro: int, d: Dist, batch_size: int) -> torch.Tensor:
    first = (micro * d.world + d.rank) * batch_size
    return batch[first:first + batch_size]


# --- distributed --------------------------------------------------------------------------


def init_distributed(args) -> Dist:
    """Under torchrun (RANK / WORLD_SIZE set): the process group, NCCL on CUDA, gloo on the CPU."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Dist()
    d = Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(d.local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    return d


def wrap_parallel(model, args, d: Dist, device: torch.device):
    if d.world == 1:
        return model
    if args.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    # The mesh on the run's device: without one, fully_shard picks CUDA whenever it is available.
    mesh = init_device_mesh(device.type, (d.world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=not args.fsdp2_keep_gathered)
    fully_shard(model, mesh=mesh)
    return model


def build_optimizer(model, params, args, device: torch.device, d: Dist) -> torch.optim.Optimizer:
    """AdamW, or Muon for the 2-D weights of the decoder layers with AdamW for the rest (the
    embedding and the LM head, whose rows are tokens, and the norms), as the Muon recipe does."""
    if args.optimizer == "adamw":
        if args.impl == "trainscale":
            # Ours, with the clipping folded into the update (one pass over the gradients fewer);
            # under FSDP2 on each rank's shards, the norm all-reduced.
            from .optim import AdamW
            optimizer = AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                              max_grad_norm=args.max_grad_norm or None)
            if args.optimizer_in_backward:
                if d.world > 1:
                    raise SystemExit("--optimizer-in-backward: one process only (no DDP / FSDP2)")
                optimizer.step_in_backward()
            return optimizer
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                                 fused=device.type == "cuda")
    from .optim import Muon
    base = getattr(model, "module", model)  # DDP wraps the model; FSDP2 does not
    token_rows = {id(p) for m in (base.get_input_embeddings(), base.get_output_embeddings()) if m is not None
                  for p in m.parameters()}
    matrices = [p for p in params if p.ndim == 2 and id(p) not in token_rows]
    others = [p for p in params if not (p.ndim == 2 and id(p) not in token_rows)]
    return Muon([{"params": matrices, "use_muon": True}, {"params": others, "use_muon": False}], lr=args.lr,
                weight_decay=args.weight_decay, adjust_lr_fn="match_rms_adamw", adamw_lr=args.lr,
                adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=args.weight_decay,
                distributed=d.world > 1, ns_method=args.ns_method)


def _grad_sync(model, enabled: bool):
    """Gradient reduction only on the last micro-batch of a step."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def _reduce(values, d: Dist, op):
    if d.world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=op)
    return t.tolist()


# --- reports ------------------------------------------------------------------------------


class Log:
    """Rank 0's records: a JSONL file, and Weights & Biases (offline unless WANDB_MODE says)."""

    def __init__(self, path: Optional[str], use_wandb: bool, run: dict):
        self.file = open(path, "w") if path else None
        self.wandb = None
        if use_wandb:
            try:
                import wandb
            except ImportError:
                wandb = None
            if wandb is not None:
                self.wandb = wandb.init(project="trainscale-train", config=run, name=f"{run['preset']}-{run['impl']}",
                                        mode=os.environ.get("WANDB_MODE", "offline"))
        self.write({"type": "run", **run})

    def write(self, record: dict):
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.wandb is not None and record["type"] == "step":
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and v is not None},
                           step=record["step"])

    def close(self, summary: dict):
        self.write({"type": "summary", **summary})
        if self.file:
            self.file.close()
        if self.wandb is not None:
            self.wandb.summary.update(summary)
            self.wandb.finish()


def _peak_memory(device: torch.device):
    """(max allocated, max reserved) on the GPU, in GiB; (None, None) on the CPU."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device) / _GIB, torch.cuda.max_memory_reserved(device) / _GIB


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GIB  # Linux: KiB


def summarize(steps: list, warmup: int, world: int = 1) -> dict:
    """Means over the steps after the warm-up and not profiled (world: the number of processes);
    final_loss: the mean of the last five losses."""
    timed = [s for s in steps if s["step"] > warmup and not s.get("profiled")]
    out = {"timed_steps": len(timed), "final_loss": sum(s["loss"] for s in steps[-5:]) / len(steps[-5:])}
    keys = ("step_time_s", "tokens_per_s", "tflops", "mfu", "mfu_measured")
    for key in keys:
        values = [s[key] for s in timed if s.get(key) is not None]
        out[key] = sum(values) / len(values) if values else None
    if timed:  # tokens/s of the whole timed span (not the mean of per-step rates)
        out["tokens_per_s"] = sum(s["tokens"] for s in timed) / sum(s["step_time_s"] for s in timed)
    out["tokens_per_s_per_process"] = out["tokens_per_s"] / world if out["tokens_per_s"] is not None else None
    last = steps[-1]
    for key in ("peak_mem_allocated_gib", "peak_mem_reserved_gib", "peak_rss_gib"):
        out[key] = last[key]
    return out


def _progress(r: dict, steps: int) -> str:
    mem = (f" mem {r['peak_mem_allocated_gib']:.2f}/{r['peak_mem_reserved_gib']:.2f} GiB"
           if r["peak_mem_allocated_gib"] is not None else f" rss {r['peak_rss_gib']:.2f} GiB")
    return (f"step {r['step']:>{len(str(steps))}}/{steps} loss {r['loss']:.4f} gnorm {r['grad_norm']:.3f} "
            f"lr {r['lr']:.2e} {r['step_time_s'] * 1e3:.1f} ms {r['tokens_per_s']:,.0f} tok/s "
            f"{r['tflops']:.3g} TFLOP/s mfu {100 * r['mfu']:.3g}%{mem}" + (" (warm-up)" if r["warmup"] else ""))


# --- training -----------------------------------------------------------------------------


def train(args) -> dict:
    d = init_distributed(args)
    try:
        return _train(args, d)
    finally:
        if d.world > 1:
            dist.destroy_process_group()


def _run_worker(args):
    """The command line under torchrun: train, then leave through exit_worker (no process-group
    teardown; the run's logs are closed by then)."""
    from ._distributed import exit_worker
    d = init_distributed(args)
    _train(args, d)
    exit_worker(0)


def _train(args, d: Dist) -> dict:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    device = torch.device("cuda", d.local_rank) if args.device != "cpu" and torch.cuda.is_available() \
        else torch.device("cpu")
    precision = args.precision if args.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    preset = PRESETS[args.preset]
    global_batch = args.batch_size * args.grad_accum * d.world

    if args.data == "corpus":
        from .train_data import corpus_tokens
        tokens, tokenizer_vocab = corpus_tokens(args.vocab_size or preset["tokenizer_vocab"], args.corpus_mb,
                                                args.cache_dir, d, verbose=d.main and not args.quiet)
        vocab = preset["vocab"] or tokenizer_vocab
        if tokenizer_vocab > vocab:
            raise SystemExit(f"--vocab-size: the tokenizer's {tokenizer_vocab} exceeds the model's {vocab}")
    else:
        tokens, vocab = None, preset["vocab"] or args.vocab_size or preset["tokenizer_vocab"]
    batches = Batches(tokens, vocab, args.seq_len, global_batch, args.seed)
    if args.measured_peak_tflops == "auto":
        if device.type != "cuda":
            raise SystemExit("--measured-peak-tflops auto: times a GEMM on the GPU; this run is on the CPU")
        args.measured_peak_tflops = gemm_peak_tflops(args.batch_size * args.seq_len, preset["hidden"], preset["ffn"],
                                                     device)

    model = build_model(preset, vocab, args.seq_len, args.seed, device,
                        torch.bfloat16 if precision == "bf16" else torch.float32)
    if args.perturb_init:
        perturb(model, args.perturb_init, args.seed)
    flops_per_token = model_flops_per_token(model, preset, args.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    model = apply_impl(model, args.impl, verbose=d.main and not args.quiet, loss_accumulation=args.loss_accumulation,
                       skip=args.trainscale_skip)
    if args.checkpointing:
        # transformers 5 renamed gradient_checkpointing_enable (deprecated) to activation_checkpointing_enable.
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model = wrap_parallel(model, args, d, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, params, args, device, d)
    forward = torch.compile(model) if args.impl == "compile" else model
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-autocast"
                else contextlib.nullcontext())

    run = {"preset": args.preset, "impl": args.impl, "trainscale_skip": list(args.trainscale_skip), "gc_every": args.gc_every,
           "sync_every": args.sync_every, "perturb_init": args.perturb_init,
           "data": args.data, "precision": precision,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "world_size": d.world, "parallel": args.parallel if d.world > 1 else None,
           "steps": args.steps, "warmup_steps": args.warmup_steps, "batch_size": args.batch_size,
           "grad_accum": args.grad_accum, "global_batch": global_batch, "seq_len": args.seq_len, "vocab": vocab,
           "params": n_params, "model_flops_per_token": flops_per_token, "optimizer": args.optimizer,
           "optimizer_in_backward": bool(getattr(optimizer, "in_backward", False)),
           "max_grad_norm": args.max_grad_norm,
           "lr": args.lr, "seed": args.seed,
           "checkpointing": args.checkpointing, "loss_accumulation": args.loss_accumulation,
           "peak_tflops": args.peak_tflops,
           "measured_peak_tflops": args.measured_peak_tflops, "torch": torch.__version__,
           "commit": git_commit()}
    log = Log(args.jsonl, not args.no_wandb, run) if d.main else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    records, window = [], []
    tokens_per_step = global_batch * args.seq_len
    with _manual_gc(args.gc_every):
        for step in range(1, args.steps + 1):
            if not window:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
            window.append(_queue_step(step, args, d, device, model, forward, optimizer, params, batches, autocast))
            if _window_ends(step, args):
                losses = [(float(q["loss"]), float(q["grad_norm"])) for q in window]  # waits for the GPU
                step_time = (time.perf_counter() - start) / len(window)
                for q, (loss, grad_norm) in zip(window, losses):
                    records.append(_record(q, loss, grad_norm, step_time, args, d, device, flops_per_token,
                                           tokens_per_step, log))
                window = []
    summary = summarize(records, args.warmup_steps, d.world)
    if d.main:
        log.close(summary)
        if not args.quiet:
            print("summary: " + json.dumps(summary), flush=True)
    return {"run": run, "steps": records, "summary": summary}


@contextlib.contextmanager
def _manual_gc(every: int):
    """With every > 0: Python's automatic garbage collection off (a full collection first), back on
    at the end; _step collects the young generations at the start of every every-th step."""
    if every <= 0:
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _window_ends(step: int, args) -> bool:
    """Whether the host waits for the GPU after this step: every --sync-every steps, at the end of
    the warm-up and of the run, and around the profiled step (timed alone)."""
    return (step % args.sync_every == 0 or step in (args.warmup_steps, args.steps)
            or args.profile_step in (step, step + 1))


def _queue_step(step, args, d, device, model, forward, optimizer, params, batches, autocast) -> dict:
    """Queues one optimizer step on the device without waiting for it: its step, learning rate,
    and the loss and gradient norm as tensors (or numbers) that are ready once it has run."""
    lr = args.lr * min(1.0, step / args.lr_warmup_steps) if args.lr_warmup_steps else args.lr
    for group in optimizer.param_groups:
        group["lr"] = lr
        if "adamw_lr" in group:  # Muon's AdamW parameters
            group["adamw_lr"] = lr
    batch = batches.step(step - 1)
    if device.type == "cuda":
        batch = batch.pin_memory()  # the upload then leaves the host free to queue the step
    profiler = contextlib.nullcontext()
    if step == args.profile_step and d.main:
        from .step_profile import profiled_step
        profiler = profiled_step(args.profile_prefix, device.type == "cuda")
    with profiler:
        if args.gc_every > 0 and step % args.gc_every == 0:
            gc.collect(1)
        loss_sum = 0.0
        for micro in range(args.grad_accum):
            ids = micro_batch(batch, micro, d, args.batch_size).to(device, non_blocking=True)
            with _grad_sync(model, micro == args.grad_accum - 1), autocast:
                loss = forward(input_ids=ids, labels=ids).loss
                (loss / args.grad_accum).backward()
            loss_sum += loss.detach()
        if getattr(optimizer, "max_grad_norm", None) is not None or getattr(optimizer, "in_backward", False):
            optimizer.step()  # trainscale.optim.AdamW: clips in its step, or has stepped in the backward
            grad_norm = optimizer.grad_norm
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or math.inf)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
                grad_norm = grad_norm.full_tensor()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == args.profile_step and device.type == "cuda":
            torch.cuda.synchronize(device)  # the profiled step's kernels inside its trace
    return {"step": step, "lr": lr, "loss": loss_sum / args.grad_accum, "grad_norm": grad_norm}


def _record(queued: dict, loss_value: float, grad_norm: float, step_time: float, args, d, device, flops_per_token,
            tokens_per_step, log) -> dict:
    """A run step's record (step_time: its window's time per step); logged and printed."""
    step = queued["step"]
    mem_alloc, mem_reserved = _peak_memory(device)
    (loss_value,) = [v / d.world for v in _reduce([loss_value], d, dist.ReduceOp.SUM)]
    step_time, mem_alloc_max, mem_reserved_max, rss = _reduce(
        [step_time, mem_alloc or 0.0, mem_reserved or 0.0, _peak_rss_gib()], d, dist.ReduceOp.MAX)
    tflops = flops_per_token * tokens_per_step / step_time / 1e12 / d.world  # per GPU (process)
    r = {"type": "step", "step": step, "warmup": step <= args.warmup_steps, "loss": loss_value,
         "grad_norm": grad_norm, "lr": queued["lr"], "tokens": tokens_per_step, "step_time_s": step_time,
         "tokens_per_s": tokens_per_step / step_time, "tokens_per_s_per_process": tokens_per_step / step_time / d.world,
         "tflops": tflops, "mfu": tflops / args.peak_tflops,
         "mfu_measured": tflops / args.measured_peak_tflops if args.measured_peak_tflops else None,
         "peak_mem_allocated_gib": mem_alloc_max if mem_alloc is not None else None,
         "peak_mem_reserved_gib": mem_reserved_max if mem_reserved is not None else None,
         "peak_rss_gib": rss}
    if step == args.profile_step:
        r["profiled"] = True
    if d.main:
        log.write(r)
        if not args.quiet:
            print(_progress(r, args.steps), flush=True)
    if not math.isfinite(loss_value):
        raise SystemExit(f"step {step}: the loss is {loss_value}; stopping")
    return r


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # quiet: no tokenizer threads before forks
    if args.plot:
        from .train_plot import plot
        plot(args.plot, args.logs)
        return 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        _run_worker(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
