"""Tensor-parallel styles torch does not ship: HuggingFace's ``Conv1D`` (GPT-2 family) column- and row-wise, a module
kept whole whose gradient is summed over tp, and a fused ``[q | k | v]`` projection split per head.

Notes: docs/internals.md, "lightning_dist/parallelize/tp/styles.py"."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_dist.parallelize.tp.vocab import is_conv1d

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class Conv1DParallel(ParallelStyle):
    """Shard a ``Conv1D`` over a 1-D mesh: ``colwise`` splits its output features (weight dim 1, bias dim 0),
    ``rowwise`` its input features (weight dim 0; the bias is replicated and added once, after the reduction).

    Args:
        kind: ``"colwise"`` or ``"rowwise"``.
        input_layout: how a plain-tensor input is laid out (colwise: replicated; rowwise: split on the last dim).
        output_layout: the layout the output is redistributed to (colwise: ``Shard(-1)``; rowwise: ``Replicate()``).
        use_local_output: hand the next module a plain local tensor (else the DTensor).
    """

    def __init__(
        self, kind: str, *, input_layout: Any = None, output_layout: Any = None, use_local_output: bool = True
    ) -> None:
        super().__init__()
        assert kind in ("colwise", "rowwise"), kind
        self.kind = kind
        colwise = kind == "colwise"
        self.input_layout = input_layout or (Replicate() if colwise else Shard(-1))
        self.desired_input = Replicate() if colwise else Shard(-1)
        self.output_layout = output_layout or (Shard(-1) if colwise else Replicate())
        self.use_local_output = use_local_output

    def _partition(self, name: str, module: nn.Module, mesh: "DeviceMesh") -> None:
        colwise = self.kind == "colwise"
        for pname, param in list(module.named_parameters(recurse=False)):
            if pname == "weight":
                placement = Shard(1 if colwise else 0)
            else:
                placement = Shard(0) if colwise else Replicate()
            dparam = nn.Parameter(distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad)
            module.register_parameter(pname, dparam)

    def _input(self, module: nn.Module, inputs: tuple, mesh: "DeviceMesh") -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (self.input_layout,), run_check=False)
        if x.placements != (self.desired_input,):
            x = x.redistribute(placements=(self.desired_input,))
        return (x, *inputs[1:])

    def _output(self, module: nn.Module, out: DTensor, mesh: "DeviceMesh") -> Any:
        if out.placements != (self.output_layout,):
            out = out.redistribute(placements=(self.output_layout,))
        return out.to_local() if self.use_local_output else out

    def _apply(self, module: nn.Module, device_mesh: "DeviceMesh") -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._input, self._output)


class ReplicateGradSum(ParallelStyle):
    """Keep a module whole on every tp rank while it runs on each rank's part of a split activation (a per-head q/k
    norm after a head-split projection), and sum its parameters' gradients over tp: the parameters become
    ``Replicate()`` DTensors and the first input a ``Shard(0)`` one (docs/strategies/tp.md, "the split-flow rule")."""

    def _apply(self, module: nn.Module, device_mesh: "DeviceMesh") -> nn.Module:
        def params(name: str, mod: nn.Module, mesh: "DeviceMesh") -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                local = param.to_local() if isinstance(param, DTensor) else param
                dparam = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
                mod.register_parameter(pname, nn.Parameter(dparam, requires_grad=param.requires_grad))

        def inputs(mod: nn.Module, args: tuple, mesh: "DeviceMesh") -> tuple:
            x = args[0]
            if isinstance(x, DTensor):
                x = x.to_local()  # a DTensor input is someone's split layout: this module sees its local part
            return (DTensor.from_local(x, mesh, (Shard(0),), run_check=False), *args[1:])

        def outputs(mod: nn.Module, out: Any, mesh: "DeviceMesh") -> Any:
            if isinstance(out, DTensor):
                return out.to_local()
            if isinstance(out, (tuple, list)):
                return type(out)(o.to_local() if isinstance(o, DTensor) else o for o in out)
            return out

        return distribute_module(module, device_mesh, params, inputs, outputs)


FUSED_SHAPES_KEY = "_tp_fused_shapes"
"""``module.__dict__`` key: {parameter name: original shape} of a layer split by :class:`FusedQKVParallel`."""


def _fused_shape(shape: tuple[int, ...], dim: int, parts: int) -> tuple[int, ...]:
    return (*shape[:dim], parts, shape[dim] // parts, *shape[dim + 1 :])


def fused_qkv_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forward of a layer split by :class:`FusedQKVParallel`, bound to the layer: with a DTensor weight the local
    ``[q_r | k_r | v_r]`` columns; with plain weights (a single-device copy) the original layer's output."""
    from torch.distributed.tensor import Partial

    w, b = self.weight, self.bias
    if isinstance(w, DTensor):
        mesh = w.device_mesh
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        elif x.placements != (Replicate(),):
            x = x.redistribute(placements=(Replicate(),))
        # each rank's input gradient covers its own heads only: the Partial sums them (one all-reduce)
        x = x.to_local(grad_placements=(Partial(),))
        w, b = w.to_local(), None if b is None else b.to_local()
    b = None if b is None else b.reshape(-1)
    if is_conv1d(self):  # [in, 3, E_local] -> [in, 3 * E_local]: addmm as Conv1D.forward does
        w = w.reshape(w.shape[0], -1)
        flat = x.reshape(-1, x.shape[-1])
        out = flat @ w if b is None else torch.addmm(b, flat, w)
        return out.view(*x.shape[:-1], -1)
    return torch.nn.functional.linear(x, w.reshape(-1, w.shape[-1]), b)  # [3, E_local, in] -> [3 * E_local, in]


