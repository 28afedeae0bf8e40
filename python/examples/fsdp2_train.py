"""FSDP2 training on the "collectives" backend and on Gloo, side by side in
one job: the same model, data and seed trained twice, the losses compared
step by step and the time per step printed for each.

    torchrun --nproc-per-node 2 python/examples/fsdp2_train.py [--steps 20] [--layers 4] [--dim 512] [--json out.json]

Each layer is sharded on its own (`fully_shard`), so every step all-gathers
each layer's parameters before its forward and backward and
reduce-scatters its gradients after: the collectives FSDP2 spends its
network time in. `--mp` keeps bfloat16 parameters with float32 gradient
reduction. Prints "fsdp2 ok" when the losses agree.
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import collectives.torch  # noqa: F401  (registers the backend)

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--dim", type=int, default=512)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--mp", action="store_true", help="bfloat16 parameters, float32 reduction")
parser.add_argument("--backends", default="collectives,gloo")
parser.add_argument("--json", help="also write the figures here")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("collectives")
rank, n = dist.get_rank(), dist.get_world_size()
groups = {"collectives": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}


def model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(args.dim, 2 * args.dim), nn.GELU(), nn.Linear(2 * args.dim, args.dim))
              for _ in range(args.layers)]
    return nn.Sequential(*blocks, nn.Linear(args.dim, 1))


def train(group) -> tuple[list[float], list[float]]:
    mesh = DeviceMesh.from_group(group, "cpu")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mp else MixedPrecisionPolicy()
    m = model()
    for block in m:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(m, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    losses, times = [], []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(args.batch, args.dim, generator=g)
        y = torch.randn(args.batch, 1, generator=g)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        loss = (m(x).float() - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        # The mean loss over ranks (Gloo sums it, the same on every run).
        avg = loss.detach().clone()
        dist.all_reduce(avg, group=groups["gloo"])
        losses.append(avg.item() / n)
    return losses, times[args.warmup:]


results = {b: train(groups[b]) for b in args.backends.split(",")}
names = list(results)
a, b = results[names[0]][0], results[names[-1]][0]
tol = 2e-2 if args.mp else 1e-4
agree = all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))
if rank == 0:
    print(f"# FSDP2, {n} ranks, {args.layers} layers of {args.dim}, batch {args.batch}"
          f"{', bf16 params / fp32 reduce' if args.mp else ''}; median of {args.steps - args.warmup} steps")
    print(f"{'backend':>12} {'ms/step':>10} {'final loss':>12}")
    med = {k: statistics.median(t) * 1e3 for k, (_, t) in results.items()}
    for k, (losses, _) in results.items():
        print(f"{k:>12} {med[k]:>10.2f} {losses[-1]:>12.6f}")
    if len(names) > 1:
        print(f"{names[-1]}/{names[0]} time per step: {med[names[-1]] / med[names[0]]:.2f}x")
    print("fsdp2 ok" if agree else f"fsdp2 DIFFER: {a} vs {b}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": n, "ms_per_step": med, "losses": {k: v[0] for k, v in results.items()}}, f, indent=1)
dist.destroy_process_group()
