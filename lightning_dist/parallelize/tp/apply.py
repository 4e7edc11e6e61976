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


# ---- applying ----------------------------------------------------------------------------------
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

    seq, rep = Shard(sequence_dim), Replicate()
    opts = entry.options
    if entry.style == "replicate":
        return None  # whole on every rank: nothing to apply
    if entry.style == "replicate_grad_sum":
        from lightning_dist.parallelize.tp.styles import ReplicateGradSum

        return ReplicateGradSum()
    if entry.style == "colwise_qkv":
        from lightning_dist.parallelize.tp.styles import FusedQKVParallel

        return FusedQKVParallel(parts=3)
    if entry.kind == "conv1d" and entry.style in ("colwise", "colwise_gather", "rowwise"):
        from lightning_dist.parallelize.tp.styles import Conv1DParallel

        if entry.style == "colwise_gather":  # loss_parallel: the logits stay a vocabulary-sharded DTensor
            return Conv1DParallel(
                "colwise", output_layout=Shard(-1) if loss_parallel else rep, use_local_output=not loss_parallel
            )
        kind = entry.style
        default_out = Shard(-1) if kind == "colwise" else (seq if sequence_parallel else rep)
        return Conv1DParallel(
            kind,
            input_layout=_placement(opts.get("input"), None),
            output_layout=_placement(opts.get("output"), default_out),
            use_local_output=kind == "colwise" or not sequence_parallel,
        )
    if entry.kind == "embedding" and entry.style == "rowwise":
        # vocab-parallel embedding (Megatron): token ids replicated in, the partial lookups summed to whole rows
        return RowwiseParallel(
            input_layouts=_placement(opts.get("input"), rep), output_layouts=_placement(opts.get("output"), rep)
        )
    if entry.style == "colwise":
        return ColwiseParallel(
            input_layouts=_placement(opts.get("input"), rep), output_layouts=_placement(opts.get("output"), Shard(-1))
        )
    if entry.style == "colwise_gather":
        if loss_parallel:  # the logits stay a vocabulary-sharded DTensor for torch's loss_parallel (see tp_loss)
            return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return ColwiseParallel(output_layouts=rep, use_local_output=True)
    if entry.style == "rowwise":
        # with SP the output stays a sequence-sharded DTensor: the residual stream between regions is sharded
        output = _placement(opts.get("output"), seq if sequence_parallel else rep)
        return RowwiseParallel(
            input_layouts=_placement(opts.get("input"), Shard(-1)),
            output_layouts=output,
            use_local_output=not sequence_parallel,
        )
    if entry.style == "sequence_parallel":
        return SequenceParallel(sequence_dim=sequence_dim, use_local_output=False)
    # DTensors (not local shards) flow between regions: uneven sequence lengths keep their true global shape
    if entry.style == "sp_enter":
        return PrepareModuleInput(input_layouts=(rep,), desired_input_layouts=(seq,), use_local_output=False)
    if entry.style == "region_input":
        # a DTensor, not a local tensor: q/k/v input gradients add up as Partial and are reduced once
        return PrepareModuleInput(
            input_layouts=(seq if sequence_parallel else rep,), desired_input_layouts=(rep,), use_local_output=False
        )
    if entry.style == "sp_exit":
        return PrepareModuleOutput(output_layouts=(seq,), desired_output_layouts=(rep,), use_local_output=True)
    assert entry.style == "sp_region", entry.style
    return PrepareModuleInputOutput(
        input_layouts=(rep,),
        desired_input_layouts=(seq,),
        output_layouts=(seq,),
        desired_output_layouts=(rep,),
        use_local_output=True,
    )


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


def _repack_gathered(root: nn.Module, styles: dict[str, str]) -> None:
    """On torch releases whose uneven all-gathers keep the padded buffer's strides (see ``_compat``), re-pack
    what the plan gathers: in the forward, each module's inputs and outputs after its style's hooks; in the
    backward, the gradients each style's redistribution hands back (identity hooks placed before the style's)."""
    if not DTENSOR_UNEVEN_GATHER_STRIDED:
        return
    from torch.utils._pytree import tree_map_only

    def grads(tree):
        return tree_map_only(torch.Tensor, lambda t: _RepackGrad.apply(t) if t.requires_grad else t, tree)

    def values(tree):
        return tree_map_only(torch.Tensor, _repack, tree)

    for fqn in styles:
        module = root.get_submodule(fqn)
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
    """Parallelize `model` in place over the 1-D `tp_mesh` following `plan`; returns the resolved entries.

    `plan`: a :class:`ResolvedPlan` (resolved once by the caller, e.g. the strategy), or a plan to resolve
    here. Either way it is validated before anything is sharded (same result on every rank, so a bad plan
    raises everywhere before any tensor-parallel collective). `sequence_dim`: the activation dim split by sequence
    parallelism.
    `loss_parallel`: the plan's one ``colwise_gather`` layer (the output head) returns vocabulary-sharded DTensor
    logits for torch's ``loss_parallel`` instead of gathered ones (see :mod:`.loss`).
    Call before activation checkpointing and FSDP.
    """
    from torch.distributed.tensor.parallel import parallelize_module

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
    styles = {
        e.fqn: _to_style(e, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim, loss_parallel=loss_parallel)
        for e in entries
        if e.active
    }
    styles = {fqn: style for fqn, style in styles.items() if style is not None}
    ties = shared_parameters(model)  # found before sharding: parallelize_module gives each owner a new parameter
    parallelize_module(model, tp_mesh, styles)
    _repack_gathered(model, {e.fqn: e.style for e in entries if e.fqn in styles})
    retie(model, ties)  # resolve_plan checked that every owner is sharded alike: one DTensor serves all
    set_local_attrs(model, entries, tp)  # forwards that read a head count attribute see their local heads
    log.info(
        "applied tensor parallelism (plan %s, tp=%d, sequence_parallel=%s) to %d modules",
        resolved.name,
        tp,
        sequence_parallel,
        len(styles),
    )
    return entries


def resolve_stage_plan(owner: nn.Module, net: nn.Module, plan: Plan | str, *, tp: int) -> list[TPEntry]:
    """Resolve `plan` on `owner` for a pipelined `net` (a submodule of it) whose stages apply it piecewise.

    The plan must hold on the whole model (every pattern matches somewhere, sizes divide), and the network's
    last layer must give whole outputs on every tensor rank: the pipeline's loss sees them.
    """
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
    """Apply entries resolved on `owner` to the modules of `part` (a piece of `owner`, e.g. a pipeline stage).

    Entries are matched by module identity, so a plan checked once on the whole model (where every pattern
    must match something) applies to each piece under the piece's own names; entries of modules that live
    elsewhere are skipped. Returns the number of modules parallelized.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    modules = dict(owner.named_modules())
    by_id = {id(modules[e.fqn]): e for e in entries if e.active}
    styles = {
        name: _to_style(by_id[id(m)], sequence_parallel=False, sequence_dim=sequence_dim)
        for name, m in part.named_modules()
        if name and id(m) in by_id
    }
    styles = {name: style for name, style in styles.items() if style is not None}
    if styles:
        ties = shared_parameters(part)
        parallelize_module(part, tp_mesh, styles)
        _repack_gathered(part, {name: by_id[id(m)].style for name, m in part.named_modules() if name in styles})
        retie(part, ties)
        set_local_attrs(owner, entries, tp_mesh.size(), within=part)
    return len(styles)


__all__ = ["apply_tp", "apply_tp_entries", "resolve_stage_plan"]
