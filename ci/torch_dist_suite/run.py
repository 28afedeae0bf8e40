#!/usr/bin/env python
"""Runs torch's own DistributedTest suite (what torch's run_test.py does
for test/distributed/test_distributed_spawn.py) for one backend, with
pytest, in the torch environment ci/python.sh makes:

  python ci/torch_dist_suite/run.py gloo                  # baseline (about 20 min here)
  python ci/torch_dist_suite/run.py collectives           # gated exactly as Gloo (--mode as-gloo)
  python ci/torch_dist_suite/run.py collectives --mode plain   # gated as an unknown plugin
  python ci/torch_dist_suite/run.py collectives -k "all_reduce and not cuda"
  python ci/torch_dist_suite/compare.py gloo collectives  # Gloo passes, we do not, and why

Writes OUT/<name>_pass.txt, <name>_fail.txt ("test<TAB>first error line"),
<name>_skip.txt, <name>.xml, <name>.log, <name>_summary.txt
(OUT=target/dist-suite). See test_dist_suite.py for how a plugin backend
is gated as Gloo is without editing torch.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent


EXC = re.compile(r"^\s*(?:E\s+)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Timeout|Warning)\b.*)$")


def _last_exc(block: str) -> str:
    hits = [m.group(1).strip() for l in block.splitlines() if (m := EXC.match(l))]
    hits = [h for h in hits if "exited with error code" not in h and not h.startswith("AssertionError: Scalars are not equal")]
    return hits[-1] if hits else ""


def first_error_line(text: str, stderr: str = "") -> str:
    """One line: the exception a rank raised (first rank that reported one)."""
    text = text or ""
    m = re.search(r"Process (\d+) exited with error code \d+ and exception:\n(.*?)(?=\nProcess \d+ exited with error code|\Z)", text, re.S)
    if m:
        return f"[rank {m.group(1)}] " + (_last_exc(m.group(2)) or "?")[:300]
    m = re.search(r"Process \d+ terminated or timed out after [\d.]+ seconds", text)
    if m:
        return m.group(0)
    m = re.search(r"Expected exit code (\d+) but got (-?\d+)", text)
    if m:
        # a rank died outside run_test (e.g. in init_process_group) or by a signal
        why = ""
        for blk in stderr.split("Traceback (most recent call last):")[1:]:
            why = _last_exc(blk.split("\nI1")[0])
            if why:
                break
        return (f"rank exit code {m.group(2)}: " + (why or "no traceback"))[:300]
    m = re.search(r"Failed: Timeout.*", text)
    if m:
        return "pytest-timeout: " + m.group(0)[:200]
    return (_last_exc(text) or text.strip().splitlines()[0] if text.strip() else "")[:300]


def write_lists(xml: Path, out: Path, name: str):
    passed, failed, skipped = [], [], []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        tid = tc.get("name")
        f = tc.find("failure")
        if f is None:
            f = tc.find("error")
        s = tc.find("skipped")
        if f is not None:
            se = tc.find("system-err")
            failed.append((tid, first_error_line((f.get("message") or "") + "\n" + (f.text or ""),
                                                 se.text if se is not None and se.text else "")))
        elif s is not None:
            msg = (s.get("message") or "").strip()
            skipped.append((tid, msg.splitlines()[0][:200] if msg else ""))
        else:
            passed.append(tid)
    (out / f"{name}_pass.txt").write_text("".join(t + "\n" for t in sorted(passed)))
    (out / f"{name}_fail.txt").write_text("".join(f"{t}\t{r}\n" for t, r in sorted(failed)))
    (out / f"{name}_skip.txt").write_text("".join(f"{t}\t{r}\n" for t, r in sorted(skipped)))
    return passed, failed, skipped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("backend")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--mode", choices=["as-gloo", "plain"], default="as-gloo",
                    help="for a plugin backend: gate tests as for Gloo (default) or as the suite gates an unknown plugin")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--test-timeout", type=int, default=300,
                    help="MultiProcessTestCase per-test timeout (DISTRIBUTED_TESTS_DEFAULT_TIMEOUT)")
    ap.add_argument("--out", default=str(HERE.parent.parent / "target" / "dist-suite"))
    ap.add_argument("--name", default=None, help="output file prefix (default: backend)")
    ap.add_argument("--init-file", action="store_true",
                    help="set INIT_METHOD=file://... (run_test.py's old with_init_file variant; un-skips test_barrier_timeout_global)")
    ap.add_argument("--reparse", action="store_true", help="rebuild the lists from OUT/<name>.xml; run nothing")
    ap.add_argument("pytest_args", nargs="*")
    a = ap.parse_args()

    name = a.name or a.backend
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.reparse:
        p, f, s = write_lists(out / f"{name}.xml", out, name)
        print(f"{len(p)} passed, {len(f)} failed, {len(s)} skipped")
        return
    tmp = tempfile.mkdtemp(prefix=f"dtest-{name}-")
    os.mkdir(os.path.join(tmp, "barrier"))
    os.mkdir(os.path.join(tmp, "test_dir"))
    env = dict(os.environ)
    env.update(
        BACKEND=a.backend,
        WORLD_SIZE=str(a.world_size),
        TEMP_DIR=tmp,
        DTEST_MODE=a.mode if a.backend not in ("gloo", "nccl", "ucc", "mpi") else "native",
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
        COLL_SOCKET_IFNAME="lo",
        DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(a.test_timeout),
        TEST_REPORT_SOURCE_OVERRIDE=f"dist-{a.backend}",
        PYTHONUNBUFFERED="1",
    )
    # ninja (torch's cpp_extension build of the backend) lives in the venv's bin
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("INIT_METHOD", None)  # as run_test.py: the suite inits from its own file://
    if a.init_file:
        os.mkdir(os.path.join(tmp, "init_dir"))
        env["INIT_METHOD"] = "file://" + os.path.join(tmp, "init_dir", "shared_init_file")
    if a.backend == "collectives":
        # build (or find cached) the native extension once, not in each rank
        subprocess.check_call([sys.executable, "-c", "import collectives.torch as c; c.extension()"], env=env)
    xml = out / f"{name}.xml"
    log = out / f"{name}.log"
    cmd = [sys.executable, "-m", "pytest", str(HERE / "test_dist_suite.py"),
           "-p", "no:cacheprovider", "-v", "-rfEs", f"--junitxml={xml}",
           "-o", "junit_logging=system-err", "-o", "junit_log_passing_tests=False",
           # outer guard above the suite's own per-test timeout (500 s max override)
           f"--timeout={max(a.test_timeout, 500) + 120}"]
    if a.k:
        cmd += ["-k", a.k]
    cmd += a.pytest_args
    print("+", " ".join(cmd), f"(BACKEND={a.backend} WORLD_SIZE={a.world_size} mode={env['DTEST_MODE']})", flush=True)
    t0 = time.time()
    with open(log, "w") as lf:
        rc = subprocess.call(cmd, env=env, cwd=str(HERE), stdout=lf, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    shutil.rmtree(tmp, ignore_errors=True)

    passed, failed, skipped = write_lists(xml, out, name)
    total = len(passed) + len(failed) + len(skipped)
    summary = (f"backend={a.backend} mode={env['DTEST_MODE']} world_size={a.world_size} "
               f"total={total} passed={len(passed)} failed={len(failed)} skipped={len(skipped)} "
               f"wall={wall:.0f}s pytest_rc={rc}")
    (out / f"{name}_summary.txt").write_text(summary + "\n")
    print(summary)
    print(f"{len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped")


if __name__ == "__main__":
    main()
