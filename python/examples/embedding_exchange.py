"""The embedding exchange of a recommendation model, with torch's
all_to_all_single and uneven splits, on the collectives backend and on
Gloo in the same job:

    torchrun --nproc-per-node 4 python/examples/embedding_exchange.py

An embedding table of ROWS x DIM is sharded by row blocks across the ranks.
Each step, every rank looks up a batch of ids drawn from a skewed (Zipf)
distribution: it sends each id to the rank owning its row (uneven splits),
the owners gather the rows and send them back (the splits reversed). Every
result is checked against the whole table, which each rank can rebuild
from the seed. Rank 0 prints the time per exchange for both backends.
"""

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

import collectives.torch  # noqa: F401

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--rows", type=int, default=100_000)
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--batch", type=int, default=8192, help="lookups per rank per step")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("collectives")
rank, n = dist.get_rank(), dist.get_world_size()
groups = {"collectives": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}

table = torch.randn(args.rows, args.dim, generator=torch.Generator().manual_seed(7))
per_rank = -(-args.rows // n)
mine = table[rank * per_rank : (rank + 1) * per_rank]


def exchange(ids: torch.Tensor, group) -> torch.Tensor:
    """The rows of `ids`, fetched from their owners."""
    owner = ids // per_rank
    order = torch.argsort(owner, stable=True)
    send_ids = ids[order]
    send_counts = torch.bincount(owner, minlength=n)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # who asks me for how many
    sends, recvs = send_counts.tolist(), recv_counts.tolist()
    asked = torch.empty(sum(recvs), dtype=ids.dtype)
    dist.all_to_all_single(asked, send_ids, output_split_sizes=recvs, input_split_sizes=sends, group=group)
    rows = mine[asked - rank * per_rank]
    got = torch.empty(len(ids), args.dim)
    dist.all_to_all_single(got, rows, output_split_sizes=sends, input_split_sizes=recvs, group=group)
    out = torch.empty_like(got)
    out[order] = got
    return out


zipf = 1.0 / torch.arange(1, args.rows + 1, dtype=torch.float64) ** 1.1
gen = torch.Generator().manual_seed(100 + rank)
times = {k: [] for k in groups}
wrong = 0
for step in range(args.steps):
    ids = torch.multinomial(zipf, args.batch, replacement=True, generator=gen)
    for name, group in groups.items():
        dist.barrier(group=group)
        t0 = time.perf_counter()
        got = exchange(ids, group)
        times[name].append(time.perf_counter() - t0)
        wrong += int(not torch.equal(got, table[ids]))

total = torch.tensor([wrong])
dist.all_reduce(total)
if rank == 0:
    print(f"# embedding exchange: {n} ranks, table {args.rows} x {args.dim}, {args.batch} Zipf lookups per rank")
    for name, t in times.items():
        print(f"# {name:12s} median {statistics.median(t[2:]) * 1e3:8.2f} ms per exchange")
    ratio = statistics.median(times["gloo"][2:]) / statistics.median(times["collectives"][2:])
    print(f"# collectives is {ratio:.2f}x as fast as gloo; wrong lookups: {total.item()}")
    print("embedding ok" if total.item() == 0 else "embedding FAILED", flush=True)
# The Gloo group goes first, on every rank, before any rank exits and closes
# its sockets: torn down together, a rank once died at exit in CI
# ("terminate called without an active exception", from C++).
dist.destroy_process_group(groups["gloo"])
dist.barrier()
dist.destroy_process_group()
sys.exit(1 if total.item() else 0)
