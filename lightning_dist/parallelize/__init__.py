"""Model-independent parallelism, applied by :func:`parallelize_model` in one fixed order.

Notes: docs/internals.md, "lightning_dist/parallelize/__init__.py"."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from lightning_dist.mesh import DP_CP, DP_SHARD, TP, DistMesh
from lightning_dist.parallelize.ac import ACOption, apply_ac, apply_offload_activations, parse_ac
from lightning_dist.parallelize.compile import apply_compile, compile_units, tp_eager_blocks
from lightning_dist.parallelize.fsdp import apply_fsdp, apply_fsdp_to_stage, apply_replicate
from lightning_dist.rules import ep_spans_tp, replicates

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ParallelizeConfig:
    """What :func:`parallelize_model` applies."""

    zero_stage: Literal[1, 2, 3] = 3
    """3: parameters resharded after forward; 2: kept unsharded until backward; 1: replicated, optimizer sharded."""
    units: str | Sequence[str] = "auto"
    """FSDP units: ``"auto"`` (each block of the model's block list) or module class names."""
    activation_checkpointing: ACOption = False
    """True/"full", "selective", "every:N" or block class names (see ``parallelize.ac``)."""
    selective_ac_ops: Sequence[Any] | None = None
    """Ops whose outputs "selective" keeps; None: ``ac.SELECTIVE_AC_OPS``."""
    offload_activations: bool = False
    """Offload the tensors the uncheckpointed blocks save for backward to pinned host memory (CUDA)."""
    blocks: Sequence[nn.Module] | None = None
    """The blocks of `model` (a pipeline stage's); None: found from the model's block list."""
    mp_policy: Any | None = None
    """FSDP2 ``MixedPrecisionPolicy`` (derived from Lightning's precision flag by the strategy)."""
    offload_policy: Any | None = None
    """FSDP2 ``CPUOffloadPolicy`` or None."""
    tp_plan: Any | None = None
    """Tensor-parallel plan, used when the mesh has ``tp > 1``: a ``ResolvedPlan`` (``parallelize.tp_plan``; the
    strategy resolves it once per setup), applied as it is, or a plan ``apply_tp`` resolves (see ``parallelize.tp``)."""
    tp_options: dict = field(default_factory=dict)
    """Extra keyword arguments for ``apply_tp`` (e.g. ``sequence_parallel``)."""
    compile: bool | str | Sequence[str] = False
    """True: ``torch.compile`` each block; or block class names to compile."""
    tp_entries: Sequence[Any] | None = None
    """A plan already resolved on `tp_owner` (``TPEntry`` list), applied to the modules `model` holds; else
    `tp_plan`."""
    tp_owner: Any | None = None
    """The module `tp_entries` were resolved on (the whole model, of which `model` is a piece)."""
    recompute_context: Any | None = None
    """A context-manager factory the recomputation of checkpointed blocks runs under (context parallelism's
    attention mode, which torch's autograd engine does not carry into backward)."""
    split_backward: bool = False
    """The pipeline schedule runs input- and weight-gradient passes (zero-bubble): checkpointed blocks are
    recomputed in each (``apply_ac(split_backward=True)``)."""
    ep: int = 1
    """Expert parallelism: each experts module split over ``ep`` ranks of ``dp_shard x cp`` (x ``tp``: ``rules``)."""
    ep_capacity_factor: float | None = None
    """None: every token reaches the experts it chose; a number: ep's dispatch drops pairs past each expert's capacity
    (``parallelize.ep.expert_capacity``), which changes the result."""
    fsdp_root: Literal["children", "model"] = "children"
    """FSDP2/replicate roots: the model's direct children (a LightningModule) or the model itself (a pipeline stage)."""


def parallelize_model(model: nn.Module, mesh: DistMesh, config: ParallelizeConfig) -> nn.Module:
    """Apply TP, activation checkpointing, compile and data parallelism to `model` in place, in that order."""
    # 1. tensor parallelism first: it turns weights into DTensors on the `tp` mesh
    tp_styles: dict[nn.Module, str] = {}  # {module: style} of the applied plan (compile leaves some blocks eager)
    if mesh.size(TP) > 1:
        from lightning_dist.parallelize.tp.apply import apply_tp, apply_tp_entries

        if config.tp_entries is not None:  # a piece of a model (pipeline stage): the whole model's plan
            apply_tp_entries(model, mesh.get_mesh(TP), list(config.tp_entries), config.tp_owner)
            tp_styles = {config.tp_owner.get_submodule(e.fqn): e.style for e in config.tp_entries if e.active}
        else:
            entries = apply_tp(model, mesh.get_mesh(TP), plan=config.tp_plan, **config.tp_options)
            tp_styles = {model.get_submodule(e.fqn): e.style for e in entries if e.active}

    # 1b. expert parallelism after TP and before FSDP: each rank keeps its experts, which FSDP then shards further
    experts: list[nn.Module] = []
    experts_fsdp_mesh = None
    if config.ep > 1:
        from lightning_dist.parallelize.ep import apply_ep

        ep_mesh, experts_fsdp_mesh = mesh.expert_meshes(config.ep)
        tp_group = mesh.group(TP) if ep_spans_tp(config.ep, mesh.size(TP)) else None
        experts = [model.get_submodule(n) for n in apply_ep(model, ep_mesh, tp_group, config.ep_capacity_factor)]

    # 2. activation checkpointing after TP and before FSDP, so FSDP's units are the checkpointed blocks
    ac = parse_ac(config.activation_checkpointing, ops=config.selective_ac_ops)
    blocks: Any = list(config.blocks) if config.blocks is not None else "auto"
    checkpointed: list[nn.Module] = []
    if ac is not None:
        checkpointed = apply_ac(
            model,
            units=blocks if ac.units == "auto" else ac.units,
            mode=ac.mode,
            every=ac.every,
            ops=ac.ops,
            recompute_context=config.recompute_context,
            split_backward=config.split_backward,
        )
    if config.offload_activations:  # the blocks AC left keep their saved tensors: those go to host memory
        apply_offload_activations(model, units=blocks, skip=checkpointed)

    # 3. per-block compile after AC wrapping and before FSDP (tensor-parallel blocks torch compiles wrong stay eager)
    units = compile_units(config.compile)
    if units is not None:
        apply_compile(model, units=units, eager=tp_eager_blocks(model, tp_styles, units) if tp_styles else None)

    # 4. data parallelism last, over what TP left: DDP-style replication or FSDP2 (lightning_dist.rules.replicates)
    # the ranks that average gradients: dp_replicate x dp_shard, times cp (context peers hold parts of the sequences)
    dp_size = mesh.size(DP_CP)
    # CPU offload is an FSDP2 policy: it needs fully_shard even with one data-parallel rank (one GPU is the
    # most common reason to offload at all), so an offload policy never takes the replicate/no-op paths
    offload = config.offload_policy is not None
    if config.fsdp_root == "model":
        # a pipeline stage: its own FSDP2 root over every data-parallel dim (PipelineStage runs the stage module)
        if dp_size > 1 or offload:
            apply_fsdp_to_stage(
                model,
                mesh.fsdp_mesh(),
                units=config.units,
                reshard_after_forward=config.zero_stage == 3,
                mp_policy=config.mp_policy,
                offload_policy=config.offload_policy,
                experts=[(m, experts_fsdp_mesh) for m in experts],
            )
        return model
    if replicates(
        zero_stage=config.zero_stage, dp_shard=mesh.size(DP_SHARD), tp=mesh.size(TP), offload=offload, cp=mesh.cp_size
    ):
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
            experts=[(m, experts_fsdp_mesh) for m in experts],
        )
    return model


