"""Weights tied across pipeline stages (a head tied to the token embedding): one copy per holding stage, saved once.
Notes: docs/internals.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_dist.mesh import PP


def tied_problems(
    tied: Sequence[tuple[tuple[str, ...], tuple[int, ...]]],
    stage_ranks: Sequence[int],
    *,
    dp_size: int,
    tp_size: int = 1,
) -> list[str]:
    """What cannot be trained (pure): a tied parameter held by two stages of one rank under FSDP2, or by stages
    whose tensor-parallel plans may shard it differently (the holders' gradient shards would not line up)."""
    out = []
    for names, stages in tied:
        if tp_size > 1 and len({stage_ranks[s] for s in stages}) > 1:
            out.append(
                f"{list(names)} is tied across pipeline stages {list(stages)} and tp={tp_size}: each stage's"
                " tensor-parallel plan shards it on its own. Untie it, or use tp=1 with the pipeline."
            )
            continue
        ranks = [stage_ranks[s] for s in stages]
        if len(set(ranks)) < len(ranks) and dp_size > 1:
            out.append(
                f"{list(names)} is held by stages {list(stages)}, two of them on one rank: FSDP2 would shard it"
                " once per stage. Use another schedule or split, or no data (nor context) parallelism."
            )
    return out


def tied_gradient_groups(
    tied: Sequence[tuple[tuple[str, ...], tuple[int, ...]]], stage_ranks: Sequence[int], *, spec: Any, rank: int
) -> list[tuple[tuple[str, ...], Any, bool]]:
    """For each tied parameter this rank holds on several pp ranks: (names, group of its holders, counted in norms).

    ``torch.distributed.new_group`` is collective: every rank makes every pipeline's group, in one order.
    """
    pipelines = sorted({tuple(spec.group_ranks(r, PP)) for r in range(spec.world_size)})
    pp_rank = spec.coords(rank)[PP]
    out = []
    for names, stages in tied:
        holders = sorted({stage_ranks[s] for s in stages})
        if len(holders) < 2:
            continue  # one rank holds every use: its gradient accumulates in one tensor
        mine = None
        for line in pipelines:
            group = dist.new_group([line[h] for h in holders])
            if rank in line:
                mine = group
        if pp_rank in holders:
            out.append((names, mine, pp_rank == holders[0]))
    return out


def tied_checkpoint_keys(
    net: nn.Module,
    tied: Sequence[tuple[tuple[str, ...], tuple[int, ...]]],
    stage_ranks: Sequence[int],
    *,
    pp_rank: int,
    prefix: str = "",
) -> list[tuple[str, tuple[str, ...], bool]]:
    """For each tied parameter: (its checkpoint key: the unsplit model's first name for it, every key of its copies,
    whether this pp rank saves it). `prefix`: the network's path in the LightningModule. Call it before the split."""
    canonical = {id(p): name for name, p in net.named_parameters()}
    out = []
    for names, stages in tied:
        key = canonical[id(net.get_parameter(names[0]))]
        holders = sorted({stage_ranks[s] for s in stages})
        out.append((prefix + key, tuple(prefix + n for n in names), pp_rank == holders[0]))
    return out


def tied_aliases(keys: Sequence[tuple[str, tuple[str, ...], bool]]) -> dict[str, str]:
    """``{key of a copy: checkpoint key}`` for every copy saved under another name."""
    return {name: key for key, names, _ in keys for name in names if name != key}


def save_tied_once(
    state: dict[str, Any], keys: Sequence[tuple[str, tuple[str, ...], bool]], *, optimizer: bool = False
) -> dict[str, Any]:
    """This rank's model (or flattened optimizer: ``state.<name>.<slot>``, ``param_groups.<name>.<option>``) state
    with each tied parameter under its checkpoint key once: the saving rank renames its copy, the others drop theirs."""
    out = dict(state)
    for key, names, saves in keys:
        for name in names:
            pattern = (
                [(f"{kind}.{name}.", f"{kind}.{key}.") for kind in ("state", "param_groups")]
                if optimizer
                else [(name, key)]
            )
            for old, new in pattern:
                for k in [k for k in out if (k.startswith(old) if optimizer else k == old)]:
                    value = out.pop(k)
                    if saves:
                        out.setdefault(new + k[len(old) :], value)
    return out


__all__ = [
    "save_tied_once",
    "tied_aliases",
    "tied_checkpoint_keys",
    "tied_gradient_groups",
    "tied_problems",
]
