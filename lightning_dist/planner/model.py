"""What the planner needs to know of a model: its parameter counts (:class:`ParamCounts`).

:func:`lightning_dist.parallelize.counts.count_params` fills them from a module (on the meta device), as the
runtime splits it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dist.planner._checks import check_count, check_size
from lightning_dist.planner.memory import split_stages


@dataclass(frozen=True, kw_only=True)
class ParamCounts:
    """What the planner needs to know of a model (:func:`~lightning_dist.parallelize.counts.count_params` fills it)."""

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
        check_count("total", self.total)
        if self.tp_sharded is not None and not 0 <= self.tp_sharded <= self.total:
            raise ValueError(f"tp_sharded={self.tp_sharded} must lie in [0, total={self.total}].")

    @property
    def tp_sharded_params(self) -> float:
        return self.total if self.tp_sharded is None else self.tp_sharded

    def stage_params(self, stages: int) -> list[int]:
        """Per-stage parameters: a split of the block list when known, else an even split of the total."""
        if self.layer_params:
            return split_stages(self.layer_params, stages, pre_params=self.pre_params, post_params=self.post_params)
        check_size("stages", stages)
        base, extra = divmod(int(self.total), stages)
        return [base + (1 if s < extra else 0) for s in range(stages)]
