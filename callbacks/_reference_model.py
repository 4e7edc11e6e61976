"""A plain single-device copy of a distributed model (FSDP2 / TP / pipeline stages), for reference computations."""

from __future__ import annotations

import copy
import types
from typing import Any

import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_dist._compat import fully_shard_api
from lightning_dist.parallelize.pipeline import PipelineView, join_stages
from lightning_dist.parallelize.pipeline_pruned import model_class_copy
from lightning_dist.parallelize.pipeline_stages import is_pipelined_module
from lightning_dist.parallelize.tp_checks import GLOBAL_ATTRS_KEY

# the class FSDP2 mixes into the modules it shards (None without FSDP2)
_FSDPModule = fully_shard_api()[3]
# the prefix of the keys torch's composable APIs (fully_shard, replicate) keep their state under in a module
_COMPOSABLE_STATE = "__composable_api_state_key"


def full_tensor_of(t: Tensor) -> Tensor:
    """A plain tensor holding the whole value (DTensor shards are gathered: a collective)."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


def unsharded_clone(module: nn.Module, full_by_id: dict[int, Tensor], memo: dict[int, nn.Parameter]) -> nn.Module:
    """A plain single-device copy of `module` for the reference computation.

    Hand-written because ``copy.deepcopy`` cannot copy what distributed wrappers attach (process
    groups, FSDP2 state and hooks): every module is copied shallowly with fresh parameter/buffer/child
    dicts and no hooks, FSDP2's generated classes are turned back into the user's classes, parameters
    are replaced by their gathered whole values (``full_by_id``; one copy per tensor in `memo`, so parameters
    shared between modules stay shared), head counts a tensor-parallel plan made local are restored,
    buffers are replaced by clones, methods of a module kept in its instance dict are bound to its copy, and
    torchmetrics metrics are deep-copied without their process group so updates never touch the real states.
    """
    if isinstance(module, Metric):
        memo = {id(module.process_group): None} if module.process_group is not None else {}
        return copy.deepcopy(module, memo)
    cls = type(module)
    if _FSDPModule is not None and isinstance(module, _FSDPModule):
        # fully_shard swapped in a generated subclass (FSDPModule, UserClass); give back the user's class
        cls = next(b for b in cls.__bases__ if b is not _FSDPModule)
    # not copy.copy: FSDP2's __new__ re-runs the user's __init__ without arguments
    new = object.__new__(cls)
    for key, value in vars(module).items():
        if key.startswith(_COMPOSABLE_STATE) or key.startswith("_fsdp") or key == "_is_fsdp_managed_module":
            continue  # FSDP2/composable state (process groups, streams): neither needed nor picklable
        if isinstance(value, types.MethodType) and value.__self__ is module:
            # a method of the original kept in the instance dict (Lightning's _ForwardRedirection leaves
            # `forward` there under ddp): bound to the copy, else the copy's forward runs the real model
            value = types.MethodType(value.__func__, new)
        new.__dict__[key] = type(value)() if "hooks" in key and isinstance(value, dict) else value  # no hooks
    new.__dict__.update(new.__dict__.pop(GLOBAL_ATTRS_KEY, {}))  # e.g. num_heads as before tensor parallelism
    new._parameters = {}
    for name, p in module._parameters.items():
        if p is not None and id(p) not in memo:
            whole = full_by_id[id(p)] if id(p) in full_by_id else full_tensor_of(p.detach())
            memo[id(p)] = nn.Parameter(whole.clone(), requires_grad=p.requires_grad)
        new._parameters[name] = None if p is None else memo[id(p)]
    new._buffers = {name: None if b is None else full_tensor_of(b).clone() for name, b in module._buffers.items()}
    new._modules = {
        name: None if c is None else unsharded_clone(c, full_by_id, memo) for name, c in module._modules.items()
    }
    if is_pipelined_module(new):
        new.runner = None  # the copy runs its own layers, never the strategy's pipeline schedule
    if isinstance(new, LightningModule):
        new._trainer = None  # the copy's `self.log` is a no-op and it never drives the real trainer
    return new


def whole_pipeline_network(view: PipelineView, mesh: Any, local: nn.Module) -> nn.Module:
    """The whole single-device network, joined from every pipeline rank's copy of its stages.

    Each pp rank sends its plain stage copy (CPU) to the others (``all_gather_object``: simple, and the
    model must fit on one device for the reference anyway); :func:`join_stages` puts the parts back in the
    split's order under their single-device names. Runs on every rank (a collective over ``pp``).

    A HuggingFace causal LM called with ``labels`` computes its loss as the pipeline does (in the logits'
    dtype, :func:`~lightning_dist.parallelize.pipeline_hf.pipeline_loss_function`, set by its layout's join),
    not with HF's own ``loss_function``, which casts float64 logits to float32: the reference gradient is then the exact
    single-device gradient of the loss the pipeline trains, and a float64 check is not a false alarm.
    """
    assert view.split is not None
    local = model_class_copy(local.to("cpu"))  # a pruned stage's class is made at run time: not picklable
    pieces = [local]
    if mesh.size("pp") > 1:
        pieces = [None] * mesh.size("pp")
        dist.all_gather_object(pieces, local, group=mesh.group("pp"))
    return join_stages(view.split, pieces)
