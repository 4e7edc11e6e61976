"""FSDP2OffloadStrategy: FSDP2 with ``CPUOffloadPolicy`` (parameters, gradients and optimizer state in host memory).

The FSDP2 backend of offloading; :class:`~lightning_dist.strategies.offload.OffloadStrategy` is the DeepSpeed one.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_dist._compat import CUDA_AVAILABLE, fully_shard_api
from lightning_dist.measure import bytes_by_place, cuda_memory
from lightning_dist.mesh import MeshSpec
from lightning_dist.parallelize import offload as off
from lightning_dist.strategies._offload_report import OffloadReportMixin
from lightning_dist.strategies.hsdp import HybridShardStrategy


class FSDP2OffloadStrategy(OffloadReportMixin, HybridShardStrategy):
    """FSDP2 with ``CPUOffloadPolicy``: parameters, gradients and optimizer state in host memory.

    Use it as ``FSDP2OffloadStrategy(optimizer="cpu", parameters="cpu")`` or ``Trainer(strategy="offload_fsdp2")``.
    Memory is pinned only where CUDA exists; on a CPU-only
    machine the device *is* host memory, so offloading saves nothing there (the code path still runs).
    """

    strategy_name = "offload_fsdp2"

    def __init__(
        self,
        *,
        optimizer: off.Target = "cpu",
        parameters: off.Target = "cpu",
        nvme_path: Optional[str] = None,
        zero_stage: Literal[1, 2, 3] = 3,
        backend: Literal["fsdp2"] = "fsdp2",
        report: bool = True,
        pin_memory: Optional[bool] = None,
        **kwargs: Any,
    ) -> None:
        self.plan = off.OffloadPlan(
            optimizer=optimizer, parameters=parameters, nvme_path=nvme_path, zero_stage=zero_stage, backend=backend
        ).validate()
        pin = CUDA_AVAILABLE if pin_memory is None else pin_memory
        if pin and not CUDA_AVAILABLE:
            raise ValueError("pin_memory=True needs a CUDA device (pinning fails without an accelerator): pass False.")
        _, _, CPUOffloadPolicy, _ = fully_shard_api()
        kwargs.setdefault("shard_size", "full")
        super().__init__(zero_stage=zero_stage, offload_policy=CPUOffloadPolicy(pin_memory=pin), **kwargs)
        self.report = report

    @override
    def validate_config(self, spec: MeshSpec) -> None:
        super().validate_config(spec)
        if self.root_device.type == "cpu":
            rank_zero_warn("FSDP2 CPU offload saves nothing on a CPU-only machine: the device already is host memory.")

    def offload_report(self) -> dict[str, Any]:
        """This rank's bytes of each state (the local shards of the DTensors)."""
        params = list(self.lightning_module.parameters())
        states = [
            t for opt in self.optimizers for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        ]
        # measured: where each local shard lives (tensor.device), not where the plan says
        resident = {
            "parameters": bytes_by_place(params),
            "gradients": bytes_by_place(p.grad for p in params),
            "optimizer": bytes_by_place(states),
        }
        return off.offload_report(
            plan=self.plan,
            resident=resident,
            nvme={},
            rank=self.global_rank,
            device_type=self.root_device.type,
            cuda=cuda_memory(self.root_device),
        )
