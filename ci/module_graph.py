#!/usr/bin/env python3
"""The folders of a crate's src/ and which import which; fails on a circle.

Usage: python3 ci/module_graph.py [SRC_DIR ...]
       (default: collectives/src transport/src bench-cli/src)

A node is a folder of src/ or a file at its top (lib.rs, main.rs excepted). An edge
A -> B is a `crate::B...` path in a file of A, or a name the crate root
re-exports from B (`crate::Communicator` is in comm/). Each crate's folders
must form layers: a circle between two folders means one of them holds
something the other should own, and the script exits 1 naming the circle.
Printed bottom-up (a node after every node it imports), so the output is
also the architecture's picture of layers.
"""
import re
import sys
from pathlib import Path

PATH = re.compile(r"\bcrate::(?:\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
REEXPORT = re.compile(r"^pub use ([a-z_][a-z0-9_]*)(?:::[a-z_][a-z0-9_]*)*::(?:\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))", re.M)


def nodes_of(src: Path):
    """Folder or top-level file (without .rs) -> its .rs files."""
    nodes = {}
    for f in sorted(src.rglob("*.rs")):
        rel = f.relative_to(src)
        if rel.parts in (("lib.rs",), ("main.rs",)):
            continue
        name = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        nodes.setdefault(name, []).append(f)
    return nodes


def reexports(src: Path):
    """Names the crate root re-exports -> the node they come from."""
    root = src / "lib.rs" if (src / "lib.rs").exists() else src / "main.rs"
    text = root.read_text()
    names = {}
    for m in REEXPORT.finditer(text):
        items = m.group(2) or m.group(3)
        for item in re.split(r"[,\s]+", items):
            if item:
                names[item.split(" as ")[-1]] = m.group(1)
    return names


def strip_comments(text: str) -> str:
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def edges_of(src: Path):
    """node -> {node it imports: [where, ...]}."""
    nodes = nodes_of(src)
    names = reexports(src)
    edges = {n: {} for n in nodes}
    for node, files in nodes.items():
        for f in files:
            for no, line in enumerate(strip_comments(f.read_text()).splitlines(), 1):
                for m in PATH.finditer(line):
                    for item in re.split(r"[,\s]+", m.group(1) or m.group(2)):
                        head = item.split("::")[0]
                        target = head if head in nodes else names.get(head)
                        if target and target != node and target in nodes:
                            edges[node].setdefault(target, []).append(f"{f}:{no}")
    return edges


def layers(edges):
    """Nodes bottom-up, or (None, circle)."""
    order, state = [], {}

    def visit(n, stack):
        if state.get(n) == "done":
            return None
        if state.get(n) == "open":
            return stack[stack.index(n):] + [n]
        state[n] = "open"
        for m in sorted(edges[n]):
            circle = visit(m, stack + [n])
            if circle:
                return circle
        state[n] = "done"
        order.append(n)
        return None

    for n in sorted(edges):
        circle = visit(n, [])
        if circle:
            return None, circle
    return order, None


def main():
    failed = False
    for src in [Path(a) for a in sys.argv[1:]] or [Path(p) for p in ("collectives/src", "transport/src", "bench-cli/src")]:
        edges = edges_of(src)
        order, circle = layers(edges)
        if circle:
            print(f"{src}: a circle of imports: {' -> '.join(circle)}")
            for a, b in zip(circle, circle[1:]):
                print(f"  {a} -> {b}: {', '.join(edges[a][b][:4])}")
            failed = True
            continue
        print(f"{src}: bottom-up, each with what it imports")
        for n in order:
            print(f"  {n:<10} {' '.join(sorted(edges[n])) or '-'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
