"""The ``"collectives"`` backend of ``torch.distributed`` (CPU tensors).

    import collectives.torch  # registers the backend
    dist.init_process_group("collectives")  # under torchrun, mpirun, ...

It is a ``ProcessGroup`` subclass (the shape of torch's own
``multi_threaded_pg.py``), so its Works keep ``is_completed()`` and
``source_rank()`` and DDP's logs name it "collectives". The cost:
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does not wrap it; the library itself
checks every call across ranks (collective, count, dtype, op, root, order)
and names the rank that disagrees.

Each group meets through its own torch store: its rank 0 makes a unique id
and publishes it there. ``dist.new_group(ranks)`` therefore builds a fresh
communicator among the members only; torch calls a backend on member ranks
alone, and a split needs every rank of the parent.

When ranks die, the survivors keep going with torch's own API (see
``python/examples/elastic_train.py``)::

    failed = dist.group.WORLD._get_backend(torch.device("cpu")).failed_ranks()
    dist.shrink_group(failed)   # the new default group: the survivors

``failed_ranks()`` is the same list on every survivor; ``shrink`` (what
``dist.shrink_group`` calls) returns a ``BackendCollectives``, which torch
wraps in a process group of its own. The store must outlive any rank (a
launcher's, as torchrun's agent store, not one served by rank 0).

Every method turns tensors into zero-copy numpy views, starts one native
call (the GIL released while it runs) and returns a Work whose future
completes when the call does, so collectives overlap the caller's compute.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import ml_dtypes
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    Backend,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from torch.distributed import ReduceOp

import collectives

__all__ = ["BackendCollectives", "ProcessGroupCollectives", "launcher_env", "shared_empty"]


def shared_empty(*size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed CPU tensor in memory that peers on the host map (see
    ``collectives.shared_empty``): the backend's calls read large messages
    from it with ``memcpy`` instead of a system call. Any dtype, bfloat16
    included; ``size`` as ``torch.empty`` takes it."""
    like = torch.empty(*size, dtype=dtype, device="meta")  # torch reads the size; no memory
    raw = collectives.shared_empty(like.numel() * like.element_size(), "uint8")
    return torch.from_numpy(raw).view(dtype).reshape(like.shape)


def launcher_env() -> dict[str, str]:
    """RANK, WORLD_SIZE (and LOCAL_RANK) of whatever launched this process
    (torchrun, mpirun of Open MPI or MPICH, Slurm), as the library reads
    them. torch's ``env://`` reads torchrun's names only, so under mpirun::

        os.environ.update(collectives.torch.launcher_env())
        dist.init_process_group("collectives")  # with MASTER_ADDR/MASTER_PORT set
    """
    return collectives._native.launcher_env()

# Options carry a ReduceOp object that equals these but hashes differently.
_OPS = [
    (ReduceOp.SUM, "sum"),
    (ReduceOp.PRODUCT, "prod"),
    (ReduceOp.MIN, "min"),
    (ReduceOp.MAX, "max"),
    (ReduceOp.AVG, "avg"),
]


def _op(op) -> str:
    for torch_op, name in _OPS:
        if op == torch_op:
            return name
    raise NotImplementedError(
        f"the collectives backend has no reduction {op} (it has SUM, PRODUCT, MIN, MAX, AVG)"
    )


