"""One rank of the Python correctness matrix: every method x dtype x size x
in/out of place (and async), against numpy references computed here from
every rank's regenerated input. Values are small integers, exact in every
dtype (float16 and bfloat16 included) and in every sum, product and mean of
2 or 4 ranks. Prints "ok RANK" when every case passed."""

import sys

import ml_dtypes
import numpy as np

import collectives

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64]
OPS = ["sum", "prod", "min", "max", "avg"]
SIZES = [0, 1, 7, 997]

comm = collectives.Communicator.from_env()
rank, n = comm.rank, comm.size
failures = []


def values(dtype, op, count, r, case):
    rng = np.random.default_rng(case * 1000 + r)
    unsigned = np.dtype(dtype).kind == "u"
    if op == "prod":
        v = rng.choice([1, 2] if unsigned else [-1, 1, 2], size=count)
    else:
        v = rng.integers(0 if unsigned else -8, 9, size=count)
    return v.astype(dtype)


def reference(dtype, op, inputs):
    wide = np.stack([i.astype(np.float64) for i in inputs])
    out = {"sum": wide.sum(0), "prod": wide.prod(0), "min": wide.min(0), "max": wide.max(0), "avg": wide.sum(0) / n}[op]
    if op == "avg" and np.dtype(dtype).kind in "iu":
        out = np.trunc(out)
    return out.astype(dtype)


def check(label, got, want):
    if got.shape != want.shape or not np.array_equal(got.astype(np.float64), want.astype(np.float64)):
        bad = np.flatnonzero(got.astype(np.float64) != want.astype(np.float64))[:3]
        failures.append(f"{label}: wrong at {bad} ({got[bad]} vs {want[bad]})")


case = 0
for dtype in DTYPES:
    name = np.dtype(dtype).name
    for count in SIZES:
        for op in OPS:
            case += 1
            inputs = [values(dtype, op, count, r, case) for r in range(n)]
            a = inputs[rank].copy()
            comm.all_reduce(a, op)
            check(f"all_reduce {name} {op} {count}", a, reference(dtype, op, inputs))
            b = inputs[rank].copy()
            comm.all_reduce(b, op, async_op=True).wait()
            check(f"all_reduce async {name} {op} {count}", b, reference(dtype, op, inputs))

        case += 1
        block = [values(dtype, "sum", count, r, case) for r in range(n)]
        full = [np.concatenate([block[r]] * n) for r in range(n)]
        whole = [values(dtype, "sum", count * n, r, case + 7) for r in range(n)]
        for in_place in (False, True):
            tag = f"{name} {count} {'in place' if in_place else 'out of place'}"
            # all_to_all: block j of rank r's buffer is whole[r][j].
            send = whole[rank].copy()
            recv = send if in_place else np.zeros_like(send)
            comm.all_to_all(send, recv)
            want = np.concatenate([whole[j][rank * count:(rank + 1) * count] for j in range(n)]) if count else whole[rank][:0]
            check(f"all_to_all {tag}", recv, want)
            # all_gather
            out = np.zeros(count * n, dtype)
            if in_place:
                out[rank * count:(rank + 1) * count] = block[rank]
                comm.all_gather(out, out)
            else:
                comm.all_gather(block[rank].copy(), out)
            check(f"all_gather {tag}", out, np.concatenate(block))
            # reduce_scatter: in place, the result lands in block `rank`.
            send = whole[rank].copy()
            if in_place:
                comm.reduce_scatter(send, send, "max")
                got = send[rank * count:(rank + 1) * count]
            else:
                got = np.zeros(count, dtype)
                comm.reduce_scatter(send, got, "max")
            check(f"reduce_scatter {tag}", got, reference(dtype, "max", whole)[rank * count:(rank + 1) * count])
            # broadcast (in place) and reduce, rooted at the last rank.
            root = n - 1
            a = block[rank].copy()
            comm.broadcast(a, root)
            check(f"broadcast {tag}", a, block[root])
            send = block[rank].copy()
            recv = send if in_place else np.zeros_like(send)
            comm.reduce(send, recv, "sum", root)
            if rank == root:
                check(f"reduce {tag}", recv, reference(dtype, "sum", block))

        # all_to_all_v: rank r sends (r + 2j) % 3 * count // 2 elements to j.
        case += 1
        pair = lambda i, j: ((i + 2 * j) % 3) * count // 2
        send_counts = [pair(rank, j) for j in range(n)]
        recv_counts = [pair(j, rank) for j in range(n)]
        data = [values(dtype, "sum", sum(pair(r, j) for j in range(n)), r, case) for r in range(n)]
        recv = np.zeros(sum(recv_counts), dtype)
        comm.all_to_all_v(data[rank], send_counts, recv, recv_counts)
        parts = []
        for j in range(n):
            start = sum(pair(j, t) for t in range(rank))
            parts.append(data[j][start:start + pair(j, rank)])
        check(f"all_to_all_v {name} {count}", recv, np.concatenate(parts))

        # send/recv around the ring, both directions at once (async).
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        out = values(dtype, "sum", count, rank, case)
        got = np.zeros(count, dtype)
        hs = comm.send(out, nxt, async_op=True), comm.recv(got, prv, async_op=True)
        for h in hs:
            h.wait()
        check(f"send/recv {name} {count}", got, values(dtype, "sum", count, prv, case))

# Groups: AllToAll as grouped sends and receives (this rank included), a
# ring exchange, small AllReduces fused into one.
block = 5
send = np.arange(n * block, dtype=np.int64) + 1000 * rank
want = np.empty_like(send)
comm.all_to_all(send, want)
got = np.zeros_like(send)
with comm.group() as g:
    for r in range(n):
        g.send(send[r * block:(r + 1) * block], r)
        g.recv(got[r * block:(r + 1) * block], r)
check("group all_to_all", got, want)
out, inp = np.full(1 << 21, rank, np.float64), np.zeros(1 << 21)
with comm.group() as g:
    g.send(out, (rank + 1) % n)
    g.recv(inp, (rank - 1) % n)
check("group ring exchange", inp, np.full(1 << 21, (rank - 1) % n, np.float64))
small = [np.full(100 + k, rank + k, np.float32) for k in range(50)]
with comm.group() as g:
    for a in small:
        g.all_reduce(a)
for k, a in enumerate(small):
    check(f"group all_reduce {k}", a, np.full(100 + k, n * (n - 1) / 2 + n * k, np.float32))

# Arrays in memory peers map (collectives.shared_empty): large messages
# are read through a mapping; in place, out of place, and freed.
big = collectives.shared_empty((3, (1 << 18) + 3), np.float32)
big[...] = (rank + 1) * (np.arange(big.size, dtype=np.float32) % 97).reshape(big.shape)
comm.all_reduce(big)
want = n * (n + 1) / 2 * (np.arange(big.size, dtype=np.float32) % 97).reshape(big.shape)
check("all_reduce of shared_empty memory", big, want)
gathered = collectives.shared_empty((n,) + big.shape, np.float32)
comm.all_gather(big, gathered)
check("all_gather of shared_empty memory", gathered, np.stack([want] * n))
check("shared_empty is zeroed", collectives.shared_empty(5, np.int64), np.zeros(5, np.int64))
del big, gathered

comm.barrier()
if failures:
    print(f"rank {rank}: {len(failures)} failures:\n  " + "\n  ".join(failures[:20]), file=sys.stderr)
    sys.exit(1)
sys.stdout.write(f"ok {rank}\n")
comm.close()
