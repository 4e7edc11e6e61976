"""Checkpoints of the pack's strategies: sharded DCP directories or one consolidated file.

Notes: docs/internals.md, "lightning_dist/checkpoint.py"."""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_dist.atomic import atomic_write
from lightning_dist.atomic import swap_in as _swap_in  # a module global: tests/scenarios/fault_save.py wraps it

if TYPE_CHECKING:
    from lightning_dist.checkpoint_async import BackgroundWriter

META = "meta.pt"
MODEL_KEY = "state_dict"
ZERO_KEY = "zero_consolidated"  # marks a ZeroRedundancyOptimizer's consolidated (index-keyed) state
# in meta.pt of a pipeline checkpoint: {key of a tied copy: the one key its value is saved under}
TIED_KEY = "tied_weights"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _unwrap(optimizer: Any) -> Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer -> torch optimizer


def _is_zero(optimizer: Any) -> bool:
    # looked up, not imported: importing torch.distributed.optim scripts its functional optimizers (0.64 s measured
    # inside the first save of a run); an optimizer of that class exists only once its module is imported
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(_unwrap(optimizer), module.ZeroRedundancyOptimizer)


# ---- collecting state --------------------------------------------------------------------------
def model_state(model: nn.Module, *, full: bool) -> dict[str, Any]:
    """Sharded (DTensor) state dict, or the full one (on rank 0 only; other ranks get ``{}``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=full))


def _fqn_order(fqn_keyed: Mapping[str, Any]) -> list[str]:
    return [fqn for group in fqn_keyed["param_groups"] for fqn in group["params"]]


def fqn_to_index(osd: Mapping[str, Any]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict (torch.distributed.checkpoint) -> torch's index-keyed layout."""
    index = {fqn: i for i, fqn in enumerate(_fqn_order(osd))}
    groups = [{**g, "params": [index[f] for f in g["params"]]} for g in osd["param_groups"]]
    return {"state": {index[f]: s for f, s in osd["state"].items()}, "param_groups": groups}


def unflatten_optimizer(flat: Mapping[str, Any], order: Sequence[str]) -> dict[str, Any]:
    """torch's flattened optimizer layout (``state.<fqn>.<slot>``, ``param_groups.<fqn>.<option>``, used by
    the pipeline strategy because stages hold different parameters) -> the FQN-keyed nested layout.

    Parameters with equal options form one group; `order` (the model's parameter names) orders them.
    """
    state: dict[str, dict[str, Any]] = {}
    options: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        fqn, _, leaf = rest.rpartition(".")
        (state if kind == "state" else options).setdefault(fqn, {})[leaf] = value
    rank = {name: i for i, name in enumerate(order)}
    groups: list[dict[str, Any]] = []
    for fqn in sorted(options, key=lambda n: rank.get(n, len(rank))):
        group = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == options[fqn]), None)
        if group is None:
            group = {**options[fqn], "params": []}
            groups.append(group)
        group["params"].append(fqn)
    return {"state": state, "param_groups": groups}


def _is_flat_optimizer(osd: Mapping[str, Any]) -> bool:
    return bool(osd) and all(k.startswith(("state.", "param_groups.")) for k in osd)


def index_to_fqn(osd: Mapping[str, Any], template: Mapping[str, Any]) -> dict[str, Any]:
    """torch's index-keyed optimizer state dict -> FQN keys, taking the order from a live FQN-keyed template."""
    order = _fqn_order(template)
    n_saved = sum(len(g["params"]) for g in osd["param_groups"])
    if n_saved != len(order):
        raise ValueError(
            f"The checkpoint's optimizer has {n_saved} parameters but the live optimizer has {len(order)};"
            " the checkpoint was written by a different model or `configure_optimizers`."
        )
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": {order[int(i)]: s for i, s in osd["state"].items()}, "param_groups": groups}


def optimizer_state(model: nn.Module, optimizer: Any, *, full: bool) -> dict[str, Any]:
    """Sharded FQN-keyed optimizer state, or the full index-keyed one on rank 0 (``{}`` elsewhere).

    A ZeroRedundancyOptimizer (ZeRO-1) is consolidated on rank 0 in both cases (a collective).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optimizer = _unwrap(optimizer)
    if _is_zero(optimizer):
        optimizer.consolidate_state_dict(to=0)
        return {ZERO_KEY: optimizer.state_dict()} if _rank() == 0 else {ZERO_KEY: None}
    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
    if full:
        return fqn_to_index(osd) if osd else {}
    return osd


# ---- writing -----------------------------------------------------------------------------------
def _atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary file in the same folder, fsync, then os.replace (atomic on POSIX)."""
    atomic_write(path, lambda f: torch.save(obj, f))


