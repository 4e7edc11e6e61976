"""Parameters shared between modules (tied weights): found before any sharding, kept tied or refused.

Notes: docs/internals.md, "lightning_dist/parallelize/shared.py"."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn


def shared_parameters(model: nn.Module) -> list[tuple[str, ...]]:
    """Groups of qualified names that reach the same parameter tensor, in ``named_parameters`` order.

    Only groups of two or more names are returned; the first name is the one ``named_parameters()``
    reports (its deduplicated name).
    """
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def _split(name: str) -> tuple[str, str]:
    owner, _, attr = name.rpartition(".")
    return owner, attr


def check_shared_tp(groups: Iterable[tuple[str, ...]], sharded_dims: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Problems with tied parameters under a tensor-parallel plan (empty when every group is consistent).

    `sharded_dims`: module name -> {parameter attribute: tensor dim split over ``tp``} for the modules the
    plan shards. A group is consistent when every owner splits the tensor on the same dim, or none does.
    """
    problems = []
    for names in groups:
        dims = {n: sharded_dims.get(_split(n)[0], {}).get(_split(n)[1]) for n in names}
        if len(set(dims.values())) <= 1:
            continue
        how = ", ".join(
            f"{n}: " + ("replicated (not in the plan)" if d is None else f"split on dim {d}") for n, d in dims.items()
        )
        problems.append(
            f"parameters {list(names)} are one tied tensor, but the plan shards its owners differently ({how}):"
            " they would become separate parameters and train apart. Shard every owner the same way, e.g. a tied"
            " embedding + output head as vocab-parallel: the nn.Embedding 'rowwise' and the head 'colwise' or"
            " 'colwise_gather' (both split the vocabulary, dim 0), or leave all owners out of the plan, or untie them."
        )
    return problems


def retie(model: nn.Module, groups: Iterable[tuple[str, ...]]) -> int:
    """Make every name of each group refer to its first name's (possibly re-registered) parameter again.

    Returns the number of names re-pointed. Call after ``parallelize_module``, which gave each sharded owner
    its own new parameter.
    """
    changed = 0
    for names in groups:
        owner, attr = _split(names[0])
        keep = getattr(model.get_submodule(owner), attr)
        for name in names[1:]:
            mod_name, a = _split(name)
            mod = model.get_submodule(mod_name)
            if getattr(mod, a) is not keep:
                setattr(mod, a, keep)
                changed += 1
    return changed


def check_shared_units(groups: Iterable[tuple[str, ...]], units: Iterable[str]) -> list[str]:
    """Problems with tied parameters whose owners lie in different data-parallel units.

    `units`: qualified names of the modules each wrapped as one FSDP2/replicate group (blocks and roots);
    a parameter belongs to the innermost unit that contains its owner ("" is the whole model).
    """
    units = sorted(set(units), key=len, reverse=True)

    def unit_of(name: str) -> str:
        return next((u for u in units if u and (name == u or name.startswith(u + "."))), "")

    problems = []
    for names in groups:
        where = {n: unit_of(n) for n in names}
        if len(set(where.values())) > 1:
            how = ", ".join(f"{n} in {u or 'the model root'!r}" for n, u in where.items())
            problems.append(
                f"parameters {list(names)} are one tied tensor but lie in different sharding units ({how}); a"
                " parameter can belong to one FSDP unit only. Choose `units` so that a single unit (or the root)"
                " holds all of its owners, or untie them."
            )
    return problems


__all__ = ["check_shared_tp", "check_shared_units", "retie", "shared_parameters"]