def _np(t: torch.Tensor, what: str):
    """A zero-copy numpy view of a CPU tensor (bfloat16 through ml_dtypes)."""
    if t.device.type != "cpu":
        raise ValueError(f"{what}: the collectives backend runs on CPU tensors, not {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: the tensor is not contiguous (call .contiguous())")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _one(tensors, what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{what}: one tensor per call (got {len(tensors)})")
    return tensors[0]


def _rows(t: torch.Tensor) -> int:
    """Elements per index of dim 0 (all_to_all_single splits count rows)."""
    return t[0].numel() if t.dim() > 0 and t.shape[0] > 0 else max(t.numel(), 1)


class _Work(dist.Work):
    """A native handle as a torch Work; `then` runs once when it is done
    (copies out of a packed buffer) before the future completes."""

    def __init__(self, handle, result, then=None, source_rank=-1):
        super().__init__()
        self._handle = handle
        self._result = result
        self._then = then
        self._source_rank = source_rank
        self._lock = threading.Lock()
        self._future = None
        self._error = None

    def _finish(self) -> None:
        with self._lock:
            then, self._then = self._then, None
        if then is not None:
            then()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if timeout else None
        if not self._handle.wait(seconds or None):
            raise collectives.TimeoutError(f"the call did not finish within {timeout}")
        self._finish()
        return True

    def is_completed(self) -> bool:
        if not self._handle.is_done():
            return False
        try:
            self._handle.wait()
            self._finish()
        except collectives.Error as e:
            self._error = e
        return True

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        self.is_completed()
        return self._error

    def source_rank(self) -> int:
        return self._source_rank

    def result(self):
        return self._result

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            future = torch.futures.Future()

            def done(error):
                if error is None:
                    self._finish()
                    future.set_result(self._result)
                else:
                    future.set_exception(error)

            self._future = future
            self._handle.add_done_callback(done)
        return self._future


class _Collectives:
    """The operations, on ``self._comm``: shared by the process group torch
    makes at ``init_process_group`` and the backend a shrink returns."""

    def getBackendName(self) -> str:
        return "collectives"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank()}, size={self.size()})"

    @property
    def communicator(self) -> collectives.Communicator:
        return self._comm

    supports_coalescing = False
    supports_splitting = False
    _supports_time_estimate = False

    # ---- surviving failed ranks (dist.shrink_group) ----

    supports_shrinking = True

    def shrink(self, ranks_to_exclude, shrink_flags: int = 0, pg_options=None) -> "BackendCollectives":
        """What ``dist.shrink_group`` asks of a backend: one of the ranks
        not excluded (every one of them calls it), on a communicator of its
        own; ``SHRINK_ABORT`` (1) first ends what is in flight here."""
        abort = bool(shrink_flags & 1)
        return BackendCollectives(self._comm.shrink(list(ranks_to_exclude), abort=abort))

    def failed_ranks(self) -> list[int]:
        """The ranks of this group that failed, the same list on every
        survivor (each must call it): what to pass to ``dist.shrink_group``."""
        return self._comm.failed_ranks()

    # ---- collectives ----

    def allreduce(self, tensors, opts=AllreduceOptions()):
        t = _one(tensors, "allreduce")
        h = self._comm.all_reduce(_np(t, "allreduce"), _op(opts.reduceOp), async_op=True)
        return _Work(h, tensors)

    def allreduce_coalesced(self, tensors, opts=AllreduceCoalescedOptions()):
        # One pass over a packed buffer instead of one call per tensor.
        flat = torch.cat([t.reshape(-1) for t in tensors])
        h = self._comm.all_reduce(_np(flat, "allreduce_coalesced"), _op(opts.reduceOp), async_op=True)

        def unpack():
            at = 0
            for t in tensors:
                t.copy_(flat[at : at + t.numel()].view_as(t))
                at += t.numel()

        return _Work(h, tensors, then=unpack)

    def broadcast(self, tensors, opts=BroadcastOptions()):
        t = _one(tensors, "broadcast")
        h = self._comm.broadcast(_np(t, "broadcast"), opts.rootRank, async_op=True)
        return _Work(h, tensors)

    def reduce(self, tensors, opts=ReduceOptions()):
        t = _one(tensors, "reduce")
        a = _np(t, "reduce")
        # In place: the root ends with the result, as torch's reduce does.
        h = self._comm.reduce(a, a, _op(opts.reduceOp), opts.rootRank, async_op=True)
        return _Work(h, tensors)

    def allgather(self, output_tensors, input_tensors, opts=AllgatherOptions()):
        outputs, t = _one(output_tensors, "allgather"), _one(input_tensors, "allgather")
        packed = torch.empty((self.size(), *t.shape), dtype=t.dtype)
        h = self._comm.all_gather(_np(t, "allgather"), _np(packed, "allgather"), async_op=True)

        def unpack():
            for out, block in zip(outputs, packed):
                out.copy_(block)

        return _Work(h, output_tensors, then=unpack)

    def all_gather_single(self, output, input, opts=AllgatherOptions()):
        h = self._comm.all_gather(_np(input, "all_gather_into_tensor"), _np(output, "all_gather_into_tensor"), async_op=True)
        return _Work(h, [output])

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=ReduceScatterOptions()):
        out, inputs = _one(output_tensors, "reduce_scatter"), _one(input_tensors, "reduce_scatter")
        packed = torch.cat([t.reshape(-1) for t in inputs])
        h = self._comm.reduce_scatter(_np(packed, "reduce_scatter"), _np(out, "reduce_scatter"), _op(opts.reduceOp), async_op=True)
        return _Work(h, output_tensors, then=lambda: packed)

    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        h = self._comm.reduce_scatter(_np(input, "reduce_scatter_tensor"), _np(output, "reduce_scatter_tensor"), _op(opts.reduceOp), async_op=True)
        return _Work(h, [output])

    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=AllToAllOptions()):
        n = self.size()
        if not output_split_sizes and not input_split_sizes:
            h = self._comm.all_to_all(_np(input, "all_to_all_single"), _np(output, "all_to_all_single"), async_op=True)
            return _Work(h, [output])
        send = _split_counts(input, input_split_sizes, n)
        recv = _split_counts(output, output_split_sizes, n)
        h = self._comm.all_to_all_v(_np(input, "all_to_all_single"), send, _np(output, "all_to_all_single"), recv, async_op=True)
        return _Work(h, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=AllToAllOptions()):
        send = torch.cat([t.reshape(-1) for t in input_tensors])
        recv = torch.empty(sum(t.numel() for t in output_tensors), dtype=send.dtype)
        counts_in = [t.numel() for t in input_tensors]
        counts_out = [t.numel() for t in output_tensors]
        h = self._comm.all_to_all_v(_np(send, "all_to_all"), counts_in, _np(recv, "all_to_all"), counts_out, async_op=True)

        def unpack():
            at = 0
            for t in output_tensors:
                t.copy_(recv[at : at + t.numel()].view_as(t))
                at += t.numel()

        return _Work(h, output_tensors, then=unpack)

    def gather(self, output_tensors, input_tensors, opts=GatherOptions()):
        # A gather is an AllToAllv in which only the root receives.
        t, root, n = _one(input_tensors, "gather"), opts.rootRank, self.size()
        me = self.rank() == root
        recv = torch.empty((n * t.numel()) if me else 0, dtype=t.dtype)
        send = [t.numel() if j == root else 0 for j in range(n)]
        got = [t.numel() if me else 0] * n
        h = self._comm.all_to_all_v(_np(t.reshape(-1), "gather"), send, _np(recv, "gather"), got, async_op=True)

        def unpack():
            if me:
                for j, out in enumerate(_one(output_tensors, "gather")):
                    out.copy_(recv[j * t.numel() : (j + 1) * t.numel()].view_as(out))

        return _Work(h, output_tensors, then=unpack)

    def scatter(self, output_tensors, input_tensors, opts=ScatterOptions()):
        out, root, n = _one(output_tensors, "scatter"), opts.rootRank, self.size()
        me = self.rank() == root
        send = torch.cat([t.reshape(-1) for t in _one(input_tensors, "scatter")]) if me else torch.empty(0, dtype=out.dtype)
        counts = [out.numel() if me else 0 for _ in range(n)]
        got = [out.numel() if j == root else 0 for j in range(n)]
        flat = out.view(-1)
        h = self._comm.all_to_all_v(_np(send, "scatter"), counts, _np(flat, "scatter"), got, async_op=True)
        return _Work(h, output_tensors)

    def gather_single(self, output, input, opts=GatherOptions()):
        return self.gather([list(output.chunk(self.size()))] if self.rank() == opts.rootRank else [], [input], opts)

    def barrier(self, opts=BarrierOptions()):
        return _Work(self._comm.barrier(async_op=True), [])

    # Coalesced forms: one call per tensor, in order (allreduce_coalesced
    # packs instead).

    def allgather_coalesced(self, output_lists, input_list, opts=AllgatherOptions()):
        return [self.allgather([o], [i], opts) for o, i in zip(output_lists, input_list)][-1]

    def all_gather_single_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        return [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)][-1]

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=ReduceScatterOptions()):
        return [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)][-1]

    # ---- lifetime ----

    def shutdown(self) -> None:
        self._comm.close()

    def abort(self) -> None:
        self._comm.abort(f"rank {self.rank()} aborted its process group")
        self._comm.close()

    # ---- point-to-point ----

    def send(self, tensors, dst_rank: int, tag: int = 0):
        t = _one(tensors, "send")
        return _Work(self._comm.send(_np(t, "send"), dst_rank, async_op=True), tensors)

    def recv(self, tensors, src_rank: int, tag: int = 0):
        t = _one(tensors, "recv")
        h = self._comm.recv(_np(t, "recv"), src_rank, async_op=True)
        return _Work(h, tensors, source_rank=src_rank)

    def recv_anysource(self, tensors, tag: int = 0):
        raise NotImplementedError("the collectives backend receives from a named rank only (no ANY_SOURCE)")

    def monitored_barrier(self, opts=None, wait_all_ranks: bool = False):
        raise NotImplementedError(
            "the collectives backend has no monitored_barrier: a plain barrier already names the rank it waits for on timeout"
        )


