"""What the planner predicts for the run in progress: the layout read off the live strategy and module.

Shared by :class:`~lightning_dist.callbacks.CommunicationLedger` and
:class:`~lightning_dist.callbacks.MemoryReport`. It mirrors the decisions of
:func:`lightning_dist.parallelize.parallelize_model` (replicate-only for ZeRO-1 and shard groups of one
rank, FSDP2 otherwise) and feeds the planner the shapes FSDP2 really shards (tensor-parallel local shapes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_dist import planner, rules
from lightning_dist.mesh import CP, DP, DP_CP, DP_REPLICATE, DP_SHARD, DP_SHARD_CP, PP, TP, DistMesh
from lightning_dist.precision import precision_flag as lightning_precision_flag

# Preferred names when one group spans several dims (1x4 FSDP: dp_shard == dp): elementary dims first.
_LABEL_ORDER = (TP, CP, DP_SHARD, DP_REPLICATE, PP, DP_SHARD_CP, DP, DP_CP)
# torch optimizer class -> planner optimizer name (state tensors per parameter)
_OPTIMIZERS = {"Adam": "adam", "AdamW": "adamw", "SGD": "sgd"}


@dataclass(frozen=True, kw_only=True)
class RunLayout:
    """How the data-parallel dims treat the parameters on this rank."""

    mode: str
    """``"replicate"`` (DDP all-reduce, ZeRO-1 too), ``"fsdp"`` (FSDP2 on dp_shard, HSDP) or ``"single"``."""
    zero_stage: int
    """0 (replicated), 1 (optimizer sharded), 2 or 3 (FSDP2)."""
    shard_size: int
    """Ranks a parameter (or, for ZeRO-1, the optimizer state) is partitioned over."""
    shard_rank: int
    """This rank's index in that partition."""
    replicate_size: int
    """Replica groups (``dp_replicate`` for FSDP2; 1 otherwise)."""
    dp_size: int
    """Data-parallel ranks in all."""


def group_label(ranks: list[int], *, mesh: DistMesh | None, rank: int, world: int) -> str:
    """Name of the mesh dim whose group (containing `rank`) has exactly these ranks, else ``world`` / the ranks."""
    ranks = sorted(ranks)
    if mesh is not None:
        for name in _LABEL_ORDER:
            if mesh.spec.size(name) > 1 and mesh.spec.group_ranks(rank, name) == ranks:
                return name
    if ranks == list(range(world)):
        return "world"
    return "ranks" + ",".join(map(str, ranks))


def dim_label(dim: str, *, mesh: DistMesh | None, rank: int, world: int) -> str:
    """A planner dim name (``dp``, ``dp_shard``...) as :func:`group_label` names the same group."""
    if mesh is None:
        return "world" if dim in (DP, DP_SHARD, DP_REPLICATE) else dim
    return group_label(mesh.spec.group_ranks(rank, dim), mesh=mesh, rank=rank, world=world)


def strategy_mesh(strategy: Any) -> DistMesh | None:
    mesh = getattr(strategy, "mesh", None)
    return mesh if isinstance(mesh, DistMesh) else None


def run_layout(strategy: Any) -> RunLayout | None:
    """The layout of the pack's MeshStrategy, or of a plain DDP-like strategy; None when unknown (DeepSpeed...).

    With pipeline stages (``pp > 1``) this describes the data-parallel treatment of the rank's own stages.
    """
    import torch.distributed as dist

    mesh = strategy_mesh(strategy)
    if mesh is not None:
        stage = getattr(strategy, "zero_stage", 3)
        # context parallelism: FSDP2 shards over dp_shard x cp, and the cp ranks average gradients with the dp ones
        dp, shard, rep = mesh.size(DP_CP), mesh.size(DP_SHARD_CP), mesh.size(DP_REPLICATE)
        offload = getattr(strategy, "offload_policy", None) is not None  # FSDP2 even without sharding
        if dp == 1:
            return RunLayout(mode="single", zero_stage=0, shard_size=1, shard_rank=0, replicate_size=1, dp_size=1)
        # parallelize_model's rule (rules.replicates): nothing to shard -> DDP's all-reduce (ZeRO-1 adds a sharded
        # optimizer)
        if rules.replicates(zero_stage=stage, dp_shard=shard, tp=mesh.size(TP), offload=offload, cp=mesh.cp_size):
            if stage == 1:
                return RunLayout(
                    mode="replicate", zero_stage=1, shard_size=dp, shard_rank=mesh.dp_rank, replicate_size=1, dp_size=dp
                )
            return RunLayout(mode="replicate", zero_stage=0, shard_size=1, shard_rank=0, replicate_size=1, dp_size=dp)
        return RunLayout(
            mode="fsdp",
            zero_stage=stage,
            shard_size=shard,
            shard_rank=mesh.local_rank(DP_SHARD_CP),
            replicate_size=rep,
            dp_size=dp,
        )
    name = type(strategy).__name__
    if name in ("DDPStrategy", "SingleDeviceStrategy"):
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return RunLayout(
            mode="replicate" if world > 1 else "single",
            zero_stage=0,
            shard_size=1,
            shard_rank=0,
            replicate_size=1,
            dp_size=world,
        )
    return None


