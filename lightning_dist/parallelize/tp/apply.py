"""Tensor parallelism from declarative plans, applied with DTensor's ``parallelize_module``.

Notes: docs/internals.md, "lightning_dist/parallelize/tp/apply.py"."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lightning_dist._compat import DTENSOR_UNEVEN_GATHER_STRIDED
from lightning_dist.parallelize.shared import retie, shared_parameters
from lightning_dist.parallelize.tp.checks import set_local_attrs
from lightning_dist.parallelize.tp.plan import ResolvedPlan, resolve_tp_plan
from lightning_dist.parallelize.tp.vocab import Plan, TPEntry, parse_layout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


def _placement(layout: str | None, default: Any) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if layout is None:
        return default
    kind, dim = parse_layout(layout)  # validated in resolve_plan
    return Replicate() if kind == "replicate" else Shard(dim)


def _to_style(
    entry: TPEntry, *, sequence_parallel: bool, sequence_dim: int, loss_parallel: bool = False
) -> Optional[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    from lightning_dist.parallelize.tp.styles import Conv1DParallel, FusedQKVParallel, ReplicateGradSum

    seq, rep = Shard(sequence_dim), Replicate()
    style, opts = entry.style, entry.options
    if style == "replicate":
        return None  # whole on every rank: nothing to apply
    if style == "replicate_grad_sum":
        return ReplicateGradSum()
    if style == "colwise_qkv":
        return FusedQKVParallel(parts=3)
    if style == "sequence_parallel":
        return SequenceParallel(sequence_dim=sequence_dim, use_local_output=False)
    # DTensors (not local shards) flow between regions: uneven sequence lengths keep their true global shape
    if style == "sp_enter":
        return PrepareModuleInput(input_layouts=(rep,), desired_input_layouts=(seq,), use_local_output=False)
    if style == "region_input":
        # a DTensor, not a local tensor: q/k/v input gradients add up as Partial and are reduced once
        return PrepareModuleInput(
            input_layouts=(seq if sequence_parallel else rep,), desired_input_layouts=(rep,), use_local_output=False
        )
    if style == "sp_exit":
        return PrepareModuleOutput(output_layouts=(seq,), desired_output_layouts=(rep,), use_local_output=True)
    if style == "sp_region":
        return PrepareModuleInputOutput(
            input_layouts=(rep,),
            desired_input_layouts=(seq,),
            output_layouts=(seq,),
            desired_output_layouts=(rep,),
            use_local_output=True,
        )
    if style == "colwise_gather":  # loss_parallel: the logits stay a vocabulary-sharded DTensor (see .loss)
        layouts = (rep, Shard(-1) if loss_parallel else rep, not loss_parallel)
    elif style == "colwise":
        layouts = (_placement(opts.get("input"), rep), _placement(opts.get("output"), Shard(-1)), True)
    elif entry.kind == "embedding":  # rowwise: vocab-parallel (Megatron), the partial lookups summed to whole rows
        layouts = (_placement(opts.get("input"), rep), _placement(opts.get("output"), rep), True)
    else:
        assert style == "rowwise", style
        # with SP the output stays a sequence-sharded DTensor: the residual stream between regions is sharded
        output = _placement(opts.get("output"), seq if sequence_parallel else rep)
        layouts = (_placement(opts.get("input"), Shard(-1)), output, not sequence_parallel)
    inputs, outputs, local = layouts
    kind = "rowwise" if style == "rowwise" else "colwise"
    if entry.kind == "conv1d":
        return Conv1DParallel(kind, input_layout=inputs, output_layout=outputs, use_local_output=local)
    torch_style = RowwiseParallel if kind == "rowwise" else ColwiseParallel
    return torch_style(input_layouts=inputs, output_layouts=outputs, use_local_output=local)


def _repack(x: Any) -> Any:
    """`x` with a densely strided local tensor (a DTensor stays a DTensor with the same global layout)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        local = x.to_local()
        if local.is_contiguous():
            return x
        return DTensor.from_local(
            local.contiguous(), x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
        )
    return x.contiguous() if isinstance(x, torch.Tensor) else x


class _RepackGrad(torch.autograd.Function):
    """Identity whose backward re-packs the incoming gradient (see ``_repack_gathered``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _repack(grad)


def _repack_gathered(root: nn.Module, names: list[str]) -> None:
    """On torch releases whose uneven all-gathers keep the padded buffer's strides (see ``_compat``), re-pack what the
    named modules' styles gather: inputs and outputs in the forward, the gradients they hand back in the backward."""
    if not DTENSOR_UNEVEN_GATHER_STRIDED:
        return
    from torch.utils._pytree import tree_map_only

    def grads(tree):
        return tree_map_only(torch.Tensor, lambda t: _RepackGrad.apply(t) if t.requires_grad else t, tree)

    def values(tree):
        return tree_map_only(torch.Tensor, _repack, tree)

    for name in names:
        module = root.get_submodule(name)
        module.register_forward_pre_hook(lambda m, args: grads(args), prepend=True)
        module.register_forward_pre_hook(lambda m, args: values(args))
        module.register_forward_hook(lambda m, args, out: grads(out), prepend=True)
        module.register_forward_hook(lambda m, args, out: values(out))


