"""One rank of the torch backend's tests: init_process_group("collectives")
and every torch.distributed call a training script makes, checked against
values computed here; subgroups used at once from two threads; Works that
complete asynchronously. Prints "ok RANK"."""

import os
import sys
import threading

import torch
import torch.distributed as dist

import collectives.torch  # noqa: F401  (registers the backend)
from collectives.torch import launcher_env

os.environ.update(launcher_env())  # under mpirun: RANK, WORLD_SIZE from its variables
dist.init_process_group("collectives")
rank, n = dist.get_rank(), dist.get_world_size()
failures = []


def expect(label, got, want):
    if not torch.equal(got, want):
        failures.append(f"{label}: {got.flatten()[:6].tolist()} != {want.flatten()[:6].tolist()}")


assert dist.get_backend() == "collectives", dist.get_backend()
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64]
for dtype in DTYPES:
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    for op, f in [(dist.ReduceOp.SUM, lambda r: n * (n - 1) / 2), (dist.ReduceOp.MAX, lambda r: n - 1), (dist.ReduceOp.MIN, lambda r: 0)]:
        t = (base + rank).to(dtype)
        dist.all_reduce(t, op=op)
        expect(f"all_reduce {dtype} {op}", t, (base * (n if op == dist.ReduceOp.SUM else 1) + f(rank)).to(dtype))
    if dtype.is_floating_point:
        t = torch.full((5,), float(rank), dtype=dtype)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        expect(f"all_reduce avg {dtype}", t, torch.full((5,), (n - 1) / 2, dtype=dtype))
    t = torch.full((6,), rank, dtype=dtype)
    dist.broadcast(t, src=n - 1)
    expect(f"broadcast {dtype}", t, torch.full((6,), n - 1, dtype=dtype))
    t = torch.full((6,), rank + 1, dtype=dtype)
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
    if rank == 0:
        expect(f"reduce {dtype}", t, torch.full((6,), n * (n + 1) // 2, dtype=dtype))
    outs = [torch.zeros(3, dtype=dtype) for _ in range(n)]
    dist.all_gather(outs, torch.full((3,), rank, dtype=dtype))
    for j, o in enumerate(outs):
        expect(f"all_gather {dtype} block {j}", o, torch.full((3,), j, dtype=dtype))
    big = torch.zeros(n * 3, dtype=dtype)
    dist.all_gather_into_tensor(big, torch.full((3,), rank, dtype=dtype))
    expect(f"all_gather_into_tensor {dtype}", big, torch.arange(n).repeat_interleave(3).to(dtype))
    out = torch.zeros(2, dtype=dtype)
    dist.reduce_scatter_tensor(out, torch.arange(n * 2).to(dtype))
    expect(f"reduce_scatter_tensor {dtype}", out, (torch.arange(rank * 2, rank * 2 + 2) * n).to(dtype))
    out = torch.zeros(2, dtype=dtype)
    dist.reduce_scatter(out, [torch.full((2,), j + rank, dtype=dtype) for j in range(n)])
    expect(f"reduce_scatter {dtype}", out, torch.full((2,), n * rank + n * (n - 1) // 2, dtype=dtype))

# all_to_all_single with uneven splits (rows of 3): rank r sends j + r + 1 rows to j.
rows_to = [j + rank + 1 for j in range(n)]
rows_from = [rank + j + 1 for j in range(n)]
inp = torch.cat([torch.full((k, 3), 100 * rank + j, dtype=torch.float32) for j, k in enumerate(rows_to)])
out = torch.zeros(sum(rows_from), 3)
dist.all_to_all_single(out, inp, output_split_sizes=rows_from, input_split_sizes=rows_to)
expect("all_to_all_single uneven", out, torch.cat([torch.full((k, 3), 100 * j + rank, dtype=torch.float32) for j, k in enumerate(rows_from)]))
out = torch.zeros(n * 2, dtype=torch.int64)
dist.all_to_all_single(out, torch.arange(n * 2) + 10 * rank)
expect("all_to_all_single even", out, torch.tensor([10 * j + 2 * rank + k for j in range(n) for k in range(2)]))
outs = [torch.zeros(j + 1) for j in range(n)]
dist.all_to_all(outs, [torch.full((rank + 1,), float(rank)) for _ in range(n)])
for j, o in enumerate(outs):
    expect(f"all_to_all list from {j}", o, torch.full((j + 1,), float(j)))

# gather / scatter
g = [torch.zeros(2) for _ in range(n)] if rank == 0 else None
dist.gather(torch.full((2,), float(rank)), g, dst=0)
if rank == 0:
    for j, t in enumerate(g):
        expect(f"gather {j}", t, torch.full((2,), float(j)))
s = torch.zeros(2)
dist.scatter(s, [torch.full((2,), float(j)) for j in range(n)] if rank == n - 1 else None, src=n - 1)
expect("scatter", s, torch.full((2,), float(rank)))

# point-to-point: blocking pairs, isend/irecv around the ring, batch_isend_irecv.
nxt, prv = (rank + 1) % n, (rank - 1) % n
t = torch.zeros(4)
if rank % 2 == 0:
    dist.send(torch.full((4,), float(rank)), nxt)
    dist.recv(t, prv)
else:
    dist.recv(t, prv)
    dist.send(torch.full((4,), float(rank)), nxt)
expect("send/recv", t, torch.full((4,), float(prv)))
big_out, big_in = torch.full((4 << 20,), float(rank)), torch.zeros(4 << 20)
works = [dist.isend(big_out, nxt), dist.irecv(big_in, prv)]
for w in works:
    w.wait()
expect("isend/irecv 16 MiB ring", big_in[:8], torch.full((8,), float(prv)))
ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank)), nxt), dist.P2POp(dist.irecv, t3 := torch.zeros(3), prv)]
for w in dist.batch_isend_irecv(ops):
    w.wait()