def tp_local_shape(param: torch.Tensor) -> tuple[int, ...]:
    """Shape of the tensor FSDP2 shards: the DTensor's shard on the ``tp`` mesh dim (global shape otherwise)."""
    from torch.distributed.tensor import DTensor, Shard

    shape = list(param.shape)
    if not isinstance(param, DTensor):
        return tuple(shape)
    mesh = param.device_mesh
    for i, (name, placement) in enumerate(zip(mesh.mesh_dim_names or (), param.placements)):
        if name == TP and isinstance(placement, Shard):
            size, r = mesh.size(i), mesh.get_local_rank(i)
            chunk = -(-shape[placement.dim] // size)  # torch.chunk sizes, as DTensor shards
            shape[placement.dim] = max(0, min(chunk, shape[placement.dim] - r * chunk))
    return tuple(shape)


def optimizer_name(optimizers: list[Any]) -> str | None:
    """Planner optimizer name of the (single kind of) optimizer in use; None when the planner has no entry."""
    names = set()
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)  # LightningOptimizer
        opt = getattr(opt, "optim", opt) if type(opt).__name__ == "ZeroRedundancyOptimizer" else opt
        cls = type(opt).__name__
        if cls == "SGD":
            momentum = max(float(g.get("momentum", 0) or 0) for g in opt.param_groups)
            names.add("sgd-momentum" if momentum > 0 else "sgd")
        elif cls in _OPTIMIZERS:
            names.add(_OPTIMIZERS[cls])
        else:
            return None
    if len(names) != 1:
        return None if names else "sgd"
    return names.pop()


def precision_flag(trainer: Any) -> str:
    return lightning_precision_flag(trainer)  # "32-true" for a flag the planner does not know


def _reshards_after_forward(module: nn.Module, has_fsdp_ancestor: bool) -> bool:
    """Whether FSDP2 frees this unit's parameters after forward (so backward gathers them again)."""
    try:  # private FSDP2 state: after lazy init, `post_forward_mesh_info is None` means no reshard
        groups = module._get_fsdp_state()._fsdp_param_groups
        return any(g.post_forward_mesh_info is not None for g in groups)
    except AttributeError:  # fallback: FSDP2's default (a root keeps its parameters; units reshard)
        return has_fsdp_ancestor


def fsdp_units(module: nn.Module) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(twice-gathered shapes, once-gathered shapes) of the parameters of the ``fully_shard`` modules.

    Under ZeRO-3 a unit is gathered in forward and again in backward; a unit that FSDP2 keeps unsharded after
    forward (the root when ``reshard_after_forward`` was left to FSDP2; every unit at ZeRO-2) once. The
    pack's strategies pass ``reshard_after_forward=True`` explicitly, so their roots are gathered twice.
    Read after the first step (FSDP2 decides at its lazy init).
    """
    from torch.distributed.fsdp import FSDPModule

    owner: dict[int, bool] = {}  # parameter id -> its innermost unit reshards after forward

    def visit(mod: nn.Module, inside: bool) -> None:
        is_fsdp = isinstance(mod, FSDPModule)
        if is_fsdp:
            twice = _reshards_after_forward(mod, inside)
            for p in mod.parameters():
                owner[id(p)] = twice  # deeper units overwrite: each parameter ends at its innermost unit
        for child in mod.children():
            visit(child, inside or is_fsdp)

    visit(module, False)
    twice, once = [], []
    for p in module.parameters():
        if id(p) in owner:
            (twice if owner[id(p)] else once).append(tp_local_shape(p))
    return twice, once


def planned_memory(trainer: Any, module: nn.Module) -> planner.MemoryBreakdown | None:
    """``fsdp2_state_bytes`` for this rank's parameters and layout; None when the layout or optimizer is unknown."""
    layout = run_layout(trainer.strategy)
    opt = optimizer_name(list(trainer.optimizers))
    if layout is None or opt is None or _expert_parallel(trainer.strategy):
        return None
    state = planner.state_bytes(precision=precision_flag(trainer), optimizer=opt)
    shapes = [tp_local_shape(p) for p in module.parameters()]
    return planner.fsdp2_state_bytes(
        shapes, shard_size=layout.shard_size, rank=layout.shard_rank, state=state, zero_stage=layout.zero_stage
    )


