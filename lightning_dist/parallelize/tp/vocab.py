"""The words a tensor-parallel plan is written in: module kinds, styles, :class:`TPEntry`, pattern matching (imported
by every other ``tp`` module, importing none of them). The plan syntax: docs/internals.md, "tp/apply.py"."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from torch import nn

PlanValue = Union[str, Mapping[str, Any]]
Plan = Mapping[str, PlanValue]


# ---- module kinds ------------------------------------------------------------------------------
_NORMS: tuple[type, ...] = (nn.LayerNorm, nn.Dropout, nn.RMSNorm)  # nn.RMSNorm: torch >= 2.4, below our range


def is_conv1d(module: nn.Module) -> bool:
    """HuggingFace's ``Conv1D`` (GPT-2 family): a Linear whose weight is stored transposed, ``[nx, nf]``; recognized by
    its name and fields, so the pack does not import ``transformers``."""
    named = any(c.__name__ == "Conv1D" for c in type(module).__mro__)  # a subclass of Conv1D counts too
    return named and isinstance(getattr(module, "nf", None), int) and isinstance(getattr(module, "nx", None), int)


def is_norm(module: nn.Module) -> bool:
    """A norm or dropout (what ``sequence_parallel`` runs on sequence shards)."""
    # HF models bring their own RMSNorm classes (LlamaRMSNorm...): a norm is anything named *Norm with a weight
    return isinstance(module, _NORMS) or (
        type(module).__name__.endswith("Norm") and not any(True for _ in module.children())
    )


def linear_like(module: nn.Module) -> bool:
    """An ``nn.Linear`` or a HuggingFace ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def out_features(module: nn.Module) -> int | None:
    """Output features of a Linear or a ``Conv1D`` (None for other modules)."""
    return module.nf if is_conv1d(module) else getattr(module, "out_features", None)


def module_kind(module: nn.Module) -> str:
    """``conv1d``, ``linear``, ``embedding`` or ``other`` (:attr:`TPEntry.kind`: picks the torch style)."""
    if is_conv1d(module):
        return "conv1d"
    return "linear" if isinstance(module, nn.Linear) else "embedding" if isinstance(module, nn.Embedding) else "other"


# ---- styles ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Style:
    accepts: Callable[[nn.Module], bool]  # module kinds the style supports
    kinds: str  # those kinds, for error messages
    sp_only: bool = False  # a no-op unless sequence_parallel=True
    layouts: bool = False  # the dict form may override input/output layouts


def _any(module: nn.Module) -> bool:
    return True


def _shardable(module: nn.Module) -> bool:
    return linear_like(module) or isinstance(module, nn.Embedding)


def _has_own_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


_SHARDABLE, _LINEAR = "['Linear', 'Conv1D', 'Embedding']", "['Linear', 'Conv1D']"
STYLES: dict[str, _Style] = {
    "colwise": _Style(_shardable, _SHARDABLE, layouts=True),  # output features split
    "rowwise": _Style(_shardable, _SHARDABLE, layouts=True),  # input features split (an Embedding: vocab-parallel)
    "colwise_gather": _Style(linear_like, _LINEAR),  # column-wise, output gathered to full
    "colwise_qkv": _Style(linear_like, _LINEAR),  # column-wise per head of a fused [q | k | v] projection
    "sequence_parallel": _Style(is_norm, "norms and dropout", sp_only=True),  # runs on sequence shards
    "sp_enter": _Style(_any, "any module", sp_only=True),  # input split into sequence shards
    "region_input": _Style(_any, "any module"),  # input replicated (gathered with SP)
    "sp_exit": _Style(_any, "any module", sp_only=True),  # output gathered from sequence shards
    "sp_region": _Style(_any, "any module", sp_only=True),  # input split, output gathered
    # whole on every rank, run on each rank's part of a split activation: gradient summed over tp
    "replicate_grad_sum": _Style(_has_own_params, "modules holding parameters"),
    "replicate": _Style(_any, "any module"),  # whole on every rank, nothing reduced (left alone)
}

GRAD_SUM_RULE = "(rule) runs on split activations"
"""The pattern of a ``replicate_grad_sum`` entry added by the plan's split-flow rule (:mod:`.flow`), not the user."""

COLWISE = ("colwise", "colwise_gather", "colwise_qkv")
"""Styles that split a layer's output features (its weight's output dim; ``colwise_qkv`` per [q | k | v] block)."""


def parse_layout(text: Any) -> tuple[str, int] | None:
    """'replicate' -> ('replicate', 0); 'shard(1)' -> ('shard', 1); anything else -> None."""
    if not isinstance(text, str):
        return None
    text = text.strip().lower()
    if text == "replicate":
        return ("replicate", 0)
    m = re.fullmatch(r"shard\((-?\d+)\)", text)
    return ("shard", int(m.group(1))) if m else None


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


# ---- one module of a resolved plan ---------------------------------------------------------------
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
    """(parameter, the model's shape, the shape held on one tensor rank: ``colwise_qkv`` holds ``[in, 3, E/tp]``)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Layout overrides from the dict form (``input``, ``output``)."""
    active: bool = True
    """False for sequence-parallel entries when sequence parallelism is off."""
    kind: str = "other"
    """``linear``, ``conv1d`` (HF, transposed weight), ``embedding`` or ``other``: picks the torch style."""
    copy_output: bool = False
    """The model changes this layer's output in place (``out += residual``): the split layer hands it a copy."""


def split_regions(entries: list[TPEntry], *, stated_layouts: bool = True) -> list[str]:
    """Parents of both a column-wise and a row-wise layer of the plan: the attention/MLP modules it splits (in plan
    order). ``stated_layouts=False``: entries that state their own ``input``/``output`` layout do not count."""
    kinds: dict[str, set[str]] = {}
    for e in entries:
        if e.active and e.style in ("colwise", "colwise_qkv", "rowwise") and (stated_layouts or not e.options):
            kinds.setdefault(e.fqn.rpartition(".")[0], set()).add("row" if e.style == "rowwise" else "col")
    return [p for p, k in kinds.items() if k == {"row", "col"}]


# ---- patterns ------------------------------------------------------------------------------------
def plan_roots(model: nn.Module) -> list[str]:
    """Where patterns are anchored: the model itself and, for a LightningModule, each of its direct children
    (the network it keeps as ``self.model``), so plans need not know that attribute name."""
    lightning = any(c.__name__ == "LightningModule" for c in type(model).__mro__)  # Lightning-free isinstance
    return [""] + ([name for name, _ in model.named_children()] if lightning else [])


def pattern_matches(fqn: str, pattern: str, roots: list[str]) -> bool:
    """True when module name `fqn` matches plan `pattern` from one of `roots` (:func:`plan_roots`)."""
    # from a root only: `decoder` names `model.decoder`, never also `model.transformer.decoder`
    return any(fnmatch.fnmatchcase(fqn, f"{root}.{pattern}" if root else pattern) for root in roots)
