"""Gradients of a parallelized model: grouped by layout, their global norm, clipping by norm and by value.

Notes: docs/internals.md, "lightning_dist/grads.py"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor


def grads_by_layout(grads: Sequence[Tensor]) -> list[list[Tensor]]:
    """Gradients grouped by layout (plain tensors; DTensors per (mesh, placements)): torch's foreach kernels and
    ``get_total_norm`` take one layout per call."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    return list(groups.values())


def global_grad_norm(grads: Sequence[Tensor], group: Optional[Any] = None, *, device: torch.device) -> Tensor:
    """The 2-norm of all of the model's gradients (float64 on ``device``), as one device would compute it.

    Each layout group's norm is made whole with ``full_tensor()`` (one collective per group, not per
    parameter); ``group``: the process group whose ranks hold distinct parameters (the pipeline stages),
    over which the squares are summed; None where every rank holds (a shard of) every parameter.
    """
    from torch.distributed.tensor import DTensor

    total = torch.zeros((), dtype=torch.float64, device=device)
    for part in grads_by_layout(grads):
        norm = torch.nn.utils.get_total_norm(part, norm_type=2.0)
        if isinstance(norm, DTensor):
            local = norm.to_local()
            if local.device != device:  # FSDP2 CPU offload: host gradients under a CUDA mesh (NCCL needs device data)
                norm = DTensor.from_local(local.to(device), norm.device_mesh, norm.placements, run_check=False)
            norm = norm.full_tensor()
        total = total + norm.to(device=device, dtype=torch.float64) ** 2
    if group is not None:
        dist.all_reduce(total, group=group)
    return total.sqrt()


def clip_grads_by_norm_(
    grads: Sequence[Tensor],
    max_norm: Union[int, float],
    *,
    counted: Optional[Sequence[Tensor]] = None,
    group: Optional[Any] = None,
    device: torch.device,
) -> Tensor:
    """Scale ``grads`` in place by torch's rule (``max_norm / (norm + 1e-6)``, at most 1); returns the global norm.

    ``counted``: the gradients that make up the norm when not all of ``grads`` (a weight tied across pipeline
    stages has a copy on each holder: all are scaled, one is counted).
    """
    total = global_grad_norm(grads if counted is None else counted, group, device=device)
    coef = float(max_norm) / (total.item() + 1e-6)
    if not coef >= 1.0:  # as torch: a NaN norm makes NaN gradients (multiplying by 1 would change nothing)
        for part in grads_by_layout(grads):
            torch._foreach_mul_(part, coef)
    return total


def clip_grads_by_value_(grads: Sequence[Tensor], clip_value: Union[int, float]) -> None:
    """Clamp ``grads`` in place to ``[-clip_value, clip_value]`` (elementwise: each rank clamps the part it holds)."""
    value = float(clip_value)
    for part in grads_by_layout(grads):
        torch._foreach_clamp_min_(part, -value)
        torch._foreach_clamp_max_(part, value)


__all__ = ["clip_grads_by_norm_", "clip_grads_by_value_", "global_grad_norm", "grads_by_layout"]
