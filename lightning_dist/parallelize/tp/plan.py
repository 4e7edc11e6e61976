"""Tensor-parallel plans matched against a model and checked: :func:`resolve_plan`, :class:`ResolvedPlan`.

Notes: docs/internals.md, "lightning_dist/parallelize/tp/plan.py"."""

from __future__ import annotations

import fnmatch
import io
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from lightning_dist.parallelize.shared import check_shared_tp, shared_parameters
from lightning_dist.parallelize.tp.auto import builtin_plan
from lightning_dist.parallelize.tp.checks import (
    divisibility_problems,
    input_problems,
    local_attr_problems,
    region_problems,
)
from lightning_dist.parallelize.tp.flow import split_flow
from lightning_dist.parallelize.tp.vocab import (
    GRAD_SUM_RULE,
    STYLES,
    Plan,
    PlanValue,
    TPEntry,
    module_kind,
    parse_layout,
    pattern_matches,
    plan_roots,
    shard_dims,
)


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
        if parse_layout(layout) is None:
            problems.append(f"plan[{pattern!r}]: {key}={layout!r} is not a layout; use 'replicate' or 'shard(N)'.")
            return None
    return style, options


def _entry(fqn: str, module: nn.Module, style: str, pattern: str, tp: int, **fields: Any) -> TPEntry:
    """The plan's entry for `module`, with each parameter's shape and the shape one tensor rank holds."""
    dims = shard_dims(module, style)
    shapes = []
    for name, p in module.named_parameters(recurse=False):
        shape, local = tuple(p.shape), list(p.shape)
        if name in dims and style == "colwise_qkv":  # held with [q | k | v] as a dim of its own (styles.py)
            d = dims[name]
            local[d : d + 1] = [3, shape[d] // 3 // tp]
        elif name in dims:
            local[dims[name]] //= tp
        shapes.append((name, shape, tuple(local)))
    kind = module_kind(module)
    return TPEntry(fqn, style, pattern, type(module).__name__, tuple(shapes), kind=kind, **fields)


def resolve_plan(model: nn.Module, plan: Plan | str, *, tp: int, sequence_parallel: bool = False) -> list[TPEntry]:
    """Match `plan` (a mapping, a built-in plan name or ``"auto"``) against `model` and validate it for `tp` ranks, in
    one process; every problem (sizes or heads not divisible by `tp`, a pattern matching no module, a module given two
    styles or one it does not support, ...) is listed in one ``ValueError``."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"`tp={tp!r}` must be an integer >= 1.")
    if isinstance(plan, str):
        plan = builtin_plan(model, plan, tp=tp)[1]
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"A tensor-parallel plan must be a mapping of pattern -> style or a name; got {type(plan).__name__}."
        )
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
    roots = plan_roots(model)
    claimed: dict[str, str] = {}
    entries: list[TPEntry] = []
    for pattern, (style, options) in parsed.items():
        hits = [fqn for fqn in modules if fqn and pattern_matches(fqn, pattern, roots)]
        if not hits:
            deeper = [n for n in modules if n and fnmatch.fnmatchcase(n, "*." + pattern)][:4]
            near = [n for n, m in modules.items() if n and STYLES[style].accepts(m)][:6]
            hint = (
                f"it only names deeper paths {deeper}: write the full path"
                if deeper
                else f"module names look like {near}"
            )
            problems.append(
                f"plan pattern {pattern!r} ({style}) matches no module of {type(model).__name__}; a plan entry"
                " must not be a silent no-op. Patterns match from the root (the model, or a LightningModule's direct"
                f" children), and {hint}."
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
                problems.append(
                    f"module {fqn!r} is a {type(module).__name__}; style {style!r} supports only {STYLES[style].kinds}."
                )
                continue
            parent = modules.get(fqn.rpartition(".")[0])
            problems += divisibility_problems(fqn, module, style, tp, parent)
            active = sequence_parallel or not STYLES[style].sp_only
            entries.append(_entry(fqn, module, style, pattern, tp, options=options, active=active))
    problems += region_problems(entries, modules)
    problems += input_problems(entries, modules)
    problems += local_attr_problems(model, entries, tp)
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
    """The resolved plan as a rich table: module -> style -> global (the model's) -> local (held per rank) shapes."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    caption = None
    if any(e.active and e.style == "colwise_qkv" for e in entries):  # it changes what named_parameters() shows
        caption = escape(
            "colwise_qkv: the parameter is held as [in, 3, E/tp] ([3, E/tp, in] for a Linear; bias [3, E/tp]) in"
            " named_parameters() and the optimizer; state_dict, checkpoints and consolidation keep the model's [in, 3E]"
        )
    table = Table(title=title or f"Tensor-parallel plan (tp={tp})", caption=caption, caption_justify="left")
    for col in ("module", "type", "style", "global shape", "local shape"):
        table.add_column(col)
    for e in entries:
        style = e.style + ("" if e.active else " (off)")
        glob = ", ".join(f"{n} {'x'.join(map(str, s))}" for n, s, _ in e.shapes) or "-"
        local = ", ".join(f"{n} {'x'.join(map(str, local_shape))}" for n, _, local_shape in e.shapes) or "-"
        table.add_row(e.fqn, e.module_type, style, glob, local)
    buf = io.StringIO()
    Console(file=buf, width=140, force_terminal=False).print(table)
    return buf.getvalue()


@dataclass(frozen=True)
class ResolvedPlan:
    """A tensor-parallel plan matched against one model and checked for `tp` ranks (see :func:`resolve_tp_plan`)."""

    name: str
    """The built-in plan that was picked (``hf``, ``transformer``, ``mlp``) or ``custom`` for a mapping."""
    entries: tuple[TPEntry, ...]
    """One entry per planned module, in the model's module order."""
    tp: int
    """The tensor-parallel degree it was checked for."""
    sequence_parallel: bool
    """Whether the sequence-parallel entries are active."""
    flow_traced: bool = True
    """Whether the split-flow rule (:mod:`.flow`) ran a forward (else it read the plan's regions)."""


def resolve_tp_plan(
    model: nn.Module, plan: Plan | str | None, *, tp: int, sequence_parallel: bool = False
) -> ResolvedPlan:
    """Pick the plan (``"auto"``/``None``: the first built-in plan that matches; a built-in name; a mapping), match
    it against `model` and check it (:func:`resolve_plan`): the one resolution that everything downstream uses."""
    if isinstance(plan, ResolvedPlan):
        return plan
    name = "custom"
    if plan is None or isinstance(plan, str):
        name, plan = builtin_plan(model, "auto" if plan is None else plan, tp=tp)
    entries = resolve_plan(model, plan, tp=tp, sequence_parallel=sequence_parallel)
    flow = split_flow(model, entries, tp)
    if flow.problems:
        raise ValueError(
            f"Invalid tensor-parallel plan for tp={tp} (modules it leaves whole meet its split activations):\n  - "
            + "\n  - ".join(flow.problems)
        )
    modules = dict(model.named_modules())
    order = {n: i for i, n in enumerate(modules)}
    added = [_entry(fqn, modules[fqn], "replicate_grad_sum", GRAD_SUM_RULE, tp) for fqn in flow.grad_sum]
    entries = [replace(e, copy_output=True) if e.fqn in flow.in_place else e for e in entries]
    entries = sorted([*entries, *added], key=lambda e: order[e.fqn])
    return ResolvedPlan(
        name=name, entries=tuple(entries), tp=tp, sequence_parallel=sequence_parallel, flow_traced=flow.traced
    )


__all__ = ["ResolvedPlan", "format_plan", "resolve_plan", "resolve_tp_plan"]
