"""Exact per-rank partitions: FSDP2's dim-0 shards and ZeroRedundancyOptimizer's owners.

Notes: docs/internals.md, "lightning_dist/planner/shards.py"."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from lightning_dist.planner._checks import check_count, check_size, check_zero_stage
from lightning_dist.planner.memory import MemoryBreakdown, StateBytes


def fsdp2_local_numel(shape: Sequence[int], world_size: int, rank: int, *, padded: bool = False) -> int:
    """Elements rank ``rank`` holds of a parameter of ``shape`` under FSDP2's dim-0 sharding.

    FSDP2 splits dim 0 with ``torch.chunk`` into chunks of ``c = ceil(d0 / W)`` rows (trailing ranks get
    fewer or none): rank ``r`` holds ``clamp(d0 - r c, 0, c)`` rows. ``padded=True`` gives the padded
    storage FSDP2 allocates for the all-gather (``c`` rows on every rank).
    """
    check_size("world_size", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside world_size={world_size}.")
    if len(shape) == 0:
        raise ValueError("FSDP2 shards along dim 0 and rejects 0-dim (scalar) parameters; reshape it to (1,).")
    d0, rest = shape[0], math.prod(shape[1:])
    chunk = -(-d0 // world_size)
    rows = chunk if padded else min(chunk, max(0, d0 - rank * chunk))
    return rows * rest


def per_parameter_shards(shapes: Iterable[Sequence[int]], world_size: int, *, padded: bool = False) -> list[int]:
    """Local parameter elements on each of ``world_size`` ranks when every parameter is FSDP2-sharded on dim 0.

    Returns one count per rank (rank 0 first, which always holds the most); ``sum`` of the unpadded counts is
    the model size. Multiply by :class:`StateBytes` parts for bytes (see :func:`fsdp2_state_bytes`).
    """
    shapes = [tuple(s) for s in shapes]
    return [sum(fsdp2_local_numel(s, world_size, r, padded=padded) for s in shapes) for r in range(world_size)]


def zero_redundancy_owners(numels: Sequence[int], world_size: int) -> list[int]:
    """Rank that owns each parameter's optimizer state under torch's ``ZeroRedundancyOptimizer``.

    Mirrors its greedy partition (one parameter group): parameters sorted by size, largest first (a stable
    sort), each to the rank with the smallest total so far (the lowest such rank on ties).
    """
    check_size("world_size", world_size)
    sizes, owners = [0] * world_size, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):
        rank = sizes.index(min(sizes))
        owners[i] = rank
        sizes[rank] += int(numels[i])
    return owners


def zero_redundancy_partition(numels: Sequence[int], world_size: int) -> list[int]:
    """Parameter elements whose optimizer state each rank owns under ``ZeroRedundancyOptimizer``."""
    sizes = [0] * world_size
    for n, rank in zip(numels, zero_redundancy_owners(numels, world_size)):
        sizes[rank] += int(n)
    return sizes


def fsdp2_state_bytes(
    shapes: Iterable[Sequence[int]],
    *,
    shard_size: int,
    rank: int = 0,
    state: StateBytes,
    zero_stage: int = 3,
    padded: bool = False,
    step_bytes: float = 0,
) -> MemoryBreakdown:
    """Live model-state bytes on ``rank`` of a shard group, as the pack's FSDP2 strategies hold them at rest.

    * ``zero_stage`` 3 and 2: FSDP2 keeps only the dim-0 shards between steps (stage 2 differs from 3 by
      keeping the unsharded parameters from forward to backward, which is transient), so params, grads and
      optimizer state are all :func:`fsdp2_local_numel` elements.
    * ``zero_stage`` 1: parameters and gradients replicated, optimizer state partitioned whole-parameter by
      :func:`zero_redundancy_partition` over ``shard_size`` ranks (ZeroRedundancyOptimizer).
    * ``zero_stage`` 0: everything replicated.
    ``step_bytes``: per-parameter-tensor scalar optimizer state, added to the optimizer part (torch's Adam
    keeps a float32 ``step`` per parameter: 4; FSDP2 ranks hold one per parameter, even with zero rows).
    Differs from the closed form :func:`model_state_bytes` only by the rounding of uneven shards.
    """
    check_zero_stage(zero_stage)
    check_count("step_bytes", step_bytes)
    shapes = [tuple(s) for s in shapes]
    total = sum(math.prod(s) for s in shapes)
    steps = len(shapes) * step_bytes
    if zero_stage >= 2:
        local = sum(fsdp2_local_numel(s, shard_size, rank, padded=padded) for s in shapes)
        return MemoryBreakdown(
            params=local * state.param, grads=local * state.grad, optimizer=local * state.optimizer + steps
        )
    opt = total
    if zero_stage == 1:
        check_size("shard_size", shard_size)
        if not 0 <= rank < shard_size:
            raise ValueError(f"rank={rank} is outside shard_size={shard_size}.")
        numels = [math.prod(s) for s in shapes]
        owners = zero_redundancy_owners(numels, shard_size)
        opt = sum(n for n, r in zip(numels, owners) if r == rank)
        steps = sum(1 for r in owners if r == rank) * step_bytes
    return MemoryBreakdown(
        params=total * state.param, grads=total * state.grad, optimizer=opt * state.optimizer + steps
    )
