"""What every pipeline stage module is (:class:`PipelinedModule`), and the stages of an ``nn.Sequential``: a
:class:`StageModule` holds some of its children under their original keys and applies them in order."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn


class PipelinedModule(nn.Module):
    """A module made of what some pipeline stages run: ``run_local`` is the stages' forward; once the strategy sets
    ``runner``, calling the module runs the whole pipeline schedule instead."""

    runner: Callable | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if self.runner is not None:
            return self.runner(*args, **kwargs)
        return self.run_local(*args, **kwargs)

    def run_local(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def stage_blocks(self) -> list[nn.Module]:
        """The blocks this module holds (FSDP2's ``"auto"`` units, activation checkpointing's and compile's)."""
        raise NotImplementedError

    def fsdp_units(self) -> list[nn.Module]:
        return self.stage_blocks()


class StageModule(PipelinedModule):
    """Some children of an ``nn.Sequential`` under their original keys, applied in order (one tensor in and out)."""

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        for key, module in blocks:
            self.add_module(key, module)

    def run_local(self, x: Any) -> Any:
        # `_modules`, not `children()`: children() yields a module used twice (weight sharing) only once
        for part in self._modules.values():
            x = part(x)
        return x

    def stage_blocks(self) -> list[nn.Module]:
        return list(self.children())

    def fsdp_units(self) -> list[nn.Module]:
        return []  # FSDP2's root unit holds a Sequential's children (a child used twice must not be a unit)


def plain_call_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict, None]:
    """(first stage's input, inputs every stage takes, labels) of a call of a pipelined network: one tensor."""
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
        raise TypeError("A pipelined network takes exactly one tensor argument (the batch of inputs).")
    return args[0], {}, None


def plain_call_output(shown: torch.Tensor, loss: Any, labels: Any, aux: Any = None, coef: float = 0.0) -> torch.Tensor:
    """What the pipelined network's call returns: what the step sees of the output."""
    return shown


def is_pipelined_module(net: object) -> bool:
    """A stage module built by ``split.build_stage_module`` (of either kind)."""
    return isinstance(net, PipelinedModule)


def stage_blocks(stage: PipelinedModule) -> list[nn.Module]:
    """The blocks a stage module holds (its block list's entries; a split ``nn.Sequential``: its children)."""
    return stage.stage_blocks()


def is_sequential(net: nn.Module) -> bool:
    """An ``nn.Sequential`` whose forward is its children in order (a subclass may override it)."""
    return isinstance(net, nn.Sequential) and type(net).forward is nn.Sequential.forward


def build_sequential_stage(net: nn.Sequential, keys: Sequence[str]) -> StageModule:
    """A :class:`StageModule` with children `keys` of `net` (the same module objects)."""
    return StageModule([(k, net._modules[k]) for k in keys])


def join_sequential(keys: Sequence[str], pieces: Sequence[nn.Module]) -> StageModule:
    """The whole ``nn.Sequential`` from plain copies of every stage, its children in their original order."""
    children = {k: m for piece in pieces for k, m in piece._modules.items()}
    return StageModule([(k, children[k]) for k in keys])


def part_costs(layout: Any, times: Sequence[float]) -> tuple[float, list[float], float]:
    """(stem, each block, head) from one time per stem part, block and head part, in that order."""
    n_stem, n_head = len(layout.stem), len(layout.head)
    return sum(times[:n_stem]), list(times[n_stem : len(times) - n_head]), sum(times[len(times) - n_head :])


def profile_parts(
    net: nn.Module, layout: Any, run: Callable[[], Any], *, repeats: int = 5
) -> tuple[float, list[float], float]:
    """Milliseconds of (stem, each block, head) in forward, timed by hooks inside ``run()`` (the model's own forward:
    its blocks may take extra inputs, a mask or rotary tables), best of `repeats`; the split needs ratios only, so no
    backward."""
    names = [*layout.stem, *(layout.block_name(i) for i in range(len(layout.blocks))), *layout.head]
    best = [float("inf")] * len(names)
    starts: dict[int, float] = {}
    handles = []
    for i, name in enumerate(names):
        module = net.get_submodule(name)
        handles.append(module.register_forward_pre_hook(lambda m, a, i=i: starts.__setitem__(i, time.perf_counter())))
        handles.append(
            module.register_forward_hook(
                lambda m, a, o, i=i: best.__setitem__(i, min(best[i], (time.perf_counter() - starts[i]) * 1e3))
            )
        )
    try:
        with torch.no_grad():
            for _ in range(repeats + 1):
                run()
    finally:
        for h in handles:
            h.remove()
    return part_costs(layout, [0.0 if b == float("inf") else b for b in best])  # a part never called costs nothing


__all__ = [
    "PipelinedModule",
    "StageModule",
    "build_sequential_stage",
    "is_pipelined_module",
    "is_sequential",
    "join_sequential",
    "part_costs",
    "plain_call_inputs",
    "plain_call_output",
    "profile_parts",
    "stage_blocks",
]