def pipeline_model(
    model: nn.Module,
    mesh: DistMesh,
    config: ParallelizeConfig,
    *,
    split: Any,
    stage_indices: Sequence[int],
) -> tuple[nn.Module, list[nn.Module]]:
    """Split `model` into the pipeline stages `stage_indices` of `split`, then parallelize each stage's module.

    Returns ``(container, stages)``: one stage module (``split.build_stage_module``)
    holding every part this rank runs (what the LightningModule keeps: its parameters under their single-device
    names) and one stage module per local stage (what ``PipelineStage`` runs), sharing those parts. Each stage goes
    through :func:`parallelize_model` with `config`: its blocks are the units of activation checkpointing and
    compile (``True``); FSDP2's ``"auto"`` units are the blocks of its block list. With ``tp > 1``,
    ``config.tp_entries`` must hold the plan resolved on ``config.tp_owner`` (a module containing `model`), still
    holding `model`.
    """
    from dataclasses import replace

    from lightning_dist.parallelize.pipeline.split import build_stage_module
    from lightning_dist.parallelize.pipeline.stages import stage_blocks

    if mesh.size(TP) > 1 and (config.tp_entries is None or config.tp_owner is None):
        raise ValueError("pipeline_model with tp > 1 needs `tp_entries` resolved on `tp_owner` (the whole model).")
    container = build_stage_module(model, split, stage_indices)
    stages = [build_stage_module(model, split, [s]) for s in stage_indices]
    for stage in stages:
        blocks = stage_blocks(stage)
        auto = lambda option: blocks if option is True or option == "auto" else option  # noqa: E731
        stage_config = replace(
            config,
            fsdp_root="model",
            blocks=blocks,
            compile=auto(config.compile) if config.compile is not False else False,
        )
        parallelize_model(stage, mesh, stage_config)
    log.info("pipeline: %d local stage(s) %s parallelized", len(stages), list(stage_indices))
    return container, stages


__all__ = [
    "ParallelizeConfig",
    "parallelize_model",
    "pipeline_model",
    "apply_ac",
    "apply_offload_activations",
    "apply_compile",
    "apply_fsdp",
    "apply_fsdp_to_stage",
    "apply_replicate",
]
