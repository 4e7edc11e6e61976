"""Tensor parallelism from declarative plans, applied with DTensor's ``parallelize_module``.

A **plan** is plain data (writable in LightningCLI YAML): a mapping from glob patterns over fully
qualified module names to a style name, or to ``{"style": ..., "input": layout, "output": layout}``::

    {"blocks.*.attn.q": "colwise", "blocks.*.attn.proj": "rowwise", "blocks.*.norm1": "sequence_parallel"}

A pattern matches from the root: the module's full name, or for a LightningModule its name under one of
the LightningModule's children (``blocks.*.attn.q`` matches ``model.blocks.3.attn.q``; ``decoder`` never
also matches ``model.transformer.decoder``). Styles (``colwise``/``rowwise`` take ``nn.Linear``,
``nn.Embedding`` and HuggingFace's ``Conv1D``; ``rowwise`` on an embedding is vocab-parallel):

=====================  ========================================================================================
``colwise``            Linear/Embedding sharded on its output features; replicated input, sharded local output
``rowwise``            Linear/Embedding sharded on its input features; output all-reduced (reduce-scattered
                       over the sequence with sequence parallelism)
``colwise_gather``     ``colwise`` whose output is all-gathered back to the full tensor: for output heads, so
                       the loss is the ordinary loss on full logits (see "Loss" below)
``colwise_qkv``        a fused projection laid out ``[q | k | v]`` (GPT-2's ``c_attn``) split per head: each rank
                       holds and computes the q, k and v columns of its own heads (see ``tp.styles``)
``sequence_parallel``  norm/dropout run on sequence shards (only with ``sequence_parallel=True``)
``sp_enter``           split the module's replicated input into sequence shards (first block; SP only)
``region_input``       the input of a parallel region (``attn``, ``mlp``): all-gathered from sequence shards
                       with SP; in both modes passed on as one replicated DTensor, so the input gradients
                       of all the region's column-wise layers are summed locally and reduced once
``sp_exit``            all-gather the module's sequence-sharded output (last block; SP only)
``sp_region``          ``sp_enter`` and ``sp_exit`` on one module (a single block; SP only)
=====================  ========================================================================================

Layouts in the dict form: ``"replicate"`` or ``"shard(N)"``. The ``sp_*`` and ``sequence_parallel``
entries are no-ops when ``sequence_parallel=False``, so one plan serves both modes.

**Loss**: an output layer given ``colwise_gather`` returns the full logits on every tensor rank
(``output_layouts=Replicate()``, ``use_local_output=True``), so any user loss is correct unchanged, at
the cost of one all-gather of the logits per step and a ``[tokens x vocab]`` tensor on every tp rank. That is the
default. ``loss_parallel=True`` keeps that layer's logits sharded on the vocabulary and runs the step inside
torch's ``loss_parallel``, which supports only cross-entropy (:mod:`.loss`; other uses are refused).

Built-in plans (``tp_plan="auto"`` picks the first that matches; see :mod:`.auto`): ``hf`` (a HuggingFace
model's own plan), ``transformer`` (attention and MLP regions found from each block's structure) and
``mlp`` (a network of Linear layers only).

:mod:`.vocab` holds the words a plan is written in (module kinds, :data:`~.vocab.STYLES`,
:class:`~.vocab.TPEntry`, pattern matching). :func:`~.plan.resolve_plan` (:mod:`.plan`) validates a plan
against a model in one process (meta-device models work; the checks are in :mod:`.checks`): sizes and heads
divisible by ``tp``, every split output taken back and every row-wise input produced inside its region, tied
parameters split alike (:mod:`.shared`). :func:`~.plan.resolve_tp_plan` picks a built-in plan and resolves it
once into a :class:`~.plan.ResolvedPlan`; :func:`~.plan.format_plan` prints it as a table; :func:`apply_tp`
(here) applies it (resolving first when given a plan), re-ties tied parameters and makes head-count attributes
local. :mod:`.probe` then checks the split model's output
on ``example_input_array`` against the unsplit one's.
"""

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
    from lightning.fabric.utilities.apply_func import apply_to_collection

    def grads(tree):
        return apply_to_collection(tree, torch.Tensor, lambda t: _RepackGrad.apply(t) if t.requires_grad else t)

    def values(tree):
        return apply_to_collection(tree, torch.Tensor, _repack)

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
