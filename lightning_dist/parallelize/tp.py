"""Tensor parallelism from declarative plans, applied with DTensor's ``parallelize_module``.

A **plan** is plain data (writable in LightningCLI YAML): a mapping from glob patterns over fully
qualified module names to a style name, or to ``{"style": ..., "input": layout, "output": layout}``::

    {"blocks.*.attn.q": "colwise", "blocks.*.attn.proj": "rowwise", "blocks.*.norm1": "sequence_parallel"}

A pattern matches a module whose full name, or any dotted suffix of it, matches the glob
(``blocks.*.attn.q`` matches ``model.blocks.3.attn.q``). Styles:

=====================  ========================================================================================
``colwise``            Linear/Embedding sharded on its output features; replicated input, sharded local output
``rowwise``            Linear/Embedding sharded on its input features; output all-reduced (reduce-scattered
                       over the sequence with sequence parallelism)
``colwise_gather``     ``colwise`` whose output is all-gathered back to the full tensor: for output heads, so
                       the loss is the ordinary loss on full logits (see "Loss" below)
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

Built-in plans (``plan="auto"`` picks the first that matches): ``gpt`` and ``vit`` (the pack's example
models: transformer blocks plus the output head), ``transformer`` (any block list whose blocks have
``attn.{q,k,v}`` or a head-major fused ``attn.qkv``, ``attn.proj`` and ``mlp.{fc1,fc2}``: heads split
over ``tp``, projections column-wise, ``proj``/``fc2`` row-wise, norms sequence-parallel) and ``mlp``
(a network of Linear layers only: alternating column-/row-wise pairs).

:func:`resolve_plan` validates a plan against a model in one process (meta-device models work) and
:func:`format_plan` prints it as a table; :func:`apply_tp` does both and then parallelizes.
"""

from __future__ import annotations

import fnmatch
import io
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from torch import nn

from lightning_dist.parallelize.units import find_block_lists

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

PlanValue = Union[str, Mapping[str, Any]]
Plan = Mapping[str, PlanValue]

_NORMS: tuple[type, ...] = (nn.LayerNorm, nn.Dropout, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))
_SHARDABLE = (nn.Linear, nn.Embedding)


@dataclass(frozen=True)
class _Style:
    description: str
    types: tuple[type, ...]  # module types the style accepts (nn.Module: any)
    sp_only: bool = False  # a no-op unless sequence_parallel=True
    layouts: bool = False  # the dict form may override input/output layouts


STYLES: dict[str, _Style] = {
    "colwise": _Style("column-wise sharded (output features)", _SHARDABLE, layouts=True),
    "rowwise": _Style("row-wise sharded (input features)", _SHARDABLE, layouts=True),
    "colwise_gather": _Style("column-wise, output gathered to full", (nn.Linear,)),
    "sequence_parallel": _Style("runs on sequence shards", _NORMS, sp_only=True),
    "sp_enter": _Style("input split into sequence shards", (nn.Module,), sp_only=True),
    "region_input": _Style("input replicated (gathered with SP)", (nn.Module,)),
    "sp_exit": _Style("output gathered from sequence shards", (nn.Module,), sp_only=True),
    "sp_region": _Style("input split, output gathered", (nn.Module,), sp_only=True),
}
_HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads")


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


def _matches(fqn: str, pattern: str) -> bool:
    # the full name or any dotted suffix, so plans need not know the LightningModule's attribute name
    return fnmatch.fnmatchcase(fqn, pattern) or fnmatch.fnmatchcase(fqn, "*." + pattern)


def _local_shapes(module: nn.Module, style: str, tp: int) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]:
    # which dim of each parameter a style shards (torch's ColwiseParallel/RowwiseParallel conventions)
    linear = isinstance(module, nn.Linear)
    if style in ("colwise", "colwise_gather"):
        dims = {"weight": 0, "bias": 0} if linear else {"weight": 1}
    elif style == "rowwise":
        dims = {"weight": 1} if linear else {"weight": 0}
    else:
        dims = {}
    out = []
    for name, p in module.named_parameters(recurse=False):
        shape, local = tuple(p.shape), list(p.shape)
        if name in dims:
            local[dims[name]] //= tp
        out.append((name, shape, tuple(local)))
    return tuple(out)


