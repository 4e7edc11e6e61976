"""Checks of a tensor-parallel plan against the model, in one process (sizes, heads, regions, single inputs), and the
head-count attributes of split regions made local."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping

from torch import nn

from lightning_dist.parallelize.tp.vocab import TPEntry, is_conv1d, linear_like, out_features, split_regions

_HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "num_attention_heads")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
# head counts an attention module may read in its forward: set to the local count on a split region (as torchtitan
# sets n_heads // tp), the global ones kept under GLOBAL_ATTRS_KEY for single-device copies; GPT-2's attention splits
# c_attn's output by split_size (= embed_dim)
LOCAL_ATTRS = (*_HEAD_ATTRS, *_KV_HEAD_ATTRS, "all_head_size", "split_size", "embed_dim")
GLOBAL_ATTRS_KEY = "_tp_global_attrs"
# the same counts read from a `config` object (litgpt: self.config.n_head, n_query_groups): the split module gets its
# own shallow copy of the config with the local counts (the config is shared by every layer)
CONFIG_ATTRS = (*_HEAD_ATTRS, "num_key_value_heads", "n_query_groups", "num_kv_heads", "n_kv_heads")


def _read(obj: object, attr: str) -> object:
    """`obj.attr`, or None where reading it raises (transformers' heterogeneous configs refuse a global read of a
    per-layer field with their own error, not AttributeError)."""
    try:
        return getattr(obj, attr, None)
    except Exception:
        return None


def _ints(obj: object, attrs: tuple[str, ...]) -> dict[str, int]:
    values = {a: _read(obj, a) for a in attrs}
    return {a: v for a, v in values.items() if isinstance(v, int) and not isinstance(v, bool)}


def _first_int(obj: object, attrs: tuple[str, ...]) -> int | None:
    return next((v for v in (_read(obj, a) for a in attrs) if isinstance(v, int) and not isinstance(v, bool)), None)


def _config(module: nn.Module) -> object | None:
    cfg = module.__dict__.get("config")
    return None if isinstance(cfg, nn.Module) else cfg


def _head_counts(module: nn.Module) -> dict[str, int]:
    """The head counts a split region's forward may read, by path: its own (``num_heads``) and its config's."""
    counts = _ints(module, LOCAL_ATTRS)
    return counts | {f"config.{a}": v for a, v in _ints(_config(module), CONFIG_ATTRS).items()}


def local_attr_problems(model: nn.Module, entries: list[TPEntry], tp: int) -> list[str]:
    return [
        f"{parent or type(model).__name__} has {attr}={value}, which the plan must set to the local count {attr} // tp"
        f" on each rank, but {value} is not divisible by tp={tp}; choose a tp that divides it."
        for parent in split_regions(entries)
        for attr, value in _head_counts(model.get_submodule(parent)).items()
        if value % tp
    ]


def set_local_attrs(model: nn.Module, entries: list[TPEntry], tp: int, *, within: nn.Module | None = None) -> list[str]:
    """Divide the head-count attributes of each split region by `tp` (only regions inside `within`, a pipeline stage,
    when given; a region whose global values are already kept is left alone); returns the ``module.attr`` changed."""
    inside = None if within is None else {id(m) for m in within.modules()}
    changed = []
    for parent in split_regions(entries):
        module = model.get_submodule(parent)
        if (inside is not None and id(module) not in inside) or GLOBAL_ATTRS_KEY in module.__dict__:
            continue
        counts, saved = _head_counts(module), {}
        if any(a.startswith("config.") for a in counts):
            saved["config"] = module.config
            module.config = copy.copy(module.config)  # this module's own config: the shared one keeps the global counts
        for attr, value in counts.items():
            owner, _, name = attr.rpartition(".")
            if not owner:
                saved[name] = value
            setattr(module.config if owner else module, name, value // tp)
            changed.append(f"{parent}.{attr}")
        if saved:
            module.__dict__[GLOBAL_ATTRS_KEY] = saved
    return changed


def divisibility_problems(fqn: str, module: nn.Module, style: str, tp: int, parent: nn.Module | None) -> list[str]:
    problems = []
    if style == "colwise_qkv":
        return _fused_problems(fqn, module, tp, parent)
    if style in ("colwise", "colwise_gather", "rowwise"):
        row = style == "rowwise"
        if isinstance(module, nn.Linear):
            size, what = (module.in_features, "in_features") if row else (module.out_features, "out_features")
        elif is_conv1d(module):
            size, what = (module.nx, "nx (in features)") if row else (module.nf, "nf (out features)")
        else:
            size, what = (module.num_embeddings, "num_embeddings") if row else (module.embedding_dim, "embedding_dim")
        if size % tp:
            problems.append(
                f"{fqn} ({type(module).__name__}, {style}): {what}={size} is not divisible by tp={tp};"
                f" choose a tp that divides {size} or leave this module out of the plan."
            )
    if style == "colwise" and parent is not None and not problems:
        problems += _head_problems(fqn, module, tp, parent)
    return problems


def _fused_problems(fqn: str, module: nn.Module, tp: int, parent: nn.Module | None) -> list[str]:
    """A fused [q | k | v] projection: three equal blocks, each split into whole heads over `tp`."""
    out = out_features(module)
    if out % 3:
        return [
            f"{fqn} ({type(module).__name__}, colwise_qkv): {out} output features are not three equal [q | k | v]"
            " blocks; colwise_qkv is for a fused q/k/v projection (a head-major one takes 'colwise')."
        ]
    block = out // 3
    head_dim = _head_dim(parent) if parent is not None else None
    heads = block // head_dim if head_dim and block % head_dim == 0 else None
    if heads is not None and heads % tp:
        return _heads_problem(fqn, heads, "heads", tp)
    if block % tp:
        return [
            f"{fqn} ({type(module).__name__}, colwise_qkv): each q/k/v block has {block} features, not divisible"
            f" by tp={tp}; choose a tp that divides {block}."
        ]
    return []


def _head_dim(attn: nn.Module) -> int | None:
    """Per-head width of an attention module: its or its ``config``'s ``head_dim``/``head_size`` (litgpt), else the
    config's width over the head count."""
    cfg = getattr(attn, "config", None)
    head_dim = _first_int(attn, ("head_dim", "head_size")) or _first_int(cfg, ("head_dim", "head_size"))
    heads = _first_int(attn, _HEAD_ATTRS) or _first_int(cfg, _HEAD_ATTRS)
    width = _read(cfg, "hidden_size")
    return head_dim or (width // heads if isinstance(width, int) and heads else None)


def _heads_problem(fqn: str, heads: int, kind: str, tp: int) -> list[str]:
    return [
        f"{fqn}: the attention module has {heads} {kind}, not divisible by tp={tp}; heads are split over tensor"
        f" ranks, so choose a tp that divides {heads}."
    ]


def _head_problems(fqn: str, module: nn.Module, tp: int, parent: nn.Module) -> list[str]:
    # a column-wise projection of an attention module must give each rank whole heads (query or key/value heads)
    head_dim, out, name = _head_dim(parent), out_features(module), fqn.rpartition(".")[2]
    if head_dim and isinstance(out, int) and out % head_dim == 0:
        heads = out // head_dim
        if name in ("qkv", "query_key_value", "Wqkv") and heads % 3 == 0:
            heads //= 3  # head-major fused q, k, v
    else:  # no head width known: the module's own head count attribute, if any
        heads = _first_int(parent, _HEAD_ATTRS)
    if heads is None or heads % tp == 0:
        return []
    kind = "key/value heads" if name in ("k", "v", "k_proj", "v_proj", "key", "value") else "heads"
    return _heads_problem(fqn, heads, kind, tp)


# styles that lay out a module's inputs with torch's PrepareModuleInput, one layout: exactly one positional input
ONE_INPUT_STYLES = ("region_input", "sp_enter", "sp_exit", "sp_region")


def forward_inputs(module: nn.Module) -> list[str] | None:
    """Names of the positional inputs `module`'s forward requires (no default), ``*args`` as ``*name``; None when
    its signature cannot be read."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return names + [f"*{p.name}" for p in params if p.kind is p.VAR_POSITIONAL]


def input_problems(entries: list[TPEntry], modules: Mapping[str, nn.Module]) -> list[str]:
    """A one-input style on a module whose forward takes several inputs (torch would fail at the first forward, after
    the weights were distributed: its PrepareModuleInput gets one layout per positional input)."""
    problems = []
    for e in entries:
        if e.style not in ONE_INPUT_STYLES or not e.active:
            continue
        names = forward_inputs(modules[e.fqn])
        if names is not None and len(names) > 1:
            problems.append(
                f"{e.fqn} ({e.module_type}) is given {e.style!r}, which lays out exactly one input, but its forward"
                f" takes {len(names)} inputs {names} (torch would fail with 'module inputs and input_layouts should"
                f" have same length!'). Drop the {e.pattern!r} entry (its column-wise layers take a replicated input"
                " themselves; no sequence parallelism around it), or put the style on a module whose forward takes"
                " one tensor."
            )
    return problems


def region_problems(entries: list[TPEntry], modules: Mapping[str, nn.Module]) -> list[str]:
    """Each split activation consumed where it is split: a column-wise layer's output taken back by a row-wise layer of
    the same parent module, a row-wise layer's split input produced by a column-wise one (unless a layout is stated)."""
    by_parent: dict[str, list[TPEntry]] = {}
    for e in entries:
        if e.active:
            by_parent.setdefault(e.fqn.rpartition(".")[0], []).append(e)
    problems = []
    for parent, group in by_parent.items():
        cols = [e for e in group if e.style in ("colwise", "colwise_qkv") and "output" not in e.options]
        rows = [e for e in group if e.style == "rowwise" and linear_like(modules[e.fqn]) and "input" not in e.options]
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
