"""The package's imports, read from the source (tests/_imports.py): no import cycle, a planner that imports no
runtime module, and a ``lightning-dist plan`` that runs without torch's pipelining."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from _imports import ROOT, cycles, describe, import_graph, imported_names, module_files, one_cycle

# Cycles accepted for now (each the set of modules of one cycle). A new entry needs a reason beside it.
KNOWN_CYCLES: list[frozenset[str]] = []

PLANNER = "lightning_dist.planner"
# what the planner must not reach, directly or through another module of the package
RUNTIME = ("lightning_dist.parallelize", "lightning_dist.strategies", "lightning_dist.dryrun")


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") or module.startswith(p + "_") for p in packages)


def test_the_graph_reads_lazy_and_relative_imports():
    graph = import_graph()
    assert len(graph) == len(module_files()) > 50
    # a lazy import inside a function counts (the strategy base imports the guards inside a hook)
    assert "lightning_dist.callbacks.guards" in graph["lightning_dist.strategies.base"]
    # a package's __init__ is the package's module; `from lightning_dist.callbacks import x` is callbacks/x.py
    assert "lightning_dist.callbacks._planned" in graph["lightning_dist.callbacks.memory"]
    assert "lightning_dist.strategies.auto_parallel" in graph["lightning_dist.strategies"]
    # importing `a.b.c` runs `a/__init__` and `a/b/__init__` first: edges to them (the dry run imports pipeline.split)
    assert {"lightning_dist.parallelize", "lightning_dist.parallelize.pipeline"} <= set(graph["lightning_dist.dryrun"])
    # except to the packages holding the importer, which are initialized before it runs
    assert "lightning_dist.strategies" not in graph["lightning_dist.strategies.hsdp"]
    assert "lightning_dist" not in graph["lightning_dist.mesh"]


def test_a_cycle_through_a_package_init_is_found(tmp_path, monkeypatch):
    # tool -> pkg.base (runs pkg/__init__) -> pkg.chooser -> tool: the shape of the dry run's former cycle
    import _imports

    files = {
        "tool": "from root.pkg.base import Base\n",
        "pkg/__init__": "from root.pkg.chooser import Chooser\n",
        "pkg/base": "class Base: ...\n",
        "pkg/chooser": "def choose():\n    from root.tool import run\n",
    }
    for name, text in files.items():
        path = tmp_path / "root" / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setattr(_imports, "ROOT", tmp_path)
    monkeypatch.setattr(_imports, "PACKAGES", {"root": "root"})
    assert cycles(import_graph()) == [["root.pkg", "root.pkg.chooser", "root.tool"]]


def test_no_import_cycles_among_the_package_modules():
    graph = import_graph()
    unexpected = [c for c in cycles(graph) if not any(set(c) <= known for known in KNOWN_CYCLES)]
    assert not unexpected, "import cycles (lazy imports included):\n" + "\n".join(
        describe(graph, one_cycle(graph, c)) for c in unexpected
    )


def test_planner_imports_no_runtime_module():
    files = module_files()
    direct = [
        f"{module} line {line}: {base}"
        for module, path in files.items()
        if _within(module, (PLANNER,))
        for base, _, line, _ in imported_names(module, path)
        if _within(base, RUNTIME)
    ]
    assert not direct, "the planner imports runtime modules:\n" + "\n".join(direct)
    # nor through another module of the package (breadth-first over the graph, lazy imports included)
    graph = import_graph()
    parent: dict[str, str | None] = {m: None for m in graph if _within(m, (PLANNER,))}
    frontier = list(parent)
    while frontier:
        reached_now = []
        for v in frontier:
            for w in graph[v]:
                if w not in parent:
                    parent[w] = v
                    reached_now.append(w)
        frontier = reached_now
    reached = sorted(m for m in parent if _within(m, RUNTIME))
    paths = []
    for m in reached:
        path = [m]
        while parent[path[-1]] is not None:
            path.append(parent[path[-1]])
        paths.append(" <- ".join(path))
    assert not reached, "the planner reaches runtime modules:\n" + "\n".join(paths)


def test_planner_modules_share_only_public_names():
    files = module_files()
    private = [
        f"{module} line {line}: from {base} import {name}"
        for module, path in files.items()
        if _within(module, (PLANNER, "lightning_dist.rules"))
        for base, names, line, _ in imported_names(module, path)
        if base.startswith("lightning_dist")
        for name in names
        if name.startswith("_") and f"{base}.{name}" not in files
    ]
    assert not private, "private names imported across modules:\n" + "\n".join(private)


BLOCK_PIPELINING = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoPipelining(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch.distributed.pipelining" or name.startswith("torch.distributed.pipelining."):
                raise ImportError(f"{name} is blocked by the test")
            return None

    sys.meta_path.insert(0, NoPipelining())
    from lightning_dist.cli import main

    code = main(sys.argv[1:])
    assert not any(m.startswith("torch.distributed.pipelining") for m in sys.modules), "pipelining was imported"
    sys.exit(code)
    """
)


@pytest.mark.parametrize(
    "args",
    [
        ["--params", "7B", "--world-size", "16", "--devices-per-node", "8", "--device-memory", "80GB"],
        ["--model", "lightning_dist.models.gpt.CharGPT", "--init-args", '{"n_layer": 4}', "--world-size", "4"],
    ],
    ids=["params", "model"],
)
def test_plan_runs_without_torch_pipelining(args):
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_PIPELINING, "plan", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "recommend" in out.stdout.lower(), out.stdout[-2000:]
