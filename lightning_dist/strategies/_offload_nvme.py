"""The NVMe side of :class:`~lightning_dist.strategies.offload.OffloadStrategy`: swap folder, buffers, partitions.

DeepSpeed's defaults for parameters on NVMe are made for GPU servers with host memory to spare; these
methods check the swap folder, pick memory-lean defaults the user did not set, size the page-locked swap
buffers to the real partitions and partition a model built outside ``configure_model`` in the right dtype.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn

from lightning_dist._integrations import deepspeed as ds_patches
from lightning_dist.parallelize import offload as off
from lightning_dist.precision import precision_dtypes

# elements per NVMe swap buffer of the parameters while `configure_model` builds the model (sized to the largest
# partition once it is known); Lightning's 1e8 would page-lock 5 x 400 MB per rank in float32
NVME_PARAMS_BUFFER_SIZE = 10_000_000


class NvmeSwapMixin(DeepSpeedStrategy):
    """NVMe swap handling of the DeepSpeed offload strategy (expects ``plan`` and ``_user_buffer_size``)."""

    plan: off.OffloadPlan
    _user_buffer_size: bool

    def _prepare_nvme(self, model: nn.Module) -> None:
        """Before DeepSpeed starts: check the swap folder for this model, size the buffers, partition to NVMe."""
        if "nvme" in (self.plan.optimizer, self.plan.parameters):
            self._check_nvme(model)  # models built in `configure_model` are only known now
            self._size_param_buffers(model)
            if self.plan.parameters == "nvme":
                self._partition_for_nvme(model)

    def _check_nvme(self, model: nn.Module) -> None:
        n = off.count_parameters(model)
        if n == 0:
            return  # built later in `configure_model`: checked again before DeepSpeed starts
        world = self.num_nodes * self.num_processes  # known before the process group starts
        estimate = off.estimate_states(n, plan=self.plan, world_size=world, param_bytes=_param_bytes(self))
        off.check_nvme_path(
            self.plan.nvme_path, required_bytes=estimate.total(place="nvme"), ranks_sharing=self.num_processes
        )

    def _lean_nvme_params(self, chosen: Optional[dict[str, bool]]) -> None:
        """The memory-lean defaults for parameters on NVMe (see the class docstring) the user did not set.

        `chosen`: which ``offload_param`` keys the user gave as arguments; None for a user config, whose own
        keys count as chosen (Lightning's arguments fill every key with its defaults, so they cannot tell).
        """
        zero = self.config.setdefault("zero_optimization", {})
        swap = zero.get("offload_param")
        if not isinstance(swap, dict) or swap.get("device") != "nvme":
            return  # a user config without NVMe parameters: nothing of ours applies
        chosen = {key: key in swap for key in ("buffer_size", "max_in_cpu")} if chosen is None else chosen
        self._user_buffer_size = chosen["buffer_size"]
        if not chosen["max_in_cpu"]:
            swap["max_in_cpu"] = 0
        if not chosen["buffer_size"]:
            swap["buffer_size"] = NVME_PARAMS_BUFFER_SIZE
        zero.setdefault("stage3_max_reuse_distance", 0)

    def _size_param_buffers(self, model: nn.Module) -> None:
        """Size the NVMe swap buffers of the parameters to the largest partition once the model is known.

        Each buffer holds one parameter partition (``ceil(numel / world size)`` elements), and they are
        page-locked: resident all the time. A model built before ``fit`` is partitioned later with this size;
        one built in ``configure_model`` already has its buffers (sized when ``zero.Init`` started), which
        are reallocated at this size while none is in use.
        """
        swap = self.config["zero_optimization"].get("offload_param")
        if self._user_buffer_size or not isinstance(swap, dict) or swap.get("device") != "nvme":
            return
        largest = max(ds_patches.param_partition_numels(model, self.world_size), default=1)
        swap["buffer_size"] = largest
        for swapper in ds_patches.param_swappers(model):
            ds_patches.resize_param_swap_buffers(swapper, largest)

    def _partition_for_nvme(self, model: nn.Module) -> None:
        """Partition a model built outside ``configure_model`` with the config's dtype before DeepSpeed does.

        When DeepSpeed 0.19 partitions a built model itself it passes a dtype that its fallback ignores on an
        accelerator without float16 (the CPU): the NVMe swap buffers come out bfloat16 and float32 training
        fails ("Float and BFloat16"). ``zero.Init`` without a dtype takes it from the config (float32, or
        bfloat16 with ``bf16-mixed``). The parameters are cast to that dtype first, as DeepSpeed's engine casts
        a model it partitions itself (it casts no model partitioned before it starts): with
        ``bf16-mixed`` the swap buffers are bfloat16, and float32 parameters gathered from them fail the same way.
        """
        import deepspeed

        if all(hasattr(p, "ds_id") for p in model.parameters()):
            return  # already built under zero.Init (configure_model), in the config's dtype
        dtype = off.training_dtype(self.config)
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        deepspeed.zero.Init(module=model, config_dict_or_path=self.config)

    def _disk_bytes(self) -> dict[str, int]:
        out = dict.fromkeys(off.KINDS, 0)
        if not self.plan.nvme_path:
            return out
        root = os.path.join(self.plan.nvme_path, "zero_stage_3")  # DeepSpeed's swap layout
        rank = f"rank{self.global_rank}"
        for folder, _, files in os.walk(root):
            if os.path.basename(folder) != rank:
                continue
            for name in files:
                size = os.path.getsize(os.path.join(folder, name))
                kind = "gradients" if "_gradient_" in name else "optimizer" if "optimizer" in folder else "parameters"
                out[kind] += size
        return out


def _param_bytes(strategy: Any) -> int:
    # DeepSpeed keeps its working parameters in the compute dtype (16-bit under *-mixed too)
    return precision_dtypes(strategy).compute_bytes
