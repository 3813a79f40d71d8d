"""Print hftrain's import circles and its imports from a lower layer to a higher one (exit 1 when there are any).

Every ``import hftrain.…`` is counted, at module level or inside a function (a lazy import still ties the layers).
Packages are ranked bottom to top as ``docs/architecture.md`` draws them; a module may import its own package and
any package below it. Circles are reported between modules (module-level imports only: what Python executes on
import) and between packages (every import).

    .venv/bin/python scripts/check_layers.py
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hftrain"
LAYERS = (  # bottom to top; a package may import those of its own rank and below
    ("hftrain",), ("hftrain.errors",), ("hftrain.files",), ("hftrain.log",), ("hftrain.parallel",), ("hftrain.tasks",),
    ("hftrain.data", "hftrain.metrics"),
    ("hftrain.config",), ("hftrain.models",), ("hftrain.checkpoint",), ("hftrain.strategies",), ("hftrain.env",),
    ("hftrain.pictures",), ("hftrain.trainers",), ("hftrain.validate",), ("hftrain.plan", "hftrain.launch"),
    ("hftrain.job",), ("hftrain.doctor",), ("hftrain.api", "hftrain.cli"), ("hftrain.__main__",),
)  # fmt: skip
RANK = {package: rank for rank, group in enumerate(LAYERS) for package in group}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(imported hftrain module, at module level)`` for every import in the file."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hftrain"):
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.startswith("hftrain")]
        else:
            continue
        found += [(name, id(node) in top) for name in names]
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def main() -> int:
    modules: dict[str, set[str]] = defaultdict(set)
    packages: dict[str, set[str]] = defaultdict(set)
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        source = _module(path)
        for target, module_level in _imports(path):
            if module_level:
                modules[source].add(target)
            low, high = _package(source), _package(target)
            if low != high:
                packages[low].add(high)
                if RANK[high] > RANK[low]:
                    upward.append(f"{source} imports {target} ({high} is above {low})")
    circles = [" -> ".join(c) for c in _cycles(modules)] + [" <-> ".join(c) for c in _cycles(packages)]
    print(f"import circles: {len(circles)}")
    print(*(f"  {c}" for c in circles), sep="\n") if circles else None
    print(f"imports from a lower layer to a higher one: {len(upward)}")
    print(*(f"  {u}" for u in upward), sep="\n") if upward else None
    return 1 if circles or upward else 0


if __name__ == "__main__":
    sys.exit(main())
