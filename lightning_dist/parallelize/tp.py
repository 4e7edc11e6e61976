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
                       holds and computes the q, k and v columns of its own heads (see ``tp_styles``)
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
the cost of one all-gather of the logits per step. We chose this over torch's ``loss_parallel``, which
saves that gather but needs the user's ``training_step`` to run inside a context manager and supports
only ``cross_entropy``.

Built-in plans (``plan="auto"`` picks the first that matches; see :mod:`.tp_auto`): ``hf`` (a HuggingFace
model's own plan), ``transformer`` (attention and MLP regions found from each block's structure) and
``mlp`` (a network of Linear layers only).

:func:`resolve_plan` validates a plan against a model in one process (meta-device models work; the
checks are in :mod:`.tp_checks`): sizes and heads divisible by ``tp``, every split output taken back and
every row-wise input produced inside its region, tied parameters split alike (:mod:`.shared`).
:func:`format_plan` prints it as a table; :func:`apply_tp` does both, parallelizes, re-ties tied
parameters and makes head-count attributes local. :mod:`.tp_probe` then checks the split model's output
on ``example_input_array`` against the unsplit one's.
"""

from __future__ import annotations

import fnmatch
import io
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import nn

from lightning_dist._compat import DTENSOR_UNEVEN_GATHER_STRIDED
from lightning_dist.parallelize.shared import check_shared_tp, retie, shared_parameters
from lightning_dist.parallelize.tp_checks import (  # noqa: F401  (GLOBAL_ATTRS_KEY, is_conv1d: public here too)
    GLOBAL_ATTRS_KEY,
    _divisibility,
    _is_norm,
    _kind,
    _linear_like,
    _local_attr_problems,
    _region_problems,
    is_conv1d,
    set_local_attrs,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

PlanValue = Union[str, Mapping[str, Any]]
Plan = Mapping[str, PlanValue]

@dataclass(frozen=True)
class _Style:
    description: str
    accepts: Callable[[nn.Module], bool]  # module kinds the style supports
    kinds: str  # those kinds, for error messages
    sp_only: bool = False  # a no-op unless sequence_parallel=True
    layouts: bool = False  # the dict form may override input/output layouts


def _any(module: nn.Module) -> bool:
    return True


_SHARDABLE = "['Linear', 'Conv1D', 'Embedding']"
STYLES: dict[str, _Style] = {
    "colwise": _Style("column-wise sharded (output features)", lambda m: _linear_like(m) or isinstance(m, nn.Embedding),
                      _SHARDABLE, layouts=True),
    "rowwise": _Style("row-wise sharded (input features; vocab-parallel for an Embedding)",
                      lambda m: _linear_like(m) or isinstance(m, nn.Embedding), _SHARDABLE, layouts=True),
    "colwise_gather": _Style("column-wise, output gathered to full", _linear_like, "['Linear', 'Conv1D']"),
    "colwise_qkv": _Style("column-wise per head of a fused [q | k | v] projection", _linear_like, "['Linear', 'Conv1D']"),
    "sequence_parallel": _Style("runs on sequence shards", _is_norm, "norms and dropout", sp_only=True),
    "sp_enter": _Style("input split into sequence shards", _any, "any module", sp_only=True),
    "region_input": _Style("input replicated (gathered with SP)", _any, "any module"),
    "sp_exit": _Style("output gathered from sequence shards", _any, "any module", sp_only=True),
    "sp_region": _Style("input split, output gathered", _any, "any module", sp_only=True),
}
@dataclass(frozen=True)
class TPEntry:
    """One module of a resolved plan."""

    fqn: str
    """Fully qualified module name."""
    style: str
    """Style name (a key of :data:`STYLES`)."""
    pattern: str
    """The plan pattern that matched."""
    module_type: str
    """Class name of the module."""
    shapes: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    """(parameter, global shape, local shape on one tensor rank)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Layout overrides from the dict form (``input``, ``output``)."""
    active: bool = True
    """False for sequence-parallel entries when sequence parallelism is off."""
    kind: str = "other"
    """``linear``, ``conv1d`` (HF, transposed weight), ``embedding`` or ``other``: picks the torch style."""


# ---- plan data ---------------------------------------------------------------------------------
def _parse_value(pattern: str, value: PlanValue, problems: list[str]) -> tuple[str, dict[str, Any]] | None:
    if isinstance(value, str):
        style, options = value, {}
    elif isinstance(value, Mapping) and isinstance(value.get("style"), str):
        style, options = value["style"], {k: v for k, v in value.items() if k != "style"}
    else:
        problems.append(f"plan[{pattern!r}]={value!r} must be a style name or a mapping with a 'style' key.")
        return None
    if style not in STYLES:
        problems.append(f"plan[{pattern!r}]: unknown style {style!r}; the styles are {sorted(STYLES)}.")
        return None
    allowed = {"input", "output"} if STYLES[style].layouts else set()
    extra = sorted(set(options) - allowed)
    if extra:
        problems.append(
            f"plan[{pattern!r}]: style {style!r} takes no option(s) {extra}"
            + (f"; it accepts {sorted(allowed)}." if allowed else ".")
        )
        return None
    for key, layout in options.items():
        if _parse_layout(layout) is None:
            problems.append(f"plan[{pattern!r}]: {key}={layout!r} is not a layout; use 'replicate' or 'shard(N)'.")
            return None
    return style, options


def _parse_layout(text: Any) -> tuple[str, int] | None:
    """'replicate' -> ('replicate', 0); 'shard(1)' -> ('shard', 1); anything else -> None."""
    if not isinstance(text, str):
        return None
    text = text.strip().lower()
    if text == "replicate":
        return ("replicate", 0)
    m = re.fullmatch(r"shard\((-?\d+)\)", text)
    return ("shard", int(m.group(1))) if m else None


def _roots(model: nn.Module) -> list[str]:
    """Where patterns are anchored: the model itself and, for a LightningModule, each of its direct children
    (the network it keeps as ``self.model``), so plans need not know that attribute name."""
    from lightning.pytorch import LightningModule

    return [""] + ([name for name, _ in model.named_children()] if isinstance(model, LightningModule) else [])


def _matches(fqn: str, pattern: str, roots: list[str]) -> bool:
    # from a root only: `decoder` names `model.decoder`, never also `model.transformer.decoder`
    return any(fnmatch.fnmatchcase(fqn, f"{root}.{pattern}" if root else pattern) for root in roots)


COLWISE = ("colwise", "colwise_gather", "colwise_qkv")
"""Styles that split a layer's output features (its weight's output dim; ``colwise_qkv`` per [q | k | v] block)."""


def shard_dims(module: nn.Module, style: str) -> dict[str, int]:
    """Which dim of each of `module`'s own parameters `style` splits over ``tp`` (torch's Colwise/RowwiseParallel)."""
    if is_conv1d(module):  # HF Conv1D keeps its weight transposed: [in_features, out_features]
        return {"weight": 1, "bias": 0} if style in COLWISE else {"weight": 0} if style == "rowwise" else {}
    linear = isinstance(module, nn.Linear)
    if style in COLWISE:
        return {"weight": 0, "bias": 0} if linear else {"weight": 1}
    if style == "rowwise":
        return {"weight": 1} if linear else {"weight": 0}
    return {}


def _local_shapes(module: nn.Module, style: str, tp: int) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]:
    dims = shard_dims(module, style)
    out = []
    for name, p in module.named_parameters(recurse=False):
        shape, local = tuple(p.shape), list(p.shape)
        if name in dims:
            local[dims[name]] //= tp
        out.append((name, shape, tuple(local)))
    return tuple(out)


def resolve_plan(model: nn.Module, plan: Plan | str, *, tp: int, sequence_parallel: bool = False) -> list[TPEntry]:
    """Match `plan` against `model` and validate it for `tp` ranks, in one process (no process group).

    `plan` is a mapping, a built-in plan name or ``"auto"``. Collects every problem and raises one
    ``ValueError``: heads or hidden sizes not divisible by `tp`, a pattern that matches no module, a
    module given two styles, a style on a module type it does not support, sequence parallelism
    requested from a plan without sequence-parallel entries.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"`tp={tp!r}` must be an integer >= 1.")
    if isinstance(plan, str):
        plan = builtin_plan(model, plan, tp=tp)[1]
    if not isinstance(plan, Mapping):
        raise TypeError(f"A tensor-parallel plan must be a mapping of pattern -> style or a name; got {type(plan).__name__}.")
    problems: list[str] = []
    parsed: dict[str, tuple[str, dict[str, Any]]] = {}
    for pattern, value in plan.items():
        if not isinstance(pattern, str) or not pattern:
            problems.append(f"plan key {pattern!r} must be a non-empty module-name pattern.")
            continue
        got = _parse_value(pattern, value, problems)
        if got is not None:
            parsed[pattern] = got
    modules = dict(model.named_modules())
    roots = _roots(model)
    claimed: dict[str, str] = {}
    entries: list[TPEntry] = []
    for pattern, (style, options) in parsed.items():
        hits = [fqn for fqn in modules if fqn and _matches(fqn, pattern, roots)]
        if not hits:
            deeper = [n for n in modules if n and fnmatch.fnmatchcase(n, "*." + pattern)][:4]
            near = [n for n, m in modules.items() if n and STYLES[style].accepts(m)][:6]
            problems.append(
                f"plan pattern {pattern!r} ({style}) matches no module of {type(model).__name__}; a plan entry"
                " must not be a silent no-op. Patterns match from the root (the model, or a LightningModule's direct children), "
                + (f"and it only names deeper paths {deeper}: write the full path." if deeper else f"and module names look like {near}.")
            )
            continue
        if len(hits) > 1 and not any(c in pattern for c in "*?["):
            problems.append(
                f"plan pattern {pattern!r} ({style}) has no wildcard but matches {len(hits)} paths {hits[:4]}"
                " (from the LightningModule and from one of its children); write the full path of the one you mean."
            )
            continue
        for fqn in hits:
            module = modules[fqn]
            if fqn in claimed:
                problems.append(
                    f"module {fqn!r} is given two styles: {claimed[fqn]} and {pattern!r} -> {style!r};"
                    " make the patterns disjoint."
                )
                continue
            claimed[fqn] = f"{pattern!r} -> {style!r}"
            if not STYLES[style].accepts(module):
                problems.append(f"module {fqn!r} is a {type(module).__name__}; style {style!r} supports only {STYLES[style].kinds}.")
                continue
            parent = modules.get(fqn.rpartition(".")[0])
            problems += _divisibility(fqn, module, style, tp, parent)
            entries.append(
                TPEntry(
                    fqn=fqn, style=style, pattern=pattern, module_type=type(module).__name__,
                    shapes=_local_shapes(module, style, tp), options=options,
                    active=sequence_parallel or not STYLES[style].sp_only, kind=_kind(module),
                )
            )
    problems += _region_problems(entries, modules)
    problems += _local_attr_problems(model, entries, tp)
    sharded = {e.fqn: shard_dims(modules[e.fqn], e.style) for e in entries if e.active}
    problems += check_shared_tp(shared_parameters(model), sharded)
    if sequence_parallel and not any(e.style in ("sp_enter", "sp_region") for e in entries) and not problems:
        problems.append(
            "sequence_parallel=True but the plan has no 'sp_enter'/'sp_region' entry marking where activations are"
            " split over the sequence; plan='auto' adds them only for blocks whose forward takes the hidden states"
            " alone (not masks or caches): add those entries by hand, or set sequence_parallel=False."
        )
    if problems:
        raise ValueError(f"Invalid tensor-parallel plan for tp={tp}:\n  - " + "\n  - ".join(problems))
    order = {name: i for i, name in enumerate(modules)}
    return sorted(entries, key=lambda e: order[e.fqn])


