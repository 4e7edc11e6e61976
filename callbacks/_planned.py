"""What the planner predicts for the run in progress: the layout read off the live strategy and module.

Shared by :class:`~lightning_dist.callbacks.CommunicationLedger` and
:class:`~lightning_dist.callbacks.MemoryReport`. It mirrors the decisions of
:func:`lightning_dist.parallelize.parallelize_model` (replicate-only for ZeRO-1 and shard groups of one
rank, FSDP2 otherwise) and feeds the planner the shapes FSDP2 really shards (tensor-parallel local shapes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_dist import planner, rules
from lightning_dist.mesh import CP, DP, DP_CP, DP_REPLICATE, DP_SHARD, DP_SHARD_CP, EP, EP_OUTER, PP, TP, DistMesh
from lightning_dist.precision import precision_flag as lightning_precision_flag

# Preferred names when one group spans several dims (1x4 FSDP: dp_shard == dp; ep == dp_shard): elementary dims first.
# The recorder names a group by its ranks alone, whatever the op: when an ep group is exactly a tp group (ep = tp, the
# groups spanning tp) its all-to-alls are labelled ``tp`` with the tp all-gathers and all-reduces (ep first would label
# every tp collective ``ep``); `dim_label` maps the plan's ``ep`` rows to ``tp`` too, so planned and measured still
# meet. Likewise a dp_shard_mod_ep group equal to a dp_shard one is labelled ``dp_shard``.
_LABEL_ORDER = (TP, CP, DP_SHARD, EP, EP_OUTER, DP_REPLICATE, PP, DP_SHARD_CP, DP, DP_CP)
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


def _ep_block(mesh: DistMesh, rank: int, ep: int) -> list[int]:
    """`rank`'s block of ranks expert parallelism's groups are cut from, as ``DistMesh.expert_meshes`` does:
    ``dp_shard x cp``, or ``dp_shard x cp x tp`` when the ep groups span tp (``rules.ep_spans_tp``), in rank order
    (adjacent mesh dims, tp the fastest)."""
    spec = mesh.spec
    inner = (DP_SHARD, CP, TP) if rules.ep_spans_tp(ep, spec.size(TP)) else (DP_SHARD, CP)
    mine = spec.coords(rank)
    return [
        r
        for r in range(spec.world_size)
        if all(spec.coords(r)[d] == mine[d] for d in (PP, DP_REPLICATE, DP_SHARD, CP, TP) if d not in inner)
    ]


def _group_ranks(mesh: DistMesh, rank: int, dim: str, ep: int) -> list[int]:
    """The ranks of `rank`'s group on `dim`; expert parallelism's ``ep`` (``ep`` consecutive ranks) and
    ``dp_shard_mod_ep`` (every ``ep``-th) are cut from the block of :func:`_ep_block`, as ``DistMesh.expert_meshes``
    does."""
    if dim not in (EP, EP_OUTER):
        return mesh.spec.group_ranks(rank, dim)
    block = _ep_block(mesh, rank, ep)
    at = block.index(rank)
    if dim == EP:
        start = at - at % ep
        return block[start : start + ep]
    return block[at % ep :: ep]


def _ep_outer_size(mesh: DistMesh, ep: int) -> int:
    """Ranks of the experts' FSDP2 groups (``dp_shard_mod_ep``): the block of :func:`_ep_block` over ``ep``."""
    tp = mesh.spec.size(TP)
    block = mesh.spec.size(DP_SHARD) * mesh.spec.size(CP) * (tp if rules.ep_spans_tp(ep, tp) else 1)
    return block // ep


def group_label(ranks: list[int], *, mesh: DistMesh | None, rank: int, world: int, ep: int = 1) -> str:
    """Name of the mesh dim whose group (containing `rank`) has exactly these ranks, else ``world`` / the ranks.
    ``ep > 1``: expert parallelism's groups are named too (``ep``, ``dp_shard_mod_ep``)."""
    ranks = sorted(ranks)
    if mesh is not None:
        for name in _LABEL_ORDER:
            if name in (EP, EP_OUTER):
                size = ep if name == EP else _ep_outer_size(mesh, ep)
                if ep == 1 or size == 1:
                    continue
            elif mesh.spec.size(name) == 1:
                continue
            if _group_ranks(mesh, rank, name, ep) == ranks:
                return name
    if ranks == list(range(world)):
        return "world"
    return "ranks" + ",".join(map(str, ranks))


def dim_label(dim: str, *, mesh: DistMesh | None, rank: int, world: int, ep: int = 1) -> str:
    """A planner dim name (``dp``, ``dp_shard``, ``ep``...) as :func:`group_label` names the same group."""
    if dim not in _LABEL_ORDER:  # a group outside the mesh (torchft's across replica groups): its own name
        return dim
    if mesh is None:
        return "world" if dim in (DP, DP_SHARD, DP_REPLICATE, EP) else dim
    return group_label(_group_ranks(mesh, rank, dim, ep), mesh=mesh, rank=rank, world=world, ep=ep)