expect("batch_isend_irecv", t3, torch.full((3,), float(prv)))

# Works complete asynchronously; futures too; is_completed is kept.
t = torch.ones(1 << 20)
w = dist.all_reduce(t, async_op=True)
fut = w.get_future()
w.wait()
assert w.is_completed() and fut.wait()[0].eq(n).all(), "async all_reduce"
vals = dist.all_reduce(torch.ones(3), async_op=True).get_future().then(lambda f: f.value()[0] * 2).wait()
expect("future.then", vals, torch.full((3,), 2.0 * n))

# Tensors in memory peers map (collectives.torch.shared_empty), bfloat16
# too: large messages are read through a mapping.
for dtype in (torch.float32, torch.bfloat16):
    s = collectives.torch.shared_empty(3, (1 << 18) + 3, dtype=dtype)
    assert s.shape == (3, (1 << 18) + 3) and s.dtype == dtype and s.eq(0).all(), "shared_empty"
    # Small integers (exact in bfloat16) that differ from piece to piece.
    pattern = (torch.arange(s.numel()) // 4099 % 8).reshape(s.shape).to(dtype)
    s.copy_(pattern * (rank + 1))
    dist.all_reduce(s)
    expect(f"all_reduce of shared_empty {dtype}", s, pattern * (n * (n + 1) // 2))

# Subgroups: even and odd ranks, each used from its own thread, at once
# with the world group.
evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
g_even, g_odd = dist.new_group(evens), dist.new_group(odds)
mine, members = (g_even, evens) if rank % 2 == 0 else (g_odd, odds)


def in_group():
    for _ in range(20):
        x = torch.full((1000,), float(rank))
        dist.all_reduce(x, group=mine)
        expect("subgroup all_reduce", x, torch.full((1000,), float(sum(members))))


th = threading.Thread(target=in_group)
th.start()
for _ in range(20):
    x = torch.full((1000,), float(rank))
    dist.all_reduce(x)
    expect("world all_reduce beside a subgroup", x, torch.full((1000,), float(n * (n - 1) / 2)))
th.join()
assert dist.get_world_size(mine) == len(members)

dist.barrier()
if failures:
    print(f"rank {rank}: {len(failures)} failures:\n  " + "\n  ".join(failures[:20]), file=sys.stderr)
    sys.exit(1)
sys.stdout.write(f"ok {rank}\n")
dist.destroy_process_group()
