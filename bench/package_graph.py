"""Print the package graph of the tree and every import circle between modules.

    python -m bench.package_graph [--depth 2]

One line a package: what it imports of ours (at `--depth` dotted parts), then the module
pairs that import each other, directly or through others, as import-linter's grimp sees
them (imports under TYPE_CHECKING included). Exit status 1 when a circle exists.
"""

from __future__ import annotations

import argparse
import sys

import grimp

ROOTS = ("contract", "runtime", "pipeline", "serve", "demo", "bench")


def package(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth])


def package_edges(graph: grimp.ImportGraph, depth: int) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for a in graph.modules:
        edges.setdefault(package(a, depth), set())
        for b in graph.find_modules_directly_imported_by(a):
            if b.split(".")[0] in ROOTS and package(a, depth) != package(b, depth):
                edges[package(a, depth)].add(package(b, depth))
    return edges


def module_circles(graph: grimp.ImportGraph) -> list[tuple[str, str]]:
    """Pairs (a, b) where a imports b directly and b reaches a back."""
    found = set()
    for a in graph.modules:
        for b in graph.find_modules_directly_imported_by(a):
            if b.split(".")[0] in ROOTS and graph.chain_exists(importer=b, imported=a):
                found.add((min(a, b), max(a, b)))
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=2, help="dotted parts that name a package")
    args = ap.parse_args(argv)
    graph = grimp.build_graph(*ROOTS)
    for pkg, deps in sorted(package_edges(graph, args.depth).items()):
        print(f"{pkg:<24} -> {', '.join(sorted(deps)) or '-'}")
    circles = module_circles(graph)
    print(f"\nimport circles between modules: {len(circles)}")
    for a, b in circles:
        print(f"  {a} <-> {b}")
    return 1 if circles else 0


if __name__ == "__main__":
    sys.exit(main())
