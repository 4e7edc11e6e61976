"""Finding a model's repeated blocks: the units FSDP shards, activation checkpointing wraps and pipelines split."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

# Attribute names under which models conventionally keep their block list, most specific first.
BLOCK_LIST_NAMES = ("blocks", "layers", "h", "block", "encoder_layers", "decoder_layers")


def find_block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every ``nn.ModuleList`` registered under a conventional block-list name, with its qualified name.

    Falls back to every ModuleList whose children all have the same class and hold parameters when no
    conventional name exists (a list of torchmetrics metrics, one per eval loader, is not a block list).
    """
    found = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and len(mod) and name.rsplit(".", 1)[-1] in BLOCK_LIST_NAMES
    ]
    if found:
        return found
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList)
        and len(mod) > 1
        and len({type(c) for c in mod}) == 1
        and next(mod.parameters(), None) is not None
    ]


def select_units(
    model: nn.Module, units: str | Sequence[str] | Sequence[nn.Module] = "auto"
) -> list[tuple[str, nn.Module]]:
    """The modules to treat as units, outermost first.

    `units` is ``"auto"`` (each child of the model's block lists), module class names
    (e.g. ``["ViTBlock"]``) or the modules themselves (a pipeline stage's blocks).
    Raises ``ValueError`` naming what could not be matched.
    """
    if not isinstance(units, str) and units and all(isinstance(u, nn.Module) for u in units):
        ids = {id(u) for u in units}
        return [(n, m) for n, m in model.named_modules() if id(m) in ids]
    if isinstance(units, str) and units == "auto":
        # by key, not position: a pipeline stage's block list keeps the single-device indices of the blocks it holds
        return [(f"{ln}.{k}", block) for ln, blocks in find_block_lists(model) for k, block in blocks._modules.items()]
    if isinstance(units, str):
        units = [units]
    wanted = set(units)
    picked = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in wanted]
    missing = wanted - {type(m).__name__ for _, m in picked}
    if missing:
        present = sorted({type(m).__name__ for _, m in model.named_modules()})
        raise ValueError(
            f"Unit class name(s) {sorted(missing)} match no module of {type(model).__name__}."
            f" Module classes present: {present}. Pass names from that list, or 'auto'."
        )
    # drop units nested inside other picked units: sharding/checkpointing applies to the outermost
    outer = [(n, m) for n, m in picked if not any(n.startswith(p + ".") for p, _ in picked if p != n)]
    return outer
