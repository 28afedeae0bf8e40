"""torchft on the collectives backend, through torchft's own tests: its
Manager's integration tests (replicas that fail and heal), its
process-group test cases (every collective on ranks that are threads of
this process, then again after a rank shuts down, where the survivors must
fail with Gloo's phrases and not hang) run on `ProcessGroupCollectives`
as they run on its `ProcessGroupGloo`, plus reconfiguration, functional
collectives through a registered torchft group, and DDP.

torchft is needed; without it these skip, unless COLL_REQUIRE_TORCH=1.
"""

import os
import time
from datetime import timedelta
from unittest.mock import patch

import pytest

if os.environ.get("COLL_REQUIRE_TORCH") != "1":
    pytest.importorskip("torchft")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from parameterized import parameterized  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402
from torchft import manager_integ_test as integ  # noqa: E402
from torchft import process_group_test as upstream  # noqa: E402

from collectives.torchft import ProcessGroupCollectives  # noqa: E402


class CollectivesMultiPgTest(upstream.MultiPgBaseTest):
    """torchft's multi-rank cases (`NormalGlooMultiPgTest`'s) on ours;
    every collective, the ones Gloo skips included."""

    BACKEND = "collectives"
    WORLD_SIZE = 3
    COLLECTIVES = sorted(upstream._ALL_COLLECTIVES)

    @classmethod
    def _create_pg(cls, backend: str):
        return ProcessGroupCollectives(timeout=timedelta(seconds=10))

    @parameterized.expand(COLLECTIVES)
    def test_collective(self, collective: str) -> None:
        self._run_parallel(collective, device="cpu")

    @parameterized.expand(COLLECTIVES)
    def test_collective_with_resiliency(self, collective: str) -> None:
        started = time.monotonic()
        self._run_with_resiliency(collective, device="cpu")
        # The survivors learn of the departed rank from its closed
        # connections, not at the 30 s timeout torchft set.
        assert time.monotonic() - started < 10


class CollectivesManagerIntegTest(integ.ManagerIntegTest):
    """torchft's Manager tests (DDP replicas that fail at a step and heal
    from the others, quorums, the manager's allreduce) with every
    `ProcessGroupGloo()` they make on ours; the torchcomms ones excluded."""

    def setUp(self) -> None:
        if "torchcomms" in self._testMethodName:
            self.skipTest("torchcomms is another stack")
        if self._testMethodName == "test_ddp_skip_init_sync":
            # Its replicas are threads that seed the one global RNG under a
            # lock to build equal models, but draw their batches from it
            # without the lock: a replica that starts its first step while
            # the other builds its model changes that model (1 run in ~40
            # here; the weights then differ by far more than round-off).
            self.skipTest("racy in torchft: model init shares the RNG with the other replica's batches")
        p = patch.object(integ, "ProcessGroupGloo", ProcessGroupCollectives)
        p.start()
        self.addCleanup(p.stop)
        super().setUp()


def _store_addr(prefix: str) -> tuple[TCPStore, str]:
    store = TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    return store, f"localhost:{store.port}/{prefix}"


def test_every_api_on_one_rank_and_ddp():
    """torchft's `test_gloo_apis` on ours."""
    store, addr = _store_addr("apis")
    pg = ProcessGroupCollectives()
    pg.configure(addr, "0", 0, 1)
    assert pg.size() == 1 and pg.getBackendName() == "torchft-collectives"
    upstream._test_pg(pg, torch.tensor([2]))
    m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 4), process_group=pg)
    m(torch.rand(2, 3)).sum().backward()


def test_configure_waits_no_longer_than_the_timeout():
    """A quorum whose other member never comes fails at the timeout, with
    the phrase torchft matches."""
    store, addr = _store_addr("timeout")
    pg = ProcessGroupCollectives(timeout=timedelta(seconds=0.5))
    started = time.monotonic()
    with pytest.raises(Exception, match="(Timed out|timed out)"):
        pg.configure(addr, "0", 0, 2)
    assert time.monotonic() - started < 10


def test_reconfigure_and_functional_collectives():
    """A torchft group registered by name serves functional collectives;
    configure() again builds a fresh communicator."""
    import torch.distributed._functional_collectives as funcol

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pg = ProcessGroupCollectives().register("collectives_torchft_test")
    try:
        for round in range(2):
            store, addr = _store_addr(f"round{round}")
            pg.configure(addr, "0", 0, 1)
            t = funcol.all_reduce(torch.full((4,), 3.0), "sum", pg).wait()
            assert torch.equal(t, torch.full((4,), 3.0))
    finally:
        pg.unregister()
