"""A plain single-device copy of a distributed module (FSDP2, tensor parallelism), for reference computations."""

from __future__ import annotations

import copy
import types

from torch import Tensor, nn

from lightning_dist._compat import fully_shard_api
from lightning_dist.parallelize.tp.checks import GLOBAL_ATTRS_KEY

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
    from torchmetrics import Metric

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
        if key == "_compiled_call_impl":
            continue  # Module.compile's function calls the original module: the copy runs its own forward
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
    return new


__all__ = ["full_tensor_of", "unsharded_clone"]
