"""Whether a transformers layer may keep its KV cache when it is checkpointed.

Reason: transformers' ``GradientCheckpointingLayer`` drops the cache of a checkpointed layer unless its class sets the
private flag ``_can_checkpoint_with_cache`` (a layer that only reads the cache); the pack's activation checkpointing
(``parallelize/ac.py``) follows the same rule. Gate: :data:`lightning_dist._compat.TRANSFORMERS_CACHE_TESTED`.
Test: ``tests/unit/test_ac_cache.py``.
"""

from __future__ import annotations

from torch import nn

from lightning_dist._compat import TRANSFORMERS_CACHE_TESTED, require_tested


def reads_cache_only(module: nn.Module) -> bool:
    """True when `module` is a transformers layer whose class declares that it only reads its KV cache, so that
    recomputing it in backward does not write the cache a second time; False for every other module."""
    if not type(module).__module__.startswith("transformers."):
        return False
    require_tested("transformers", TRANSFORMERS_CACHE_TESTED, patch="KV-cache rule of checkpointed layers")
    return bool(getattr(type(module), "_can_checkpoint_with_cache", False))


__all__ = ["reads_cache_only"]
