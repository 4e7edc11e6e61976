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

from lightning_dist.parallelize.shared import check_shared_tp, retie, shared_parameters

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

PlanValue = Union[str, Mapping[str, Any]]
Plan = Mapping[str, PlanValue]

_NORMS: tuple[type, ...] = (nn.LayerNorm, nn.Dropout, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))


def is_conv1d(module: nn.Module) -> bool:
    """HuggingFace's ``Conv1D`` (GPT-2 family): a Linear whose weight is stored transposed, ``[nx, nf]``.

    Recognized by shape rather than imported, so the pack does not import ``transformers``.
    """
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int) and isinstance(
        getattr(module, "nx", None), int)


def _is_norm(module: nn.Module) -> bool:
    # HF models bring their own RMSNorm classes (LlamaRMSNorm...): a norm is anything named *Norm with a weight
    return isinstance(module, _NORMS) or (type(module).__name__.endswith("Norm") and not any(True for _ in module.children()))


def _linear_like(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


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
    "sequence_parallel": _Style("runs on sequence shards", _is_norm, "norms and dropout", sp_only=True),
    "sp_enter": _Style("input split into sequence shards", _any, "any module", sp_only=True),
    "region_input": _Style("input replicated (gathered with SP)", _any, "any module"),
    "sp_exit": _Style("output gathered from sequence shards", _any, "any module", sp_only=True),
    "sp_region": _Style("input split, output gathered", _any, "any module", sp_only=True),
}
_HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads")
# head counts an attention module may read in its forward: set to the local count on a split region (as
# torchtitan sets n_heads // tp); kept as they were in GLOBAL_ATTRS_KEY for single-device copies
LOCAL_ATTRS = (*_HEAD_ATTRS, "num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "all_head_size")
GLOBAL_ATTRS_KEY = "_tp_global_attrs"


def _split_regions(entries: list[TPEntry]) -> list[str]:
    """Parents of column-wise layers consumed by a row-wise sibling: the attention/MLP modules that are split."""
    parents: dict[str, set[str]] = {}
    for e in entries:
        if e.active and e.style in ("colwise", "rowwise"):
            parents.setdefault(e.fqn.rpartition(".")[0], set()).add(e.style)
    return [p for p, styles in parents.items() if styles == {"colwise", "rowwise"}]


def _local_attr_problems(model: nn.Module, entries: list[TPEntry], tp: int) -> list[str]:
    problems = []
    for parent in _split_regions(entries):
        module = model.get_submodule(parent)
        for attr in LOCAL_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value % tp:
                problems.append(
                    f"{parent or type(model).__name__} has {attr}={value}, which the plan must set to the local count"
                    f" {attr} // tp on each rank, but {value} is not divisible by tp={tp}; choose a tp that divides it."
                )
    return problems


def set_local_attrs(model: nn.Module, entries: list[TPEntry], tp: int, *, within: nn.Module | None = None) -> list[str]:
    """Divide the head-count attributes of each split region by `tp`; returns ``module.attr`` names changed.

    `within`: only regions that are modules of this piece of `model` (a pipeline stage). Idempotent: a
    region whose global values are already kept is left alone.
    """
    inside = None if within is None else {id(m) for m in within.modules()}
    changed = []
    for parent in _split_regions(entries):
        module = model.get_submodule(parent)
        if (inside is not None and id(module) not in inside) or GLOBAL_ATTRS_KEY in module.__dict__:
            continue
        saved = {}
        for attr in LOCAL_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                saved[attr] = value
                setattr(module, attr, value // tp)
                changed.append(f"{parent}.{attr}")
        if saved:
            module.__dict__[GLOBAL_ATTRS_KEY] = saved
    return changed


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


def shard_dims(module: nn.Module, style: str) -> dict[str, int]:
    """Which dim of each of `module`'s own parameters `style` splits over ``tp`` (torch's Colwise/RowwiseParallel)."""
    if is_conv1d(module):  # HF Conv1D keeps its weight transposed: [in_features, out_features]
        return {"weight": 1, "bias": 0} if style in ("colwise", "colwise_gather") else {"weight": 0} if style == "rowwise" else {}
    linear = isinstance(module, nn.Linear)
    if style in ("colwise", "colwise_gather"):
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


def _divisibility(fqn: str, module: nn.Module, style: str, tp: int, parent: nn.Module | None) -> list[str]:
    problems = []
    if style in ("colwise", "colwise_gather", "rowwise"):
        if isinstance(module, nn.Linear):
            size, what = (module.in_features, "in_features") if style == "rowwise" else (module.out_features, "out_features")
        elif is_conv1d(module):
            size, what = (module.nx, "nx (in features)") if style == "rowwise" else (module.nf, "nf (out features)")
        else:
            size, what = (module.num_embeddings, "num_embeddings") if style == "rowwise" else (module.embedding_dim, "embedding_dim")
        if size % tp:
            problems.append(
                f"{fqn} ({type(module).__name__}, {style}): {what}={size} is not divisible by tp={tp};"
                f" choose a tp that divides {size} or leave this module out of the plan."
            )
    if style == "colwise" and parent is not None and not problems:
        problems += _head_problems(fqn, module, tp, parent)
    return problems


def _head_dim(attn: nn.Module) -> int | None:
    """Per-head width of an attention module: its ``head_dim``/``head_size``, or from its ``config``."""
    for attr in ("head_dim", "head_size"):
        if isinstance(getattr(attn, attr, None), int):
            return getattr(attn, attr)
    cfg = getattr(attn, "config", None)
    if isinstance(getattr(cfg, "head_dim", None), int):
        return cfg.head_dim
    heads = next((getattr(attn, a) for a in _HEAD_ATTRS if isinstance(getattr(attn, a, None), int)), None)
    if heads is None:
        heads = next((getattr(cfg, a) for a in _HEAD_ATTRS if isinstance(getattr(cfg, a, None), int)), None)
    width = getattr(cfg, "hidden_size", None) if cfg is not None else None
    return width // heads if isinstance(width, int) and heads else None


def _head_problems(fqn: str, module: nn.Module, tp: int, parent: nn.Module) -> list[str]:
    # a column-wise projection of an attention module must give each rank whole heads (query or key/value heads)
    head_dim = _head_dim(parent)
    out = module.nf if is_conv1d(module) else getattr(module, "out_features", None)
    name = fqn.rpartition(".")[2]
    if not head_dim or not isinstance(out, int) or out % head_dim:
        # no head width known: the module's own head count attribute, if any
        heads = next((getattr(parent, a) for a in _HEAD_ATTRS if isinstance(getattr(parent, a, None), int)), None)
        if heads is None:
            return []
    else:
        heads = out // head_dim
        if name in ("qkv", "query_key_value", "Wqkv") and heads % 3 == 0:
            heads //= 3  # head-major fused q, k, v
    if heads % tp == 0:
        return []
    kind = "key/value heads" if name in (
        "k", "v", "k_proj", "v_proj", "key", "value") else "heads"
    return [f"{fqn}: the attention module has {heads} {kind}, not divisible by tp={tp}; heads are split over tensor"
            f" ranks, so choose a tp that divides {heads}."]


def _kind(module: nn.Module) -> str:
    if is_conv1d(module):
        return "conv1d"
    return "linear" if isinstance(module, nn.Linear) else "embedding" if isinstance(module, nn.Embedding) else "other"


def _region_problems(entries: list[TPEntry], modules: Mapping[str, nn.Module]) -> list[str]:
    """A plan checked against the model's structure: each split activation is consumed where it is split.

    A column-wise layer leaves its output split over the tp ranks: a row-wise layer of the same parent
    module (the attention or MLP region) must take it back, else the next layer or the loss sees a
    fraction of the features (``Target 25 is out of bounds``). A row-wise layer expects a split input: a
    column-wise layer of the same parent must produce it, else it is handed the whole activation as if it
    were one shard (``mat1 and mat2 shapes cannot be multiplied``). A dict entry with an explicit
    ``input``/``output`` layout states the layout itself and is not second-guessed.
    """
    by_parent: dict[str, list[TPEntry]] = {}
    for e in entries:
        if e.active:
            by_parent.setdefault(e.fqn.rpartition(".")[0], []).append(e)
    problems = []
    for parent, group in by_parent.items():
        cols = [e for e in group if e.style == "colwise" and "output" not in e.options]
        rows = [e for e in group if e.style == "rowwise" and _linear_like(modules[e.fqn]) and "input" not in e.options]
        where = repr(parent) if parent else "the model root"
        for e in cols if not rows else ():
            problems.append(
                f"{e.fqn} ({e.module_type}, colwise) leaves its output split over the tp ranks, and no row-wise layer"
                f" of {where} takes it back: the layers after it (or the loss) would see 1/tp of its features. Give an"
                " output layer 'colwise_gather', add the row-wise layer that consumes it, or state the layout:"
                " {style: colwise, output: replicate}."
            )
        for e in rows if not cols else ():
            problems.append(
                f"{e.fqn} ({e.module_type}, rowwise) expects an input split over the tp ranks, but no column-wise layer"
                f" of {where} produces one. Give the layer(s) feeding it 'colwise', or state the layout:"
                " {style: rowwise, input: replicate}."
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
        retie(part, ties)
        set_local_attrs(owner, entries, tp_mesh.size(), within=part)
    return len(styles)


# the built-in plans live in tp_auto (they use the helpers above); re-exported here as the public home
from lightning_dist.parallelize.tp_auto import BUILTIN_PLANS, builtin_plan, mlp_plan, transformer_plan  # noqa: E402

__all__ = [
    "BUILTIN_PLANS", "STYLES", "Plan", "TPEntry", "apply_tp", "apply_tp_entries", "builtin_plan", "format_plan", "mlp_plan",
    "resolve_plan", "resolve_stage_plan", "transformer_plan",
]
