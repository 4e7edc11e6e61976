"""Replicas start equal: one source for the initial parameters and buffers of every rank.

Notes: docs/internals.md, "lightning_dist/parallelize/sync.py"."""

from __future__ import annotations

import itertools
import logging
import zlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

log = logging.getLogger(__name__)

BUCKET_BYTES = 256 * 2**20
"""Largest flat buffer one broadcast sends (a bucket holds at least one tensor)."""


def _plain_states(module: nn.Module) -> Iterator[Tensor]:
    """Parameters and buffers held as ordinary tensors (not meta, not DTensor), each once, in module order."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) in seen or t.is_meta or isinstance(t, DTensor):
            continue
        seen.add(id(t))
        yield t


def _buckets(tensors: list[Tensor], bucket_bytes: int) -> Iterator[list[Tensor]]:
    by_kind: dict[tuple, list[Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for group in by_kind.values():
        bucket: list[Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


@torch.no_grad()
def in_flat_buckets(tensors: list[Tensor], op: Callable[[Tensor], None], *, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Run `op` in place on flat copies of `tensors` (one per dtype and device, at most `bucket_bytes` each, a tensor
    never split), then copy each bucket's result back into its tensors; returns the calls of `op`."""
    calls = 0
    for bucket in _buckets(tensors, bucket_bytes):
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        op(flat)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(part.view_as(t))
        calls += 1
    return calls


@torch.no_grad()
def broadcast_module_states(module: nn.Module, *, src: int = 0, group=None, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Copy rank `src`'s parameters and buffers into every rank of `group` (default: all); returns the broadcasts made.

    Meta and DTensor tensors are skipped (see :func:`materialize_in_sync`). Every rank must hold the same
    tensors (names, shapes, dtypes) in the same order: call it on the whole model before parallelizing.
    torch's own coalesced broadcast (``DistributedDataParallel``'s ``_sync_module_states``) is private, so
    the tensors of one dtype are flattened into buckets here with public ops.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0
    broadcast = lambda flat: dist.broadcast(flat, src=src, group=group)  # noqa: E731
    calls = in_flat_buckets(list(_plain_states(module)), broadcast, bucket_bytes=bucket_bytes)
    log.info("broadcast the initial parameters and buffers from rank %d in %d call(s)", src, calls)
    return calls


def shared_seed(device: torch.device) -> int:
    """A seed drawn from global rank 0's torch RNG, the same on every rank (one small broadcast)."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        seed = seed.to(device)
        dist.broadcast(seed, src=0)
    return int(seed.item())


def _module_seed(seed: int, name: str) -> int:
    return (seed + zlib.crc32(name.encode())) % 2**63


def materialize_in_sync(module: nn.Module, device: torch.device, *, seed: int) -> list[str]:
    """Materialize meta parameters/buffers on `device` and initialize them with ``reset_parameters``.

    Lightning's ``_materialize_distributed_module``, with each module's initialization under a seed derived
    from `seed` (the same on every rank) and the module's name: ranks holding equally shaped local tensors
    of one module draw identical values, whatever each rank's RNG did before. Returns the class names of
    modules with tensors but no ``reset_parameters`` (left uninitialized; the caller warns).
    """
    module.to_empty(device=device)
    fork_devices = [device] if device.type != "cpu" else []
    missing = []
    for name, sub in module.named_modules():
        if not any(True for _ in itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))):
            continue
        reset = getattr(sub, "reset_parameters", None)
        if not callable(reset):
            missing.append(type(sub).__name__)
            continue
        with torch.random.fork_rng(devices=fork_devices, device_type=device.type):
            torch.manual_seed(_module_seed(seed, name))
            reset()
    return missing


__all__ = ["BUCKET_BYTES", "broadcast_module_states", "materialize_in_sync", "shared_seed"]
