"""Typed stubs of the native module (see the package docstring)."""

from typing import Any, Callable, Literal, Optional, Sequence, overload

import numpy.typing as npt

Array = Any  # a C-contiguous numpy array, or an object with __dlpack__ (torch CPU tensor)
Op = Literal["sum", "prod", "min", "max", "avg"]

class Error(Exception):
    """A call failed; the message names the rank, the peer and the call."""

class ArgumentError(Error):
    """The arguments cannot work; nothing moved, the communicator is still usable."""

class MismatchError(Error):
    """The ranks disagree on a call (collective, count, dtype, op, root or order)."""

class PeerError(Error):
    """A peer died, closed its connection or aborted."""

class TimeoutError(Error):
    """Nothing moved for the timeout (COLL_TIMEOUT seconds)."""

class AbortedError(Error):
    """The communicator was aborted (on request, by Ctrl-C, or by an earlier failure)."""

def unique_id() -> bytes:
    """128 bytes naming a new job's rendezvous, served by this process.

    >>> uid = collectives.unique_id()          # on rank 0
    >>> comm = Communicator.init(rank, size, uid)  # on every rank
    """

def launcher_env() -> dict[str, str]:
    """RANK, WORLD_SIZE and LOCAL_RANK as read from the launcher's variables."""

class SharedMemory:
    """``nbytes`` zeroed bytes that peers on the host map (see
    ``collectives.shared_empty``); ``numpy.asarray`` views them as uint8."""

    def __init__(self, nbytes: int) -> None: ...
    def __len__(self) -> int: ...
    @property
    def __array_interface__(self) -> dict: ...

class Handle:
    """A call in flight (every method with ``async_op=True`` returns one)."""

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until done (True), or ``timeout`` seconds passed (False);
        raises the call's error. Ctrl-C aborts the communicator and raises."""
    def is_done(self) -> bool: ...
    def add_done_callback(self, fn: Callable[[Optional[Error]], None]) -> None:
        """``fn(None)`` or ``fn(error)`` once done, on a library thread holding the GIL."""

class Communicator:
    """One rank's communicator. Calls are collective: every rank makes them
    in the same order with matching counts and dtypes (a disagreement raises
    MismatchError on the ranks that see it, naming the other rank).

    >>> comm = Communicator.from_env()
    >>> x = np.full(4, comm.rank, np.float32)
    >>> comm.all_reduce(x, op="sum")
    """

    @staticmethod
    def from_env() -> Communicator:
        """Joins the job torchrun, mpirun or Slurm describe in the environment."""
    @staticmethod
    def init(rank: int, size: int, unique_id: bytes, timeout: Optional[float] = None) -> Communicator:
        """Joins the job ``unique_id`` names as rank ``rank`` of ``size``."""
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @overload
    def all_reduce(self, a: Array, op: Op = "sum", *, async_op: Literal[False] = False) -> None: ...
    @overload
    def all_reduce(self, a: Array, op: Op = "sum", *, async_op: Literal[True]) -> Handle:
        """``a[i] = op over ranks of a[i]``, in place."""
    def all_to_all(self, send: Array, recv: Array, *, async_op: bool = False) -> Optional[Handle]:
        """Block j of ``send`` goes to rank j; block j of ``recv`` comes from rank j
        (``recv is send``: in place)."""
    def all_to_all_v(
        self,
        send: Array,
        send_counts: Sequence[int],
        recv: Array,
        recv_counts: Sequence[int],
        *,
        async_op: bool = False,
    ) -> Optional[Handle]:
        """``send_counts[j]`` elements (blocks packed in rank order) go to rank j;
        ``recv_counts[j]`` come from rank j. Rank i's ``send_counts[j]`` must equal
        rank j's ``recv_counts[i]``."""
    def reduce_scatter(self, send: Array, recv: Array, op: Op = "sum", *, async_op: bool = False) -> Optional[Handle]:
        """``recv`` = block ``rank`` of the reduction of ``send`` (one block per rank)."""
    def all_gather(self, send: Array, recv: Array, *, async_op: bool = False) -> Optional[Handle]:
        """Block j of ``recv`` = rank j's ``send``."""
    def broadcast(self, a: Array, root: int = 0, *, async_op: bool = False) -> Optional[Handle]:
        """Every rank's ``a`` becomes ``root``'s."""
    def reduce(self, send: Array, recv: Array, op: Op = "sum", root: int = 0, *, async_op: bool = False) -> Optional[Handle]:
        """``recv`` on ``root`` = op over ranks of ``send`` (workspace elsewhere)."""
    def send(self, a: Array, peer: int, *, async_op: bool = False) -> Optional[Handle]:
        """Sends ``a`` to ``peer`` (matched in order per pair of ranks)."""
    def recv(self, a: Array, peer: int, *, async_op: bool = False) -> Optional[Handle]:
        """Receives ``peer``'s next message into ``a`` (same count and dtype)."""
    def barrier(self, *, async_op: bool = False) -> Optional[Handle]: ...
    def split(self, color: Optional[int], key: int = 0) -> Optional[Communicator]:
        """Ranks with one color form a new communicator ordered by key; None
        (or negative) opts out and returns None. Every rank must call it."""
    def abort(self, reason: str = "aborted by the application") -> None:
        """Fails calls in flight and later ones here, and tells every peer; any thread."""
    def close(self) -> None:
        """Finishes the calls in flight and closes the connections."""
    def __enter__(self) -> Communicator: ...
    def __exit__(self, *exc: object) -> None: ...
