#!/usr/bin/env python3
"""The module import graph of a crate, and its circles.

Reads every `.rs` file under a crate's `src/`, takes each path that starts with `crate::`,
`super::` or `self::` (in `use` lines and in code, comments skipped), resolves it to the file of
the deepest module it names, and prints the strongly connected components of more than one file
(the circles): `python3 scripts/import-graph.py crates/dlbridge [--edges] [--from DIR]
[--max-circle N]`.

Unit-test modules (`#[cfg(test)] mod tests`) are left out. `--edges` also lists, for each circle, the edges inside it; `--from DIR` lists the files outside
DIR that name a module under DIR (e.g. `--from backend/cuda`).
"""

import argparse
import os
import re
import sys

PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+|::\{)")
GROUP = re.compile(r"\buse\s+(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^;]*)\};", re.S)


def modules(src):
    """Maps module paths (tuples) to files, and files to their module path."""
    by_path, by_file = {}, {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(root, f), src)
            parts = rel[:-3].split(os.sep)
            if parts[-1] in ("mod", "lib") and len(parts) >= 1:
                parts = parts[:-1]
            by_path.setdefault(tuple(parts), []).append(rel)
            by_file[rel] = tuple(parts)
    return by_path, by_file


def strip_comments(text):
    # Unit tests (a `#[cfg(test)] mod tests` at the end of a file) are not the architecture.
    text = re.split(r"#\[cfg\(test\)\]\s*mod tests\b", text)[0]
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def path_attrs(text):
    """`#[path = "x.rs"] mod name;` declarations: name -> path."""
    return dict(re.findall(r'#\[path\s*=\s*"([^"]+)"\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)', text))


def resolve(base, segs, by_path):
    """The files of the deepest module `base + segs` names (several for cfg'd alternatives)."""
    full = list(base) + list(segs)
    for n in range(len(full), -1, -1):
        if tuple(full[:n]) in by_path:
            return by_path[tuple(full[:n])]
    return []


def graph(src):
    by_path, by_file = modules(src)
    alternative = set()
    # `#[path]` modules: their file is reached under another name.
    for rel in list(by_file):
        text = open(os.path.join(src, rel)).read()
        for target, name in path_attrs(text).items():
            here = os.path.dirname(rel)
            tgt = os.path.normpath(os.path.join(here, target))
            mod = by_file[rel] + (name,)
            # A cfg'd alternative (`backend/cuda/unavailable.rs` for `backend::cuda`): both
            # files are that module, and `super::` in it means the module's parent.
            by_path.setdefault(mod, []).append(tgt)
            by_file[tgt] = mod
            alternative.add(tgt)
    # Names the crate root re-exports (`pub use tensor::Tensor;`): `crate::Tensor` is tensor.rs.
    reexport = {}
    root = strip_comments(open(os.path.join(src, "lib.rs")).read())
    for prefix, body in re.findall(r"pub use ([\w:]+)::\{([^}]*)\};", root):
        for name in body.split(","):
            name = name.strip().split(" as ")[-1].strip()
            if name:
                reexport[name] = [x for x in prefix.split("::") if x]
    for prefix, name in re.findall(r"pub use ([\w:]+)::(\w+);", root):
        reexport[name] = [x for x in prefix.split("::") if x]
    edges = {f: set() for f in by_file}
    for rel, mod in by_file.items():
        text = strip_comments(open(os.path.join(src, rel)).read())
        is_mod_file = os.path.basename(rel) in ("mod.rs", "lib.rs") or rel in alternative
        self_mod = mod if is_mod_file else mod
        parent = mod[:-1]

        def add(kind, segs):
            if kind == "crate":
                base = ()
                if segs and segs[0] in reexport:
                    segs = reexport[segs[0]] + segs[1:]
            elif kind == "super":
                base = parent if not is_mod_file else mod[:-1]
                # `super::super::x`
                while segs and segs[0] == "super":
                    base, segs = base[:-1], segs[1:]
            else:
                base = self_mod
            for target in resolve(base, segs, by_path):
                if target != rel:
                    edges[rel].add(target)

        for kind, prefix, body in GROUP.findall(text):
            pre = [s for s in prefix.split("::") if s]
            for item in re.split(r",(?![^{]*\})", body):
                item = item.strip().split(" as ")[0]
                if not item:
                    continue
                inner = re.match(r"([\w:]+)::\{(.*)\}", item, re.S)
                if inner:
                    head = [s for s in inner.group(1).split("::") if s]
                    for sub in inner.group(2).split(","):
                        sub = sub.strip()
                        if sub:
                            add(kind, pre + head + [s for s in sub.split("::") if s and s != "self"])
                else:
                    add(kind, pre + [s for s in item.split("::") if s and s != "self"])
        # Paths through a child module this file declares (`mod cuda;` ... `cuda::Cuda`).
        children = set(re.findall(r"\bmod\s+(\w+)\s*;", text))
        for child, rest in re.findall(r"(?<![:\w])(\w+)((?:::[A-Za-z_][A-Za-z0-9_]*)+)", text):
            if child in children:
                add("self", [child] + [s for s in rest.split("::") if s])
        for kind, rest in PATH.findall(text):
            segs = [s for s in rest.split("::") if s and s != "{"]
            if segs:  # `use super::{a, b}` is read by GROUP above
                add(kind, segs)
    return edges


def sccs(edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
            out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("crate")
    ap.add_argument("--edges", action="store_true")
    ap.add_argument("--from", dest="from_dir")
    ap.add_argument("--max-circle", type=int, metavar="N",
                    help="exit with status 1 when a circle has more than N files (a check)")
    ap.add_argument("--seam", action="store_true",
                    help="drop the registration edges (backend/mod.rs into a backend folder): "
                         "the circles left are those a backend takes part in besides "
                         "'backend implements the core's request types'")
    args = ap.parse_args()
    src = os.path.join(args.crate, "src")
    edges = graph(src)
    if args.seam:
        edges["backend/mod.rs"] = {t for t in edges["backend/mod.rs"]
                                   if not re.match(r"backend/[^/]+/", t)}
    circles = sorted(sccs(edges), key=len, reverse=True)
    print(f"{len(edges)} files, {sum(len(e) for e in edges.values())} edges, "
          f"{len(circles)} circles: {[len(c) for c in circles]}")
    for c in circles:
        print(f"\ncircle of {len(c)}: {' '.join(c)}")
        if args.edges:
            for f in c:
                inside = sorted(edges[f] & set(c))
                print(f"  {f} -> {' '.join(inside)}")
    if args.from_dir:
        d = args.from_dir.rstrip("/") + "/"
        print(f"\nfiles outside {d} that name a module under it:")
        for f in sorted(edges):
            if not f.startswith(d):
                hits = sorted(t for t in edges[f] if t.startswith(d))
                if hits:
                    print(f"  {f} -> {' '.join(hits)}")
    if args.max_circle is not None and circles and len(circles[0]) > args.max_circle:
        print(f"\nFAIL: a circle of {len(circles[0])} files (at most {args.max_circle} allowed)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