def _expert_parallel(strategy: Any) -> bool:
    """Expert parallelism: experts sharded over ep and tokens exchanged are not in the planner yet: no plan rather
    than a wrong one (the measured rows stand alone)."""
    return getattr(strategy, "ep", 1) > 1


def planned_places(strategy: Any) -> dict[str, str]:
    """Where the strategy puts each model state (``params``/``grads``/``optimizer`` -> ``"device"``, ``"host"``
    or ``"nvme"``): an offload strategy's plan, host memory for an FSDP2 ``CPUOffloadPolicy``, else the device."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from lightning_dist.parallelize.offload import OffloadPlan

    plan = getattr(strategy, "plan", None)  # (TensorParallelStrategy.plan is its TP plan: checked by type)
    if isinstance(plan, OffloadPlan):
        return {
            "params": plan.place("parameters"),
            "grads": plan.place("gradients"),
            "optimizer": plan.place("optimizer"),
        }
    where = "host" if isinstance(getattr(strategy, "offload_policy", None), CPUOffloadPolicy) else "device"
    return dict.fromkeys(("params", "grads", "optimizer"), where)


def planned_traffic(
    trainer: Any, module: nn.Module, *, activation: dict | None = None
) -> list[planner.Collective] | None:
    """The planner's collectives per step for this run (data-parallel, plus tensor-parallel activations when
    `activation` = ``{"batch", "seq", "hidden", "bytes", "blocks", "row_parallel_per_block"}`` is known; under
    context parallelism also ``"cp_network"`` and ``"block_lists"``, for the all-to-alls)."""
    layout = run_layout(trainer.strategy)
    mesh = strategy_mesh(trainer.strategy)
    if layout is None or (mesh is not None and mesh.size(PP) > 1) or _expert_parallel(trainer.strategy):
        # pipeline: stage-boundary activations and per-micro-batch gathers are not predicted here
        return None
    cp = mesh.cp_size if mesh is not None else 1
    attention_traffic = None
    if cp > 1 and activation is not None and activation.get("cp_network") is not None:
        from lightning_dist.parallelize.cp import planned_attention_traffic

        attention_traffic = planned_attention_traffic(
            activation["cp_network"],
            activation["block_lists"],
            batch=activation["batch"],
            seq=activation["seq"] * cp,  # the blocks see this rank's seq / cp tokens
            cp=cp,
            tp=mesh.size(TP),
            bytes_per_element=activation["bytes"],
            style=getattr(trainer.strategy, "cp_style", "ulysses"),
        )
    if cp > 1 and attention_traffic is None:
        return None  # the all-to-alls need the attention's shape: no plan rather than one without them
    # traffic depends on the gather / reduce dtypes only, not on the optimizer
    state = planner.state_bytes(precision=precision_flag(trainer), optimizer="sgd")
    out: list[planner.Collective] = []
    if layout.mode == "replicate":
        num = sum(math.prod(tp_local_shape(p)) for p in module.parameters() if p.requires_grad)
        out += planner.data_parallel_traffic(
            num, state=state, zero_stage=layout.zero_stage, shard_size=layout.dp_size, replicate_size=1
        )
    elif layout.mode == "fsdp":
        twice, once = fsdp_units(module)
        # zero_stage=3 here: which units gather twice was read off FSDP2 itself (ZeRO-2 ones are in `once`)
        out += planner.fsdp2_traffic(
            twice,
            root_shapes=once,
            shard_size=layout.shard_size,
            replicate_size=layout.replicate_size,
            state=state,
            zero_stage=3,
            frozen_shapes=[tp_local_shape(p) for p in module.parameters() if not p.requires_grad],
        )
    out = planner.with_cp_dims(out, cp)  # FSDP2 over dp_shard x cp
    out += attention_traffic or []
    if activation is not None and mesh is not None and mesh.size(TP) > 1:
        out += planner.tp_activation_traffic(
            batch=activation["batch"],
            seq=activation["seq"],
            hidden=activation["hidden"],
            blocks=activation["blocks"],
            tp=mesh.size(TP),
            bytes_per_element=activation["bytes"],
            row_parallel_per_block=activation["row_parallel_per_block"],
            sequence_parallel=bool(getattr(trainer.strategy, "sequence_parallel", False)),
            gathered=activation.get("gathered", ()),
        )
    return out
