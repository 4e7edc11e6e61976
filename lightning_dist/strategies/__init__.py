"""The pack's Lightning strategies, registered by name in Lightning's StrategyRegistry."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist.strategies.base import MeshStrategy, attach_mesh
from lightning_dist.strategies.hsdp import FullyShardStrategy, HybridShardStrategy

# name -> (class, description, init params); one table so docs and tests can list them
REGISTERED: dict[str, tuple[type, str, dict]] = {
    "hsdp": (HybridShardStrategy, "FSDP2 hybrid sharding: shard inside a node, replicate across nodes (ZeRO-3)", {}),
    "hsdp_zero2": (HybridShardStrategy, "hybrid sharding, parameters kept unsharded until backward", {"zero_stage": 2}),
    "hsdp_zero1": (HybridShardStrategy, "replicated parameters (all-reduce), optimizer state sharded", {"zero_stage": 1}),
    "fsdp2": (FullyShardStrategy, "FSDP2 full sharding over all data-parallel ranks (ZeRO-3)", {}),
    "fsdp2_zero2": (FullyShardStrategy, "FSDP2 full sharding, no reshard after forward (ZeRO-2)", {"zero_stage": 2}),
}


def register_strategies(registry=StrategyRegistry) -> None:
    """Register every name of :data:`REGISTERED` (idempotent)."""
    for name, (cls, description, params) in REGISTERED.items():
        if name not in registry:
            registry.register(name, cls, description=description, **params)


__all__ = ["MeshStrategy", "HybridShardStrategy", "FullyShardStrategy", "attach_mesh", "register_strategies", "REGISTERED"]
