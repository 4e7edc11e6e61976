"""``PipelineStrategy`` (``strategy``), its set-up checks (``setup``) and its training step (``step``)."""

from lightning_dist.strategies.pipeline.strategy import PipelineStrategy

__all__ = ["PipelineStrategy"]
