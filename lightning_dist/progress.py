"""Lightning's Rich progress bar, configured to say what runs: the epoch without a bogus bound, the step of a
``max_steps`` run, and no ``v_num``.

Notes: docs/internals.md, "lightning_dist/progress.py"."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

__all__ = ["RunProgressBar", "epoch_description", "step_metric"]


def epoch_description(current_epoch: int, max_epochs: int | None) -> str:
    """``Epoch 3/9`` when epochs bound the run (Lightning's 0-based last index), else ``Epoch 3``."""
    if max_epochs is None or max_epochs < 0:  # -1: unbounded, the run ends on max_steps or max_time
        return f"Epoch {current_epoch}"
    return f"Epoch {current_epoch}/{max_epochs - 1}"


def step_metric(global_step: int, max_steps: int) -> dict[str, str]:
    """``{"step": "40/200"}`` when ``max_steps`` bounds the run, else nothing (the epoch bar says it all)."""
    return {"step": f"{global_step}/{max_steps}"} if max_steps is not None and max_steps > 0 else {}


class RunProgressBar(RichProgressBar):
    """Lightning's :class:`~lightning.pytorch.callbacks.RichProgressBar` (same arguments), showing the epoch
    without a bogus bound, ``step: N/max_steps`` when ``max_steps`` bounds the run, and no ``v_num``."""

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        # Lightning's documented way to drop the logger version from the bar
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return {**step_metric(trainer.global_step, trainer.max_steps), **items}

    def _get_train_description(self, current_epoch: int) -> str:
        """Reason: Lightning 2.6 builds the training bar's label here (private) as ``f"/{max_epochs - 1}"``
        whenever ``max_epochs`` is not None, which a ``max_steps`` run sets to -1; there is no public hook."""
        description = epoch_description(current_epoch, self.trainer.max_epochs)
        # Lightning pads the label to the validation bar's width so the two do not flicker
        return f"{description:{len(self.validation_description)}}"
