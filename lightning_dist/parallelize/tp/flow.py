"""The plan's split-flow rule: which modules left whole run on activations that tensor parallelism splits.

Notes: docs/internals.md, "lightning_dist/parallelize/tp/flow.py"."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_dist.parallelize.self_check import probe_samples, run_eval
from lightning_dist.parallelize.tp.vocab import TPEntry, out_features, split_regions

SOURCES = ("colwise", "colwise_qkv")
"""Styles whose output stays split over tp (without an ``output`` layout of their own)."""
COPIED_OUTPUTS = ("colwise", "rowwise", "colwise_gather")
"""Styles whose output is torch's view of a DTensor's local part, which autograd forbids changing in place."""


@dataclass
class SplitFlow:
    """What the rule found: modules to give ``replicate_grad_sum`` and problems no style can fix."""

    grad_sum: list[str] = field(default_factory=list)
    """Modules left whole whose parameters meet split activations (in module order)."""
    problems: list[str] = field(default_factory=list)
    traced: bool = False
    """True when a forward showed it; False when no probe sample ran (nothing found, nothing added)."""
    in_place: list[str] = field(default_factory=list)
    """Planned layers whose output the forward changes in place (``out += residual``): their styles hand it a copy."""


def _unit(module: nn.Module, style: str, tp: int) -> int:
    """Features of one rank's contiguous part of a source layer's output (per [q | k | v] block for colwise_qkv)."""
    out = out_features(module)
    if not isinstance(out, int):
        out = module.weight.shape[0]
    return out // tp // (3 if style == "colwise_qkv" else 1)


def _in_place(name: str) -> bool:
    """A torch op that changes its first operand: ``add_``, ``x += y`` (``__iadd__``)."""
    if name.startswith("__"):
        return name[2:3] == "i" and name[3:-2] in _OPERATORS
    return name.endswith("_") and name != "requires_grad_"


_OPERATORS = {
    "add",
    "sub",
    "mul",
    "truediv",
    "floordiv",
    "mod",
    "pow",
    "matmul",
    "and",
    "or",
    "xor",
    "lshift",
    "rshift",
}


class _Watch(TorchFunctionMode):
    """Marks every tensor computed from a split activation, and records what meets one in a torch call: parameters of
    modules left whole (or tensors computed from them alone, as Gemma's ``1 + weight``) and other graded activations.
    Tensors are held weakly: an id freed and reused is not mistaken for a marked tensor."""

    def __init__(
        self, owners: dict[int, tuple[str, str, Tensor]], planned: set[int], buffers: frozenset[int] = frozenset()
    ) -> None:
        super().__init__()
        self.owners, self.planned, self.buffers = owners, planned, buffers
        self.split: dict[int, tuple[Any, int, str, int]] = {}  # id -> (weakref, unit, source layer, its output's size)
        self.derived: dict[int, tuple[Any, frozenset]] = {}  # id -> (weakref, owner params it is computed from)
        # module -> {param: (numel, unit, source, whether it met a slice of the source's output only)}
        self.meets: dict[str, dict[str, tuple[int, int, str, bool]]] = {}
        self.joins: dict[str, str] = {}  # "source -> call" -> the graded replicated activation that joined
        self.outputs: dict[int, tuple[Any, str]] = {}  # id -> (weakref, the planned layer whose output it is)
        self.in_place: dict[str, None] = {}  # planned layers whose output an in-place op changed

    @staticmethod
    def _get(table: dict, t: Tensor) -> Any:
        got = table.get(id(t))
        return got if got is not None and got[0]() is t else None

    def mark(self, out: Any, unit: int, source: str, size: int | None = None) -> None:
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self.split[id(t)] = (weakref.ref(t), unit, source, t.numel() if size is None else size)

    def produced(self, out: Any, fqn: str) -> None:
        if isinstance(out, Tensor):
            self.outputs[id(out)] = (weakref.ref(out), fqn)

    def unmark(self, out: Any) -> None:
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self.split.pop(id(t), None)

    def _params_of(self, t: Tensor) -> Optional[frozenset]:
        """The whole-kept parameters `t` is (or is computed from alone); None for anything else."""
        if id(t) in self.owners and self.owners[id(t)][2] is t:
            return frozenset([id(t)])
        got = self._get(self.derived, t)
        return got[1] if got is not None else None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if args and isinstance(args[0], Tensor) and _in_place(getattr(func, "__name__", "")):
            got = self._get(self.outputs, args[0])  # an in-place op on a planned layer's output
            if got is not None:
                self.in_place[got[1]] = None
        out = func(*args, **kwargs)
        operands = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        hit = next(((got, t) for t in operands if (got := self._get(self.split, t)) is not None), None)
        if hit is None:
            sources = [self._params_of(t) for t in operands]
            # anything else that is a tensor of its own (graded, or data as a token-id model's ids: the embedding's
            # output is an activation, not a parameter's derivative); buffers and 0-dim constants are neutral
            others = any(p is None and t.dim() > 0 and id(t) not in self.buffers for t, p in zip(operands, sources))
            if any(sources) and not others:  # computed from whole-kept parameters alone
                params = frozenset().union(*(p for p in sources if p))
                for t in tree_leaves(out):
                    if isinstance(t, Tensor):
                        self.derived[id(t)] = (weakref.ref(t), params)
            return out
        (_, unit, source, size), operand = hit
        for t in operands:
            if self._get(self.split, t) is not None:
                continue
            params = self._params_of(t)
            if params:
                for pid in params - self.planned:  # a planned module's parameters are its style's business
                    fqn, pname, _ = self.owners[pid]
                    self.meets.setdefault(fqn, {})[pname] = (t.numel(), unit, source, operand.numel() < size)
            elif t.requires_grad and t.grad_fn is not None:
                name = getattr(func, "__name__", str(func))
                self.joins.setdefault(f"{source} -> {name}", f"a {tuple(t.shape)} activation computed without it")
        self.mark(out, unit, source, size)
        return out


def split_flow(model: nn.Module, entries: list[TPEntry], tp: int) -> SplitFlow:
    """The rule for `entries` on `model`, from one unsplit forward on a probe sample (meta-device models too), or
    nothing found when no sample runs. One process, no collective: the same result on every rank."""
    regions = split_regions(entries, stated_layouts=False)
    if not regions:
        return SplitFlow(traced=True)  # nothing is split inside a region: nothing to meet
    modules = dict(model.named_modules())
    active = [e for e in entries if e.active]
    planned_fqns = {e.fqn for e in active} | {e.fqn for e in entries if e.style == "replicate"}
    planned = {id(p) for f in planned_fqns for p in modules[f].parameters(recurse=False)}
    owners = {}  # every parameter (the planned ones too: what is computed from them is no stray activation)
    for fqn, mod in modules.items():
        for pname, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), (fqn, pname, p))
    for net, sample in probe_samples(model):
        watch = _Watch(owners, planned, frozenset(id(b) for b in model.buffers()))
        handles = []
        for e in active:
            mod = modules[e.fqn]
            if e.style in SOURCES and "output" not in e.options:
                unit = _unit(mod, e.style, tp)
                handles.append(mod.register_forward_hook(lambda m, a, o, u=unit, f=e.fqn: watch.mark(o, u, f)))
            elif e.style in ("rowwise", "colwise_gather"):
                handles.append(mod.register_forward_hook(lambda m, a, o: watch.unmark(o)))
            if e.style in COPIED_OUTPUTS:
                handles.append(mod.register_forward_hook(lambda m, a, o, f=e.fqn: watch.produced(o, f)))
        try:
            with watch:
                run_eval(net, sample, grad=True)
        except Exception:  # a sample the forward does not take (or an op the meta device lacks): the next guess
            continue
        finally:
            for h in handles:
                h.remove()
        found = SplitFlow(traced=True, in_place=list(watch.in_place))
        for fqn in modules:  # module order
            if fqn in watch.meets:
                _classify(found, fqn, modules[fqn], watch.meets[fqn], fqn in regions)
        found.problems += _per_slice_lists(modules, watch.meets)
        for where, what in watch.joins.items():
            found.problems.append(
                f"{where}: {what} joins the split activation of {where.split(' ->')[0]!r} inside its region, so its"
                " gradient on each rank covers that rank's part only and no style of the plan sums it (multi-head"
                " latent attention's rotary key is one such). Leave that region whole, or split the layer that"
                " computes it."
            )
        return found
    return SplitFlow(traced=False)  # the setup's gradient self-check decides


def _classify(found: SplitFlow, fqn: str, module: nn.Module, meets: dict, is_region: bool) -> None:
    kind = type(module).__name__
    if is_region:
        found.problems.append(
            f"{fqn} ({kind}) is a region the plan splits, and its own parameter(s) {sorted(meets)} meet its split"
            " activations (a per-head parameter held by the attention itself): each rank would use every head's"
            " values on its own heads. Leave this region whole (drop its column-/row-wise entries)."
        )
        return
    wide = {n: m for n, m in meets.items() if m[1] % m[0]}
    if wide:
        name, (numel, unit, source, _) = next(iter(wide.items()))
        found.problems.append(
            f"{fqn} ({kind}) runs on the output of {source!r}, which the plan splits into parts of {unit} features"
            f" per rank, but its {name!r} spans {numel} values: it works across the split dimension (a norm over the"
            f" whole projection, as OLMo 2's q/k norms). Keep that projection whole: give {source!r}"
            " 'colwise_gather' and its region's row-wise layer {style: rowwise, input: replicate} (a HuggingFace"
            " model's own plan does this: plan='hf'), or leave the region out of the plan."
        )
        return
    found.grad_sum.append(fqn)


def _per_slice_lists(modules: dict[str, nn.Module], meets: dict) -> list[str]:
    """Module lists whose members each ran on a slice of a split activation only (a norm per head): the split forward
    pairs a rank's own slices with the list's first members, whatever slices they belonged to."""
    problems = []
    for fqn, module in modules.items():
        members = [f"{fqn}.{k}" if fqn else k for k in module._modules] if isinstance(module, nn.ModuleList) else []
        met = [m for m in members if m in meets and all(sliced for *_, sliced in meets[m].values())]
        if len(met) > 1:
            source = next(iter(meets[met[0]].values()))[2]
            problems.append(
                f"{fqn} holds one {type(modules[met[0]]).__name__} per slice of the split output of {source!r}"
                f" ({len(met)} of them ran, a norm per head): after the split each rank's forward would pair its own"
                " slices with the list's first modules, not with theirs. Leave that region whole (drop its column- and"
                " row-wise entries; the MLP's can stay), or apply one module to every slice."
            )
    return problems


__all__ = ["COPIED_OUTPUTS", "SOURCES", "SplitFlow", "split_flow"]
