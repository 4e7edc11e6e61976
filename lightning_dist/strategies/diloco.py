"""``FaultTolerance(sync="diloco")``: torchft's DiLoCo around the inner optimizer for one fit, and its outer optimizer.

The replica groups train on their own; every ``sync_every`` inner steps DiLoCo's hook on the inner optimizer syncs
after the step: the quorum (a group behind heals there), the pseudo-gradients' all-reduce, the commit vote, the
outer step. Notes: docs/fault_tolerance.md, "DiLoCo".
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch


def _default_outer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def outer_optimizer_factory(value: Any) -> Callable[[Any], Any]:
    """``params -> optimizer`` for ``FaultTolerance(outer_optimizer=value)``; TypeError/ValueError naming the value."""
    if value is None:
        return _default_outer
    if isinstance(value, Mapping):
        if set(value) - {"class_path", "init_args"} or not isinstance(value.get("class_path"), str):
            raise ValueError(
                f"`FaultTolerance(outer_optimizer={dict(value)!r})`: a dict names the class as LightningCLI does,"
                " {'class_path': 'torch.optim.SGD', 'init_args': {'lr': 0.7, 'momentum': 0.9, 'nesterov': True}}."
            )
        module, _, name = value["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name, None) if module else None
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(
                f"`FaultTolerance(outer_optimizer={{'class_path': {value['class_path']!r}}})` is not a"
                " torch.optim.Optimizer class; e.g. 'torch.optim.SGD'."
            )
        return functools.partial(cls, **dict(value.get("init_args") or {}))
    if (isinstance(value, type) and not issubclass(value, torch.optim.Optimizer)) or not callable(value):
        raise TypeError(
            f"`FaultTolerance(outer_optimizer={value!r})` must be a torch.optim.Optimizer class, a factory"
            " `params -> optimizer` (e.g. functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)),"
            " or None for that default."
        )
    return value


class DiLoCoSync:
    """torchft's DiLoCo over `module`, entered now (its hooks on `inner`) until :meth:`close`; the outer optimizer
    built from `outer_optimizer` (``FaultTolerance(outer_optimizer=...)``) over the module's parameters."""

    def __init__(self, manager: Any, module: torch.nn.Module, inner: Any, *, outer_optimizer: Any, every: int) -> None:
        from lightning_dist._integrations.torchft import diloco
        from lightning_dist.parallelize.shard_state import LocalShardState

        outer = outer_optimizer_factory(outer_optimizer)(module.parameters())
        if not isinstance(outer, torch.optim.Optimizer):
            raise TypeError(
                f"`FaultTolerance(outer_optimizer={outer_optimizer!r})` returned {type(outer).__name__}, not a"
                " torch.optim.Optimizer: a factory takes the parameters and returns the optimizer."
            )
        self.manager, self.every, self.inner_steps = manager, every, 0
        self.module, self.outer = module, outer
        self._stack = contextlib.ExitStack()
        self._sync = self._stack.enter_context(diloco(manager, module, inner, LocalShardState(outer), every))

    def step(
        self, optimizer_step: Callable[[Callable[[], Any]], Any], closure: Callable[[], Any], *, failed: Callable
    ) -> tuple[Any, bool | None]:
        """Run ``optimizer_step(closure)`` (the inner step; every ``every``-th, DiLoCo's sync after it). Returns (its
        result, whether the sync committed: None without a sync). A failure in a sync after the training step ran
        is raised as ``failed(inner_step, error)``."""
        self.inner_steps += 1
        syncs = self.inner_steps % self.every == 0
        trained = []

        def step_closure() -> Any:
            out = closure()
            trained.append(True)  # an error after this is the optimizer's or DiLoCo's sync, not the training step's
            return out

        before = self.manager.current_step()
        try:
            result = optimizer_step(step_closure)
        except Exception as err:
            if not (syncs and trained):
                raise
            raise failed(self.inner_steps, err) from err
        return result, (self.manager.current_step() > before if syncs else None)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (plain tensors, whole: a collective for DTensor parameters): the inner steps, the
        outer optimizer's state and the global (last synced) weights by parameter name."""
        from lightning_dist._integrations.torchft import diloco_global_weights

        params = dict(self.module.named_parameters())
        weights = diloco_global_weights(self._sync)
        outer = self.outer.state_dict()
        by_index = _outer_params(self.outer)
        state = {i: {k: _whole(v, by_index[i]) for k, v in s.items()} for i, s in outer["state"].items()}
        return {
            "inner_steps": self.inner_steps,
            "sync_every": self.every,
            "outer_class": _class_name(self.outer),
            "outer_optimizer": {"state": state, "param_groups": outer["param_groups"]},
            "global_weights": {name: _whole(t, params[name], shard=True) for name, t in weights.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (of the same model and outer optimizer); ValueError naming a mismatch."""
        from lightning_dist._integrations.torchft import diloco_global_weights, set_diloco_inner_step

        saved, mine = state["outer_class"], _class_name(self.outer)
        if saved != mine:
            raise ValueError(
                f"The checkpoint's DiLoCo outer optimizer is {saved}, this run's {mine}: resume with the same"
                " FaultTolerance(outer_optimizer=...)."
            )
        params = dict(self.module.named_parameters())
        weights = diloco_global_weights(self._sync)
        if set(state["global_weights"]) != set(weights):
            missing, extra = set(weights) - set(state["global_weights"]), set(state["global_weights"]) - set(weights)
            raise ValueError(
                f"The checkpoint's DiLoCo global weights do not match the model (missing {sorted(missing)}, unexpected"
                f" {sorted(extra)}): resume the same LightningModule."
            )
        with torch.no_grad():
            for name, backup in weights.items():
                backup.copy_(_local(state["global_weights"][name], params[name], shard=True))
        by_index = _outer_params(self.outer)
        outer = state["outer_optimizer"]
        local = {i: {k: _local(v, by_index[i]) for k, v in s.items()} for i, s in outer["state"].items()}
        self.outer.load_state_dict({"state": local, "param_groups": outer["param_groups"]})
        self.inner_steps = int(state["inner_steps"])
        set_diloco_inner_step(self._sync, self.inner_steps % self.every)

    def heal_state(self) -> dict[str, int]:
        """What a healing replica group takes over besides torchft's own DiLoCo state (its global weights and outer
        optimizer, which DiLoCo registers itself): the inner steps taken (what a checkpoint saves, and Lightning's
        global step counts), so that a healed group's count, checkpoints and sync schedule are the healthy group's."""
        return {"inner_steps": self.inner_steps}

    def load_heal_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a healthy group's :meth:`heal_state`, inside the sync (DiLoCo's own counter of the inner
        steps since the last sync is the same in every group there: ``every``, reset after the sync)."""
        self.inner_steps = int(state["inner_steps"])

    def close(self) -> None:
        """DiLoCo's hooks off the inner optimizer."""
        self._stack.close()


def _class_name(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _outer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters as the optimizer's ``state_dict`` numbers them."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _whole(value: Any, param: torch.Tensor, *, shard: bool = False) -> Any:
    """`value` (a DTensor, or with `shard` this rank's local shard of `param`) as a whole tensor on the CPU (a
    collective for a DTensor `param`); anything else as it is."""
    from torch.distributed.tensor import DTensor

    if not torch.is_tensor(value):
        return value
    if shard and isinstance(param, DTensor):
        value = DTensor.from_local(
            value.to(param.device), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().cpu().clone()


def _local(value: Any, param: torch.Tensor, *, shard: bool = False) -> Any:
    """A whole tensor of `param`'s shape as `param` holds it: a DTensor for a DTensor `param` (sliced, no
    communication), with `shard` its local shard; anything else as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not (isinstance(param, DTensor) and torch.is_tensor(value) and value.shape == param.shape):
        return value
    value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value.to_local() if shard else value
