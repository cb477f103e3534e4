"""Distributed ts.optim.Muon (or ts.optim.AdamW with clipping) against the single-process
optimizer, under torchrun:

    torchrun --standalone --nproc-per-node 2 python/tests/distributed_muon_check.py --parallel ddp
    torchrun --standalone --nproc-per-node 2 python/tests/distributed_muon_check.py --parallel fsdp2 --device cuda
    torchrun --standalone --nproc-per-node 2 python/tests/distributed_muon_check.py --parallel fsdp2 --optimizer adamw

Each rank builds the same model and feeds the same gradients (seeded per step) to the
distributed optimizer on a DDP-wrapped or FSDP2-sharded copy and to a single-process optimizer on
a plain copy; after every step the full parameters must be bit-identical (AdamW: within float
rounding, its clipping norm summed over the ranks in another order), and so must AdamW's norm. A
last step runs a real forward and backward through the wrapper and checks that the ranks still
agree. gloo on the CPU, NCCL on CUDA (one GPU per rank). Prints "OK <parallel> <device>" on rank
0 and exits 0."""
import argparse
import copy
import os

import torch
import torch.distributed as dist

import trainscale as ts


class Net(torch.nn.Module):
    """Matrices of several shapes (two of one shape), biases, a norm and an embedding."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([
            torch.nn.Embedding(32, 24), torch.nn.Linear(24, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 24),
            torch.nn.Linear(24, 40, bias=False), torch.nn.Linear(40, 40, bias=False), torch.nn.Linear(24, 56)])

    def forward(self, tokens):
        m = self.layers
        x = m[0](tokens)
        x = m[3](m[2](m[1](x)))
        return m[6](x).sum() + m[5](m[4](x)).sum()


def model(device, dtype):
    torch.manual_seed(0)
    return Net().to(device=device, dtype=dtype)


def groups(m):
    # The embedding through AdamW by its flag; the other 2-D weights through Muon.
    layers = list(m.layers)
    return [{"params": list(layers[0].parameters()), "use_muon": False},
            {"params": [p for layer in layers[1:] for p in layer.parameters()]}]


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--parallel", choices=["ddp", "fsdp2"], required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32

    single = model(device, dtype)
    wrapped = copy.deepcopy(single)
    if args.parallel == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(wrapped, device_ids=[device.index] if cuda else None)
        inner = wrapped.module
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # not CUDA just because it exists
        for layer in wrapped.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(wrapped, mesh=mesh)
        inner = wrapped
    if args.optimizer == "muon":
        options = dict(lr=0.05, weight_decay=0.1, adamw_lr=1e-2)
        single_opt = ts.optim.Muon(groups(single), **options)
        dist_opt = ts.optim.Muon(groups(inner), distributed=True, **options)
    else:  # a norm of about 18 against 1: every step clips
        options = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
        single_opt = ts.optim.AdamW(single.parameters(), **options)
        dist_opt = ts.optim.AdamW(inner.parameters(), **options)

    for step in range(args.steps):
        generator = torch.Generator().manual_seed(100 + step)
        for p, q in zip(single.parameters(), inner.parameters()):
            g = torch.randn(p.shape, generator=generator).to(device=device, dtype=dtype)
            p.grad = g.clone()
            if hasattr(q, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor
                q.grad = distribute_tensor(g, q.device_mesh, q.placements, src_data_rank=None)
            else:
                q.grad = g.clone()
        single_opt.step()
        dist_opt.step()
        for (name, p), q in zip(single.named_parameters(), inner.parameters()):
            if args.optimizer == "muon":
                assert torch.equal(p, full(q)), f"rank {rank} step {step}: {name} differs from the single-process update"
            else:
                torch.testing.assert_close(full(q), p, rtol=2e-6 if dtype == torch.float32 else 1e-2, atol=1e-6,
                                           msg=lambda m: f"rank {rank} step {step}: {name}: {m}")
        if args.optimizer == "adamw":
            torch.testing.assert_close(dist_opt.grad_norm, single_opt.grad_norm, rtol=1e-6, atol=0)
            assert 0 < single_opt.grad_norm.item() and single_opt.grad_norm.item() > 1.0

    # A real step through the wrapper: every rank ends with the same parameters.
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank)).to(device)
    dist_opt.zero_grad()
    wrapped(tokens).backward()
    dist_opt.step()
    for name, q in inner.named_parameters():
        value = full(q).detach().clone()
        gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, value)
        assert all(torch.equal(gathered[0], v) for v in gathered), f"{name}: ranks disagree after a real step"
    if args.optimizer == "adamw" and args.parallel == "fsdp2":  # the moments keep the parameters' sharding
        assert all(hasattr(s["exp_avg"], "full_tensor") for s in dist_opt.state.values())
    if rank == 0:
        print(f"OK {args.parallel} {args.device}", flush=True)
    from trainscale._distributed import exit_worker
    exit_worker(0)


if __name__ == "__main__":
    main()
