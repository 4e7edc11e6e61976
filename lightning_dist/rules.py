"""The pack's parallelization decisions, as pure functions of numbers (no torch): one home for each.

Notes: docs/internals.md, "lightning_dist/rules.py"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

# name -> (torch.distributed.pipelining schedule class, default stages per rank, stage -> rank style)
SCHEDULES: dict[str, tuple[str, int, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zero_bubble": ("ScheduleZBVZeroBubble", 2, "v"),
}


def stage_ranks(num_stages: int, pp: int, style: Literal["loop", "v"] = "loop") -> list[int]:
    """Pipeline rank of each stage: ``loop`` (stage s on rank s % pp) or ``v`` (ZBV: 0..p-1 then p-1..0)."""
    if num_stages % pp:
        raise ValueError(f"{num_stages} stages do not divide over pp={pp} ranks.")
    if style == "loop":
        return [s % pp for s in range(num_stages)]
    out = []
    for s in range(num_stages):
        lap, pos = divmod(s, pp)
        out.append(pos if lap % 2 == 0 else pp - 1 - pos)
    return out


def partition(costs: Sequence[float], num_stages: int, *, first: float = 0.0, last: float = 0.0) -> list[int]:
    """Split points (start block of stages 1..S-1) of the contiguous split minimising the costliest stage.

    `first`/`last` are fixed costs of stage 0 (the stem) and the last stage (the head). Every stage gets at
    least one block. Exact dynamic programme over (stage, end block): O(S n^2), n is a few hundred at most.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"Cannot split {n} blocks into {num_stages} stages; need 1 <= stages <= blocks.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, i: int, j: int) -> float:  # blocks i..j-1 on stage s
        return prefix[j] - prefix[i] + (first if s == 0 else 0.0) + (last if s == num_stages - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: the smallest max-cost placing blocks 0..j-1 on stages 0..s; arg[s][j] the start of stage s
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    arg = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = stage_cost(0, 0, j)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], stage_cost(s, i, j))
                if value < best[s][j] - 1e-12:  # strict: ties keep the earliest split (deterministic)
                    best[s][j], arg[s][j] = value, i
    points, j = [], n
    for s in range(num_stages - 1, 0, -1):
        j = arg[s][j]
        points.append(j)
    return points[::-1]


def bubble_theory(pp: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction with equal stages and free communication: (p-1)/(v*m+p-1) for GPipe/1F1B (v=1) and
    interleaved 1F1B (v stages per rank, each 1/v of the work: the warm-up shrinks v times). Zero-bubble
    schedules fill part of it with weight-gradient work: this is their upper bound."""
    return (pp - 1) / (stages_per_rank * n_microbatches + pp - 1)


def replicates(*, zero_stage: int, dp_shard: int, tp: int, offload: bool = False, cp: int = 1) -> bool:
    """True when the data-parallel dims of a (not pipelined) model use DDP-style replication (torch's
    ``replicate``: one bucketed gradient all-reduce), False when they use FSDP2's ``fully_shard``.

    With nothing to shard (ZeRO-1, or shard groups of one rank) DDP's bucketed all-reduce is the fastest
    correct choice; FSDP2 over a (N, 1) mesh would issue one small all-reduce per unit (~3x slower on CPU).
    DTensor (tensor-parallel) parameters need FSDP2, which composes with them, and CPU offload is an FSDP2
    policy. A pipeline stage is always its own FSDP2 root over the data-parallel dims. Context parallelism
    (``cp > 1``) shards over ``dp_shard`` x ``cp`` with FSDP2, as torchtitan does.
    """
    return not offload and cp == 1 and (zero_stage == 1 or (dp_shard == 1 and tp == 1))


def ep_spans_tp(ep: int, tp: int) -> bool:
    """True when the expert-parallel groups take every ``tp`` rank (``ep`` a multiple of ``tp > 1``, torchtitan's
    layout): each tp rank then dispatches its ``1/tp`` share of the tokens the tp group holds alike. False: the ep
    groups are formed inside ``dp_shard x cp`` at each tp coordinate, and every tp rank runs the same tokens."""
    return tp > 1 and ep % tp == 0


def cp_chunks(seq_len: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` ranges of a sequence of `seq_len` tokens that context-parallel rank `rank` of `cp` holds.

    The sequence is cut into ``2 * cp`` equal chunks and rank r holds chunks r and ``2cp - 1 - r``: under a causal
    mask the early chunks attend to few keys and the late ones to many, so every rank gets one of each and the
    same attention work (torchtitan's and Megatron's load balancing). `seq_len` must divide by ``2 * cp``.
    """
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"rank={rank} is not a rank of cp={cp}.")
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} does not divide into 2 x cp = {2 * cp} equal chunks (the load-balanced"
            f" split of context parallelism); pad or crop the sequences to a multiple of {2 * cp}."
        )
    c = seq_len // (2 * cp)
    return [(rank * c, (rank + 1) * c), ((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]


__all__ = ["SCHEDULES", "bubble_theory", "cp_chunks", "ep_spans_tp", "partition", "replicates", "stage_ranks"]
