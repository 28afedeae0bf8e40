"""torch's test/distributed/test_distributed_spawn.py, for any backend name.

Env (set by run_dist_test.py): BACKEND, WORLD_SIZE, TEMP_DIR (with barrier/),
DTEST_MODE = "native" (BACKEND is gloo/nccl/ucc: exactly upstream),
"as-gloo" (a plugin backend gated exactly as Gloo is) or "plain" (a plugin
backend, gated as the suite gates an unknown plugin backend).

Spawned ranks re-import this module (the test class is pickled by reference),
so every patch below also runs in each rank before the suite is imported.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

import torch
import torch.distributed as dist

torch.backends.cuda.matmul.allow_tf32 = False

BACKEND = os.environ["BACKEND"]
MODE = os.environ.get("DTEST_MODE", "native")
_SUITE = "torch.testing._internal.distributed.distributed_test"

if BACKEND not in ("gloo", "nccl", "ucc", "mpi"):
    # The plugin must be registered in every process before init_process_group.
    if BACKEND == "collectives":
        import collectives.torch  # noqa: F401  registers "collectives" (cpu)
    else:
        importlib.import_module(os.environ.get("DTEST_BACKEND_MODULE", BACKEND))

    from torch.testing._internal.common_distributed import DistTestCases

    # require_backend_is_available() only knows gloo/nccl/mpi/ucc or names in
    # backend_feature["plugin"]; a name elsewhere is "not available".
    DistTestCases.backend_feature["plugin"].add(BACKEND)
    if MODE == "plain":
        # What an out-of-tree CPU backend would declare: DDP and subgroups
        # (not "gpu"/"cuda"). Tests gated on BACKEND == "gloo" stay skipped.
        for feat in ("ddp", "subgroup"):
            DistTestCases.backend_feature[feat].add(BACKEND)

    if MODE == "as-gloo":
        class _AsGloo(str):
            """Its value is the plugin's name (init_process_group, dist.Backend,
            f-strings, .lower()/.upper() all see "collectives"), but it compares
            and hashes equal to "gloo", so every `BACKEND == "gloo"`,
            `BACKEND != "gloo"`, `BACKEND in {...}` gate in the suite decides
            as it does for Gloo."""

            def __eq__(self, other):
                if isinstance(other, str) and str.__eq__(other, "gloo"):
                    return True
                return str.__eq__(self, other)

            def __ne__(self, other):
                return not self.__eq__(other)

            def __hash__(self):
                return hash("gloo")

        _ALIAS = _AsGloo(BACKEND)
        _LINE = 'BACKEND = os.environ["BACKEND"]'

        class _Loader(importlib.machinery.SourceFileLoader):
            # Compiles the installed suite with its one BACKEND line bound to
            # the alias (in memory; the file on disk is untouched).
            def get_code(self, fullname):
                src = self.get_source(fullname)
                if src.count(_LINE) != 1:
                    raise RuntimeError("distributed_test.py: BACKEND line not found")
                src = src.replace(_LINE, "BACKEND = __dtest_alias__")
                return compile(src, self.path, "exec", dont_inherit=True)

            def exec_module(self, module):
                module.__dict__["__dtest_alias__"] = _ALIAS
                super().exec_module(module)

        class _Finder(importlib.abc.MetaPathFinder):
            def find_spec(self, fullname, path, target=None):
                if fullname != _SUITE:
                    return None
                spec = importlib.machinery.PathFinder.find_spec(fullname, path)
                spec.loader = _Loader(fullname, spec.origin)
                return spec

        assert _SUITE not in sys.modules
        sys.meta_path.insert(0, _Finder())

from torch.testing._internal.common_utils import run_tests  # noqa: E402
import torch.testing._internal.distributed.distributed_test as _dt  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

if BACKEND not in ("gloo", "nccl", "ucc", "mpi") and MODE == "as-gloo":
    # Profiler expectations as for Gloo: "<backend>:<op>" events of each call.
    for _lst in (
        _dt.PROFILING_SUPPORTED_BACKENDS,
        _dt.CUDA_PROFILING_SUPPORTED_BACKENDS,
        _dt.SEND_RECV_PROFILING_SUPPORTED_BACKENDS,
    ):
        _lst.append(BACKEND)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


del TestDistBackend  # keep pytest from collecting the (test-less) base

if __name__ == "__main__":
    run_tests()