def _serialized(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def save(
    checkpoint: dict[str, Any], path: str | os.PathLike, *, sharded: bool, writer: BackgroundWriter | None = None
) -> None:
    """Write a Lightning checkpoint dict atomically; every rank must call this (collectives inside).

    `checkpoint` is what Lightning's ``dump_checkpoint`` built from :func:`model_state` and
    :func:`optimizer_state` with the same `sharded` choice. `writer` (sharded only): wait for its pending
    save, then stage this one and return while it writes (``meta.pt`` and ZeRO-1 files are serialized now and
    written before the commit).
    """
    path = Path(path)
    if writer is not None:
        if not sharded:
            raise ValueError(
                "A background checkpoint save needs sharded checkpoints (save_distributed_checkpoint=True)."
            )
        # one save in flight: the previous one is committed before this one starts (the barrier after rank 0's
        # mkdir below keeps every rank behind that commit)
        writer.wait(barrier=False)
    tmp = path.with_name(path.name + ".tmp")
    rank = _rank()
    if not sharded:
        if rank == 0:
            checkpoint = dict(checkpoint)
            checkpoint["optimizer_states"] = [
                s[ZERO_KEY] if ZERO_KEY in s else s for s in checkpoint.get("optimizer_states", [])
            ]
            _atomic_torch_save(checkpoint, path)
        _barrier()
        return

    import torch.distributed.checkpoint as dcp

    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        tmp.mkdir(parents=True)
    _barrier()
    checkpoint = dict(checkpoint)
    state: dict[str, Any] = {MODEL_KEY: checkpoint.pop(MODEL_KEY)}
    zero_states: dict[int, Any] = {}
    for i, osd in enumerate(checkpoint.pop("optimizer_states", [])):
        if ZERO_KEY in osd:
            zero_states[i] = osd[ZERO_KEY]
        else:
            state[f"optimizer_{i}"] = osd
    if writer is not None:
        commit = None
        if rank == 0:
            # Lightning's objects in them may change while training goes on: serialized now (small), written to
            # disk (fsync) in the background, before the rename
            files = {tmp / f"optimizer_{i}.pt": _serialized(osd) for i, osd in zero_states.items()}
            files[tmp / META] = _serialized(checkpoint)

            def commit() -> None:
                for file, data in files.items():
                    atomic_write(file, lambda f, data=data: f.write(data))
                _swap_in(tmp, path)  # looked up at commit time (tests/scenarios/fault_save.py wraps the global)

        writer.start(state, tmp, path, commit=commit)
        return
    dcp.save(state, checkpoint_id=tmp)
    if rank == 0:
        for i, osd in zero_states.items():
            _atomic_torch_save(osd, tmp / f"optimizer_{i}.pt")
        _atomic_torch_save(checkpoint, tmp / META)
        _swap_in(tmp, path)
    _barrier()


# ---- reading -----------------------------------------------------------------------------------
def resolve_path(path: str | os.PathLike) -> Path:
    """`path`, or its ``.old`` twin when a crash interrupted the swap of a newer checkpoint."""
    path = Path(path)
    old = path.with_name(path.name + ".old")
    if not path.exists() and old.exists():
        return old
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
    return path


_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format: DCP writes each item as one, and meta.pt is one


def _torch_load(path: Path, weights_only: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as err:
        if _read_magic(path) != _ZIP_MAGIC or "zip archive" in str(err):
            # torch's own message for a damaged file can advise weights_only=False: name the damage instead
            raise ValueError(
                f"{path} is damaged (truncated or overwritten: not a file torch.save wrote). Copy it again"
                " from where it was written, or load another checkpoint."
            ) from None
        if weights_only and "weights_only" in str(err):  # pickle.UnpicklingError under weights_only: name the way out
            # torch's message advises weights_only=False (arbitrary code execution): keep only its diagnosis
            why = (
                " ".join(
                    line.strip() for line in str(err).splitlines() if "Unsupported global" in line or "GLOBAL" in line
                )
                or "a class outside torch's allow-list"
            )
            raise RuntimeError(
                f"{path} holds objects that `torch.load(weights_only=True)` refuses ({why}). If you trust the file,"
                " allow those classes with `torch.serialization.add_safe_globals([...])`."
            ) from None
        raise


def _read_magic(path: Path, offset: int = 0) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(len(_ZIP_MAGIC))


def check_sharded(path: str | os.PathLike, *, need_meta: bool = True) -> None:
    """Refuse an incomplete or damaged sharded checkpoint directory before anything reads it (ValueError).

    Checks, with file-system reads only (the same answer on every rank, so nothing waits in a collective):
    the ``.metadata`` index is present and readable, every shard file it names exists and is as long as
    the items it holds, each item starts like a saved tensor, and ``meta.pt`` (Lightning's loop state) is there.
    The message names each missing or damaged file.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    fix = (
        " Copy the whole checkpoint directory again from where it was written (every file of it), or load"
        " another checkpoint."
    )
    if not (path / ".metadata").is_file():
        found = sorted(p.name for p in path.iterdir())[:5] if path.is_dir() else []
        raise ValueError(
            f"{path} is not a sharded checkpoint of lightning-dist: it has no `.metadata` file (the index"
            f" torch.distributed.checkpoint writes last; found {found or 'nothing'}). Pass the checkpoint"
            " directory itself (e.g. `epoch=0-step=10.ckpt`)." + fix
        )
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:
        raise ValueError(f"{path / '.metadata'} is damaged and cannot be read ({type(err).__name__})." + fix) from None
    extents: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        plain = not getattr(info, "transform_descriptors", None)  # compressed/transformed items start otherwise
        extents.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn if plain else ""))
    problems = []
    for name, items in sorted(extents.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
            continue
        size, end = file.stat().st_size, max(o + n for o, n, _ in items)
        if size < end:
            problems.append(f"{name} is truncated ({size:,} bytes; the index names {end:,})")
            continue
        bad = next((fqn for o, _, fqn in items if fqn and _read_magic(file, o) != _ZIP_MAGIC), None)
        if bad is not None:
            problems.append(f"{name} is damaged (entry {bad!r} is not a saved tensor)")
    if need_meta:
        meta = path / META
        if not meta.is_file():
            problems.append(f"{META} (Lightning's loop state) is missing")
        elif _read_magic(meta) != _ZIP_MAGIC:
            problems.append(f"{META} (Lightning's loop state) is damaged")
    if problems:
        raise ValueError(f"The checkpoint {path} is incomplete or damaged: " + "; ".join(problems) + "." + fix)


def check_compatible(
    saved_shapes: Mapping[str, Sequence[int]],
    model: nn.Module,
    strict: bool = True,
    live_state: Mapping[str, Any] | None = None,
) -> None:
    """Raise ValueError naming the first parameter whose name or shape differs between checkpoint and model.

    `live_state`: the model's sharded state dict when the caller already has it (saves collecting it twice).
    """
    state = live_state if live_state is not None else model_state(model, full=False)
    live = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    for name, shape in live.items():
        if name not in saved_shapes:
            if strict:
                raise ValueError(
                    f"The checkpoint has no entry for parameter {name!r} {list(shape)}: it was written by a"
                    " different model. Load it into the model it came from, or pass strict=False."
                )
            continue
        if tuple(saved_shapes[name]) != shape:
            raise ValueError(
                f"Parameter {name!r} has shape {list(saved_shapes[name])} in the checkpoint but {list(shape)} in"
                " the model: the checkpoint was written by a different model configuration."
            )
    if strict:
        extra = sorted(set(saved_shapes) - set(live))
        if extra:
            raise ValueError(f"The checkpoint has entries the model lacks, first {extra[0]!r}: a different model.")


def model_state_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Global (unsharded) shapes of the model's state, keyed as in the checkpoint."""
    return {k: v.shape for k, v in model_state(model, full=False).items() if isinstance(v, torch.Tensor)}


def load(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizers: Sequence[Any] = (),
    strict: bool = True,
    weights_only: bool = True,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Load model and optimizer states in place (any mesh shape); return the remaining Lightning metadata.

    `aliases`: ``{model key: checkpoint key}`` for parameters saved once under another name (weights tied
    across pipeline stages); used where the checkpoint lacks the model's own key.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = resolve_path(path)
    if path.is_dir():
        import torch.distributed.checkpoint as dcp

        check_sharded(path)
        reader = dcp.FileSystemReader(path)
        index = reader.read_metadata().state_dict_metadata
        saved = {
            k[len(MODEL_KEY) + 1 :]: md.size
            for k, md in index.items()
            if k.startswith(MODEL_KEY + ".") and hasattr(md, "size")
        }
        meta = _torch_load(path / META, weights_only)
        if aliases is None:  # a pipeline checkpoint saved each weight tied across stages once
            aliases = meta.get(TIED_KEY)
        model_sd = model_state(model, full=False)
        alias = _usable_aliases(aliases, model_sd, saved)
        view = {alias.get(k, k): v for k, v in model_sd.items()}  # a tied copy reads the one saved entry
        check_compatible(saved, model, strict=strict, live_state=view)
        dcp.load({MODEL_KEY: view}, checkpoint_id=path)
        model_sd = {k: view[alias.get(k, k)] for k in model_sd}
        set_model_state_dict(model, model_sd, options=StateDictOptions(strict=strict))
        for i, optimizer in enumerate(optimizers):
            optimizer = _unwrap(optimizer)
            zero_file = path / f"optimizer_{i}.pt"
            if zero_file.exists():
                _load_full_optimizer(model, optimizer, _torch_load(zero_file, weights_only))
                continue
            if _is_zero(optimizer):
                raise ValueError(
                    f"{path} holds sharded optimizer state from a ZeRO-2/3 run; a zero_stage=1 run cannot resume"
                    " from it. Resume with zero_stage 2 or 3, or load only the weights."
                )
            if _name_keyed_in(index, i):  # written by PipelineStrategy: optimizer state keyed by parameter name
                _load_name_keyed_optimizer(path, i, model, optimizer, alias, index)
                continue
            osd = get_optimizer_state_dict(model, optimizer)
            dcp.load({f"optimizer_{i}": osd}, checkpoint_id=path)
            set_optimizer_state_dict(model, optimizer, optim_state_dict=osd)
        return meta

    checkpoint = _torch_load(path, weights_only)
    state_dict = checkpoint.pop(MODEL_KEY)
    check_compatible({k: v.shape for k, v in state_dict.items()}, model, strict=strict)
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))
    for optimizer, osd in zip(optimizers, checkpoint.get("optimizer_states", [])):
        _load_full_optimizer(model, _unwrap(optimizer), osd)
    checkpoint.pop("optimizer_states", None)
    return checkpoint


def _usable_aliases(aliases: Mapping[str, str] | None, live: Mapping[str, Any], saved: Any) -> dict[str, str]:
    """The aliases a checkpoint needs: the model key is not saved, its checkpoint key is (older checkpoints
    saved every tied copy under its own name)."""
    return {k: v for k, v in (aliases or {}).items() if k in live and k not in saved and v in saved}


def _alias_flat_optimizer(osd: Mapping[str, Any], alias: Mapping[str, str]) -> dict[str, str]:
    """``{flattened optimizer key: key in the checkpoint}`` (``state.<name>.<slot>``, ``param_groups.<name>.<opt>``)."""
    out = {}
    for k in osd:
        kind, _, rest = k.partition(".")
        name = next((n for n in alias if rest.startswith(n + ".")), None)
        out[k] = k if name is None else f"{kind}.{alias[name]}{rest[len(name) :]}"
    return out


def name_keyed_optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Optimizer state keyed by parameter name (flattened): what each pipeline stage saves of its parameters.

    List-indexed ``param_groups`` would collide between stages holding different parameters.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(
        model, _unwrap(optimizer), options=StateDictOptions(flatten_optimizer_state_dict=True)
    )


def load_stage(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizers: Sequence[Any] = (),
    weights_only: bool = True,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Load the part of a checkpoint that one pipeline rank holds (its stages' parameters and optimizer states).

    Every key of `model` must be in a sharded checkpoint (``strict=False`` only admits the other stages'
    keys); optimizer states are matched by parameter name (see :func:`name_keyed_optimizer_state`).
    `aliases`: ``{model key: checkpoint key}`` of weights tied across stages, saved once (see :func:`load`).
    """
    import torch.distributed.checkpoint as dcp

    path = resolve_path(path)
    if not path.is_dir():  # a consolidated file: weights only (its optimizer state is in single-device layout)
        return load(path, model=model, optimizers=(), strict=False, weights_only=weights_only)
    check_sharded(path)
    saved = {
        k[len(MODEL_KEY) + 1 :]
        for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        if k.startswith(MODEL_KEY + ".")
    }
    live = model_state_shapes(model)
    alias = _usable_aliases(aliases, live, saved)
    missing = sorted({alias.get(k, k) for k in live} - saved)
    if missing:
        raise ValueError(
            f"The checkpoint {path} has no entry for {missing[:3]}... of this pipeline stage:"
            " it was written by a different model."
        )
    meta = load(path, model=model, optimizers=(), strict=False, weights_only=weights_only, aliases=alias)
    index = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for i, optimizer in enumerate(optimizers):
        if not _name_keyed_in(index, i):
            raise ValueError(
                f"The checkpoint {path} holds optimizer state keyed by parameter index (written by a"
                " data-parallel strategy), which a pipeline stage cannot pick its parameters from."
                " Resume it with the strategy that wrote it, or convert it with `lightning-dist consolidate`"
                " and load only the weights."
            )
        _load_name_keyed_optimizer(path, i, model, optimizer, alias, index)
    return meta


def _name_keyed_in(index: Mapping[str, Any], i: int) -> bool:
    """Whether a sharded checkpoint's optimizer `i` is keyed by parameter name (``param_groups.<fqn>.<option>``,
    as pipeline stages save it) rather than by group index (``param_groups.0.lr``)."""
    groups = [k for k in index if k.startswith(f"optimizer_{i}.param_groups.")]
    return bool(groups) and not any(k.endswith(".params") for k in groups)  # a nested group lists its `params`


def _load_name_keyed_optimizer(
    path: Path, i: int, model: nn.Module, optimizer: Any, alias: Mapping[str, str], index: Mapping[str, Any]
) -> None:
    """Load optimizer `i` of a name-keyed checkpoint into `optimizer` (any strategy: the names are the model's).

    Refuses, before the collective read, a checkpoint lacking this model's parameters' entries (ValueError)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    osd = name_keyed_optimizer_state(model, optimizer)
    rename = _alias_flat_optimizer(osd, alias)
    view = {rename[k]: v for k, v in osd.items()}
    missing = [
        k for k in view if not any(n == f"optimizer_{i}.{k}" or n.startswith(f"optimizer_{i}.{k}.") for n in index)
    ]
    if missing:
        raise ValueError(
            f"The checkpoint {path} has no optimizer entry {missing[0]!r} (of {len(missing)} missing): its"
            " optimizer was built over other parameters or by another `configure_optimizers`. Resume with"
            " the same model and optimizers, or load only the weights."
        )
    dcp.load({f"optimizer_{i}": view}, checkpoint_id=path)
    osd = {k: view[rename[k]] for k in osd}
    set_optimizer_state_dict(
        model, _unwrap(optimizer), optim_state_dict=osd, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )


def _load_full_optimizer(model: nn.Module, optimizer: Optimizer, osd: Mapping[str, Any]) -> None:
    """Load a full index-keyed optimizer state into a (possibly sharded or ZeRO) optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    if _is_zero(optimizer):
        optimizer.load_state_dict(osd)  # ZeroRedundancyOptimizer keeps its own partition of the full state
        return
    template = get_optimizer_state_dict(model, optimizer)
    set_optimizer_state_dict(
        model,
        optimizer,
        optim_state_dict=index_to_fqn(osd, template),
        options=StateDictOptions(full_state_dict=True),
    )


def consolidate(
    src: str | os.PathLike, dst: str | os.PathLike, *, progress: Callable[[str], None] | None = None
) -> Path:
    """Turn a sharded checkpoint directory into one Lightning checkpoint file (no process group needed).

    The result loads with ``LightningModule.load_from_checkpoint`` on a single device. ZeRO-1 optimizer
    files are carried over; FSDP optimizer states are converted to torch's index-keyed layout.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src, dst = resolve_path(src), Path(dst)
    if not src.is_dir():
        raise ValueError(f"{src} is not a sharded checkpoint directory (it is already a single file).")
    check_sharded(src)
    say = progress or (lambda msg: None)
    with tempfile.TemporaryDirectory() as tmpdir:
        flat = Path(tmpdir) / "flat.pt"
        say(f"reading shards from {src}")
        dcp_to_torch_save(src, flat)
        state = torch.load(flat, map_location="cpu", weights_only=True)
    checkpoint = _torch_load(src / META, weights_only=True)
    checkpoint[MODEL_KEY] = state.pop(MODEL_KEY)
    # weights tied across pipeline stages were saved once: every name of the plain model's state_dict gets
    # the same tensor back (torch.save writes a shared storage once, as for a single-device tied model)
    for alias, key in checkpoint.pop(TIED_KEY, {}).items():
        checkpoint[MODEL_KEY][alias] = checkpoint[MODEL_KEY][key]
    optimizer_states = []
    i = 0
    while f"optimizer_{i}" in state or (src / f"optimizer_{i}.pt").exists():
        if (src / f"optimizer_{i}.pt").exists():
            optimizer_states.append(_torch_load(src / f"optimizer_{i}.pt", True))
        else:
            osd = state.pop(f"optimizer_{i}")
            if _is_flat_optimizer(osd):
                osd = unflatten_optimizer(osd, list(checkpoint[MODEL_KEY]))
            optimizer_states.append(fqn_to_index(osd))
        i += 1
    checkpoint["optimizer_states"] = optimizer_states
    say(f"writing {dst}")
    _atomic_torch_save(checkpoint, dst)
    return dst