def format_plan(entries: list[TPEntry], *, tp: int, title: str | None = None) -> str:
    """The resolved plan as a rich table: module -> style -> global -> local shard shapes."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or f"Tensor-parallel plan (tp={tp})")
    for col in ("module", "type", "style", "global shape", "local shape"):
        table.add_column(col)
    for e in entries:
        style = e.style + ("" if e.active else " (off)")
        glob = ", ".join(f"{n} {'x'.join(map(str, s))}" for n, s, _ in e.shapes) or "-"
        local = ", ".join(f"{n} {'x'.join(map(str, l))}" for n, _, l in e.shapes) or "-"
        table.add_row(e.fqn, e.module_type, style, glob, local)
    buf = io.StringIO()
    Console(file=buf, width=140, force_terminal=False).print(table)
    return buf.getvalue()


# ---- applying ----------------------------------------------------------------------------------
def _placement(layout: str | None, default: Any) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if layout is None:
        return default
    kind, dim = _parse_layout(layout)  # validated in resolve_plan
    return Replicate() if kind == "replicate" else Shard(dim)


def _to_style(entry: TPEntry, *, sequence_parallel: bool, sequence_dim: int) -> Any:
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
    if entry.style == "colwise_qkv":
        from lightning_dist.parallelize.tp_styles import FusedQKVParallel

        return FusedQKVParallel(parts=3)
    if entry.kind == "conv1d" and entry.style in ("colwise", "colwise_gather", "rowwise"):
        from lightning_dist.parallelize.tp_styles import Conv1DParallel

        if entry.style == "colwise_gather":
            return Conv1DParallel("colwise", output_layout=rep)
        kind = entry.style
        default_out = Shard(-1) if kind == "colwise" else (seq if sequence_parallel else rep)
        return Conv1DParallel(kind, input_layout=_placement(opts.get("input"), None),
                              output_layout=_placement(opts.get("output"), default_out),
                              use_local_output=kind == "colwise" or not sequence_parallel)
    if entry.kind == "embedding" and entry.style == "rowwise":
        # vocab-parallel embedding (Megatron): token ids replicated in, the partial lookups summed to whole rows
        return RowwiseParallel(input_layouts=_placement(opts.get("input"), rep), output_layouts=_placement(opts.get("output"), rep))
    if entry.style == "colwise":
        return ColwiseParallel(input_layouts=_placement(opts.get("input"), rep), output_layouts=_placement(opts.get("output"), Shard(-1)))
    if entry.style == "colwise_gather":
        return ColwiseParallel(output_layouts=rep, use_local_output=True)
    if entry.style == "rowwise":
        # with SP the output stays a sequence-sharded DTensor: the residual stream between regions is sharded
        output = _placement(opts.get("output"), seq if sequence_parallel else rep)
        return RowwiseParallel(input_layouts=_placement(opts.get("input"), Shard(-1)), output_layouts=output,
                               use_local_output=not sequence_parallel)
    if entry.style == "sequence_parallel":
        return SequenceParallel(sequence_dim=sequence_dim, use_local_output=False)
    # DTensors (not local shards) flow between regions: uneven sequence lengths keep their true global shape
    if entry.style == "sp_enter":
        return PrepareModuleInput(input_layouts=(rep,), desired_input_layouts=(seq,), use_local_output=False)
    if entry.style == "region_input":
        # a DTensor, not a local tensor: q/k/v input gradients add up as Partial and are reduced once
        return PrepareModuleInput(input_layouts=(seq if sequence_parallel else rep,), desired_input_layouts=(rep,),
                                  use_local_output=False)
    if entry.style == "sp_exit":
        return PrepareModuleOutput(output_layouts=(seq,), desired_output_layouts=(rep,), use_local_output=True)
    assert entry.style == "sp_region", entry.style
    return PrepareModuleInputOutput(
        input_layouts=(rep,), desired_input_layouts=(seq,), output_layouts=(seq,), desired_output_layouts=(rep,),
        use_local_output=True,
    )


def _repack(x: Any) -> Any:
    """`x` with a densely strided local tensor (a DTensor stays a DTensor with the same global layout)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        local = x.to_local()
        if local.is_contiguous():
            return x
        return DTensor.from_local(local.contiguous(), x.device_mesh, x.placements, run_check=False,
                                  shape=x.shape, stride=x.stride())
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
    plan: Plan | str | None = "auto",
    sequence_parallel: bool = False,
    sequence_dim: int = 1,
) -> list[TPEntry]:
    """Parallelize `model` in place over the 1-D `tp_mesh` following `plan`; returns the resolved entries.

    The plan is validated first (same result on every rank, so a bad plan raises everywhere before
    any tensor-parallel collective). `sequence_dim`: the activation dim split by sequence parallelism.
    Call before activation checkpointing and FSDP.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    name = plan if isinstance(plan, str) else "custom"
    if plan is None or plan == "auto" or isinstance(plan, str):
        name, plan = builtin_plan(model, "auto" if plan is None else plan, tp=tp)
    entries = resolve_plan(model, plan, tp=tp, sequence_parallel=sequence_parallel)
    styles = {e.fqn: _to_style(e, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim) for e in entries if e.active}
    ties = shared_parameters(model)  # found before sharding: parallelize_module gives each owner a new parameter
    parallelize_module(model, tp_mesh, styles)
    _repack_gathered(model, {e.fqn: e.style for e in entries if e.active})
    retie(model, ties)  # resolve_plan checked that every owner is sharded alike: one DTensor serves all
    set_local_attrs(model, entries, tp)  # forwards that read a head count attribute see their local heads
    log.info("applied tensor parallelism (plan %s, tp=%d, sequence_parallel=%s) to %d modules",
             name, tp, sequence_parallel, len(styles))
    return entries


def resolve_stage_plan(owner: nn.Module, net: nn.Module, plan: Plan | str, *, tp: int) -> list[TPEntry]:
    """Resolve `plan` on `owner` for a pipelined `net` (a submodule of it) whose stages apply it piecewise.

    The plan must hold on the whole model (every pattern matches somewhere, sizes divide), and the network's
    last layer must give whole outputs on every tensor rank: the pipeline's loss sees them.
    """
    if isinstance(plan, str):
        plan = builtin_plan(owner, plan, tp=tp)[1]
    entries = resolve_plan(owner, plan, tp=tp)
    leaves = [m for m in net.modules() if not any(True for _ in m.children())]
    names = {n for n, m in owner.named_modules() if leaves and m is leaves[-1]}
    last = next((e for e in entries if e.fqn in names), None)
    if last is not None and last.style == "colwise" and "output" not in last.options:
        raise ValueError(f"tp_plan gives the network's last layer {last.fqn!r} style 'colwise': its output would"
                         " stay sharded over the tensor ranks, but pipeline_loss needs whole outputs. Use"
                         " 'colwise_gather' for it (or leave it out of the plan).")
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
    styles = {name: _to_style(by_id[id(m)], sequence_parallel=False, sequence_dim=sequence_dim)
              for name, m in part.named_modules() if name and id(m) in by_id}
    if styles:
        ties = shared_parameters(part)
        parallelize_module(part, tp_mesh, styles)
        _repack_gathered(part, {name: by_id[id(m)].style for name, m in part.named_modules() if name and id(m) in by_id})
        retie(part, ties)
        set_local_attrs(owner, entries, tp_mesh.size(), within=part)
    return len(styles)


# the built-in plans live in tp_auto (they use the helpers above); re-exported here as the public home
from lightning_dist.parallelize.tp_auto import BUILTIN_PLANS, builtin_plan, mlp_plan, transformer_plan  # noqa: E402

__all__ = [
    "BUILTIN_PLANS", "STYLES", "Plan", "TPEntry", "apply_tp", "apply_tp_entries", "builtin_plan", "format_plan", "mlp_plan",
    "resolve_plan", "resolve_stage_plan", "transformer_plan",
]
