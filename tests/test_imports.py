"""The product's import structure, read from the source (function-local imports included): no
cycle, ``comm/`` knows nothing outside itself but the statistics leaf, and nothing the product runs
imports the tooling."""

from __future__ import annotations

import ast
from pathlib import Path

import cocodiff_xfuser

ROOT = Path(cocodiff_xfuser.__file__).parent
TOOLING = "cocodiff_xfuser.tools"


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its source. Importing ``a.b`` runs ``a``'s
    ``__init__`` first, so a package counts as imported with each of its modules."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            found |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & known
    return found - {name}


def product_graph() -> dict[str, set[str]]:
    found = modules()
    product = {name: path for name, path in found.items() if not name.startswith(TOOLING)}
    return {name: imports(name, path, set(found)) for name, path in product.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_the_product_has_no_import_cycle():
    assert cycles(product_graph()) == []


def test_the_cycle_finder_finds_a_lazy_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_comm_imports_nothing_outside_comm_but_leaves():
    """comm/ depends on statistics (a leaf: they depend on the platform only) and on leaf modules
    only: nothing of V-Major, the processors, padding or the xfuser wiring."""
    graph = product_graph()
    leaves = {name for name, deps in graph.items() if deps <= {"cocodiff_xfuser"}}
    outside = {dep for name, deps in graph.items() if name.startswith("cocodiff_xfuser.comm") for dep in deps
               if not dep.startswith("cocodiff_xfuser.comm")}
    assert outside - leaves <= {"cocodiff_xfuser.commstats"}, outside - leaves
    assert graph["cocodiff_xfuser.commstats"] <= leaves


def test_the_product_never_imports_the_tooling():
    graph = product_graph()
    assert {name: deps for name, deps in graph.items() if any(dep.startswith(TOOLING) for dep in deps)} == {}
