"""dist.all_reduce through torch, the collectives backend against Gloo in one
job, sizes interleaved so both see the same machine:

    torchrun --nproc-per-node 4 python/examples/torch_allreduce_bench.py [--sizes 8,1K,1M,256M] [--shared]

Rank 0 prints, per size, the median time per call of each backend (the
slowest rank's, as collbench reports) and their ratio. --shared adds the
collectives backend on tensors from collectives.torch.shared_empty (memory
peers on the host map); --api the library's own Python API on numpy arrays
(comm.all_reduce), the floor that torch's dispatch adds to. torch's flight
recorder costs each torch call about 2 us here; TORCH_FR_BUFFER_SIZE=0
turns it off.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import collectives.torch  # noqa: F401


def size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--sizes", default="8,1K,32K,1M,16M,256M")
parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (medians)")
parser.add_argument("--shared", action="store_true", help="also time tensors from collectives.torch.shared_empty")
parser.add_argument("--api", action="store_true", help="also time the library's own Python API (numpy arrays)")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("collectives")
groups = {"collectives": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
# Each series: how its buffer is made and how one call runs on it.
series = {
    name: (torch.ones, lambda t, g=groups[name]: dist.all_reduce(t, group=g)) for name in ("collectives", "gloo")
}
if args.shared:
    shared = lambda count: collectives.torch.shared_empty(count).fill_(1.0)  # noqa: E731
    series["shared"] = (shared, series["collectives"][1])
if args.api:
    import numpy as np

    uid = [collectives.unique_id() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(uid, group=groups["gloo"])
    comm = collectives.Communicator.init(dist.get_rank(), dist.get_world_size(), uid[0])
    series["api"] = (lambda count: np.ones(count, np.float32), lambda a: comm.all_reduce(a))
rank, n = dist.get_rank(), dist.get_world_size()
sizes = [size(s) for s in args.sizes.split(",")]
times = {(k, s): [] for k in series for s in sizes}
for _ in range(args.reps):
    for s in sizes:
        iters = 200 if s <= 64 << 10 else 20 if s <= 16 << 20 else 3
        for name, (make, call) in series.items():
            t = make(max(s // 4, 1))
            for _ in range(max(iters // 10, 1)):
                call(t)
            dist.barrier(group=groups["gloo"])
            t0 = time.perf_counter()
            for _ in range(iters):
                call(t)
            took = torch.tensor([(time.perf_counter() - t0) / iters])
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=groups["gloo"])
            times[(name, s)].append(took.item())
if rank == 0:
    print(f"# dist.all_reduce, {n} ranks, float32, median of {args.reps} interleaved runs (slowest rank)")
    extra = [k for k in ("shared", "api") if k in series]
    cols = "".join(f" {k + ' us':>12} {'gloo/' + k:>12}" for k in extra)
    print(f"# {'bytes':>10} {'collectives us':>15} {'gloo us':>12} {'gloo/collectives':>17}{cols}")
    for s in sizes:
        a, b = (statistics.median(times[(k, s)]) * 1e6 for k in ("collectives", "gloo"))
        line = f"  {s:>10} {a:>15.1f} {b:>12.1f} {b / a:>17.1f}"
        for k in extra:
            c = statistics.median(times[(k, s)]) * 1e6
            line += f" {c:>12.1f} {b / c:>12.1f}"
        print(line)
# The Gloo group goes first, on every rank, before any rank exits and closes
# its sockets (see embedding_exchange.py).
dist.destroy_process_group(groups["gloo"])
dist.barrier()
dist.destroy_process_group()
