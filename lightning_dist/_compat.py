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

TORCH_GE_2_13 = compare_version("torch", lambda a, b: a >= b, "2.13.0")

LIGHTNING_GE_2_6 = compare_version("lightning", lambda a, b: a >= b, "2.6.0")

# The torch and Lightning releases this pack is tested on (`make test-compat` at both ends of the torch range).
TORCH_TESTED = ("2.11", "2.14")
LIGHTNING_TESTED = ("2.6", "2.6")

# torch < 2.13: a DTensor all-gathered from uneven shards keeps the padded buffer's strides, so a later
# `view` inside F.linear fails ("view size is not compatible"); regions re-pack such inputs (parallelize/tp.py).
DTENSOR_UNEVEN_GATHER_STRIDED = not TORCH_GE_2_13
# torch < 2.13: a multi-stage schedule's first step posts a gloo send/recv between two stages of the SAME rank
# (ZBV at pp=2), which gloo cannot pair ("Pair is not connected"); our stages leave those ops out.
PIPELINE_INIT_P2P_TO_SELF = not TORCH_GE_2_13

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
