"""Tensor-parallel styles torch does not ship: HuggingFace's ``Conv1D`` (GPT-2 family) column- and row-wise.

torch's ``ColwiseParallel``/``RowwiseParallel`` accept ``nn.Linear`` and ``nn.Embedding`` only. ``Conv1D``
is a Linear whose weight is stored transposed (``[in, out]``, ``forward = addmm(bias, x, weight)``), so
it needs the opposite weight dims; the rest (replicated input in, split output out, all-reduce after
the row-wise layer) is what torch's styles do, written here with the public ``distribute_module``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

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

    def __init__(self, kind: str, *, input_layout: Any = None, output_layout: Any = None, use_local_output: bool = True) -> None:
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


__all__ = ["Conv1DParallel"]
