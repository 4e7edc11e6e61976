"""Fault-tolerant replica groups (``fault_tolerance=``): the plain layout's states and traffic, plus the heal.

Notes: docs/planner.md, "Fault-tolerant replica groups"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from lightning_dist.mesh import DP, DP_REPLICATE, DP_SHARD, PP, TP
from lightning_dist.planner._checks import check_count, check_size
from lightning_dist.planner.memory import StateBytes, tp_local_params
from lightning_dist.planner.model import ParamCounts
from lightning_dist.planner.traffic import Collective

# what the per-step all-reduce across the groups is called in a fault-tolerant layout's traffic
ACROSS_GROUPS = "across replica groups (torchft)"
# what DiLoCo's all-reduce across the groups (``sync="diloco"``, once every H steps) is called
DILOCO_SYNC = "DiLoCo's pseudo-gradients"


def diloco_sync_traffic(
    num_params: float,
    *,
    param_bytes: float,
    inner_steps: int,
    replica_groups: int,
    shard_size: int = 1,
    dim: str = DP_REPLICATE,
) -> Collective:
    """DiLoCo's all-reduce across the replica groups (``FaultTolerance(sync="diloco", sync_every=H)``), per step: once
    every ``H = inner_steps`` steps each rank all-reduces the pseudo-gradients of its parameter shards (global weights
    minus local weights, in the parameters' stored dtype; one call per parameter tensor), and no step in between sends
    anything across the groups.

    ``payload = P b_p / S / H`` per step (what the planner's traffic and ``CommunicationLedger`` count: the mean over
    the steps); per sync it is ``P b_p / S`` (``payload_bytes x inner_steps``), for ``P`` parameters on this rank
    (after tensor parallelism), ``b_p`` the stored parameter's element size (``StateBytes.param``) and ``S =
    shard_size`` the FSDP2 shards inside a group (1: a group of one data-parallel rank, which under DiLoCo has no
    data parallelism of its own). The plain layout's gradient all-reduce across the groups is not run under DiLoCo.
    """
    check_count("num_params", num_params)
    check_count("param_bytes", param_bytes)
    check_size("inner_steps", inner_steps)
    check_size("shard_size", shard_size)
    check_size("replica_groups", replica_groups)
    per_sync = num_params / shard_size * param_bytes
    return Collective(
        op="all_reduce",
        dim=dim,
        group_size=replica_groups,
        payload_bytes=per_sync / inner_steps,
        what=f"{DILOCO_SYNC}, {ACROSS_GROUPS}: {per_sync:,.0f} B per sync every {inner_steps} steps, averaged per step",
    )


def heal_transfer(
    num_params: float,
    *,
    state: StateBytes,
    zero_stage: int,
    shard_size: int,
    replica_groups: int,
    tensors: int = 0,
    step_bytes: float = 4,
    buffer_bytes: float = 0,
) -> Collective:
    """What one rank of a healthy replica group sends to the matching rank of a healing one (torchft's live state
    transfer, once per heal, not per step): its model and optimizer shards.

    ``payload = P b_p / S^[z>=2] + P b_o / S^[z>=2] + tensors x step_bytes + buffer_bytes`` for ``P`` parameters on
    this rank (after tensor parallelism), ``S = shard_size``: FSDP2 keeps only the dim-0 shards at rest at stages 2
    and 3; stage 0 (DDP, a group of one data-parallel rank) sends everything. ``tensors``: parameter tensors with
    optimizer state (torch's Adam keeps a ``step`` scalar per tensor, float32: ``step_bytes=4``); ``buffer_bytes``:
    the module's buffers (not sharded). The loop, scheduler, loader and RNG state that also travel are a few kB and
    not counted. Gradients do not travel.
    """
    check_count("num_params", num_params)
    check_size("shard_size", shard_size)
    check_size("replica_groups", replica_groups)
    check_count("tensors", tensors)
    check_count("step_bytes", step_bytes)
    check_count("buffer_bytes", buffer_bytes)
    if zero_stage not in (0, 2, 3):
        raise ValueError(
            f"`zero_stage={zero_stage!r}`: fault-tolerant replica groups run zero_stage 2 or 3 (FSDP2) or 0 (DDP);"
            " zero_stage=1 is not supported by fault_tolerance (its optimizer shards would heal shard by shard)."
        )
    local = num_params / (shard_size if zero_stage >= 2 else 1)
    return Collective(
        op="send",
        dim=DP_REPLICATE,
        group_size=replica_groups,
        payload_bytes=local * (state.param + state.optimizer) + tensors * step_bytes + buffer_bytes,
        what="heal: model and optimizer shards to the matching rank of a healing replica group (once per heal)",
    )


def fault_tolerant_layouts(
    layouts: Sequence,
    *,
    replica_groups: int,
    counts: ParamCounts | int,
    state: StateBytes,
    step_bytes: float = 4,
    sync: str = "step",
    inner_steps: int | None = None,
) -> list:
    """The `layouts` that ``fault_tolerance=`` can run with ``replica_groups`` groups, each with its heal.

    Kept: ``dp_replicate == replica_groups`` (each group one replica: its own job, ``dp_replicate=1`` inside), no
    ZeRO-1, nothing offloaded: the hsdp row of shard size ``W / replica_groups``, ddp when every group is one rank,
    tensor parallel x replicated dp, and pipeline x replicated dp under ``sync="step"`` (each group a whole pipeline
    of ``pp`` ranks: rank ``r`` of one group all-reduces its stage's gradients with rank ``r`` of the others). States
    and traffic are the plain layout's; the all-reduce across the groups (on ``dp_replicate``, or ``dp`` when
    ``dp_shard == 1``) is torchft's, its ``what`` says so; ``heal`` is :func:`heal_transfer` of the parameters this
    rank holds: after tensor parallelism, and under a pipeline those of its stage as the layout sizes them (its
    largest stage, ``memory.params / state.param``). ``counts.shapes``, when known, give the step counters: every
    parameter tensor's, also under a pipeline (an upper bound there, 4 B per tensor of the other stages: the counts
    have no tensors per stage).

    ``sync="diloco"`` (``inner_steps`` = ``sync_every``, H): that per-step gradient all-reduce is replaced by
    :func:`diloco_sync_traffic` (the pseudo-gradients of this rank's parameter shards once every H steps, averaged
    per step), on the same dim; the traffic inside a group is the plain layout's. No pipeline: PipelineStrategy
    refuses DiLoCo for now. The heal is the same (DiLoCo's global weights and outer optimizer state also travel; not
    counted, as the loop's and loader's state).
    """
    if sync not in ("step", "diloco"):
        raise ValueError(f"`sync={sync!r}` must be 'step' (every step) or 'diloco' (every inner_steps).")
    if sync == "diloco":
        check_size("inner_steps", inner_steps)  # type: ignore[arg-type]
    elif inner_steps is not None:
        raise ValueError(f"`inner_steps={inner_steps!r}` applies to sync='diloco' only.")
    counts = counts if isinstance(counts, ParamCounts) else ParamCounts(total=counts)
    check_size("replica_groups", replica_groups)
    if replica_groups < 2:
        raise ValueError(
            f"`replica_groups={replica_groups}`: a heal copies the state of a healthy replica group, so fault"
            " tolerance needs at least 2 groups; pass replica_groups >= 2."
        )
    P, out = counts.total, []
    for layout in layouts:
        mesh = layout.mesh
        if mesh[DP_REPLICATE] != replica_groups or layout.zero_stage == 1 or layout.offload.any:
            continue
        if sync == "diloco" and mesh[PP] > 1:
            continue  # PipelineStrategy refuses fault_tolerance with sync='diloco' (not supported yet)
        # the parameters this rank holds before data-parallel sharding, as candidate_layouts counts them
        if mesh[PP] > 1:  # its stage's: the layout's own per-device params (its largest stage), unsharded
            local = layout.memory.params / state.param * (mesh[DP_SHARD] if layout.zero_stage >= 3 else 1)
        else:
            local = tp_local_params(
                tp_sharded_params=counts.tp_sharded_params, replicated_params=P - counts.tp_sharded_params, tp=mesh[TP]
            )
        across = {DP_REPLICATE} | ({DP} if mesh[DP_SHARD] == 1 else set())
        if sync == "diloco":
            traffic = tuple(
                diloco_sync_traffic(
                    local,
                    param_bytes=state.param,
                    inner_steps=inner_steps,  # type: ignore[arg-type]
                    replica_groups=replica_groups,
                    shard_size=mesh[DP_SHARD],
                    dim=c.dim,
                )
                if c.op == "all_reduce" and c.dim in across
                else c
                for c in layout.traffic
            )
        else:
            traffic = tuple(
                replace(c, what=f"{c.what}, {ACROSS_GROUPS}") if c.op == "all_reduce" and c.dim in across else c
                for c in layout.traffic
            )
        heal = heal_transfer(
            local,
            state=state,
            zero_stage=layout.zero_stage,
            shard_size=mesh[DP_SHARD],
            replica_groups=replica_groups,
            tensors=len(counts.shapes),
            step_bytes=step_bytes if state.optimizer else 0,
        )
        note = f"{layout.note}; the {replica_groups} replicas fault-tolerant replica groups (torchft)"
        if sync == "diloco":
            note += f", DiLoCo every {inner_steps} steps"
        out.append(replace(layout, traffic=traffic, heal=heal, replica_groups=replica_groups, note=note))
    return out
