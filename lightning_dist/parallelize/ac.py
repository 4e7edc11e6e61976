"""Activation checkpointing per block (recompute the block's activations in backward)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from lightning_dist.parallelize.units import select_units

log = logging.getLogger(__name__)


def apply_ac(model: nn.Module, *, units: str | Sequence[str] = "auto") -> int:
    """Checkpoint each unit (each block by default); returns how many were wrapped.

    Uses torch's composable ``checkpoint`` (non-reentrant), which keeps the module's class and its
    state-dict keys, so checkpoints stay loadable without AC. Call before ``apply_fsdp``.
    """
    from torch.distributed._composable import checkpoint

    picked = select_units(model, units)
    for _, module in picked:
        checkpoint(module)
    log.info("applied activation checkpointing to %d blocks", len(picked))
    return len(picked)
