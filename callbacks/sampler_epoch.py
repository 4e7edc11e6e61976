"""Set the epoch on every object of the data pipeline that shuffles by epoch.

Lightning calls ``set_epoch`` only on ``dataloader.sampler`` and ``dataloader.batch_sampler.sampler``.
A custom batch sampler, a sampler wrapped in another sampler, or a streaming ``IterableDataset`` that
shuffles by epoch is never told the epoch and repeats the same order every epoch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import CombinedLoader
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler
from typing_extensions import override

from lightning_dist.mesh import data_parallel_info

__all__ = ["SamplerEpoch", "find_epoch_holders", "set_epoch_everywhere", "check_sampler_seeds"]

_MAX_DEPTH = 8


def dataloaders_in(obj: Any) -> list:
    """The individual loaders inside a CombinedLoader / list / tuple / dict (or `obj` itself)."""
    out: list = []

    def add(leaf: Any) -> None:
        if isinstance(leaf, CombinedLoader):
            out.extend(leaf.flattened)
        elif leaf is not None:
            out.append(leaf)

    # Lightning's walker over nested lists / tuples / dicts; the containers themselves are never leaves
    apply_to_collection(obj, object, add, wrong_dtype=(Mapping, list, tuple))
    return out


def _children(obj: Any) -> list:
    """Objects a sampler, batch sampler or dataset may wrap (the generic walk over its attributes)."""
    if isinstance(obj, DataLoader):
        return [obj.sampler, obj.batch_sampler, obj.dataset]
    out = []
    for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
        if isinstance(value, (list, tuple)):
            out.extend(v for v in value if _worth_visiting(v))
        elif _worth_visiting(value):
            out.append(value)
    return out


def _worth_visiting(value: Any) -> bool:
    # samplers, datasets and anything that can take an epoch; never tensors, arrays or strings
    return isinstance(value, (Sampler, BatchSampler, Dataset, DataLoader)) or callable(
        getattr(value, "set_epoch", None)
    )


def find_epoch_holders(loaders: Any) -> list:
    """Every object reachable from `loaders` that has a callable ``set_epoch``, each once.

    `loaders` may be a DataLoader, a CombinedLoader, or lists/tuples/dicts of them. The walk follows
    ``sampler``, ``batch_sampler`` and ``dataset`` of each loader and then any sampler/dataset stored in
    their attributes (wrappers, concatenated datasets), up to a fixed depth.
    """
    found: dict[int, Any] = {}
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if obj is None or id(obj) in seen or depth > _MAX_DEPTH:
            return
        seen.add(id(obj))
        if callable(getattr(obj, "set_epoch", None)) and not isinstance(obj, DataLoader):
            found[id(obj)] = obj
        for child in _children(obj):
            visit(child, depth + 1)

    for dl in dataloaders_in(loaders):
        visit(dl, 0)
    return list(found.values())


def set_epoch_everywhere(loaders: Any, epoch: int) -> int:
    """Call ``set_epoch(epoch)`` on every holder :func:`find_epoch_holders` finds; returns how many."""
    holders = find_epoch_holders(loaders)
    for obj in holders:
        obj.set_epoch(epoch)
    return len(holders)


def check_sampler_seeds(loaders: Any, *, group: Any = None, dp_size: int = 1, dp_rank: int = 0) -> list:
    """Check that all data-parallel ranks use the same sampler seeds, and that distributed samplers
    shard over the data-parallel group; raise ``ValueError`` with what was found otherwise, on every rank.

    One ``all_gather_object`` over `group` (every rank must call it). Returns the gathered seeds per rank.
    """
    holders = find_epoch_holders(loaders)
    seeds = [(type(h).__name__, int(h.seed)) for h in holders if isinstance(getattr(h, "seed", None), int)]
    problems = [
        f"{type(h).__name__}(num_replicas={h.num_replicas}, rank={h.rank}) on data-parallel rank {dp_rank} of"
        f" {dp_size}: build it with num_replicas={dp_size}, rank={dp_rank}"
        f" (`trainer.strategy.distributed_sampler_kwargs`)"
        for h in holders
        if isinstance(h, DistributedSampler) and (h.num_replicas != dp_size or h.rank != dp_rank)
    ]
    # one collective carrying seeds and local problems, so every rank raises the same error (no hang)
    everyone = [(seeds, problems)]
    if dp_size > 1 and dist.is_available() and dist.is_initialized():
        everyone = [None] * dp_size
        dist.all_gather_object(everyone, (seeds, problems), group=group)
    problems = [p for _, rank_problems in everyone for p in rank_problems]
    all_seeds = [rank_seeds for rank_seeds, _ in everyone]
    if any(s != all_seeds[0] for s in all_seeds):
        found = "; ".join(f"dp rank {r}: {s}" for r, s in enumerate(all_seeds))
        problems.append(
            f"data-parallel ranks use different sampler seeds ({found}). Shards would overlap or miss samples:"
            " seed every rank the same (e.g. `seed_everything(42)` before building the samplers)."
        )
    if problems:
        raise ValueError("SamplerEpoch: " + " ".join(problems))
    everyone = all_seeds
    return everyone


class SamplerEpoch(Callback):
    """Tell every sampler, batch sampler, sampler wrapper and iterable dataset the current epoch.

    At the start of every training epoch, every object with ``set_epoch`` reachable from the training
    and validation loaders (across CombinedLoader, lists and dicts) gets the epoch, so shuffling changes
    between epochs everywhere, not only in ``dataloader.sampler``. On resume the saved epoch is restored
    before the first batch (also mid-epoch, when Lightning skips ``on_train_epoch_start``). At the start
    of training all data-parallel ranks are checked to use the same sampler seed.

    Example::

        from lightning_dist.callbacks import SamplerEpoch

        trainer = Trainer(strategy="ddp", devices=4, callbacks=[SamplerEpoch()])

    Iterable datasets loaded with ``persistent_workers=True`` keep the copy made when the workers
    started; use non-persistent workers for them. On a mid-epoch resume Lightning creates the first
    iterator before any callback hook runs: samplers and batch samplers still get the restored epoch
    (they draw their order lazily), an iterable dataset's ``__iter__`` has already run by then.
    """

    def __init__(self, *, check_seeds: bool = True) -> None:
        self.check_seeds = check_seeds
        """Check at the start of training that every data-parallel rank uses the same sampler seeds."""
        self.epoch: Optional[int] = None
        """The epoch last set (saved in checkpoints)."""
        self._restored: Optional[int] = None

    def _apply(self, trainer: Trainer, epoch: int) -> None:
        set_epoch_everywhere([trainer.train_dataloader, trainer.val_dataloaders], epoch)
        self.epoch = epoch

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.check_seeds:
            group, size, rank = data_parallel_info(trainer.strategy)
            check_sampler_seeds(trainer.train_dataloader, group=group, dp_size=size, dp_rank=rank)
        # resume: Lightning skips `on_train_epoch_start` when it restarts mid-epoch
        epoch = self._restored if self._restored is not None else trainer.current_epoch
        self._apply(trainer, epoch)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._apply(trainer, trainer.current_epoch)
        self._restored = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("epoch")
