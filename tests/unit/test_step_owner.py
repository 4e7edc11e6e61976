"""Issue 40's seams around the pipeline step, in one process: ``parallelize/`` knows nothing of Lightning (lazy imports
included), and serving a module's ``pipeline_loss`` leaves nothing of the pack holding the module."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn.functional as F
from _imports import imported_names, module_files

from lightning_dist.strategies.base import serve_pipeline_loss, unserve_pipeline_loss

LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def test_parallelize_imports_nothing_of_lightning():
    found = [
        f"{module} line {line}: {base}"
        for module, path in module_files().items()
        if module == "lightning_dist.parallelize" or module.startswith("lightning_dist.parallelize.")
        for base, _, line, _ in imported_names(module, path)
        if base.split(".")[0] in LIGHTNING
    ]
    assert not found, "parallelize/ imports Lightning:\n" + "\n".join(found)


class Task(torch.nn.Module):
    def pipeline_loss(self, output, target):
        return F.mse_loss(output, target)


def test_a_served_loss_is_undone_and_keeps_nothing_alive():
    task = Task()
    original = serve_pipeline_loss(task, lambda own, out, tgt: torch.tensor(7.0))
    assert task.pipeline_loss(None, None).item() == 7.0 and original(torch.ones(2), torch.zeros(2)).item() == 1.0
    unserve_pipeline_loss(task, object())  # another server's: left alone
    assert task.pipeline_loss(None, None).item() == 7.0
    unserve_pipeline_loss(task, original)
    assert "pipeline_loss" not in task.__dict__
    # served and never undone (a failed fit): the pack's registry holds the module weakly
    served = Task()
    serve_pipeline_loss(served, lambda own, out, tgt: None)
    ref = weakref.ref(served)
    del served
    gc.collect()
    assert ref() is None
