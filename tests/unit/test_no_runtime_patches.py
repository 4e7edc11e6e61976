"""Nothing of torch, another library or the pack is reassigned at run time outside ``lightning_dist/_integrations/``.

Read from the source with ``ast``: an assignment to an attribute of a name bound by an import (a module, a class or
a function of torch, another library or the pack: ``schedules._PipelineSchedule._warmup_p2p = f``,
``nn.Module.register_parameter = f``), its ``del``, and ``setattr`` / ``delattr`` / ``object.__setattr__`` on such a
name. Attributes of instances (``self.x = ...``, a local module's ``forward``) are the objects' own state and are
not flagged.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from _imports import module_files

INTEGRATIONS = "lightning_dist._integrations"
# settings a library documents as assigned by its users (target text -> why it is not a patch)
DOCUMENTED = {
    "rank_zero_only.rank": "lightning_utilities' rank_zero_only reads the process's rank there; strategies set it",
}


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node


def _imported_names(tree: ast.AST) -> set[str]:
    """Names bound by the module's imports (anywhere: lazy ones too)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names if alias.name != "*")
    return names


def _targets(node: ast.expr) -> list[ast.expr]:
    if isinstance(node, (ast.Tuple, ast.List)):
        return [t for elt in node.elts for t in _targets(elt)]
    return [node.value] if isinstance(node, ast.Starred) else [node]


def reassignments(source: str) -> list[tuple[int, str]]:
    """(line, source text) of each run-time reassignment of an imported object's attribute, in line order."""
    tree = ast.parse(source)
    names = _imported_names(tree)

    def named(node: ast.expr) -> bool:
        root = _root(node)
        return isinstance(root, ast.Name) and root.id in names

    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in _targets(target)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = [t for target in node.targets for t in _targets(target)]
        hit = any(isinstance(t, ast.Attribute) and named(t.value) and ast.unparse(t) not in DOCUMENTED for t in targets)
        if isinstance(node, ast.Call) and node.args:
            func = ast.unparse(node.func)
            if func in ("setattr", "delattr", "object.__setattr__", "object.__delattr__"):
                hit = named(node.args[0])
        if hit:
            found.append((node.lineno, ast.get_source_segment(source, node) or ast.unparse(node)))
    return sorted(found)


def test_no_module_reassigns_what_it_imports_outside_the_integrations():
    found = [
        f"{module}:{line}: {text.splitlines()[0]}"
        for module, path in module_files().items()
        if not (module == INTEGRATIONS or module.startswith(INTEGRATIONS + "."))
        for line, text in reassignments(Path(path).read_text())
    ]
    assert not found, (
        "run-time reassignment of an imported object's attribute outside _integrations/ (give the"
        " runtime a seam: an argument, a small interface; or a named, gated patch in _integrations/):\n"
        + "\n".join(found)
    )


def test_the_scan_finds_patches_and_leaves_instance_state_alone():
    source = textwrap.dedent(
        """
        import torch.distributed.pipelining.schedules as schedules
        from torch import nn
        from lightning_dist.parallelize.pipeline.schedule import PipelineRunner
        from lightning_dist.strategies.pipeline import step as step_module
        from lightning_utilities.core.rank_zero import rank_zero_only

        def run(module, strategy):
            from torch.distributed.pipelining import stage

            schedules._PipelineSchedule._warmup_p2p = f
            stage.PipelineStage._recv_meta, stage.PipelineStage._send_meta = f, g
            PipelineRunner.output_meta = f
            step_module.returned_loss_problem = f
            nn.Module.register_parameter = f
            setattr(nn.Module, "forward", f)
            object.__setattr__(PipelineRunner, "step", f)
            del stage.PipelineStage._recv_meta
            # instance state and local objects: not flagged
            self.peer = f
            module.forward = f
            strategy._runner.peer = f
            setattr(module, "x", 1)
            object.__setattr__(self, "x", 1)
            x = nn.Linear(2, 2)
            x.weight = None
            rank_zero_only.rank = 1
        """
    )
    lines = [line for line, _ in reassignments(source)]
    assert lines == list(range(11, 19)), reassignments(source)
