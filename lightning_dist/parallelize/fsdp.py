"""Data-parallel wrapping over the mesh's data-parallel dims: FSDP2 (ZeRO-2/3, HSDP) or replication (ZeRO-1)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_dist._compat import fully_shard_api
from lightning_dist.parallelize.shared import check_shared_units, shared_parameters
from lightning_dist.parallelize.units import select_units

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


def roots(model: nn.Module) -> list[nn.Module]:
    """The modules to wrap last, as FSDP/replicate roots: the model's direct children that hold parameters.

    A LightningModule's forward is often not what runs (``training_step`` calls ``self.model``), so the
    root must be the submodule whose forward does run: FSDP2 treats the first wrapped module to run
    forward as the root of its tree.
    """
    if any(True for _ in model.parameters(recurse=False)):
        raise ValueError(
            f"{type(model).__name__} holds parameters directly"
            f" ({[n for n, _ in model.named_parameters(recurse=False)]});"
            " move them into a submodule (e.g. `self.model = nn.Module(...)`) so that it can be sharded."
        )
    return [child for child in model.children() if any(True for _ in child.parameters())]


def _refuse_split_ties(model: nn.Module, units: list[str]) -> None:
    """Tied parameters must lie in one unit (a block, or one root: each direct child of `model` is one)."""
    roots_ = [n for n, c in model.named_children() if any(True for _ in c.parameters())]
    problems = check_shared_units(shared_parameters(model), [*units, *roots_])
    if problems:
        raise ValueError("Cannot shard the model:\n  - " + "\n  - ".join(problems))


def _shard_kwargs(mesh: Any, reshard_after_forward: Any, mp_policy: Any, offload_policy: Any) -> dict[str, Any]:
    """``fully_shard``'s keyword arguments (the policies only when given: FSDP2's defaults otherwise)."""
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    return kwargs


def apply_fsdp(
    model: nn.Module,
    mesh: "DeviceMesh",
    *,
    units: str | Sequence[str] = "auto",
    reshard_after_forward: bool = True,
    mp_policy: Any | None = None,
    offload_policy: Any | None = None,
    experts: Sequence[tuple[nn.Module, "DeviceMesh"]] = (),
) -> int:
    """``fully_shard`` each unit bottom-up, then each root; returns the number of FSDP groups.

    `experts`: (experts module, its FSDP2 mesh) of expert parallelism, sharded first on their own mesh (the
    data-parallel ranks left besides ``ep``).

    A 1-D `mesh` shards fully over it; a 2-D ``(dp_replicate, dp_shard)`` mesh gives hybrid sharding
    (shard inside a group, all-reduce across groups). ``reshard_after_forward=False`` keeps parameters
    unsharded between forward and backward (ZeRO-2); True frees them after forward (ZeRO-3).
    """
    fully_shard = fully_shard_api()[0]
    kwargs = _shard_kwargs(mesh, reshard_after_forward, mp_policy, offload_policy)
    picked = select_units(model, units)
    _refuse_split_ties(model, [n for n, _ in picked])
    for module, experts_mesh in experts:
        fully_shard(module, **{**kwargs, "mesh": experts_mesh})
    # bottom-up: inner units first so each root only holds what no unit claimed
    for _, module in reversed(picked):
        fully_shard(module, **kwargs)
    tops = roots(model)
    # a root's parameters are needed again at once by backward: FSDP2's None keeps the root unsharded
    # after forward (one all-gather fewer per step) and still reshards it after backward
    root_kwargs = {**kwargs, "reshard_after_forward": None if reshard_after_forward else False}
    for module in tops:
        fully_shard(module, **root_kwargs)
    log.info("applied FSDP2 to %d units and %d roots on mesh %s", len(picked), len(tops), mesh)
    return len(picked) + len(tops)


def apply_fsdp_to_stage(
    stage: nn.Module,
    mesh: "DeviceMesh",
    *,
    units: Any = "auto",
    reshard_after_forward: bool = False,
    mp_policy: Any | None = None,
    offload_policy: Any | None = None,
    experts: Sequence[tuple[nn.Module, "DeviceMesh"]] = (),
) -> int:
    """FSDP2 on the data-parallel mesh for one pipeline stage module: its units first, then the stage as root.

    The stage module must be its own FSDP root so ``PipelineStage`` can defer the gradient reduction to the
    last micro-batch (:func:`apply_fsdp`'s roots are the LightningModule's children, which never run here).
    `units`: ``"auto"`` (the stage's ``fsdp_units()``: the blocks of its block list), class names or modules; of
    those, a block run twice or sharing a parameter with the rest of the stage stays in the root unit. Returns
    the unit count.
    """
    fully_shard = fully_shard_api()[0]
    kwargs = _shard_kwargs(mesh, reshard_after_forward, mp_policy, offload_policy)
    for module, experts_mesh in experts:  # expert parallelism's experts: their own FSDP2 mesh (as in apply_fsdp)
        fully_shard(module, **{**kwargs, "mesh": experts_mesh})
    if isinstance(units, str) and units == "auto":
        blocks = stage.fsdp_units()
    else:
        blocks = [m for _, m in select_units(stage, units)]
    picked = unshared_blocks(blocks, stage)
    for block in picked:
        fully_shard(block, **kwargs)
    fully_shard(stage, **kwargs)
    return len(picked) + 1


def unshared_blocks(blocks: Sequence[nn.Module], stage: nn.Module) -> list[nn.Module]:
    """The blocks to shard as their own FSDP units: those run once per forward and sharing no parameter.

    A block used twice (or holding a parameter another part of the stage also uses) stays with the stage's
    root unit, which keeps it gathered for the whole forward and backward of the stage.
    """
    uses: dict[int, int] = {}
    for _, p in stage.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    out, seen = [], set()
    for block in blocks:
        if id(block) in seen:
            continue
        seen.add(id(block))
        own = {id(p): 0 for p in block.parameters()}
        for _, p in block.named_parameters(remove_duplicate=False):
            own[id(p)] += 1
        if sum(b is block for b in blocks) == 1 and all(uses[k] == n for k, n in own.items()):
            out.append(block)
    return out


def apply_replicate(model: nn.Module, mesh: "DeviceMesh") -> int:
    """Plain data parallelism (gradients all-reduced) over a 1-D mesh, keeping module classes and keys (ZeRO-1)."""
    from torch.distributed._composable import replicate

    _refuse_split_ties(model, [])
    tops = roots(model)
    for module in tops:
        replicate(module, process_group=mesh.get_group())
    log.info("applied replicate (all-reduce) to %d roots over %d ranks", len(tops), mesh.size())
    return len(tops)


def offload_policies(model: nn.Module) -> dict[str, Any]:
    """Module name -> the offload policy FSDP2 applied to each ``fully_shard`` module of `model`.

    FSDP2 has no public getter for it; this reads its parameter group's ``offload_policy`` (a module
    without one, on another torch, maps to None). Used by the offload report and the tests to tell that
    ``CPUOffloadPolicy`` is really in force, not only configured.
    """
    from torch.distributed.fsdp import FSDPModule

    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            out[name] = getattr(group, "offload_policy", None)
    return out