class FusedQKVParallel(ParallelStyle):
    """Split a fused ``nn.Linear`` or ``Conv1D`` laid out ``[q | k | v]`` (``parts`` blocks) column-wise per head: each
    rank computes the columns of its own heads in every block, ``[q_r | k_r | v_r]``, from a replicated input."""

    def __init__(self, parts: int = 3) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: "DeviceMesh") -> nn.Module:
        conv = is_conv1d(module)
        shapes = {}
        for pname, param in list(module.named_parameters(recurse=False)):
            dim = (1 if conv else 0) if pname == "weight" else 0  # the output-feature dim
            shapes[pname] = tuple(param.shape)
            fused = param.detach().reshape(_fused_shape(tuple(param.shape), dim, self.parts))
            dparam = nn.Parameter(
                distribute_tensor(fused, device_mesh, [Shard(dim + 1)]), requires_grad=param.requires_grad
            )
            module.register_parameter(pname, dparam)
        module.__dict__[FUSED_SHAPES_KEY] = shapes
        # the layer keeps its class; a forward of its own reads the 3-D weights (bound: copies run it on theirs)
        module.forward = types.MethodType(fused_qkv_forward, module)
        module.register_state_dict_post_hook(_original_shape_state_dict)
        module.register_load_state_dict_pre_hook(_fused_shape_load)
        return module


def _original_shape_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State dicts show each fused parameter in its original shape and layout: a DTensor gathered and kept replicated
    (a collective), since a per-head shard of the original layout is not one contiguous chunk DCP could write."""
    for name, shape in module.__dict__.get(FUSED_SHAPES_KEY, {}).items():
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, DTensor):
            whole = value.full_tensor().reshape(shape)
            state_dict[key] = DTensor.from_local(
                whole, value.device_mesh, [Replicate()] * value.device_mesh.ndim, run_check=False
            )
        elif isinstance(value, torch.Tensor):
            state_dict[key] = value.reshape(shape)


def _fused_shape_load(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load a fused parameter from its original shape (any state dict): each rank takes its own heads' columns."""
    for name in module.__dict__.get(FUSED_SHAPES_KEY, {}):
        key, param = prefix + name, getattr(module, name)
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor) or not isinstance(param, DTensor):
            continue
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        whole = whole.to(device=param.device, dtype=param.dtype).reshape(param.shape)
        # no broadcast (src_data_rank=None): every rank holds the whole value and keeps its own part
        state_dict[key] = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)


__all__ = ["Conv1DParallel", "FUSED_SHAPES_KEY", "FusedQKVParallel", "ReplicateGradSum", "fused_qkv_forward"]
