"""The ``"collectives"`` backend of ``torch.distributed`` (CPU tensors).

    import collectives.torch  # registers the backend
    dist.init_process_group("collectives")  # or "cpu:collectives"

It is a native ``c10d::Backend`` (``csrc/backend.cpp``) over the library's
C ABI, the shape of torch's own ProcessGroupGloo: torch registers, names and
wraps it as it does Gloo, so functional collectives (eager and under
``torch.compile``), ``DeviceMesh``, DTensor, FSDP, TorchRec, torchft and
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` find it as they find Gloo, and calls from
DDP's autograd thread never take the GIL. The extension is compiled for the
installed torch the first time it is imported (a minute; then cached under
``~/.cache/collectives/torch-ext``, or ``$COLL_TORCH_EXT_DIR``).

Each group meets through its torch store: its rank 0 makes a unique id and
publishes it there (``dist.new_group``). ``dist.split_group`` and DeviceMesh's
sub-meshes use the library's split, ``dist.shrink_group`` its shrink.

When ranks die, the survivors keep going with torch's own API (see
``python/examples/elastic_train.py``)::

    failed = dist.group.WORLD._get_backend(torch.device("cpu")).failed_ranks()
    dist.shrink_group(failed)   # the new default group: the survivors

``failed_ranks()`` is the same list on every survivor. The store must
outlive any rank (a launcher's, as torchrun's agent store, not one served by
rank 0).

Errors name the rank, the peer and the call, and carry the phrases torch's
and torchft's tooling match in Gloo's (``Timed out``, ``Connection closed by
peer``). Tensors must be CPU, dense and contiguous; send and recv match in
order per pair of ranks (tags are not matched).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

import collectives

__all__ = ["BackendCollectives", "extension", "launcher_env", "shared_empty"]


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


_CSRC = Path(__file__).parent / "csrc"
_extension = None
_extension_lock = threading.Lock()  # process groups are made from several threads (torchft)


def extension():
    """The compiled backend module, built for this torch on first use (its
    sources, the C header, torch's version and the library's path name the
    cache entry, so a change to any rebuilds it)."""
    global _extension
    with _extension_lock:
        if _extension is None:
            _extension = _load()
    return _extension


def _load():
    """Imports the backend built for this torch, building it first if needed."""
    from torch.utils.cpp_extension import load

    native = Path(collectives._native.__file__).resolve()
    sources = [_CSRC / "backend.cpp", _CSRC / "collectives.h"]
    digest = hashlib.sha256()
    for part in [*(p.read_bytes() for p in sources), torch.__version__.encode(), str(native).encode()]:
        digest.update(part)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "collectives" / "torch-ext"
    build = Path(os.environ.get("COLL_TORCH_EXT_DIR") or cache) / f"torch-{torch.__version__}-{digest.hexdigest()[:16]}"
    built = build / "collectives_torch.so"
    if built.exists() and not (build / "lock").exists():
        # Built for exactly this (see the digest), and no rank is
        # building it now (torch's lock): no compiler, no ninja.
        from torch.utils.cpp_extension import _import_module_from_library

        module = _import_module_from_library("collectives_torch", str(build), True)
    else:
        build.mkdir(parents=True, exist_ok=True)
        # torch runs ninja from PATH: the one beside this interpreter.
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        module = load(
            name="collectives_torch",
            sources=[str(_CSRC / "backend.cpp")],
            extra_include_paths=[str(_CSRC)],
            extra_cflags=["-O2"],
            # The C ABI from the package's own extension module: one
            # library in the process.
            extra_ldflags=[str(native), f"-Wl,-rpath,{native.parent}"],
            build_directory=str(build),
            verbose=bool(os.environ.get("COLL_TORCH_EXT_VERBOSE")),
        )
    atexit.register(module._stop_completer)
    return module


def __getattr__(name: str):
    if name == "BackendCollectives":
        return extension().BackendCollectives
    raise AttributeError(name)


def _create(store, rank: int, size: int, timeout):
    return extension().BackendCollectives(store, rank, size, timeout)


dist.Backend.register_backend("collectives", _create, devices=["cpu"])
