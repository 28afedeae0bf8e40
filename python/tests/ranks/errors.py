"""One rank of the error-path tests; MODE is the first argument:

* kill: rank 1 is SIGKILLed in a loop of large AllReduces;
* mismatch: rank 1 passes another count than the others;
* interrupt: rank 0 gets SIGINT while blocked waiting for rank 1;
* abort: a thread of rank 0 aborts its communicator while a call blocks;
* argument: a bad argument of each kind; the communicator stays usable.

Every rank that survives prints "rank R: EXCEPTION-CLASS after S s: MESSAGE"
for what its call raised (the test checks the class, the rank named and the
time), then "done R".
"""

import os
import signal
import sys
import threading
import time

import numpy as np

import collectives

mode = sys.argv[1]
comm = collectives.Communicator.from_env()
rank, n = comm.rank, comm.size


def report(e, start):
    sys.stdout.write(f"rank {rank}: {type(e).__name__} after {time.monotonic() - start:.1f} s: {e}\n")


comm.barrier()
start = time.monotonic()
try:
    if mode == "kill":
        if rank == 1:
            threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        buf = np.ones(4 << 20, np.float32)
        for _ in range(10000):
            comm.all_reduce(buf)
    elif mode == "mismatch":
        comm.all_reduce(np.ones(1000 if rank != 1 else 999, np.float32))
    elif mode == "interrupt":
        if rank == 0:
            threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
            comm.recv(np.zeros(4, np.float32), 1)
        else:
            comm.barrier()
    elif mode == "abort":
        if rank == 0:
            threading.Timer(0.3, lambda: comm.abort("stopped by the watchdog")).start()
            comm.recv(np.zeros(4, np.float32), 1)
        else:
            comm.barrier()
    elif mode == "argument":
        cases = [
            lambda: comm.all_reduce(np.ones(4, np.float32), op="xor"),
            lambda: comm.all_reduce([1.0, 2.0]),
            lambda: comm.all_to_all(np.ones(n * 2 + 1, np.float32), np.ones(n * 2 + 1, np.float32)),
            lambda: comm.all_gather(np.ones(2, np.float32), np.ones(2 * n, np.float64)),
            lambda: comm.broadcast(np.ones(2, np.float32), root=n + 5),
            lambda: comm.send(np.ones(2, np.float32), rank),
            lambda: comm.all_to_all_v(np.ones(4, np.float32), [1] * (n + 1), np.ones(4, np.float32), [1] * n),
        ]
        for case in cases:
            try:
                case()
                sys.stdout.write(f"rank {rank}: no error\n")
            except (TypeError, ValueError, collectives.ArgumentError) as e:
                sys.stdout.write(f"rank {rank}: {type(e).__name__}: {e}\n")
        x = np.ones(8, np.float32)
        comm.all_reduce(x)  # still usable
        assert (x == n).all()
except (collectives.Error, KeyboardInterrupt) as e:
    report(e, start)
sys.stdout.write(f"done {rank}\n")
