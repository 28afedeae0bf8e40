"""Data-parallel training with DistributedDataParallel on the collectives
backend, side by side with Gloo (torch's own CPU backend) in the same job:

    torchrun --nproc-per-node 4 python/examples/ddp_train.py            # both
    torchrun --nproc-per-node 4 python/examples/ddp_train.py --backend gloo

A small MLP on a seeded synthetic classification set: every rank gets its
own shard, DDP all-reduces the gradients. With `--backend both` (default)
the same model is trained once per backend, the runs interleaved step by
step so both see the same machine; rank 0 prints the loss curves and the
step times side by side, and the script checks that both backends give
the same losses (to float round-off) and the same final weights on every
rank. Exit status 1 if not.
"""

import argparse
import gc
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import collectives.torch  # noqa: F401  (registers the "collectives" backend)

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--backend", choices=["collectives", "gloo", "both"], default="both")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
parser.add_argument("--hidden", type=int, default=1024)
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("collectives" if args.backend != "gloo" else "gloo")
rank, n = dist.get_rank(), dist.get_world_size()
groups = {"collectives": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
if args.backend == "gloo":
    groups = {"gloo": dist.group.WORLD}
elif args.backend == "collectives":
    del groups["gloo"]


def model() -> nn.Module:
    torch.manual_seed(0)
    h = args.hidden
    return nn.Sequential(nn.Linear(128, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))


# The data: every rank its own shard of one seeded problem.
g = torch.Generator().manual_seed(42)
teacher = torch.randn(128, 10, generator=g)
g.manual_seed(1000 + rank)
xs = torch.randn(args.steps, args.batch, 128, generator=g)
ys = (xs @ teacher).argmax(-1)

runs = {}
for name, group in groups.items():
    net = DDP(model(), process_group=group)
    runs[name] = {"net": net, "opt": torch.optim.SGD(net.parameters(), lr=0.1), "loss": [], "time": []}

for step in range(args.steps):
    for name, run in runs.items():
        dist.barrier(group=groups[name])
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(run["net"](xs[step]), ys[step])
        run["opt"].zero_grad()
        loss.backward()  # DDP all-reduces the gradient buckets here, overlapping backward
        run["opt"].step()
        run["time"].append(time.perf_counter() - t0)
        run["loss"].append(loss.item())

ok = True
summary = {}
for name, run in runs.items():
    weights = torch.cat([p.detach().reshape(-1) for p in run["net"].parameters()])
    # The same weights on every rank: the max and min over ranks agree.
    hi, lo = weights.clone(), weights.clone()
    dist.all_reduce(hi, dist.ReduceOp.MAX, group=groups[name])
    dist.all_reduce(lo, dist.ReduceOp.MIN, group=groups[name])
    same = torch.equal(hi, lo)
    ok &= same
    summary[name] = (weights, statistics.median(run["time"][3:] or run["time"]) * 1e3, same)

if rank == 0:
    names = list(runs)
    print(f"# DDP, {n} ranks, MLP 128-{args.hidden}-{args.hidden}-10, batch {args.batch}/rank, {args.steps} steps")
    print("# step  " + "  ".join(f"{k + ' loss':>18}" for k in names))
    for s in range(args.steps):
        print(f"  {s:4d}  " + "  ".join(f"{runs[k]['loss'][s]:18.6f}" for k in names))
    for k in names:
        print(f"# {k}: median step {summary[k][1]:.2f} ms, same weights on every rank: {summary[k][2]}")
    if len(names) == 2:
        a, b = (runs[k]["loss"] for k in names)
        worst = max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(a, b))
        wa, wb = summary[names[0]][0], summary[names[1]][0]
        wdiff = (wa - wb).abs().max().item()
        print(f"# largest relative loss difference {worst:.2e}, largest weight difference {wdiff:.2e}")
        print(f"# step time collectives / gloo: {summary['collectives'][1] / summary['gloo'][1]:.2f}")
        ok &= worst < 1e-4 and wdiff < 1e-4
    print("ddp ok" if ok else "ddp FAILED", flush=True)
# Each DDP model holds its process group: dropped first, so that the groups
# are torn down below, in order, and not by the interpreter at exit, where
# a Gloo group once took a rank down in CI after "ddp ok" ("terminate called
# without an active exception", from C++).
del net, run
runs.clear()
gc.collect()
if "gloo" in groups and groups["gloo"] is not dist.group.WORLD:
    # The Gloo group goes first, on every rank, before any rank exits and
    # closes its sockets (see embedding_exchange.py).
    dist.destroy_process_group(groups["gloo"])
    dist.barrier()
dist.destroy_process_group()
sys.exit(0 if ok else 1)
