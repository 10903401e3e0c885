#!/usr/bin/env python3
"""No cycles between the top-level modules of a crate (issue #47).

A top-level module is a file or folder directly under a crate's `src/` (`src/plan.rs` and
`src/plan/` are one module, `plan`). An edge X -> Y is any path `crate::Y` (in a `use`, a
grouped `use crate::{Y, ...}`, or inline) written in X's code, comments left out; `#[cfg(test)]`
code counts too (a test module is compiled into its parent). Prints the edges with --edges;
exits 1 naming every cycle found (each strongly connected component of two or more
modules, with the files behind its edges), 0 when there is none.

Usage: scripts/check_modules.py [--edges] [CRATE_SRC ...]   (default: src)
"""

import re
import sys
from collections import defaultdict
from pathlib import Path

LINE_COMMENT = re.compile(r"//.*$", re.M)
BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)
STRING = re.compile(r'"(?:\\.|[^"\\])*"')
# `crate::name` and `crate::{a, b::c, ...}` (one level of braces is enough for the heads).
PATH = re.compile(r"\bcrate::(\w+)")
GROUP = re.compile(r"\bcrate::\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}", re.S)


def heads(group):
    """The first segment of each path in a `use crate::{...}` group."""
    out, depth, cur = [], 0, ""
    for ch in group:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [m.group(1) for p in out if (m := re.match(r"\s*(\w+)", p))]


def edges(src):
    """{(from, to): [files]} between the top-level modules under `src`."""
    found = defaultdict(list)
    modules = {
        (p.stem if p.is_file() else p.name)
        for p in src.iterdir()
        if (p.is_dir() or p.suffix == ".rs") and p.stem not in ("lib", "main")
    }
    for f in sorted(src.rglob("*.rs")):
        rel = f.relative_to(src)
        if len(rel.parts) == 1:
            if rel.stem in ("lib", "main"):
                continue
            module = rel.stem
        else:
            module = rel.parts[0]
        text = STRING.sub('""', LINE_COMMENT.sub("", BLOCK_COMMENT.sub("", f.read_text())))
        targets = set(PATH.findall(text))
        for g in GROUP.findall(text):
            targets.update(heads(g))
        # `super::x` from a file directly under src/ is crate::x (no `mod.rs`: see
        # scripts/check_architecture.py).
        if len(rel.parts) == 1:
            targets.update(re.findall(r"\bsuper::(\w+)", text))
        for t in (targets & modules) - {module}:
            found[(module, t)].append(str(f))
    return found


def cycles(found):
    """Strongly connected components of two or more modules (Tarjan)."""
    graph = defaultdict(set)
    for a, b in found:
        graph[a].add(b)
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(graph) | {b for bs in graph.values() for b in bs}):
        if v not in index:
            visit(v)
    return out


def main(argv):
    show = "--edges" in argv
    roots = [a for a in argv if not a.startswith("--")] or ["src"]
    bad = 0
    for root in roots:
        found = edges(Path(root))
        if show:
            for (a, b), files in sorted(found.items()):
                print(f"{root}: {a} -> {b}  ({len(files)} files)")
        for comp in cycles(found):
            bad += 1
            print(f"{root}: module cycle between {', '.join(comp)}:", file=sys.stderr)
            for a, b in sorted(found):
                if a in comp and b in comp:
                    print(f"  {a} -> {b}: {', '.join(found[(a, b)])}", file=sys.stderr)
    if bad:
        return 1
    print(f"check_modules: no cycle between the top-level modules of {', '.join(roots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