def apply_tp(
    model: nn.Module,
    tp_mesh: "DeviceMesh",
    *,
    plan: Plan | str | ResolvedPlan | None = "auto",
    sequence_parallel: bool = False,
    sequence_dim: int = 1,
    loss_parallel: bool = False,
) -> list[TPEntry]:
    """Parallelize `model` in place over the 1-D `tp_mesh` following `plan`; returns the resolved entries. Call before
    activation checkpointing and FSDP.

    `plan`: a :class:`ResolvedPlan` (resolved once by the caller), or a plan to resolve and check here, before anything
    is sharded. `sequence_dim`: the activation dim split by sequence parallelism. `loss_parallel`: the plan's one
    ``colwise_gather`` layer (the output head) returns vocabulary-sharded DTensor logits (see :mod:`.loss`).
    """
    tp = tp_mesh.size()
    resolved = (
        plan
        if isinstance(plan, ResolvedPlan)
        else resolve_tp_plan(model, plan, tp=tp, sequence_parallel=sequence_parallel)
    )
    if (resolved.tp, resolved.sequence_parallel) != (tp, sequence_parallel):
        raise ValueError(
            f"apply_tp: the plan was resolved for tp={resolved.tp}, sequence_parallel={resolved.sequence_parallel}"
            f" but the mesh has tp={tp} and sequence_parallel={sequence_parallel}; resolve it again."
        )
    entries = list(resolved.entries)
    if loss_parallel:
        from lightning_dist.parallelize.tp.loss import head_entry

        head_entry(entries)  # exactly one colwise_gather layer, or a ValueError
    options = {"sequence_parallel": sequence_parallel, "sequence_dim": sequence_dim, "loss_parallel": loss_parallel}
    count = _parallelize(model, tp_mesh, {e.fqn: e for e in entries if e.active}, model, entries, **options)
    log.info(
        "applied tensor parallelism (plan %s, tp=%d, sequence_parallel=%s) to %d modules",
        resolved.name,
        tp,
        sequence_parallel,
        count,
    )
    return entries


def _parallelize(
    part: nn.Module,
    tp_mesh: "DeviceMesh",
    planned: dict[str, TPEntry],
    owner: nn.Module,
    entries: list[TPEntry],
    **options: Any,
) -> int:
    """Apply {module name in `part`: entry} to `part`, a piece of `owner` (or `owner` itself) whose plan is `entries`;
    returns the number of modules parallelized. `options`: those of :func:`_to_style`."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = {name: _to_style(e, **options) for name, e in planned.items()}
    styles = {name: style for name, style in styles.items() if style is not None}
    if styles:
        ties = shared_parameters(part)  # found before sharding: parallelize_module gives each owner a new parameter
        parallelize_module(part, tp_mesh, styles)
        _repack_gathered(part, list(styles))
        for name in (n for n in styles if planned[n].copy_output):  # torch's local view cannot change in place
            part.get_submodule(name).register_forward_hook(lambda m, args, out: out.clone())
        retie(part, ties)  # resolve_plan checked that every owner is sharded alike: one DTensor serves all
        # forwards that read a head count attribute see their local heads
        set_local_attrs(owner, entries, tp_mesh.size(), within=None if part is owner else part)
    return len(styles)


def resolve_stage_plan(owner: nn.Module, net: nn.Module, plan: Plan | str, *, tp: int) -> list[TPEntry]:
    """Resolve `plan` on `owner` (the whole model) for a pipelined `net`, a submodule of it whose stages apply it
    piecewise; the network's last layer must give whole outputs on every tensor rank: the pipeline's loss sees them."""
    entries = list(resolve_tp_plan(owner, plan, tp=tp).entries)
    leaves = [m for m in net.modules() if not any(True for _ in m.children())]
    names = {n for n, m in owner.named_modules() if leaves and m is leaves[-1]}
    last = next((e for e in entries if e.fqn in names), None)
    if last is not None and last.style == "colwise" and "output" not in last.options:
        raise ValueError(
            f"tp_plan gives the network's last layer {last.fqn!r} style 'colwise': its output would"
            " stay sharded over the tensor ranks, but pipeline_loss needs whole outputs. Use"
            " 'colwise_gather' for it (or leave it out of the plan)."
        )
    return entries


def apply_tp_entries(
    part: nn.Module,
    tp_mesh: "DeviceMesh",
    entries: list[TPEntry],
    owner: nn.Module,
    *,
    sequence_dim: int = 1,
) -> int:
    """Apply entries resolved on `owner` to the modules of `part` (a piece of `owner`, e.g. a pipeline stage), matched
    by module identity (entries of modules elsewhere are skipped). Returns the number of modules parallelized."""
    modules = dict(owner.named_modules())
    by_id = {id(modules[e.fqn]): e for e in entries if e.active}
    planned = {name: by_id[id(m)] for name, m in part.named_modules() if name and id(m) in by_id}
    return _parallelize(part, tp_mesh, planned, owner, entries, sequence_parallel=False, sequence_dim=sequence_dim)


__all__ = ["apply_tp", "apply_tp_entries", "resolve_stage_plan"]
