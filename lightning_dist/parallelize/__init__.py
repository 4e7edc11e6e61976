"""Model-independent parallelism, applied by :func:`parallelize_model` in one fixed order.

Order (each step changes the model in place and logs one line):

1. tensor parallelism on ``tp`` (DTensor ``parallelize_module``): it rewrites Linear weights into
   DTensors, which must happen before anything wraps or checkpoints those modules;
2. activation checkpointing per block: after TP (it recomputes TP-parallel code as is) and before
   FSDP (FSDP must see the checkpointed blocks as its units);
3. ``torch.compile`` per block (``compile=True``): after AC, so the checkpointed block is compiled, and
   before FSDP, whose hooks then run eagerly around each compiled block;
4. data parallelism over ``dp_replicate`` x ``dp_shard``: FSDP2 ``fully_shard`` bottom-up (ZeRO-2/3,
   HSDP), or DDP-style all-reduce replication for ZeRO-1 and shard groups of size 1 — last, because it
   shards whatever TP left. With an FSDP2 offload policy, FSDP2 always (a data-parallel size of 1 too).

Pipeline splitting happens before all of this, on the whole model (see ``pipeline.py``): each stage's
module then goes through the same steps.

Before any of it, ``MeshStrategy.setup`` makes every rank hold one model (``sync.py``): rank 0's eager
tensors are broadcast to all ranks, and what is still on the meta device is materialized afterwards under
one shared seed. It runs there, not here, so that a user's ``parallelize_fn`` gets the same guarantee.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from lightning_dist.mesh import DP_REPLICATE, DP_SHARD, TP, DistMesh
from lightning_dist.parallelize.ac import apply_ac
from lightning_dist.parallelize.compile import apply_compile, compile_units
from lightning_dist.parallelize.fsdp import apply_fsdp, apply_replicate

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ParallelizeConfig:
    """What :func:`parallelize_model` applies."""

    zero_stage: Literal[1, 2, 3] = 3
    """3: parameters resharded after forward; 2: kept unsharded until backward; 1: replicated, optimizer sharded."""
    units: str | Sequence[str] = "auto"
    """FSDP units: ``"auto"`` (each block of the model's block list) or module class names."""
    activation_checkpointing: bool | Sequence[str] = False
    """True: checkpoint each block; or module class names to checkpoint."""
    mp_policy: Any | None = None
    """FSDP2 ``MixedPrecisionPolicy`` (derived from Lightning's precision flag by the strategy)."""
    offload_policy: Any | None = None
    """FSDP2 ``CPUOffloadPolicy`` or None."""
    tp_plan: Any | None = None
    """Tensor-parallel plan (see ``parallelize.tp``); used when the mesh has ``tp > 1``."""
    tp_options: dict = field(default_factory=dict)
    """Extra keyword arguments for ``apply_tp`` (e.g. ``sequence_parallel``)."""
    compile: bool | str | Sequence[str] = False
    """True: ``torch.compile`` each block; or block class names to compile."""


def parallelize_model(model: nn.Module, mesh: DistMesh, config: ParallelizeConfig) -> nn.Module:
    """Apply TP, activation checkpointing, compile and data parallelism to `model` in place, in that order."""
    # 1. tensor parallelism first: it turns weights into DTensors on the `tp` mesh
    if mesh.size(TP) > 1:
        from lightning_dist.parallelize.tp import apply_tp

        apply_tp(model, mesh.get_mesh(TP), plan=config.tp_plan, **config.tp_options)

    # 2. activation checkpointing after TP and before FSDP, so FSDP's units are the checkpointed blocks
    if config.activation_checkpointing:
        ac_units = "auto" if config.activation_checkpointing is True else config.activation_checkpointing
        apply_ac(model, units=ac_units)

    # 3. per-block compile after AC wrapping and before FSDP
    units = compile_units(config.compile)
    if units is not None:
        apply_compile(model, units=units)

    # 4. data parallelism last, over what TP left
    dp_size = mesh.size(DP_REPLICATE) * mesh.size(DP_SHARD)
    # with nothing to shard (ZeRO-1, or shard groups of one rank) the fastest correct choice is DDP's
    # bucketed all-reduce; FSDP2 over a (N, 1) mesh would issue one small all-reduce per unit (~3x slower
    # here). DTensor (TP) parameters need FSDP2, which composes with them.
    # CPU offload is an FSDP2 policy: it needs fully_shard even with one data-parallel rank (one GPU is the
    # most common reason to offload at all), so an offload policy never takes the replicate/no-op paths
    offload = config.offload_policy is not None
    replicate_only = not offload and (config.zero_stage == 1 or (mesh.size(DP_SHARD) == 1 and mesh.size(TP) == 1))
    if replicate_only:
        if dp_size > 1:
            apply_replicate(model, mesh.dp_mesh)
    elif dp_size > 1 or offload:
        apply_fsdp(
            model,
            mesh.fsdp_mesh(),
            units=config.units,
            reshard_after_forward=config.zero_stage == 3,
            mp_policy=config.mp_policy,
            offload_policy=config.offload_policy,
        )
    return model


__all__ = ["ParallelizeConfig", "parallelize_model", "apply_ac", "apply_compile", "apply_fsdp", "apply_replicate"]
