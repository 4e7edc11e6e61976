"""Every version gate and optional-dependency probe of the pack, in one place.

Other modules import the names below instead of checking versions themselves.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch
from lightning_utilities.core.imports import compare_version

# FSDP2 (`fully_shard`, `MixedPrecisionPolicy`, `CPUOffloadPolicy`) is public in torch.distributed.fsdp from 2.6.
TORCH_GE_2_6 = compare_version("torch", lambda a, b: a >= b, "2.6.0")
# Schedule classes with `ScheduleInterleavedZeroBubble` / `ScheduleZBVZeroBubble` exist from 2.6 as well.
TORCH_GE_2_7 = compare_version("torch", lambda a, b: a >= b, "2.7.0")

LIGHTNING_GE_2_6 = compare_version("lightning", lambda a, b: a >= b, "2.6.0")

CUDA_AVAILABLE = torch.cuda.is_available()


@lru_cache(maxsize=None)
def module_available(name: str) -> bool:
    """True when `name` can be imported (no import is performed)."""
    return importlib.util.find_spec(name) is not None


def require_fsdp2() -> None:
    """Raise ImportError naming the fix when FSDP2 is unavailable."""
    if not TORCH_GE_2_6:
        raise ImportError(f"lightning-dist needs torch>=2.6 for FSDP2 (`fully_shard`); found torch {torch.__version__}.")


def fully_shard_api():
    """Return (fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, FSDPModule) from their public home."""
    require_fsdp2()
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, FSDPModule


def deepspeed_available() -> bool:
    return module_available("deepspeed")


def deepspeed_nvme_checkpoint_patch_tested() -> bool:
    """True for the DeepSpeed releases whose ZeRO-3 NVMe checkpoint methods ``offload_checkpoint`` replaces (0.19.x).

    The replacement uses private swapper calls; on other releases it still runs, with a warning.
    """
    return compare_version("deepspeed", lambda a, b: a >= b, "0.19.0") and compare_version(
        "deepspeed", lambda a, b: a < b, "0.20.0")


def matplotlib_available() -> bool:
    return module_available("matplotlib")


# torch's fake process-group backend ("fake": every collective returns at once, nothing is sent) is built
# into init_process_group from torch 2.11 on (Backend.FAKE); its store lives in a private testing module.
HAS_FAKE_PROCESS_GROUP = hasattr(torch.distributed, "Backend") and hasattr(torch.distributed.Backend, "FAKE")


def init_fake_process_group(*, rank: int, world_size: int) -> None:
    """Start torch's fake process group as ``rank`` of ``world_size`` (the dry run; no communication)."""
    import torch.distributed as dist

    if not HAS_FAKE_PROCESS_GROUP:
        raise ImportError(f"The dry run needs torch's fake process-group backend (torch>=2.11); found {torch.__version__}.")
    # importing the module registers the backend and its store; init_process_group("fake") does the same
    # import itself when no store is given, so this is the one place the private path is named
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
