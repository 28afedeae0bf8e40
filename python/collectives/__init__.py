"""Collective communication for distributed training, from Python.

Every call works in place on numpy arrays (or anything with ``__dlpack__``,
such as torch CPU tensors), zero-copy, with the GIL released::

    import numpy as np
    import collectives

    comm = collectives.Communicator.from_env()    # torchrun, mpirun, Slurm
    grads = np.full(1 << 20, comm.rank, dtype=np.float32)
    comm.all_reduce(grads, op="avg")               # every rank: the mean
    h = comm.all_reduce(grads, async_op=True)      # a Handle: h.wait(), h.is_done()

Without a launcher, rank 0 makes ``collectives.unique_id()`` (bytes), hands
it to the others any way it likes, and each calls
``Communicator.init(rank, size, unique_id)``.

Errors are ``collectives.Error`` subclasses carrying the library's message,
which names the rank, the peer and the call: ``ArgumentError`` (nothing
moved), ``MismatchError`` (ranks disagree), ``PeerError`` (a peer died or
aborted), ``TimeoutError`` (nothing moved for COLL_TIMEOUT seconds),
``AbortedError``. Ctrl-C during a call aborts the communicator (its peers
are told) and raises KeyboardInterrupt.

``import collectives.torch`` registers the ``"collectives"`` backend of
``torch.distributed``.
"""

from ._native import (
    AbortedError,
    ArgumentError,
    Communicator,
    Error,
    Handle,
    MismatchError,
    PeerError,
    TimeoutError,
    unique_id,
)

__all__ = [
    "AbortedError",
    "ArgumentError",
    "Communicator",
    "Error",
    "Handle",
    "MismatchError",
    "PeerError",
    "TimeoutError",
    "unique_id",
]
