"""Multi-process tests of the Python package and the torch backend: each test
launches N ranks of a program in tests/ranks/ (or an example) under torchrun
or Open MPI's mpirun, real processes over real shared memory and sockets,
and checks what every rank reports.

torch and mpirun are needed; a missing one skips its tests, unless
COLL_REQUIRE_TORCH=1 / COLL_REQUIRE_MPI=1 (CI sets both), when it fails them.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
EXAMPLES = HERE.parent / "examples"
RANKS = HERE / "ranks"


def _need(what: str, ok: bool, var: str) -> None:
    if ok:
        return
    if os.environ.get(var) == "1":
        pytest.fail(f"{what} is missing and {var}=1")
    pytest.skip(f"{what} is missing")


def _torch_ok() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(launcher: str, n: int, program: Path, *args: str, env=None, timeout: int = 600):
    """Runs `n` ranks of `program` under `launcher` (torchrun, mpirun, or
    "direct": processes given torchrun's variables, with no agent that
    would kill the survivors when a rank dies); returns the outcome."""
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    env.setdefault("COLL_TIMEOUT", "60")
    # Unique ids default to the first non-loopback interface (right across
    # hosts); these ranks share one host: loopback.
    env.setdefault("COLL_SOCKET_IFNAME", "lo")
    if launcher == "direct":
        port = str(_free_port())
        procs = [
            subprocess.Popen([sys.executable, str(program), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**env, "RANK": str(r), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
            for r in range(n)
        ]
        outs = [p.communicate(timeout=timeout) for p in procs]
        code = max(abs(p.returncode) for p in procs)
        return subprocess.CompletedProcess(program, code, "".join(o for o, _ in outs), "".join(e for _, e in outs))
    if launcher == "torchrun":
        _need("torch", _torch_ok(), "COLL_REQUIRE_TORCH")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
               f"--master-port={_free_port()}", str(program), *args]
    else:
        mpirun = shutil.which("mpirun.openmpi")
        _need("mpirun.openmpi", mpirun is not None, "COLL_REQUIRE_MPI")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        cmd = [mpirun, "-n", str(n), sys.executable, str(program), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def assert_ranks_ok(r, n: int, what: str) -> None:
    for rank in range(n):
        assert re.search(rf"^ok {rank}$", r.stdout, re.M), f"{what}: rank {rank} did not finish\n{r.stdout}\n{r.stderr}"
    assert r.returncode == 0, f"{what}\n{r.stdout}\n{r.stderr}"


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
@pytest.mark.parametrize("n", [2, 4])
def test_every_method_and_dtype_matches_numpy(launcher, n):
    r = launch(launcher, n, RANKS / "matrix.py")
    assert_ranks_ok(r, n, f"matrix, {n} ranks under {launcher}")


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
@pytest.mark.parametrize("n", [2, 4])
def test_torch_backend(launcher, n):
    _need("torch", _torch_ok(), "COLL_REQUIRE_TORCH")
    r = launch(launcher, n, RANKS / "torch_backend.py")
    assert_ranks_ok(r, n, f"torch backend, {n} ranks under {launcher}")


@pytest.mark.parametrize("n", [2, 4])
def test_torch_stack_matches_gloo(n):
    """Functional collectives (eager and Inductor), DTensor, tensor and
    sequence parallel, 2-D meshes (4 ranks), FSDP2, FSDP1 and pipelining, each
    run on our backend and on Gloo in one job and compared."""
    _need("torch", _torch_ok(), "COLL_REQUIRE_TORCH")
    sections = ["funcol", "dtensor", "fsdp", "pipeline"] + (["mesh2d"] if n == 4 else [])
    r = launch("torchrun", n, RANKS / "torch_stack.py", *sections)
    for section in sections:
        for rank in range(n):
            assert re.search(rf"^ok {section} {rank}$", r.stdout, re.M), f"{section} on rank {rank}\n{r.stdout}\n{r.stderr}"
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("n", [2, 4])
def test_torchrec_dlrm_trains_like_gloo(n):
    """TorchRec's DistributedModelParallel of a DLRM (table-wise,
    column-wise, table-column-wise and data-parallel tables) on our backend
    and on Gloo in one job: losses equal step by step, final weights too.
    TorchRec's CPU kernels need torch 2.14.1: its own virtual environment
    (ci/python.sh makes it; COLL_TORCHREC_PYTHON names its interpreter)."""
    python = os.environ.get("COLL_TORCHREC_PYTHON")
    _need("TorchRec's environment (COLL_TORCHREC_PYTHON)", bool(python) and Path(python).exists(), "COLL_REQUIRE_TORCH")
    port = str(_free_port())
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLL_SOCKET_IFNAME": "lo", "COLL_TIMEOUT": "60"}
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={n}", f"--master-port={port}",
           str(EXAMPLES / "dlrm_train.py"), "--steps", "30"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert "dlrm ok" in r.stdout and r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_torch_backend_errors():
    """Bad arguments are ValueErrors naming the call (the group stays
    usable); ranks that disagree, a call's timeout and a dead peer fail
    with the rank, the peer, the call and Gloo's phrases, at once."""
    _need("torch", _torch_ok(), "COLL_REQUIRE_TORCH")
    r = launch("torchrun", 3, RANKS / "torch_errors.py", env={"COLL_TIMEOUT": "30"})
    lines = [l for l in r.stdout.splitlines() if l.startswith("rank ")]
    bad = [l for l in lines if ": ok" not in l and "after" not in l]
    assert not bad and len(lines) >= 25, r.stdout + r.stderr
    for rank in range(3):
        assert f"done {rank}" in r.stdout, r.stdout + r.stderr
    for rank in (0, 1):
        seconds = float(re.search(rf"^rank {rank}: noticed the dead peer after ([\d.]+) s$", r.stdout, re.M)[1])
        assert seconds < 5, r.stdout


