"""Measurements from live tensors: model-state bytes per rank (local shards only) and where they live."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

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
        local_bytes(v)
        for opt in optimizers
        for state in _optimizer_states(opt)
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0  # scalar `step` counters are bookkeeping, not state
    )
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


# ---- where the bytes actually live -------------------------------------------------------------------
# Where a piece of model state lives: the one vocabulary of the planner, the offload plan and its report
# (users choose offload targets as "cpu" / "nvme"; those map to "host" / "nvme" here)
PLACES: tuple[str, ...] = ("device", "host", "nvme")
MEMORY_PLACES = ("device", "host")
_PLACE_NAMES = {"device": "on the device", "host": "in host memory", "nvme": "in NVMe swap files"}


def memory_place(t: torch.Tensor) -> str:
    """``"host"`` for a tensor in CPU memory, ``"device"`` for one on an accelerator (read off ``tensor.device``)."""
    return "host" if t.device.type == "cpu" else "device"


def bytes_by_place(tensors: Iterable[Any]) -> dict[str, int]:
    """Bytes of the storages of `tensors` by where they live (``{"device": ..., "host": ...}``).

    A DTensor counts its local shard; each storage is counted once (views, tied weights); None, meta tensors
    and freed storages (DeepSpeed's swapped-out placeholders) count 0.
    """
    from torch.distributed.tensor import DTensor

    seen: set = set()
    out = dict.fromkeys(MEMORY_PLACES, 0)
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), str(t.device))
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        out[memory_place(t)] += storage.nbytes()
    return out


def placement_mismatches(
    measured: Mapping[str, Mapping[str, int]], planned: Mapping[str, str], *, device_type: str
) -> list[str]:
    """One line per state whose bytes mostly live elsewhere than planned (empty when all agree).

    `measured[state]` = bytes by place (:func:`bytes_by_place`); `planned[state]` = ``"device"``, ``"host"``
    or ``"nvme"`` (NVMe-planned states are staged through host memory, so host bytes agree with them). On a
    CPU device, device and host are the same memory: nothing can be told apart, nothing is reported.
    """
    if device_type == "cpu":
        return []
    out = []
    for state, where in planned.items():
        row = measured.get(state, {})
        on_device, in_host = int(row.get("device", 0)), int(row.get("host", 0))
        if where == "device" and in_host > on_device:
            out.append(
                f"{state}: planned on the device, but {in_host:,} B of {in_host + on_device:,} B are in host memory"
            )
        elif where in ("host", "nvme") and on_device > in_host:
            out.append(
                f"{state}: planned {_PLACE_NAMES[where]} (offloaded), but {on_device:,} B of"
                f" {in_host + on_device:,} B are on the device: it is not offloaded"
            )
    return out


def model_state_places(module: nn.Module, optimizers: Iterable[Any] = ()) -> dict[str, dict[str, int]]:
    """Bytes of parameters, gradients and optimizer state by where they live (local shards, ``tensor.device``)."""
    params = list(module.parameters())
    states = [
        v
        for opt in optimizers
        for state in _optimizer_states(opt)
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return {
        "params": bytes_by_place(params),
        "grads": bytes_by_place(p.grad for p in params),
        "optimizer": bytes_by_place(states),
    }


def cuda_memory(device: torch.device) -> Optional[dict[str, int]]:
    """``{"allocated", "peak"}`` bytes from the CUDA caching allocator for a CUDA `device`; None elsewhere."""
    if torch.device(device).type != "cuda":
        return None
    return {"allocated": int(torch.cuda.memory_allocated(device)), "peak": int(torch.cuda.max_memory_allocated(device))}
