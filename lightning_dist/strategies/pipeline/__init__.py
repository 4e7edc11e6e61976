"""``PipelineStrategy`` with its training step (``step``) and its checkpoints."""

from lightning_dist.strategies.pipeline.strategy import PipelineStrategy

__all__ = ["PipelineStrategy"]
