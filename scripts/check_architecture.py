#!/usr/bin/env python3
"""Holds the drawing in docs/architecture.md against the code (issue #47).

The drawing's fenced blocks, read here:
- `parts`: `Part: module, module` for every top-level module of src/ (crate `mt`);
- `arrows`: `Part -> Part, Part`, the arrows between parts; they must be exactly the ones
  the code has (an edge X -> Y between modules, as scripts/check_modules.py finds them,
  is an arrow between their parts; arrows into Base and within a part are left out);
- `never`: `Part -> Part, Part`, arrows that must not appear in the code;
- `crates`: `crate: module, ...` naming every top-level module of worker/src and
  launcher/src (a new one must be placed in the drawing);
- `tour`: files that must exist.

And one module-file style in the three crates (src/, worker/src, launcher/src): a module
with children is `x.rs` beside its folder `x/`, never `x/mod.rs`.

Exits 1 naming each difference, 0 when the drawing and the code agree.
Usage: scripts/check_architecture.py [docs/architecture.md]
"""

import importlib.util
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def blocks(text):
    """{name: [lines]} of the fenced blocks ```name ... ```."""
    out = {}
    for m in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.S | re.M):
        out[m.group(1)] = [line.strip() for line in m.group(2).splitlines() if line.strip()]
    return out


def pairs(lines, what):
    """`A -> B, C` lines as {(A, B), (A, C)}."""
    out = set()
    for line in lines:
        m = re.fullmatch(r"(\w+)\s*->\s*(.*)", line)
        if not m:
            sys.exit(f"docs/architecture.md: `{line}` in the {what} block is not `Part -> Part, ...`")
        out.update((m.group(1), b.strip()) for b in m.group(2).split(",") if b.strip())
    return out


def top_modules(src):
    """The top-level modules of a crate's src/: files and folders, main and lib left out."""
    return {
        p.stem if p.is_file() else p.name
        for p in src.iterdir()
        if (p.is_dir() or p.suffix == ".rs") and p.stem not in ("lib", "main")
    }


def main():
    doc = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/architecture.md"
    b = blocks(doc.read_text())
    for need in ("parts", "arrows", "never", "crates", "tour"):
        if need not in b:
            sys.exit(f"{doc}: no ```{need} block")
    spec = importlib.util.spec_from_file_location("check_modules", ROOT / "scripts/check_modules.py")
    cm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cm)

    errors = []
    part_of = {}
    for line in b["parts"]:
        name, _, mods = line.partition(":")
        for m in (x.strip() for x in mods.split(",") if x.strip()):
            if m in part_of:
                errors.append(f"module `{m}` is in two parts: {part_of[m]} and {name}")
            part_of[m] = name.strip()
    modules = top_modules(ROOT / "src")
    for m in sorted(modules - set(part_of)):
        errors.append(f"src/{m}: a module of mt in no part of the drawing (add it to the parts block)")
    for m in sorted(set(part_of) - modules):
        errors.append(f"`{m}` is drawn in part {part_of[m]} but src/ has no such module")

    code = defaultdict(list)
    for (a, c), files in cm.edges(ROOT / "src").items():
        pa, pc = part_of.get(a), part_of.get(c)
        if pa and pc and pa != pc and pc != "Base":
            code[(pa, pc)].extend(str(Path(f).resolve().relative_to(ROOT)) for f in files)
    drawn = pairs(b["arrows"], "arrows")
    for a, c in sorted(set(code) - drawn):
        files = ", ".join(sorted(set(code[(a, c)]))[:4])
        errors.append(f"the code has {a} -> {c} ({files}): draw it in the arrows block, or remove it")
    for a, c in sorted(drawn - set(code)):
        errors.append(f"the drawing has {a} -> {c}, the code does not: erase it from the arrows block")
    for a, c in sorted(pairs(b["never"], "never") & set(code)):
        files = ", ".join(sorted(set(code[(a, c)]))[:4])
        errors.append(f"{a} -> {c} must never exist, and does: {files}")

    for line in b["crates"]:
        name, _, mods = line.partition(":")
        drawn_mods = {x.strip() for x in mods.split(",") if x.strip()}
        src = ROOT / name.strip() / "src"
        if not src.is_dir():
            errors.append(f"crate `{name}` of the crates block has no {src}")
            continue
        present = top_modules(src) | {"main"}
        for m in sorted(present - drawn_mods):
            errors.append(f"{name}/src/{m}: a module in no line of the crates block")
        for m in sorted(drawn_mods - present):
            errors.append(f"`{m}` is drawn in {name} but {name}/src has no such module")

    for crate_src in ("src", "worker/src", "launcher/src"):
        for f in sorted((ROOT / crate_src).rglob("mod.rs")):
            rel = f.relative_to(ROOT)
            errors.append(f"{rel}: write the module as {rel.parent}.rs beside its folder {rel.parent}/ (one module-file style)")

    for f in b["tour"]:
        if not (ROOT / f).is_file():
            errors.append(f"the tour names {f}, which does not exist")

    for e in errors:
        print(f"docs/architecture.md: {e}")
    if errors:
        sys.exit(1)
    print(f"docs/architecture.md: the drawing matches the code ({len(drawn)} arrows between {len(set(part_of.values()))} parts)")


if __name__ == "__main__":
    main()
