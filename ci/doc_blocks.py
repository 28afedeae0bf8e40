#!/usr/bin/env python3
"""Runs the code blocks of README.md and docs/*.md that are marked runnable,
as `cargo test --doc` runs Rust's: every command in them must work as
written.

    python3 ci/doc_blocks.py [--list] [--bin-dir DIR] [--timeout SECS] [-v] [FILE[:LINE] ...]

A block is runnable when its fence's info string has the word `runnable`:

    ```sh runnable
    collbench allreduce -n 2 --size 1M
    ```

Each such block runs as one script, `bash -euo pipefail -c BLOCK`, from the
repository's root, with DIR (default target/release, where `cargo build
--release` puts collbench) first on the PATH, so `collbench` is the build
being tested. A block fails on a non-zero exit or when it runs longer than
--timeout seconds (default 300; its whole process group is killed). The
script prints FILE:LINE, pass/fail and the time of each block, the output of
each failed one, and exits 1 if any failed.

Blocks that need more than the build say so: `needs=A,B` in the info string
(```sh runnable needs=torch). They run only when every one of A, B is in the
environment variable COLL_DOC_NEEDS (comma-separated, e.g.
COLL_DOC_NEEDS=mpi,torch), and are otherwise listed as skipped with the
reason. The needs in use:

    mpi     Open MPI's mpirun and mpicc, MPICH's mpiexec.hydra
    cargo   the block builds with cargo (slow; the tree must compile)
    python  `python` on the PATH imports the collectives package
    torch   `python` and `torchrun` on the PATH have torch and the package
            (ci/python.sh's ~/.cache/collectives/venv: put its bin/ on PATH)

As the project's tests do, blocks run with OMPI_ALLOW_RUN_AS_ROOT=1,
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 and OMPI_MCA_rmaps_base_oversubscribe=1, so
that Open MPI's mpirun runs as root and with more ranks than cores.

Before running anything it also checks every link of those pages: a
relative link must name a file of the repository, and a #fragment a heading
of that page (GitHub's anchors). A link that does not resolve fails the run.

--list prints the runnable blocks (and why any would be skipped) without
running them; FILE or FILE:LINE arguments run only those blocks. Not marked
runnable, on purpose: the test command itself (ci/test.sh, which runs this),
anything that needs root or a VM (verbs, soft-RoCE), long benchmarks and
comparisons, and commands that write outside the repository's target/.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def doc_files():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def blocks(path):
    """Every fenced block of a Markdown file: (line of its opening fence,
    info string words, body)."""
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or (m["fence"][0] == "`" and "`" in m["info"]):
            i += 1
            continue
        start, fence, info = i, m["fence"], m["info"].split()
        body = []
        i += 1
        while i < len(lines):
            close = re.match(r"^ {0,3}(`{3,}|~{3,})\s*$", lines[i])
            if close and close.group(1)[0] == fence[0] and len(close.group(1)) >= len(fence):
                break
            # strip at most the opening fence's indent, as CommonMark does
            body.append(lines[i][min(len(m["indent"]), len(lines[i]) - len(lines[i].lstrip(" "))):])
            i += 1
        else:
            sys.exit(f"{path.relative_to(ROOT)}:{start + 1}: a code block that is never closed")
        found.append((start + 1, info, "\n".join(body) + "\n"))
        i += 1
    return found


def slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    seen, out = {}, set()
    for line in prose(path):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def prose(path):
    """A page's lines outside fenced code blocks (those inside come back empty)."""
    lines = path.read_text().split("\n")
    inside = set()
    for line, _, body in blocks(path):
        inside.update(range(line - 1, line + body.count("\n") + 1))
    return ["" if i in inside else l for i, l in enumerate(lines)]


def bad_links():
    """Every link of the pages that names a missing file or heading."""
    bad, count = [], 0
    for path in doc_files():
        for n, line in enumerate(prose(path), 1):
            line = re.sub(r"`[^`]*`", "", line)  # links are not looked for in code spans
            for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
                target = m.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                count += 1
                file, _, frag = target.partition("#")
                dest = (path.parent / file).resolve() if file else path
                where = f"{path.relative_to(ROOT)}:{n}: {target}"
                if not dest.exists():
                    bad.append(f"{where}: no such file")
                elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                    bad.append(f"{where}: no heading #{frag} in {dest.relative_to(ROOT)}")
    return bad, count


def runnable_blocks():
    for path in doc_files():
        for line, info, body in blocks(path):
            if "runnable" not in info[1:]:
                continue
            needs = []
            for word in info[1:]:
                if word.startswith("needs="):
                    needs += [n for n in word[len("needs="):].split(",") if n]
            yield f"{path.relative_to(ROOT)}:{line}", needs, body


def selected(name, filters):
    if not filters:
        return True
    file = name.rsplit(":", 1)[0]
    return any(f == name or f == file for f in filters)


def run(body, env, timeout):
    start = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", body],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        status = None
    return status, out.decode(errors="replace"), time.monotonic() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the runnable blocks, run nothing")
    ap.add_argument("--bin-dir", default="target/release", help="put this first on the PATH (default target/release)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per block (default 300)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every block's output, not only failed ones")
    ap.add_argument("only", nargs="*", metavar="FILE[:LINE]", help="run only these blocks")
    args = ap.parse_args()

    have = {n.strip() for n in os.environ.get("COLL_DOC_NEEDS", "").split(",") if n.strip()}
    bin_dir = (ROOT / args.bin_dir).resolve()
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
    )
    todo = [b for b in runnable_blocks() if selected(b[0], args.only)]
    if args.only and not todo:
        sys.exit(f"no runnable block matches {' '.join(args.only)}")
    if not args.list and not (bin_dir / "collbench").exists():
        print(f"note: no collbench in {bin_dir}; blocks that call it will fail (build with cargo build --release)")

    bad, count = bad_links()
    for b in bad:
        print(f"bad link  {b}")
    if not bad:
        print(f"links: all {count} resolve")

    failed, ran, skipped, total = [], 0, 0, time.monotonic()
    for name, needs, body in todo:
        missing = [n for n in needs if n not in have]
        if missing:
            skipped += 1
            print(f"skip  {name}  (needs {','.join(missing)}: not in COLL_DOC_NEEDS)", flush=True)
            continue
        if args.list:
            first = body.strip().split("\n")[0]
            print(f"      {name}  {first}{' ...' if body.strip().count(chr(10)) else ''}")
            continue
        print(f"run   {name}", flush=True)
        status, out, secs = run(body, env, args.timeout)
        ran += 1
        if status == 0:
            print(f"pass  {name}  ({secs:.1f} s)", flush=True)
            if args.verbose:
                print(out, end="")
        else:
            why = f"timed out after {args.timeout:.0f} s" if status is None else f"exit status {status}"
            print(f"FAIL  {name}  ({why}, {secs:.1f} s)\n--- the block:\n{body}--- its output:\n{out}---", flush=True)
            failed.append(name)
    if args.list:
        sys.exit(1 if bad else 0)
    print(
        f"{ran - len(failed)} of {ran} runnable blocks passed, {skipped} skipped"
        f" ({time.monotonic() - total:.0f} s)" + (f"; failed: {' '.join(failed)}" if failed else "")
    )
    sys.exit(1 if failed or bad else 0)


if __name__ == "__main__":
    main()