def _divisibility(fqn: str, module: nn.Module, style: str, tp: int, parent: nn.Module | None) -> list[str]:
    problems = []
    if style in ("colwise", "colwise_gather", "rowwise"):
        if isinstance(module, nn.Linear):
            size, what = (module.in_features, "in_features") if style == "rowwise" else (module.out_features, "out_features")
        else:
            size, what = (module.num_embeddings, "num_embeddings") if style == "rowwise" else (module.embedding_dim, "embedding_dim")
        if size % tp:
            problems.append(
                f"{fqn} ({type(module).__name__}, {style}): {what}={size} is not divisible by tp={tp};"
                f" choose a tp that divides {size} or leave this module out of the plan."
            )
    if style == "colwise" and parent is not None:
        # key/value projections of grouped-query attention split their own (fewer) heads
        kv = fqn.rsplit(".", 1)[-1] in ("k", "v") and isinstance(getattr(parent, "n_kv_heads", None), int)
        attrs, what = (("n_kv_heads",), "key/value heads") if kv else (_HEAD_ATTRS, "heads")
        heads = next((getattr(parent, a) for a in attrs if isinstance(getattr(parent, a, None), int)), None)
        if heads is not None and heads % tp:
            problems.append(
                f"{fqn}: the attention module has {heads} {what}, not divisible by tp={tp}; heads are split over"
                f" tensor ranks, so choose a tp that divides {heads}."
            )
    return problems


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
    claimed: dict[str, str] = {}
    entries: list[TPEntry] = []
    for pattern, (style, options) in parsed.items():
        hits = [fqn for fqn in modules if fqn and _matches(fqn, pattern)]
        if not hits:
            near = [n for n, m in modules.items() if n and isinstance(m, STYLES[style].types)][:6]
            problems.append(
                f"plan pattern {pattern!r} ({style}) matches no module of {type(model).__name__}; a plan entry"
                f" must not be a silent no-op. Module names look like {near}."
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
            if not isinstance(module, STYLES[style].types):
                names = [t.__name__ for t in STYLES[style].types]
                problems.append(f"module {fqn!r} is a {type(module).__name__}; style {style!r} supports only {names}.")
                continue
            parent = modules.get(fqn.rpartition(".")[0])
            problems += _divisibility(fqn, module, style, tp, parent)
            entries.append(
                TPEntry(
                    fqn=fqn, style=style, pattern=pattern, module_type=type(module).__name__,
                    shapes=_local_shapes(module, style, tp), options=options,
                    active=sequence_parallel or not STYLES[style].sp_only,
                )
            )
    if sequence_parallel and not any(e.style in ("sp_enter", "sp_region") for e in entries) and not problems:
        problems.append(
            "sequence_parallel=True but the plan has no 'sp_enter'/'sp_region' entry marking where activations are"
            " split over the sequence; use a transformer plan or add those entries (or set sequence_parallel=False)."
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


# ---- built-in plans ----------------------------------------------------------------------------
def _linear(module: nn.Module | None, name: str) -> bool:
    return isinstance(getattr(module, name, None), nn.Linear)


def _block_problem(prefix: str, block: nn.Module) -> str | None:
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    if attn is None or not (all(_linear(attn, n) for n in "qkv") or _linear(attn, "qkv")):
        return f"{prefix} has no `attn` with Linear `q`, `k`, `v` (or a fused `qkv`)"
    if not _linear(attn, "proj"):
        return f"{prefix}.attn has no Linear `proj`"
    if mlp is None or not (_linear(mlp, "fc1") and _linear(mlp, "fc2")):
        return f"{prefix} has no `mlp` with Linear `fc1` and `fc2`"
    return None


def transformer_plan(model: nn.Module, *, tp: int = 1, head: str | None = None) -> dict[str, str]:
    """Plan for every block list of transformer blocks (``attn.{q,k,v}|qkv``, ``attn.proj``, ``mlp.{fc1,fc2}``).

    Heads are split over ``tp``: q/k/v (or the fused qkv, whose output must be head-major so that
    contiguous shards hold whole heads) and fc1 column-wise, proj and fc2 row-wise; the block's direct
    norm/dropout children run sequence-parallel. `head`: name of an output Linear next to the block
    list, made ``colwise_gather`` when its output size is divisible by `tp` (else left replicated).
    Raises ValueError naming the first block that does not match.
    """
    lists = find_block_lists(model)
    if not lists:
        raise ValueError(f"{type(model).__name__} has no block list (an nn.ModuleList named blocks/layers/h...).")
    plan: dict[str, str] = {}
    for list_name, blocks in lists:
        for i, block in enumerate(blocks):
            problem = _block_problem(f"{list_name}.{i}", block)
            if problem:
                raise ValueError(problem)
        first = blocks[0]
        qkv = ("q", "k", "v") if all(_linear(first.attn, n) for n in "qkv") else ("qkv",)
        for name in qkv:
            plan[f"{list_name}.*.attn.{name}"] = "colwise"
        plan[f"{list_name}.*.attn.proj"] = "rowwise"
        plan[f"{list_name}.*.mlp.fc1"] = "colwise"
        plan[f"{list_name}.*.mlp.fc2"] = "rowwise"
        plan[f"{list_name}.*.attn"] = "region_input"
        plan[f"{list_name}.*.mlp"] = "region_input"
        for child, mod in first.named_children():
            if isinstance(mod, _NORMS):
                plan[f"{list_name}.*.{child}"] = "sequence_parallel"
        if len(blocks) == 1:
            plan[f"{list_name}.0"] = "sp_region"
        else:
            plan[f"{list_name}.0"] = "sp_enter"
            plan[f"{list_name}.{len(blocks) - 1}"] = "sp_exit"
        parent_name = list_name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        if head is not None and _linear(parent, head) and getattr(parent, head).out_features % tp == 0:
            plan[f"{parent_name}.{head}" if parent_name else head] = "colwise_gather"
    return plan


def mlp_plan(model: nn.Module, *, tp: int = 1) -> dict[str, str]:
    """Plan for a network whose parameters all live in Linear layers: pairs (colwise, rowwise) in order.

    An odd last Linear stays replicated. Assumes the Linears run in registration order with only
    element-wise functions between the two layers of a pair. Raises ValueError when other modules hold
    parameters.
    """
    others = [
        f"{n} ({type(m).__name__})" for n, m in model.named_modules()
        if any(True for _ in m.parameters(recurse=False)) and not isinstance(m, nn.Linear)
    ]
    if others:
        raise ValueError(f"not a plain MLP: modules other than Linear hold parameters: {', '.join(others[:4])}")
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if len(linears) < 2:
        raise ValueError(f"not a plain MLP: it has {len(linears)} Linear layer(s); a pair needs 2")
    plan = {}
    for i in range(0, len(linears) - 1, 2):
        plan[linears[i]] = "colwise"
        plan[linears[i + 1]] = "rowwise"
    return plan


def _typed_plan(block_cls: str, head: str) -> Callable[..., dict[str, str]]:
    def build(model: nn.Module, *, tp: int = 1) -> dict[str, str]:
        blocks = [type(b).__name__ for _, bl in find_block_lists(model) for b in bl]
        if not blocks or any(b != block_cls for b in blocks):
            raise ValueError(f"its blocks are {sorted(set(blocks)) or 'absent'}, not {block_cls}")
        return transformer_plan(model, tp=tp, head=head)

    build.__doc__ = f"The pack's {block_cls} model: :func:`transformer_plan` plus ``{head}`` as ``colwise_gather``."
    return build


BUILTIN_PLANS: dict[str, Callable[..., dict[str, str]]] = {
    "gpt": _typed_plan("GPTBlock", "lm_head"),
    "vit": _typed_plan("ViTBlock", "head"),
    "transformer": transformer_plan,
    "mlp": mlp_plan,
}
"""Built-in plan builders ``fn(model, *, tp) -> plan``, in the order ``plan="auto"`` tries them."""


def builtin_plan(model: nn.Module, name: str, *, tp: int = 1) -> tuple[str, dict[str, str]]:
    """(name, plan) of the built-in plan `name` for `model`; ``"auto"`` picks the first that matches."""
    if name != "auto" and name not in BUILTIN_PLANS:
        raise ValueError(f"Unknown tensor-parallel plan {name!r}; pass 'auto', one of {sorted(BUILTIN_PLANS)} or a mapping.")
    failures = []
    for candidate in BUILTIN_PLANS if name == "auto" else (name,):
        try:
            return candidate, BUILTIN_PLANS[candidate](model, tp=tp)
        except ValueError as err:
            failures.append(f"{candidate}: {err}")
    raise ValueError(
        f"No built-in tensor-parallel plan {'matches' if name == 'auto' else 'named ' + repr(name) + ' fits'}"
        f" {type(model).__name__}:\n  - " + "\n  - ".join(failures)
        + "\nPass plan={pattern: style, ...} naming its layers (see lightning_dist.parallelize.tp)."
    )


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
    parallelize_module(model, tp_mesh, styles)
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
        parallelize_module(part, tp_mesh, styles)
    return len(styles)


__all__ = [
    "BUILTIN_PLANS", "STYLES", "Plan", "TPEntry", "apply_tp", "apply_tp_entries", "builtin_plan", "format_plan", "mlp_plan",
    "resolve_plan", "resolve_stage_plan", "transformer_plan",
]
