"""What the planner needs to know of a model, counted from a module (on the meta device)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_dist.planner._checks import _check_count, _check_size
from lightning_dist.planner.memory import split_stages

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True, kw_only=True)
class ParamCounts:
    """What the planner needs to know of a model (:func:`count_params` fills it from a module)."""

    total: int
    """Trainable and frozen parameters, shared ones counted once."""
    tp_sharded: int | None = None
    """Parameters tensor parallelism would shard (Linear / Embedding weights and biases); None: all."""
    shapes: tuple[tuple[int, ...], ...] = ()
    """Every parameter's shape (for the exact FSDP2 counts)."""
    layer_params: tuple[int, ...] = ()
    """Parameters of each block of the model's block list, in order (for pipeline splits)."""
    pre_params: int = 0
    """Parameters registered before the block list (first pipeline stage)."""
    post_params: int = 0
    """Parameters registered after the block list (last pipeline stage)."""

    def __post_init__(self) -> None:
        _check_count("total", self.total)
        if self.tp_sharded is not None and not 0 <= self.tp_sharded <= self.total:
            raise ValueError(f"tp_sharded={self.tp_sharded} must lie in [0, total={self.total}].")

    @property
    def tp_sharded_params(self) -> float:
        return self.total if self.tp_sharded is None else self.tp_sharded

    def stage_params(self, stages: int) -> list[int]:
        """Per-stage parameters: a split of the block list when known, else an even split of the total."""
        if self.layer_params:
            return split_stages(self.layer_params, stages, pre_params=self.pre_params, post_params=self.post_params)
        _check_size("stages", stages)
        base, extra = divmod(int(self.total), stages)
        return [base + (1 if s < extra else 0) for s in range(stages)]


def _block_list(model: "nn.Module") -> tuple[str, Any] | None:
    """The block list holding the most parameters (name, module), or None.

    Candidates are what FSDP units, activation checkpointing and pipeline splits use
    (:func:`~lightning_dist.parallelize.units.find_block_lists`), so the planner counts the same blocks.
    """
    from lightning_dist.parallelize.units import find_block_lists

    found = [(name, mod) for name, mod in find_block_lists(model) if len(mod) >= 2]
    if not found:
        return None
    return max(found, key=lambda item: sum(p.numel() for p in item[1].parameters()))


def _pipeline_parts(model: "nn.Module") -> tuple[tuple[int, ...], int, int] | None:
    """(parameters of each block, of the stem, of the head) as the pipeline runtime splits `model`, or None
    when it cannot split it. A weight tied between the stem and the head counts on both: each of the two
    stages holds a copy (:mod:`lightning_dist.parallelize.pipeline_tied`)."""
    from lightning_dist.parallelize.pipeline import network_layout, part_params

    try:
        layout = network_layout(model)
    except TypeError:  # not splittable into pipeline stages: the planner counts around its block list instead
        return None
    blocks, stem, head = part_params(model, layout)
    return tuple(blocks), stem, head


def count_params(model: "nn.Module") -> ParamCounts:
    """Count a module's parameters (works on the meta device; shared parameters counted once)."""
    from torch import nn

    params = dict(model.named_parameters())  # named_parameters() already drops duplicates (tied weights)
    tp_ids = {id(p) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding)) for p in m.parameters()}
    layer_params: tuple[int, ...] = ()
    pre = post = 0
    stages = _pipeline_parts(model)
    if stages is not None:  # the runtime's own stem / blocks / head, as PipelineStrategy splits the model
        layer_params, pre, post = stages
    elif (found := _block_list(model)) is not None:
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