def _outcomes(r) -> dict:
    """rank -> (exception class, seconds, message) from errors.py's lines."""
    found = {}
    for m in re.finditer(r"^rank (\d+): (\w+) after ([\d.]+) s: (.*)$", r.stdout, re.M):
        found[int(m[1])] = (m[2], float(m[3]), m[4])
    return found


def test_a_killed_rank_raises_peer_error_naming_it():
    r = launch("direct", 3, RANKS / "errors.py", "kill")
    got = _outcomes(r)
    for rank in (0, 2):
        cls, seconds, message = got.get(rank, (None, 0, r.stdout + r.stderr))
        assert cls == "PeerError" and "rank 1" in message, message
        assert seconds < 20, f"rank {rank} took {seconds} s"


def test_mismatched_counts_raise_mismatch_error():
    r = launch("torchrun", 3, RANKS / "errors.py", "mismatch")
    got = _outcomes(r)
    classes = {cls for cls, _, _ in got.values()}
    assert "MismatchError" in classes, r.stdout + r.stderr
    assert all(c in ("MismatchError", "PeerError") for c in classes), got


def test_ctrl_c_raises_keyboard_interrupt_within_a_second_and_tells_the_peers():
    r = launch("torchrun", 2, RANKS / "errors.py", "interrupt")
    got = _outcomes(r)
    cls, seconds, _ = got.get(0, (None, 99, r.stdout + r.stderr))
    assert cls == "KeyboardInterrupt" and seconds < 1.5, got
    cls, seconds, message = got.get(1, (None, 99, r.stdout + r.stderr))
    assert cls == "PeerError" and "interrupted" in message and seconds < 5, got


def test_abort_from_a_thread_ends_the_call_and_tells_the_peers():
    r = launch("torchrun", 2, RANKS / "errors.py", "abort")
    got = _outcomes(r)
    assert got.get(0, ("",))[0] == "AbortedError", r.stdout + r.stderr
    cls, seconds, message = got.get(1, (None, 99, ""))
    assert cls == "PeerError" and "stopped by the watchdog" in message and seconds < 5, got


def test_bad_arguments_are_type_and_value_errors_before_anything_moves():
    r = launch("torchrun", 2, RANKS / "errors.py", "argument")
    lines = [l for l in r.stdout.splitlines() if l.startswith("rank 0:")]
    kinds = [l.split(":")[1].strip() for l in lines]
    assert kinds == ["ValueError", "TypeError", "ArgumentError", "TypeError", "ArgumentError", "ArgumentError", "ArgumentError"], lines
    assert "done 0" in r.stdout and "done 1" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("n", [2, 4])
def test_ddp_trains_like_gloo(n):
    _need("torch", _torch_ok(), "COLL_REQUIRE_TORCH")
    r = launch("torchrun", n, EXAMPLES / "ddp_train.py", "--steps", "12", "--hidden", "256")
    assert "ddp ok" in r.stdout and r.returncode == 0, r.stdout + r.stderr


def test_embedding_exchange_with_uneven_splits():
    _need("torch", _torch_ok(), "COLL_REQUIRE_TORCH")
    r = launch("torchrun", 3, EXAMPLES / "embedding_exchange.py", "--steps", "5", "--rows", "10000")
    assert "embedding ok" in r.stdout and r.returncode == 0, r.stdout + r.stderr


def test_pipeline_parallel_matches_one_process():
    _need("torch", _torch_ok(), "COLL_REQUIRE_TORCH")
    r = launch("torchrun", 4, EXAMPLES / "pipeline.py", "--steps", "6")
    assert "pipeline ok" in r.stdout and r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("victims", [1, 2])
def test_elastic_training_survives_killed_ranks(victims):
    """elastic_train.py at 4 ranks: `victims` ranks SIGKILL themselves at
    random steps; the survivors agree, dist.shrink_group, re-shard and
    finish with equal weights and a falling loss."""
    _need("torch", _torch_ok(), "COLL_REQUIRE_TORCH")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLL_TIMEOUT": "60", "COLL_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, str(EXAMPLES / "elastic_train.py"), "--launch", "4", "--seed", str(victims),
           "--victims", str(victims), "--epochs", "3", "--steps", "20"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    what = f"{r.stdout}\n{r.stderr}"
    assert r.returncode == 0, what
    assert len(re.findall(r"^ok \d+$", r.stdout, re.M)) == 4 - victims, what
    assert "DIFFER" not in r.stdout, what
    failures = re.findall(r"^rank \d+: .* of the group failed; shrunk to.*$", r.stdout, re.M)
    assert len(failures) >= 4 - victims, what
    # Noticed from the dead rank's exit (or a survivor's abort), not by
    # running out of COLL_TIMEOUT: a victim may be a zombie its launcher has
    # not reaped yet, and still a dead rank.
    assert not any("Timed out" in f for f in failures), what
    curve = [float(v) for v in re.search(r"^loss per epoch: (.*)$", r.stdout, re.M)[1].split(", ")]
    assert curve[-1] < curve[0], what
