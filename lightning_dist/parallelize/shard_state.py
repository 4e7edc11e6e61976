"""This rank's model and optimizer state as plain local shards, and loading it back into DTensor shards.

What a healthy fault-tolerant replica group sends a healing one (torchft's transport loads with
``weights_only=True``, which DTensors do not pass), and what the dry run measures as the heal's bytes. No Lightning
here: the strategy registers these with torchft (``strategies/heal.py`` adds Lightning's side of the state).
Notes: docs/fault_tolerance.md, "Healing".
"""

from __future__ import annotations

from typing import Any

import torch


def _local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def local_tree(tree: Any) -> Any:
    """`tree` with every DTensor replaced by its local shard."""
    if isinstance(tree, dict):
        return {k: local_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_tree(v) for v in tree)
    return _local(tree)


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers (shards as plain tensors)."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return {name: _local(t).detach() for name, t in tensors.items()}


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's ``state_dict`` with its per-parameter tensors as this rank's shards."""
    return local_tree(optimizer.state_dict())


@torch.no_grad()
def load_module_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    for name, t in {**dict(module.named_parameters()), **dict(module.named_buffers())}.items():
        _local(t).copy_(state[name])


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a state of local shards: each per-parameter tensor shaped like the parameter's shard becomes a DTensor
    laid out as the parameter is (every replica group has the same inner mesh)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    restored = {}
    for index, entry in state["state"].items():
        p = params[index]
        if isinstance(p, DTensor):
            entry = {
                k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                if isinstance(v, torch.Tensor) and v.shape == p.to_local().shape
                else v
                for k, v in entry.items()
            }
        restored[index] = entry
    optimizer.load_state_dict({**state, "state": restored})


class LocalShardState:
    """An optimizer whose ``state_dict`` holds local shards, loaded back as the parameters' DTensor shards: DiLoCo's
    outer optimizer, whose state DiLoCo itself registers with torchft's transport (which sends plain tensors)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, closure: Any = None) -> Any:
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return optimizer_state(self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_optimizer_state(self.optimizer, state)
