"""Checkpoints of :class:`~lightning_dist.strategies.pipeline.PipelineStrategy`: each stage saves its own keys.

Sharded only: each pipeline rank writes its stages' parameters under their single-device names and its
optimizer states keyed by name (list-indexed ``param_groups`` would collide between stages); a weight tied
across stages is saved once (:mod:`~lightning_dist.parallelize.pipeline_tied`). The checkpoint loads into
any pipeline layout, and :func:`lightning_dist.checkpoint.consolidate` makes one single-device file of it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from typing_extensions import override

from lightning_dist import checkpoint as ckpt
from lightning_dist.parallelize.pipeline_tied import save_tied_once, tied_aliases
from lightning_dist.strategies.base import MeshStrategy


class PipelineCheckpointMixin(MeshStrategy):
    # a MeshStrategy subclass, not a plain mixin: AutoParallelStrategy becomes the strategy it picks by
    # assigning `__class__`, which Python allows only along the same chain of first bases
    """Checkpoint hooks of the pipeline strategy (placed before ``MeshStrategy`` in its bases)."""

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.model is not None
        self.wait_for_checkpoint()  # it may be the one being written
        fitting = self.lightning_module.trainer.state.fn == "fit"
        return ckpt.load_stage(
            self.broadcast(checkpoint_path),
            model=self.model,
            optimizers=self.optimizers if fitting else (),
            weights_only=True if weights_only is None else weights_only,
            aliases=tied_aliases(self._tied_keys),
        )

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return save_tied_once(super().lightning_module_state_dict(), self._tied_keys)  # a tied weight once

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # keyed by parameter name: stages hold different parameters, so list-indexed param_groups would collide
        return save_tied_once(ckpt.name_keyed_optimizer_state(self.model, optimizer), self._tied_keys, optimizer=True)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        aliases = tied_aliases(self._tied_keys)
        if aliases:  # consolidation gives every name of the plain model's state_dict the saved tensor
            checkpoint = {**checkpoint, ckpt.TIED_KEY: aliases}
        super().save_checkpoint(checkpoint, filepath, storage_options)


__all__ = ["PipelineCheckpointMixin"]
