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

``collectives.shared_empty(shape, dtype)`` allocates a zeroed array in
memory peers on the host map (as NCCL's ``ncclMemAlloc``): large messages
sent from it are read with ``memcpy`` instead of a system call.
``torch.from_numpy`` wraps it as a tensor without a copy.

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
    SharedMemory,
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
    "SharedMemory",
    "TimeoutError",
    "shared_empty",
    "unique_id",
]


def shared_empty(shape, dtype="float32"):
    """A zeroed numpy array of ``shape`` and ``dtype`` in memory that peers
    on the host map (a ``SharedMemory``, kept alive by the array)."""
    import numpy as np

    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    memory = SharedMemory(count * dtype.itemsize)
    return np.asarray(memory).view(dtype).reshape(shape)
