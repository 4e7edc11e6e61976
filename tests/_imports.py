"""The package's import graph, read from the source with ``ast`` (no module is imported).

Every ``import`` and ``from ... import`` counts, at module level or inside a function (a lazy import still runs,
just later), except those under ``if TYPE_CHECKING:`` (never run). Relative imports are resolved against the
importing module's package; ``lightning_dist.callbacks`` is the top-level ``callbacks/`` folder (pyproject's
package-dir); a package's ``__init__.py`` is the module named after the package. ``from pkg import name`` is an
edge to ``pkg.name`` when that is a module of the package, else to ``pkg``. Importing ``a.b.c`` runs ``a/__init__``
and ``a/b/__init__`` first: edges to them too, except to the packages that hold the importing module itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder -> the package name it is installed as
PACKAGES = {"lightning_dist": "lightning_dist", "callbacks": "lightning_dist.callbacks"}


def module_files() -> dict[str, Path]:
    """Module name -> source file, for every module of the package (``callbacks/`` as ``lightning_dist.callbacks``)."""
    out: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """(import node, lazy?) for every import of `tree` outside ``if TYPE_CHECKING:`` blocks."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, lazy)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, lazy))
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def imported_names(module: str, path: Path) -> list[tuple[str, list[str], int, bool]]:
    """(absolute module imported from, names taken from it, line, lazy?) for every import of one module."""
    is_package = path.name == "__init__.py"
    out = []
    for node, lazy in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.extend((alias.name, [], node.lineno, lazy) for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        out.append((base, [alias.name for alias in node.names], node.lineno, lazy))
    return out


def _canonical(name: str) -> str:
    # `callbacks.x` (the folder's name, as the repository's scripts import it) is `lightning_dist.callbacks.x`
    return "lightning_dist." + name if name == "callbacks" or name.startswith("callbacks.") else name


def import_graph() -> dict[str, dict[str, list[int]]]:
    """Module -> {imported module of the package -> lines}, lazy imports included."""
    files = module_files()
    graph: dict[str, dict[str, list[int]]] = {m: {} for m in files}
    for module, path in files.items():
        for base, names, line, _ in imported_names(module, path):
            base = _canonical(base)
            targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in files]
            if len(targets) < len(names) or not names:  # names that are not submodules come from `base` itself
                owner = base
                while owner and owner not in files:  # `import a.b.c` of a non-module: its nearest module
                    owner = owner.rpartition(".")[0]
                if owner:
                    targets.append(owner)
            for target in targets:
                for imported in (target, *_outer_packages(target, files)):
                    if imported != module and not _contains(imported, module):
                        graph[module].setdefault(imported, []).append(line)
    return graph


def _outer_packages(module: str, files: dict[str, Path]) -> list[str]:
    """The packages of the package whose ``__init__`` importing `module` runs first: ``a.b`` and ``a`` of ``a.b.c``."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)) if p in files]


def _contains(package: str, module: str) -> bool:
    # a package that holds the importing module is initialized (or being initialized) before the module runs: the
    # import does not start it, so it is no edge
    return module.startswith(package + ".")


def cycles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:  # recursion depth is bounded by the module count (~150)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(out)


def one_cycle(graph: dict[str, dict[str, list[int]]], component: list[str]) -> list[str]:
    """One closed path through `component` (its first module back to itself), for the failure message."""
    members = set(component)
    start = component[0]
    # breadth-first from start's successors back to start, inside the component
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members or w in parents:
                    continue
                parents[w] = v
                if w == start:
                    path = [start]
                    while path[-1] != start or len(path) == 1:
                        path.append(parents[path[-1]])
                    return path[::-1]
                nxt.append(w)
        frontier = nxt
    return component


def describe(graph: dict[str, dict[str, list[int]]], path: list[str]) -> str:
    """``a (line 3) -> b (line 10) -> a`` with the line of each import."""
    steps = [f"{a} (line {graph[a][b][0]})" for a, b in zip(path, path[1:])]
    return " -> ".join([*steps, path[-1]])