def outside_dim(strategy: Any) -> str:
    """The ledger's dim for collectives on a process group c10d does not know: the strategy's name for it
    (``replica_group``: torchft's all-reduce across fault-tolerant replica groups), else ``unregistered``."""
    return getattr(strategy, "outside_group_dim", None) or "unregistered"


def _replica_groups(strategy: Any) -> int:
    """Fault-tolerant replica groups whose gradients torchft averages every step (1: none)."""
    config = getattr(strategy, "fault_tolerance", None)
    return strategy.replica_groups if config is not None and config.sync == "step" else 1


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
    """Shape of the tensor FSDP2 shards: the DTensor's shard on the ``tp`` and ``ep`` mesh dims (global shape
    otherwise)."""
    from torch.distributed.tensor import DTensor, Shard

    shape = list(param.shape)
    if not isinstance(param, DTensor):
        return tuple(shape)
    mesh = param.device_mesh
    for i, (name, placement) in enumerate(zip(mesh.mesh_dim_names or (), param.placements)):
        if name in (TP, EP) and isinstance(placement, Shard):
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


def fsdp_units(
    module: nn.Module, *, select: Callable[[nn.Parameter], bool] | None = None
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(twice-gathered shapes, once-gathered shapes) of the parameters of the ``fully_shard`` modules (those
    `select` accepts, when given).

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
        if id(p) in owner and (select is None or select(p)):
            (twice if owner[id(p)] else once).append(tp_local_shape(p))
    return twice, once


def ep_degree(strategy: Any) -> int:
    """The strategy's expert-parallel degree (1: none)."""
    return int(getattr(strategy, "ep", 1) or 1)


def expert_param_ids(module: nn.Module) -> set[int]:
    """Ids of the parameters of the experts modules expert parallelism split (``parallelize.ep.apply_ep``)."""
    from lightning_dist.parallelize.ep import GLOBAL_EXPERTS_KEY

    return {id(p) for m in module.modules() if GLOBAL_EXPERTS_KEY in m.__dict__ for p in m.parameters(recurse=False)}


def planned_memory(
    trainer: Any, module: nn.Module
) -> tuple[planner.MemoryBreakdown, planner.MemoryBreakdown | None] | None:
    """(all model states, the routed experts' part or None without ep) this rank holds, as ``fsdp2_state_bytes``
    (under ep: :func:`lightning_dist.planner.ep_state_bytes_exact`) for its parameters and layout, a frozen parameter
    without gradient or optimizer state; None when the layout or optimizer is unknown."""
    layout = run_layout(trainer.strategy)
    opt = optimizer_name(list(trainer.optimizers))
    if layout is None or opt is None:
        return None
    state = planner.state_bytes(precision=precision_flag(trainer), optimizer=opt)
    ep = ep_degree(trainer.strategy)
    if ep > 1 and layout.mode != "fsdp":
        return None  # ep runs with FSDP2 only (the strategies refuse the rest)
    experts = expert_param_ids(module) if ep > 1 else set()
    mesh = strategy_mesh(trainer.strategy)
    tp = mesh.size(TP) if mesh is not None else 1
    tp_rank = mesh.local_rank(TP) if tp > 1 else 0

    def states(trainable: bool) -> tuple[planner.MemoryBreakdown, planner.MemoryBreakdown | None]:
        params = [p for p in module.parameters() if p.requires_grad == trainable or layout.zero_stage == 1]
        if ep > 1:
            return planner.ep_state_bytes_exact(
                [tp_local_shape(p) for p in params if id(p) not in experts],
                [tuple(p.shape) for p in params if id(p) in experts],
                shard_size=layout.shard_size,
                ep=ep,
                shard_rank=layout.shard_rank,
                state=state,
                tp=tp,
                tp_rank=tp_rank,
            )
        shapes = [tp_local_shape(p) for p in params]
        kw = dict(shard_size=layout.shard_size, rank=layout.shard_rank, state=state, zero_stage=layout.zero_stage)
        return planner.fsdp2_state_bytes(shapes, **kw), None

    if layout.zero_stage == 1:  # ZeroRedundancyOptimizer partitions every parameter it was given, frozen ones too
        total, _ = states(True)
        return total, None
    trained, frozen = states(True), states(False)
    parts = [(trained[i], frozen[i]) for i in range(2) if trained[i] is not None]
    merged = [
        planner.MemoryBreakdown(params=t.params + f.params, grads=t.grads, optimizer=t.optimizer) for t, f in parts
    ]
    if ep == 1:
        return merged[0], None
    dense, routed = merged
    total = planner.MemoryBreakdown(
        params=dense.params + routed.params,
        grads=dense.grads + routed.grads,
        optimizer=dense.optimizer + routed.optimizer,
    )
    return total, routed


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


def _ep_tp_gathers(routing: dict, activation: dict | None, *, tp: int, tp_rank: int) -> list[planner.Collective]:
    """The tp all-gathers of expert parallelism when its groups span tp (:func:`lightning_dist.planner.ep_tp_gathers`)
    for one kind of experts module: ``N`` (the tokens the tp group holds alike) from the measured block input, ``k``
    from the rows this rank sent per forward (its ``torch.tensor_split`` share of ``N``, times ``k``); the routing
    weights taken in the activations' dtype (the pack's routers). None (empty) without the block input's shape."""
    if activation is None or not routing["calls"]:
        return []
    tokens = activation["batch"] * activation["seq"]
    share = tokens // tp + (tp_rank < tokens % tp)
    if not share:
        return []
    return planner.ep_tp_gathers(
        tokens=tokens,
        hidden=routing["hidden"],
        top_k=max(1, round(routing["rows"] / routing["calls"] / share)),
        tp=tp,
        bytes_per_element=routing["bytes"],
        layers=routing["calls"],
    )


def planned_traffic(
    trainer: Any, module: nn.Module, *, activation: dict | None = None, routing: list[dict] | None = None
) -> list[planner.Collective] | None:
    """The planner's collectives per step for this run (data-parallel, plus tensor-parallel activations when
    `activation` = ``{"batch", "seq", "hidden", "bytes", "blocks", "row_parallel_per_block"}`` is known; under
    context parallelism also ``"cp_network"`` and ``"block_lists"``, for the all-to-alls). Under expert parallelism
    `routing` gives the step's exchange: per kind of experts module ``{"experts", "hidden", "bytes", "calls", "rows",
    "received"}`` (forwards, rows sent and rows received per step); without it, no plan."""
    layout = run_layout(trainer.strategy)
    mesh = strategy_mesh(trainer.strategy)
    ep = ep_degree(trainer.strategy)
    if layout is None or (mesh is not None and mesh.size(PP) > 1):
        # pipeline: stage-boundary activations and per-micro-batch gathers are not predicted here
        return None
    if ep > 1 and (routing is None or layout.mode != "fsdp"):
        return None  # the all-to-alls need the step's routing: no plan rather than one without them
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
    groups = _replica_groups(trainer.strategy)
    if groups > 1:  # fault tolerance: the plain layout's traffic, whose dp_replicate is the replica groups
        if layout.mode == "fsdp":
            layout = replace(layout, replicate_size=groups, dp_size=layout.dp_size * groups)
        else:  # a group of one data-parallel rank: DDP over itself, torchft's all-reduce across the groups
            layout = replace(layout, mode="replicate", zero_stage=0, dp_size=groups)
    # traffic depends on the gather / reduce dtypes only, not on the optimizer
    state = planner.state_bytes(precision=precision_flag(trainer), optimizer="sgd")
    out: list[planner.Collective] = []
    if layout.mode == "replicate":
        num = sum(math.prod(tp_local_shape(p)) for p in module.parameters() if p.requires_grad)
        out += planner.data_parallel_traffic(
            num, state=state, zero_stage=layout.zero_stage, shard_size=layout.dp_size, replicate_size=1
        )
    elif layout.mode == "fsdp":
        experts = expert_param_ids(module) if ep > 1 else set()
        twice, once = fsdp_units(module, select=lambda p: id(p) not in experts)
        # zero_stage=3 here: which units gather twice was read off FSDP2 itself (ZeRO-2 ones are in `once`)
        out += planner.fsdp2_traffic(
            twice,
            root_shapes=once,
            shard_size=layout.shard_size,
            replicate_size=layout.replicate_size,
            state=state,
            zero_stage=3,
            frozen_shapes=[
                tp_local_shape(p) for p in module.parameters() if not p.requires_grad and id(p) not in experts
            ],
        )
        tp = mesh.size(TP) if mesh is not None else 1
        if experts:  # each rank's E / ep experts: their own FSDP2 mesh, dp_replicate x dp_shard (x tp) / ep
            twice, once = fsdp_units(module, select=lambda p: id(p) in experts)
            sharded = planner.fsdp2_traffic(
                twice,
                root_shapes=once,
                shard_size=planner.ep_fsdp_size(layout.shard_size, ep, tp),
                replicate_size=layout.replicate_size,
                state=state,
                zero_stage=3,
                frozen_shapes=[
                    tp_local_shape(p) for p in module.parameters() if not p.requires_grad and id(p) in experts
                ],
            )
            # FSDP2 runs no collective over one rank
            out += [replace(c, dim=EP_OUTER) if c.dim == DP_SHARD else c for c in sharded if c.group_size > 1]
            for r in routing or ():
                out += planner.ep_all_to_all(
                    rows=r["rows"] / r["calls"],
                    received=r["received"] / r["calls"],
                    hidden=r["hidden"],
                    bytes_per_element=r["bytes"],
                    experts=r["experts"],
                    ep=ep,
                    layers=r["calls"],
                )
                if rules.ep_spans_tp(ep, tp):
                    out += _ep_tp_gathers(r, activation, tp=tp, tp_rank=mesh.local_rank(TP))
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
    if groups > 1:  # the gradient all-reduce that crosses the groups is torchft's, on its own process group
        across = (DP_REPLICATE, DP) if layout.mode == "replicate" else (DP_REPLICATE,)
        out = [
            replace(c, dim=outside_dim(trainer.strategy)) if c.op == "all_reduce" and c.dim in across else c
            for c in out
        ]
    return out
