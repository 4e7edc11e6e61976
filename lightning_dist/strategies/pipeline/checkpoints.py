"""Checkpoints of :class:`~lightning_dist.strategies.pipeline.strategy.PipelineStrategy`: each stage saves its own keys.

Notes: docs/internals.md, "lightning_dist/strategies/pipeline/checkpoints.py"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_dist import checkpoint as ckpt
from lightning_dist.parallelize.pipeline.tied import save_tied_once, tied_aliases

TiedKeys = Sequence[tuple[str, tuple[str, ...], bool]]


def load_stages(
    path: Any, *, model: nn.Module, optimizers: Sequence[Any], weights_only: bool, tied_keys: TiedKeys
) -> dict[str, Any]:
    """Load this rank's stages (and `optimizers`) from a checkpoint of any pipeline layout; every copy of a tied
    weight reads the one saved tensor."""
    return ckpt.load_stage(
        path, model=model, optimizers=optimizers, weights_only=weights_only, aliases=tied_aliases(tied_keys)
    )


def module_state(state: dict[str, Any], tied_keys: TiedKeys) -> dict[str, Any]:
    """This rank's stage parameters to save: a tied weight once, by the rank that saves it."""
    return save_tied_once(state, tied_keys)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, tied_keys: TiedKeys) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (stages hold different parameters, so list-indexed
    ``param_groups`` would collide), a tied weight's once."""
    return save_tied_once(ckpt.name_keyed_optimizer_state(model, optimizer), tied_keys, optimizer=True)


def with_tied_aliases(checkpoint: dict[str, Any], tied_keys: TiedKeys) -> dict[str, Any]:
    """The checkpoint with the names of every tied weight's copies, so that consolidation gives every name of
    the plain model's state_dict the saved tensor."""
    aliases = tied_aliases(tied_keys)
    return {**checkpoint, ckpt.TIED_KEY: aliases} if aliases else checkpoint


__all__ = ["TiedKeys", "load_stages", "module_state", "optimizer_state", "with_tied_aliases"]
