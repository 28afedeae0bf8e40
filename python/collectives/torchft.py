"""A reconfigurable process group for torchft on this library.

    from collectives.torchft import ProcessGroupCollectives
    pg = ProcessGroupCollectives(timeout=timedelta(seconds=10))
    manager = torchft.Manager(pg=pg, ...)   # where ProcessGroupGloo() would go

torchft rebuilds its process group for every quorum (``configure``) and
aborts it when a replica fails. This is its ``ProcessGroupGloo`` with our
backend underneath: each ``configure`` makes a new communicator among the
quorum's members (they meet in torchft's store), ``abort`` ends every call
in flight at once and tells the peers. A replica that dies is noticed
within milliseconds, from its closed connections ("Connection closed by
peer rank R"), not at the timeout; a silent one at the timeout ("Timed out
waiting"), the phrases torchft's own tests and retry logic match.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
from torch.distributed import ProcessGroup as BaseProcessGroup
from torch.distributed import Store
from torchft.process_group import ProcessGroupWrapper

from collectives.torch import extension

__all__ = ["ProcessGroupCollectives"]


class ProcessGroupCollectives(ProcessGroupWrapper):
    """torchft's reconfigurable ``ProcessGroupGloo``, on the collectives
    backend (CPU tensors). ``timeout`` is the library's: how long a call
    may see nothing move before it fails."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60), pg: Optional[BaseProcessGroup] = None) -> None:
        super().__init__(timeout=timeout, pg=pg)
        self._errored: Optional[Exception] = None

    def _create_pg(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        self._errored = None
        backend = extension().BackendCollectives(store, rank, world_size, self._timeout)
        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(BaseProcessGroup.BackendType.CUSTOM)
        pg._register_backend(torch.device("cpu"), BaseProcessGroup.BackendType.CUSTOM, backend)
        return pg

    def getBackendName(self) -> str:
        return "torchft-collectives"

    def abort(self, errored: bool = True) -> None:
        """Ends every call in flight at once (the peers are told) and drops
        the group; `errored()` then says so, as torchft's NCCL group does."""
        if errored:
            self._errored = RuntimeError("the process group was aborted")
        super().abort(errored)

    def errored(self) -> Optional[Exception]:
        return self._errored
