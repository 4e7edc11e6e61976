"""A plain single-device copy of a distributed model (FSDP2 / TP / pipeline stages), for reference computations."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_dist.parallelize.clone import full_tensor_of
from lightning_dist.parallelize.clone import unsharded_clone as _plain_clone
from lightning_dist.parallelize.pipeline.pruned import model_class_copy
from lightning_dist.parallelize.pipeline.split import PipelineView, join_stages
from lightning_dist.parallelize.pipeline.stages import is_pipelined_module

__all__ = ["full_tensor_of", "unsharded_clone", "whole_pipeline_network"]


def unsharded_clone(module: nn.Module, full_by_id: dict[int, Tensor], memo: dict[int, nn.Parameter]) -> nn.Module:
    """:func:`lightning_dist.parallelize.clone.unsharded_clone` for a LightningModule: the copy never runs the
    strategy's pipeline schedule (its own layers instead) and never drives the real trainer (``self.log`` a no-op)."""
    new = _plain_clone(module, full_by_id, memo)
    for m in new.modules():
        if is_pipelined_module(m):
            m.runner = None
        if isinstance(m, LightningModule):
            m._trainer = None
    return new


def whole_pipeline_network(view: PipelineView, mesh: Any, local: nn.Module) -> nn.Module:
    """The whole single-device network, joined from every pipeline rank's copy of its stages.

    Each pp rank sends its plain stage copy (CPU) to the others (``all_gather_object``: simple, and the
    model must fit on one device for the reference anyway); :func:`join_stages` puts the parts back in the
    split's order under their single-device names. Runs on every rank (a collective over ``pp``).

    A HuggingFace causal LM called with ``labels`` computes its loss as the pipeline does (in the logits'
    dtype, :func:`~lightning_dist.parallelize.pipeline.hf.pipeline_loss_function`, set by its layout's join),
    not with HF's own ``loss_function``, which casts float64 logits to float32: the reference gradient is then the exact
    single-device gradient of the loss the pipeline trains, and a float64 check is not a false alarm.
    """
    assert view.split is not None
    local = model_class_copy(local.to("cpu"))  # a pruned stage's class is made at run time: not picklable
    pieces = [local]
    if mesh.size("pp") > 1:
        pieces = [None] * mesh.size("pp")
        dist.all_gather_object(pieces, local, group=mesh.group("pp"))
    return join_stages(view.split, pieces)
