"""A module's parameter counts for the planner (:class:`~lightning_dist.planner.model.ParamCounts`), counted as
the runtime splits the module: its pipeline stem / blocks / head, or the block list FSDP units use.

Works on the meta device (``lightning-dist plan`` counts a model it never materializes).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_dist.parallelize.pipeline.split import network_layout, part_params
from lightning_dist.parallelize.units import find_block_lists
from lightning_dist.planner.model import ParamCounts


def largest_block_list(model: nn.Module) -> tuple[str, Any] | None:
    """The block list holding the most parameters (name, module), or None.

    Candidates are what FSDP units, activation checkpointing and pipeline splits use
    (:func:`~lightning_dist.parallelize.units.find_block_lists`), so the planner counts the same blocks.
    """
    found = [(name, mod) for name, mod in find_block_lists(model) if len(mod) >= 2]
    if not found:
        return None
    return max(found, key=lambda item: sum(p.numel() for p in item[1].parameters()))


def pipeline_parts(model: nn.Module) -> tuple[tuple[int, ...], int, int] | None:
    """(parameters of each block, of the stem, of the head) as the pipeline runtime splits `model`, or None
    when it cannot split it. A weight tied between the stem and the head counts on both: each of the two
    stages holds a copy (:mod:`lightning_dist.parallelize.pipeline.tied`)."""
    try:
        layout = network_layout(model)
    except TypeError:  # not splittable into pipeline stages: the planner counts around its block list instead
        return None
    blocks, stem, head = part_params(model, layout)
    return tuple(blocks), stem, head


def count_params(model: nn.Module) -> ParamCounts:
    """Count a module's parameters (works on the meta device; shared parameters counted once)."""
    params = dict(model.named_parameters())  # named_parameters() already drops duplicates (tied weights)
    tp_ids = {id(p) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding)) for p in m.parameters()}
    layer_params: tuple[int, ...] = ()
    pre = post = 0
    stages = pipeline_parts(model)
    if stages is not None:  # the runtime's own stem / blocks / head, as PipelineStrategy splits the model
        layer_params, pre, post = stages
    elif (found := largest_block_list(model)) is not None:
        _, blocks = found
        layer_params = tuple(sum(p.numel() for p in b.parameters()) for b in blocks)
        block_ids = {id(p) for p in blocks.parameters()}
        seen_block = False
        for p in params.values():
            if id(p) in block_ids:
                seen_block = True
            elif seen_block:
                post += p.numel()
            else:
                pre += p.numel()
    return ParamCounts(
        total=sum(p.numel() for p in params.values()),
        tp_sharded=sum(p.numel() for p in params.values() if id(p) in tp_ids),
        shapes=tuple(tuple(p.shape) for p in params.values()),
        layer_params=layer_params,
        pre_params=pre,
        post_params=post,
    )


__all__ = ["count_params", "largest_block_list", "pipeline_parts"]
