"""What a pipeline split cannot run as is (BatchNorm, a forward the stages would not reproduce) and the parameters
shared across stages: checks on the plan, run before anything is split."""

from __future__ import annotations

import copy
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.parallelize.pipeline.split import PipelineSplit, network_layout


def shared_across_stages(net: nn.Module, split: PipelineSplit) -> list[tuple[str, ...]]:
    """Parameters reachable from two or more stages (tied weights): the qualified names of each, per parameter."""
    return [names for names, _ in tied_stages(net, split)]


def batchnorm_modules(net: nn.Module) -> list[str]:
    """Qualified names of BatchNorm layers (their statistics would come from one micro-batch, not the batch)."""
    return [name for name, m in net.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def tied_stages(net: nn.Module, split: PipelineSplit) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """Parameters held by two or more stages (tied embeddings): ``(qualified names, stage indices)`` of each (every
    holder keeps a copy; their gradients are summed each step, see :mod:`.tied`)."""
    lay = split.layout
    owners: dict[int, list[tuple[int, str]]] = {}
    for stage in split.stages:
        parts = [
            *(lay.stem if stage.stem else ()),
            *map(lay.block_name, stage.blocks),
            *(lay.head if stage.head else ()),
        ]
        for part in parts:
            for pname, p in net.get_submodule(part).named_parameters(remove_duplicate=False):
                owners.setdefault(id(p), []).append((stage.index, f"{part}.{pname}"))
    out = []
    for uses in owners.values():
        stages = tuple(sorted({s for s, _ in uses}))
        if len(stages) > 1:
            out.append((tuple(dict.fromkeys(n for _, n in uses)), stages))
    return out


def check_splittable(net: nn.Module, split: PipelineSplit, *, allow_batchnorm: bool = False) -> None:
    """Refuse (unless allowed, then warn) BatchNorm layers, naming them."""
    bn = batchnorm_modules(net)
    if bn and not allow_batchnorm:
        raise ValueError(
            f"BatchNorm layers {bn} would normalize each micro-batch with its own statistics, unlike"
            " single-device training. Use LayerNorm/GroupNorm, or pass allow_batchnorm=True."
        )
    if bn and (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))) == 0:  # once a job
        warnings.warn(f"Pipelining BatchNorm layers {bn}: statistics come from micro-batches.", stacklevel=2)


def staged_forward_problem(net: nn.Module, sample: torch.Tensor) -> str | None:
    """Why the pipeline stages would not compute ``net(sample)`` (its layout's ``forward_problem``), or None."""
    return network_layout(net).forward_problem(net, sample)


def host_copy(net: nn.Module) -> nn.Module:
    """A copy of `net` with its tensors in host memory (never a second copy in device memory), to check later."""
    memo: dict[int, object] = {}
    for p in net.parameters():
        memo[id(p)] = nn.Parameter(p.detach().cpu().clone(), requires_grad=p.requires_grad)
    for b in net.buffers():
        memo[id(b)] = b.detach().cpu().clone()
    return copy.deepcopy(net, memo)


def check_staged_forward(net: nn.Module, sample: torch.Tensor) -> None:
    """ValueError (see :func:`staged_forward_problem`) when the stages would not compute ``net(sample)``."""
    problem = staged_forward_problem(net, sample)
    if problem:
        raise ValueError(problem)


__all__ = [
    "batchnorm_modules",
    "check_splittable",
    "check_staged_forward",
    "host_copy",
    "shared_across_stages",
    "staged_forward_problem",
    "tied_stages",
]
