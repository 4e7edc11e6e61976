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
    """The class `class_path` names; ValueError naming the path and the accepted forms when it cannot be found.

    Forms: ``package.module.Class`` (the working folder is searched after ``sys.path``, as for ``python
    main.py`` run from it), ``module:Class``, a file with its class ``path/to/my_model.py:Net``, or a file alone
    ``./my_model.py`` when it defines exactly one ``nn.Module`` subclass.
    """
    forms = (
        "a dotted path 'my_pkg.models.GPT' (importable, or a module in the working folder), 'module:Class',"
        " or a file with the class, e.g. './my_model.py:Net'"
    )
    target, colon, attr = class_path.rpartition(":") if ":" in class_path else (class_path, "", "")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(class_path, target, forms)
        if not colon:
            return _only_module_class(class_path, module)
    elif colon:
        module = _import_module(class_path, target, forms)
    else:
        target, _, attr = class_path.rpartition(".")
        if not target:
            raise ValueError(f"Model class path {class_path!r} must name a module and a class: {forms}.")
        module = _import_module(class_path, target, forms)
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"{class_path!r}: module {module.__name__!r} has no class {attr!r}.")
    return cls


def _import_module(class_path: str, name: str, forms: str) -> Any:
    import os
    import sys

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        here = os.getcwd()
        top = name.partition(".")[0]
        if err.name != top or here in sys.path or "" in sys.path:
            raise ValueError(f"Cannot import module {name!r} of {class_path!r}: {err}. Give {forms}.") from err
        sys.path.append(here)  # console scripts do not search the working folder; LightningCLI's `python main.py` does
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err2:
            raise ValueError(
                f"Cannot import module {name!r} of {class_path!r}: {err2} (searched sys.path and the"
                f" working folder {here}). Give {forms}."
            ) from err2
    except ImportError as err:
        raise ValueError(f"Cannot import module {name!r} of {class_path!r}: {err}") from err


def _import_file(class_path: str, file: str, forms: str) -> Any:
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(file).expanduser().resolve()
    if not path.is_file() or path.suffix != ".py":
        raise ValueError(
            f"Model class path {class_path!r}: {file!r} is not a Python file"
            f" ({'not found' if not path.exists() else 'not a .py file'}). Give {forms}."
        )
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path:
        return loaded
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))  # the file's own imports of its neighbours work, as under `python file.py`
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]
        raise
    return module


def _only_module_class(class_path: str, module: Any) -> type:
    from torch import nn

    defined = [
        v
        for v in vars(module).values()
        if isinstance(v, type) and issubclass(v, nn.Module) and v.__module__ == module.__name__
    ]
    if len(defined) != 1:
        names = [c.__name__ for c in defined]
        raise ValueError(
            f"{class_path!r} defines {len(defined)} nn.Module classes {names}; name the one to build:"
            f" '{class_path}:{names[-1] if names else 'Net'}'."
        )
    return defined[0]


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
        raise ValueError(
            f"{path}: expected a `model:` section with `class_path:` (and optional `init_args:`),"
            " as LightningCLI writes it; or pass --model CLASS_PATH."
        )
    return str(model["class_path"]), dict(model.get("init_args") or {})


def build_meta_hf_model(path: str) -> "nn.Module":
    """A transformers causal LM built from its ``config.json`` (a file, or a folder holding one) on the meta device."""
    import os

    import torch

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            values = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not a JSON config ({err}).") from err
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"{file}: expected a transformers config.json with a `model_type`.")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


# transformers' names for the routed experts of each MoE layer (Qwen-MoE / Mixtral / DeepSeek) and for top-k
_HF_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_HF_TOP_K = ("num_experts_per_tok",)


def moe_spec(model: "nn.Module", *, experts: int | None = None, top_k: int | None = None) -> dict[str, Any] | None:
    """What expert parallelism's plan needs of `model` (the arguments of ``planner.MoEShape``), or None when it is no
    mixture of experts: the experts modules expert parallelism splits (``parallelize.ep.find_experts``: their number
    is the MoE layers, their parameters the expert parameters, their leading size E), top-k from a transformers
    config's ``num_experts_per_tok`` or the module holding the experts (the pack's ``MoE.top_k``), the hidden size from
    the config (``hidden_size``; the pack's ``n_embd``). `experts` / `top_k` override what is read."""
    from lightning_dist.parallelize.ep import expert_count, find_experts

    found = find_experts(model)
    config = next(
        (
            m.config
            for m in model.modules()
            if any(hasattr(getattr(m, "config", None), k) for k in ("hidden_size", "n_embd"))
        ),
        None,
    )
    read = {k: getattr(config, k) for k in (*_HF_EXPERTS, *_HF_TOP_K) if isinstance(getattr(config, k, None), int)}
    if not found:
        if experts is not None or any(k in read for k in _HF_EXPERTS):
            raise ValueError(
                f"{type(model).__name__} has no experts module the pack can read (3-D parameters with the expert first"
                " and a forward (hidden, top_k_index, top_k_weights)): its expert parameters cannot be counted. Plan"
                " with --params, --expert-params, --experts, --top-k, --hidden-size and --layers instead."
            )
        return None
    sizes = {expert_count(m) for _, m in found}
    if experts is None:
        experts = sizes.pop() if len(sizes) == 1 else next((read[k] for k in _HF_EXPERTS if k in read), None)
    if top_k is None:
        top_k = next((read[k] for k in _HF_TOP_K if k in read), None)
    if top_k is None:
        holders = {n.rpartition(".")[0] for n, _ in found}
        ks = {getattr(m, "top_k", None) for n, m in model.named_modules() if n in holders}
        top_k = ks.pop() if len(ks) == 1 and None not in ks else None
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    missing = [name for name, v in (("--experts", experts), ("--top-k", top_k), ("--hidden-size", hidden)) if v is None]
    if missing:
        raise ValueError(
            f"{type(model).__name__} is a mixture of experts, but {', '.join(missing)} could not be read off it:"
            " give them."
        )
    shapes = tuple(tuple(p.shape) for _, m in found for p in m.parameters(recurse=False))
    return {
        "experts": int(experts),
        "top_k": int(top_k),
        "hidden": int(hidden),
        "layers": len(found),
        "expert_params": sum(math.prod(s) for s in shapes),
        "expert_shapes": shapes if all(s[0] == experts for s in shapes) else (),
    }


# ---- sizes and counts ---------------------------------------------------------------------------------
def parse_bytes(text: str | int | float) -> int:
    """``"80GB"`` (1e9), ``"24GiB"`` (2**30), ``"512MiB"``, ``"1.5TB"`` or a plain byte count -> bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if match is None or (unit and unit not in _DECIMAL and unit not in _BINARY):
            raise ValueError(
                f"Cannot parse memory size {text!r}; write e.g. 80GB (1e9 bytes), 24GiB (2**30 bytes),"
                " 512MiB or a number of bytes."
            )
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
