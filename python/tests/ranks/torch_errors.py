"""One rank of the torch backend's error tests: bad input gets a clear
error (never a hang, a crash or a wrong answer) and the group stays usable
where nothing moved; ranks that disagree, a timeout and a dead peer fail
with messages that name the rank, the peer and the call, and carry Gloo's
phrases. Prints "rank R: LABEL: ok" per case, then "done R"."""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import collectives.torch  # noqa: F401

dist.init_process_group("collectives")
rank, n = dist.get_rank(), dist.get_world_size()


def say(line: str) -> None:
    """One write per line: the ranks share a pipe."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def expect(label, f, exc, *phrases):
    try:
        f()
        say(f"rank {rank}: {label}: no error")
    except exc as e:
        text = str(e)
        missing = [p for p in phrases if p not in text]
        say(f"rank {rank}: {label}: {'ok' if not missing else 'missing ' + repr(missing)}: {text.splitlines()[0][:200]}")
    except Exception as e:  # noqa: BLE001
        say(f"rank {rank}: {label}: wrong exception {type(e).__name__}: {str(e)[:200]}")


# Arguments that cannot work: ValueError before anything moves.
expect("non-contiguous", lambda: dist.all_reduce(torch.zeros(4, 4).t()), ValueError, "allreduce", "not contiguous")


def _bad_root():
    opts = dist.BroadcastOptions()
    opts.rootRank = n + 3
    dist.group.WORLD._get_backend(torch.device("cpu")).broadcast([torch.zeros(2)], opts).wait()


expect("root out of range", _bad_root, ValueError, "root", str(n + 3))
expect("uneven all_to_all_single", lambda: dist.all_to_all_single(torch.zeros(n * 2 + 1), torch.zeros(n * 2 + 1)),
       ValueError, "all_to_all_single", "split evenly")
expect("dtypes differ", lambda: dist.all_gather_into_tensor(torch.zeros(2 * n, dtype=torch.float64), torch.zeros(2)),
       ValueError, "one dtype")
expect("unsupported reduction", lambda: dist.all_reduce(torch.zeros(2, dtype=torch.int32), op=dist.ReduceOp.BXOR),
       ValueError, "no reduction")
expect("sparse all_gather (torch refuses it)", lambda: dist.all_gather([torch.eye(2).to_sparse()] * n, torch.eye(2).to_sparse()),
       (RuntimeError, NotImplementedError), "Sparse")
x = torch.ones(3)
dist.all_reduce(x)
say(f"rank {rank}: usable after bad arguments: {'ok' if x.eq(n).all() else x.tolist()}")

# Ranks that disagree: an error naming the peer and both calls, no wrong answer.
# (A rank still finishing the group's set-up when the others have failed its
# first call learns of it there: the group and the call in one step.)
expect("counts differ across ranks",
       lambda: dist.all_reduce(torch.ones(1000 if rank else 999), group=dist.new_group()),
       dist.DistBackendError, "rank", "disagree")

# A call's own timeout: "Timed out", the group aborted.
g = dist.new_group()
if rank == 0:
    started = time.monotonic()
    expect("barrier timeout", lambda: dist.barrier(group=g, timeout=timedelta(seconds=0.2)), RuntimeError, "Timed out", "BARRIER")
    say(f"rank {rank}: timed out after {time.monotonic() - started:.1f} s")

# A dead peer: "Connection closed by peer rank R", at once.
dist.barrier()
if rank == n - 1:
    say(f"done {rank}")
    os._exit(0)
started = time.monotonic()
expect("dead peer", lambda: [dist.all_reduce(torch.ones(1 << 16)) for _ in range(1000)], dist.DistBackendError,
       f"Connection closed by peer rank {n - 1}", "allreduce")
say(f"rank {rank}: noticed the dead peer after {time.monotonic() - started:.2f} s")
say(f"done {rank}")
os._exit(0)
