"""HuggingFace weights in and out of a sharded model: load a safetensors folder, export one ``from_pretrained`` loads.

Notes: docs/internals.md, "lightning_dist/hf.py"."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist._compat import HAS_DCP_HF_READER
from lightning_dist.atomic import swap_in
from lightning_dist.parallelize.shared import shared_parameters


@contextmanager
def init_empty_weights() -> Iterator[None]:
    """Build modules with parameters on the meta device and buffers on the CPU.

    Hand-written (accelerate's ``init_empty_weights(include_buffers=False)`` does the same; the pack does not
    depend on accelerate): buffers that models compute in ``__init__`` and do not save (rotary ``inv_freq``)
    keep their values, parameters cost no memory until the strategy materializes its shards.
    """
    from torch.nn.modules.module import register_module_parameter_registration_hook

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is not None and param.device.type != "meta":
            return type(param)(param.to("meta"), requires_grad=param.requires_grad)
        return None  # registered as given

    # torch's hook on every module's parameter registration, for the length of the block
    handle = register_module_parameter_registration_hook(on_meta)
    try:
        yield
    finally:
        handle.remove()


def find_hf_model(module: nn.Module) -> tuple[str, nn.Module]:
    """(qualified name, module) of the outermost HuggingFace model inside `module` (it has ``config`` and
    ``save_pretrained``). Raises TypeError when there is none."""
    for name, sub in module.named_modules():
        if hasattr(sub, "config") and callable(getattr(sub, "save_pretrained", None)):
            return name, sub
    raise TypeError(
        f"{type(module).__name__} holds no HuggingFace model (a module with `config` and `save_pretrained`)."
    )


def _strip(prefix: str, key: str) -> str | None:
    if not prefix:
        return key
    return key[len(prefix) + 1 :] if key.startswith(prefix + ".") else None


def save_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of `module`'s buffers that hold values (not on the meta device): restore them after materializing."""
    return {n: b.detach().clone() for n, b in module.named_buffers() if b.device.type != "meta"}


def restore_buffers(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Put back buffer values that materialization (``to_empty``) left uninitialized."""
    for name, value in saved.items():
        buf = module.get_buffer(name)
        with torch.no_grad():
            buf.copy_(value.to(buf.device, buf.dtype))


def load_hf_weights(module: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> list[str]:
    """Fill the parameters of the HuggingFace model inside `module` (sharded or not) from a safetensors folder.

    Every rank must call it (DCP load is collective). Tied parameters are filled once, under whichever of
    their names the folder stores. With ``strict`` a parameter the folder lacks, or a tensor of the folder
    the model lacks, raises ``ValueError`` naming them (nothing is left with random values silently).
    Returns the names loaded (relative to the HuggingFace model).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    path = Path(path)
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{str(path)!r} is not a folder of .safetensors files (as written by save_pretrained).")
    prefix, hf = find_hf_model(module)
    meta_buffers = [n for n, b in module.named_buffers() if b.device.type == "meta"]
    if meta_buffers:
        raise ValueError(
            f"buffers {meta_buffers[:4]} are still on the meta device and are not stored in the folder;"
            " build the model under `lightning_dist.hf.init_empty_weights()`, which keeps buffers real."
        )
    full = get_model_state_dict(module)
    keys = {k: _strip(prefix, k) for k in full}
    keys = {k: v for k, v in keys.items() if v is not None}
    stored = _stored_keys(path)
    aliases = {n for names in shared_parameters(hf) for n in names}
    groups = {n: names for names in shared_parameters(hf) for n in names}
    missing = [
        v for v in keys.values() if v not in stored and not (v in aliases and any(a in stored for a in groups[v]))
    ]
    unexpected = sorted(set(stored) - set(keys.values()))
    if strict and (missing or unexpected):
        raise ValueError(
            f"{path} does not match {type(hf).__name__}: missing {missing[:6]}, unexpected {unexpected[:6]}"
            " (pass strict=False to load the common tensors only)."
        )
    wanted = {v: full[k] for k, v in keys.items() if v in stored}
    if HAS_DCP_HF_READER:
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        # each rank reads the slices its DTensor shards cover; plain tensors are read whole
        dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(path)))
    else:  # whole tensors on every rank, each keeping its part (distribute_tensor of the same value)
        _load_whole(wanted, path)
    loaded = {(f"{prefix}.{k}" if prefix else k): v for k, v in wanted.items()}
    set_model_state_dict(module, loaded, options=StateDictOptions(strict=False))
    return sorted(wanted)


def _stored_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    keys = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys += list(f.keys())
    return keys


def _load_whole(wanted: dict[str, Any], path: Path) -> None:
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key not in wanted:
                    continue
                target, value = wanted[key], f.get_tensor(key)
                local = target.to_local() if hasattr(target, "to_local") else target
                if hasattr(target, "placements"):
                    from torch.distributed.tensor import distribute_tensor

                    value = distribute_tensor(value.to(local.device), target.device_mesh, target.placements).to_local()
                with torch.no_grad():
                    local.copy_(value)


def save_hf_pretrained(module: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> Path | None:
    """Write the HuggingFace model inside `module` (sharded or not) as a folder ``from_pretrained`` loads.

    Collective (every rank gathers); rank 0 writes, into a temporary folder renamed to `path` (which must
    not exist). `dtype`: cast floating tensors (default: as trained). Returns `path` on rank 0, else None.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    path = Path(path)
    prefix, hf = find_hf_model(module)
    distributed = dist.is_available() and dist.is_initialized()
    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=distributed))
    rank = dist.get_rank() if distributed else 0
    out = None
    if rank == 0:
        if path.exists():
            raise FileExistsError(f"{str(path)!r} exists; export into a new folder.")
        state = {}
        for k, v in full.items():
            name = _strip(prefix, k)
            if name is not None:
                v = v.detach().cpu()
                state[name] = v.to(dtype) if dtype is not None and v.is_floating_point() else v
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            hf.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
            swap_in(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        out = path
    if distributed:
        dist.barrier()
    return out


__all__ = [
    "find_hf_model",
    "init_empty_weights",
    "load_hf_weights",
    "restore_buffers",
    "save_buffers",
    "save_hf_pretrained",
]