class ProcessGroupCollectives(_Collectives, dist.ProcessGroup):
    """A torch ProcessGroup on a collectives communicator (see the module docs)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        key = "collectives/unique_id"
        if rank == 0:
            store.set(key, collectives.unique_id())
        uid = store.get(key)
        seconds = None if "COLL_TIMEOUT" in os.environ else timeout.total_seconds()
        self._comm = collectives.Communicator.init(rank, size, uid, timeout=seconds)

    # torch probes capabilities on `_get_backend(device)`, which a
    # ProcessGroup subclass has none of (batch_isend_irecv raises without
    # it): the group answers for itself.
    def _get_backend(self, device=None):
        return self


class BackendCollectives(_Collectives, Backend):
    """The backend of a group made by ``dist.shrink_group``: torch wraps it
    in a ProcessGroup of its own, which calls these same operations."""

    def __init__(self, comm: collectives.Communicator):
        super().__init__(comm.rank, comm.size)
        self._comm = comm


def _split_counts(t: torch.Tensor, splits, n: int) -> list[int]:
    """all_to_all_single's split sizes (rows of dim 0) as element counts."""
    if not splits:
        if t.shape[0] % n:
            raise ValueError(f"all_to_all_single: dim 0 ({t.shape[0]}) is not divisible by {n} ranks")
        splits = [t.shape[0] // n] * n
    if len(splits) != n:
        raise ValueError(f"all_to_all_single: {len(splits)} split sizes for {n} ranks")
    return [s * _rows(t) for s in splits]


def _create(store, rank, size, timeout):
    return ProcessGroupCollectives(store, rank, size, timeout)


dist.Backend.register_backend("collectives", _create, devices=["cpu"])
