"""What users type, turned into values: byte sizes, parameter counts, model class paths, LightningCLI YAML.

Used by ``lightning-dist plan`` / ``dry-run`` (:mod:`lightning_dist.cli`), the dry run and
``strategy="auto_parallel"``'s ``device_memory="80GB"``; the planner itself takes plain numbers and modules.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

_DECIMAL = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


# ---- models ---------------------------------------------------------------------------------------------
def import_class(class_path: str) -> type:
    """Import ``package.module.Class``; ValueError naming the path when it cannot be found."""
    module_name, _, attr = class_path.rpartition(".")
    if not module_name:
        raise ValueError(f"Model class path {class_path!r} must be dotted, e.g. 'my_pkg.models.GPT'.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"Cannot import module {module_name!r} of {class_path!r}: {err}") from err
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"{class_path!r}: module {module_name!r} has no class {attr!r}.")
    return cls


def _instantiate(spec: Any) -> Any:
    # LightningCLI's nested {class_path, init_args} specs, instantiated recursively; a few lines instead
    # of a full jsonargparse parser, which would need the model's type hints to resolve them.
    if isinstance(spec, Mapping) and "class_path" in spec:
        cls = import_class(spec["class_path"])
        kwargs = {k: _instantiate(v) for k, v in (spec.get("init_args") or {}).items()}
        return cls(**kwargs)
    if isinstance(spec, list):
        return [_instantiate(v) for v in spec]
    return spec


def build_meta_model(class_path: str, init_args: Mapping[str, Any] | str | None = None) -> "nn.Module":
    """Build ``class_path(**init_args)`` on the meta device (no memory is allocated).

    ``init_args`` is a mapping or a JSON object string; nested ``{"class_path", "init_args"}`` values are
    instantiated too. A LightningModule's ``configure_model`` hook runs as well, since models of the pack
    create their layers there.
    """
    import torch
    from torch import nn

    if isinstance(init_args, str):
        try:
            init_args = json.loads(init_args)
        except json.JSONDecodeError as err:
            raise ValueError(f"init args are not valid JSON ({err}): {init_args!r}") from err
    if init_args is not None and not isinstance(init_args, Mapping):
        raise ValueError(f"init args must be a JSON object of keyword arguments; got {init_args!r}.")
    cls = import_class(class_path)
    if not issubclass(cls, nn.Module):
        raise TypeError(f"{class_path!r} is not a torch.nn.Module subclass; the planner counts module parameters.")
    with torch.device("meta"):
        model = _instantiate({"class_path": class_path, "init_args": dict(init_args or {})})
        hook = getattr(model, "configure_model", None)
        if callable(hook):
            hook()
    return model


def model_spec_from_config(path: str) -> tuple[str, dict[str, Any]]:
    """(class path, init args) of ``model:`` in a LightningCLI YAML config (``class_path`` / ``init_args``)."""
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    model = config.get("model") if isinstance(config, Mapping) else None
    if not isinstance(model, Mapping) or "class_path" not in model:
        raise ValueError(f"{path}: expected a `model:` section with `class_path:` (and optional `init_args:`),"
                         " as LightningCLI writes it; or pass --model CLASS_PATH.")
    return str(model["class_path"]), dict(model.get("init_args") or {})


# ---- sizes and counts ---------------------------------------------------------------------------------
def parse_bytes(text: str | int | float) -> int:
    """``"80GB"`` (1e9), ``"24GiB"`` (2**30), ``"512MiB"``, ``"1.5TB"`` or a plain byte count -> bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if match is None or (unit and unit not in _DECIMAL and unit not in _BINARY):
            raise ValueError(f"Cannot parse memory size {text!r}; write e.g. 80GB (1e9 bytes), 24GiB (2**30 bytes),"
                             " 512MiB or a number of bytes.")
        value = float(match.group(1)) * ({**_DECIMAL, **_BINARY}.get(unit, 1))
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"Memory size {text!r} must be a positive number of bytes.")
    return int(value)


def parse_count(text: str | int | float) -> int:
    """``"1.5B"``, ``"125M"``, ``"7e9"`` or ``1500000000`` -> a parameter count (K/M/B/T are powers of 1000)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]?)\s*", str(text))
        if match is None or match.group(2).lower() not in _COUNT_SUFFIX:
            raise ValueError(f"Cannot parse parameter count {text!r}; write e.g. 1500000000, 1.5e9, 1.5B or 125M.")
        value = float(match.group(1)) * _COUNT_SUFFIX[match.group(2).lower()]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"Parameter count {text!r} must be >= 0.")
    return int(round(value))
