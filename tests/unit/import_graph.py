"""The import graph of the repository's Python packages, read from their sources (nothing is imported).

An edge `a -> b` means module `a` imports module `b`, at module level or inside a function: a lazy import
is still a dependency. Imports under `if TYPE_CHECKING:` are left out (they never run). `from pkg import
name` is an edge to the submodule `pkg.name` when there is one, else to `pkg`.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the named packages."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _runtime_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
        for child in node.orelse:
            yield from _runtime_imports(child)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        for child in ast.iter_child_nodes(node):
            yield from _runtime_imports(child)


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        if not is_package:
            parts.pop()
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports."""
    modules = module_files(root, packages)
    graph = {}
    for module, path in modules.items():
        edges = set()
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            names = _targets(module, path.name == "__init__.py", node)
            if isinstance(node, ast.ImportFrom):  # `from pkg import sub` names the submodule, else pkg
                submodules = [name for name in names[:-1] if name in modules]
                names = submodules if len(submodules) == len(names) - 1 else submodules + names[-1:]
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    edges.add(name)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
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


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[tuple[str, str]]:
    """(importer, imported) where the importer's top-level package sits in a lower layer than the imported one's."""
    return sorted((module, target) for module, targets in graph.items() for target in targets
                  if layers[module.split(".")[0]] < layers[target.split(".")[0]])
