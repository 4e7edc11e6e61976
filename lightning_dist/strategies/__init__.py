"""The pack's Lightning strategies, registered by name in Lightning's StrategyRegistry."""

import difflib

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist._integrations.lightning import explain_unknown_strategy
from lightning_dist.strategies.auto_parallel import AutoParallelStrategy
from lightning_dist.strategies.base import MeshStrategy, attach_mesh
from lightning_dist.strategies.ft_config import FaultTolerance
from lightning_dist.strategies.hsdp import FullyShardStrategy, HybridShardStrategy
from lightning_dist.strategies.offload import OffloadStrategy
from lightning_dist.strategies.offload_fsdp2 import FSDP2OffloadStrategy
from lightning_dist.strategies.pipeline.strategy import PipelineStrategy
from lightning_dist.strategies.tp import SequenceParallelStrategy, TensorParallelStrategy

# name -> (class, description, init params); one table so docs and tests can list them
REGISTERED: dict[str, tuple[type, str, dict]] = {
    "hsdp": (HybridShardStrategy, "FSDP2 hybrid sharding: shard inside a node, replicate across nodes (ZeRO-3)", {}),
    "hsdp_zero2": (HybridShardStrategy, "hybrid sharding, parameters kept unsharded until backward", {"zero_stage": 2}),
    "hsdp_zero1": (
        HybridShardStrategy,
        "replicated parameters (all-reduce), optimizer state sharded",
        {"zero_stage": 1},
    ),
    "fsdp2": (FullyShardStrategy, "FSDP2 full sharding over all data-parallel ranks (ZeRO-3)", {}),
    "fsdp2_zero2": (FullyShardStrategy, "FSDP2 full sharding, no reshard after forward (ZeRO-2)", {"zero_stage": 2}),
    "pipeline": (PipelineStrategy, "pipeline parallelism (torch.distributed.pipelining, 1F1B) on pp, FSDP2 on dp", {}),
    "pipeline_1f1b": (PipelineStrategy, "pipeline parallelism over all devices, 1F1B schedule", {"schedule": "1f1b"}),
    "pipeline_gpipe": (
        PipelineStrategy,
        "pipeline parallelism over all devices, GPipe schedule",
        {"schedule": "gpipe"},
    ),
    "pipeline_interleaved": (PipelineStrategy, "interleaved 1F1B, 2 stages per rank", {"schedule": "interleaved_1f1b"}),
    "pipeline_zero_bubble": (
        PipelineStrategy,
        "zero-bubble ZBV schedule (F/I/W split), 2 stages per rank",
        {"schedule": "zero_bubble"},
    ),
    "offload": (OffloadStrategy, "DeepSpeed ZeRO-3, optimizer state in host memory (CPU machines too)", {}),
    "offload_zero2": (OffloadStrategy, "DeepSpeed ZeRO-2, optimizer state in host memory", {"zero_stage": 2}),
    "offload_params": (
        OffloadStrategy,
        "DeepSpeed ZeRO-3, optimizer state and parameters in host memory",
        {"parameters": "cpu"},
    ),
    "offload_nvme": (
        OffloadStrategy,
        "DeepSpeed ZeRO-Infinity, optimizer state and parameters on NVMe (/local_nvme)",
        {"optimizer": "nvme", "parameters": "nvme", "nvme_path": "/local_nvme"},
    ),
    "offload_fsdp2": (
        FSDP2OffloadStrategy,
        "FSDP2 CPUOffloadPolicy: parameters, gradients, optimizer in host memory",
        {},
    ),
    "cp": (
        FullyShardStrategy,
        "context parallelism: each sequence split over cp=2 ranks (Ulysses all-to-all), FSDP2 over dp_shard x cp",
        {"cp": 2},
    ),
    "tp": (TensorParallelStrategy, "tensor parallelism (DTensor) from a declarative plan, FSDP2 over dp (3-D)", {}),
    "tp_sp": (SequenceParallelStrategy, "tensor + sequence parallelism, FSDP2 over dp", {}),
    "auto_parallel": (
        AutoParallelStrategy,
        "the least parallelism that fits the device memory (planner; dry run"
        " with verify=True), then runs as hsdp / fsdp2 / tp / pipeline / offload_fsdp2",
        {},
    ),
}


def register_strategies(registry=StrategyRegistry) -> None:
    """Register every name of :data:`REGISTERED` (idempotent); an unknown name then gets the closest ones."""
    for name, (cls, description, params) in REGISTERED.items():
        if name not in registry:
            registry.register(name, cls, description=description, **params)
    explain_unknown_strategy(unknown_strategy_message)


def unknown_strategy_message(name: str, registry=StrategyRegistry) -> str:
    """What ``Trainer(strategy=name)`` says for a name nobody registered: the closest names first, then the pack's."""
    close = difflib.get_close_matches(name, list(registry), n=3, cutoff=0.6)
    # a prefix of several names (``pipeline_``, ``offload``) is closer to them than difflib's ratio says
    close += [n for n in registry if len(name) >= 3 and n.startswith(name) and n not in close][: 3 - len(close)]
    guess = f" Did you mean {' or '.join(repr(n) for n in close)}?" if close else ""
    return (
        f"Unknown strategy name strategy={name!r}.{guess}\n"
        f"lightning-dist's names: {', '.join(REGISTERED)}.\n"
        "Lightning's include auto, ddp, ddp_spawn, deepspeed, fsdp (all: StrategyRegistry.available_strategies())."
        " Or pass a Strategy object, e.g. lightning_dist.strategies.HybridShardStrategy(shard_size=8)."
    )


__all__ = [
    "MeshStrategy",
    "AutoParallelStrategy",
    "HybridShardStrategy",
    "FullyShardStrategy",
    "TensorParallelStrategy",
    "SequenceParallelStrategy",
    "PipelineStrategy",
    "OffloadStrategy",
    "FSDP2OffloadStrategy",
    "FaultTolerance",
    "attach_mesh",
    "register_strategies",
    "unknown_strategy_message",
    "REGISTERED",
]
