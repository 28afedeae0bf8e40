#!/usr/bin/env python3
"""The Gloo side of ci/compare.sh: torch.distributed's Gloo backend measured
with collbench's rules (sizes, iteration counts, time = mean per call,
maximum over ranks, busbw factors, results checked before timing).

    gloo_bench.py [--fresh] allreduce|alltoall NRANKS SIZE [SIZE...]

--fresh: a byte of every 64 of the input stored to (same value) before each
call, as collbench's --fresh does.

Prints one line per size: size count time_us busbw_gbs wrong. AllReduce is
in place (torch's only form), AllToAll out of place (all_to_all_single).
"""
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


SMALL, BIG = 64 << 10, 64 << 20


def iterations(nbytes):
    if nbytes <= SMALL:
        return 1000, 100
    if nbytes <= BIG:
        return 20, 5
    return max(2, -(-20 * BIG // nbytes)), 0


def paced(nbytes, iters, pace):
    """Up to 64 MiB, as many timed calls as fill 50 ms at the warm-up's
    pace (the slowest rank's), from `iterations`' count up to a million up
    to 64 KiB, to 1000 above (collbench's rule)."""
    if nbytes > BIG or pace <= 0:
        return iters
    most = 1000000 if nbytes <= SMALL else 1000
    return max(iters, min(most, math.ceil(0.05 / pace)))


def pattern(rank, count):
    i = torch.arange(count, dtype=torch.int64)
    return ((i % 7) - 3 + rank).to(torch.float32)


def worker(rank, n, port, coll, sizes, fresh):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    factor = 2 * (n - 1) / n if coll == "allreduce" else (n - 1) / n
    for size in sizes:
        count = size // 4
        if coll == "alltoall":
            count = count // n * n
        src = pattern(rank, count)
        out = torch.empty(count, dtype=torch.float32)

        lines = (out if coll == "allreduce" else src).view(torch.uint8)[::64]

        def call():
            if fresh:
                lines.mul_(1)
            if coll == "allreduce":
                dist.all_reduce(out)
            else:
                dist.all_to_all_single(out, src)

        # Check once, then time.
        out.copy_(src)
        call()
        i = torch.arange(count, dtype=torch.int64)
        if coll == "allreduce":
            want = (n * ((i % 7) - 3) + n * (n - 1) // 2).to(torch.float32)
        else:
            block = max(count // n, 1)
            frm = i // block
            want = (((rank * block + i % block) % 7) - 3 + frm).to(torch.float32)
        wrong = torch.tensor([int((out != want).sum()) if count else 0], dtype=torch.int64)
        dist.all_reduce(wrong)
        iters, warmup = iterations(count * 4)
        w0 = time.perf_counter()
        for _ in range(warmup):
            call()
        pace = torch.tensor([(time.perf_counter() - w0) / max(warmup, 1)], dtype=torch.float64)
        dist.all_reduce(pace, op=dist.ReduceOp.MAX)
        iters = paced(count * 4, iters, pace.item())
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            secs = t.item()
            busbw = count * 4 / secs / 1e9 * factor if secs > 0 else 0.0
            print(f"{count * 4} {count} {secs * 1e6:.3f} {busbw:.4f} {int(wrong.item())}", flush=True)
    dist.destroy_process_group()


def main():
    args = sys.argv[1:]
    fresh = args[:1] == ["--fresh"]
    args = args[fresh:]
    coll, n, sizes = args[0], int(args[1]), [int(s) for s in args[2:]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(n, port, coll, sizes, fresh), nprocs=n)


if __name__ == "__main__":
    main()
