"""Measurements from live tensors: model-state bytes per rank (local shards only)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for `t` (a DTensor counts its local shard only)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def _optimizer_states(optimizer: Any) -> Iterable[dict]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim  # the local optimizer over this rank's partition
    return optimizer.state.values()


def model_state_bytes(module: nn.Module, optimizers: Iterable[Any] = ()) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state resident on this rank, from the live tensors."""
    params = sum(local_bytes(p) for p in module.parameters())
    grads = sum(local_bytes(p.grad) for p in module.parameters() if p.grad is not None)
    optim = sum(
        local_bytes(v) for opt in optimizers for state in _optimizer_states(opt) for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0  # scalar `step` counters are bookkeeping, not state
    )
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
