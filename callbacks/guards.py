"""Guards that turn silent data problems of distributed runs into clear errors on every rank.

Notes: docs/internals.md, "callbacks/guards.py"."""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_dist.callbacks.sampler_epoch import dataloaders_in
from lightning_dist.data import samples_per_rank
from lightning_dist.mesh import data_parallel_info

__all__ = ["FiniteLossGuard", "TrainDataGuard", "check_data_runs_out_together", "train_data_problems"]


def train_data_problems(loader: Any, *, dp_size: int) -> list[str]:
    """Problems of one training DataLoader over `dp_size` data-parallel ranks (pure; empty when fine)."""
    dataset = getattr(loader, "dataset", None)
    if not isinstance(dataset, Sized):
        return []  # an iterable dataset of unknown length: nothing to check up front
    n = len(dataset)
    name = type(dataset).__name__
    if n == 0:
        return [
            f"The training dataset ({name}) is empty: len(dataset)=0. Check the data path/filters of"
            " `train_dataloader`, or do not call `fit`."
        ]
    if n < dp_size:
        return [
            f"The training dataset ({name}) has {n} samples but there are {dp_size} data-parallel ranks:"
            f" the DistributedSampler would pad it with copies, so ranks train on duplicated samples. Use at"
            f" most {n} data-parallel ranks (devices x nodes / (tp x pp)) or a dataset of >= {dp_size} samples."
        ]
    batch_size = getattr(loader, "batch_size", None)
    if getattr(loader, "drop_last", False) and batch_size:
        per_rank = samples_per_rank(n, dp_size, drop_last=getattr(loader.sampler, "drop_last", False))
        if per_rank < batch_size:
            return [
                f"The training dataset ({name}) has {n} samples, {per_rank} per data-parallel rank over"
                f" {dp_size} ranks, fewer than batch_size={batch_size} with drop_last=True: no batch would"
                f" run. Lower batch_size to <= {per_rank}, set drop_last=False, or use more data."
            ]
    return []


class TrainDataGuard(Callback):
    """Refuse training data that is empty, smaller than the number of data-parallel ranks, or too small
    for one batch; raises ``ValueError`` on every rank before the first training batch.

    Example::

        Trainer(strategy="hsdp", devices=4, callbacks=[TrainDataGuard()])
    """

    def _check(self, trainer: Trainer) -> None:
        _, dp_size, _ = data_parallel_info(trainer.strategy)
        problems = [
            p for dl in dataloaders_in(trainer.train_dataloader) for p in train_data_problems(dl, dp_size=dp_size)
        ]
        if problems:
            raise ValueError("TrainDataGuard: " + " ".join(problems))

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check(trainer)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # an empty loader makes Lightning skip the epoch loop (no `on_train_start`) with only a warning
        if trainer.num_training_batches == 0 and trainer.global_step == 0 and trainer.limit_train_batches != 0:
            self._check(trainer)
            raise ValueError(
                "TrainDataGuard: the training dataloader gave 0 batches on every rank; check"
                " `train_dataloader` (dataset size, batch_size, drop_last, limit_train_batches)."
            )


class FiniteLossGuard(Callback):
    """Stop on the first NaN/Inf training loss, on every rank, before the backward pass (weights intact).

    The error names the step and the ranks whose loss was not finite. Costs one scalar all-reduce per
    optimization step over the whole job.
    """

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        bad = torch.zeros(max(trainer.world_size, 1), dtype=torch.float32, device=loss.device)
        if not torch.isfinite(loss.detach()).all():
            bad[trainer.global_rank] = 1.0
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(bad)  # every rank learns which ranks saw a non-finite loss
        ranks = [r for r, flag in enumerate(bad.tolist()) if flag]
        if ranks:
            raise FloatingPointError(
                f"FiniteLossGuard: the training loss is not finite (NaN/Inf) on rank(s) {ranks} at global step"
                f" {trainer.global_step}; stopped before backward, the weights are those of step"
                f" {trainer.global_step}. Check the inputs of that batch for NaN/Inf, lower the learning rate, or"
                " clip gradients (Trainer(gradient_clip_val=...))."
            )


def check_data_runs_out_together(trainer: Trainer, batch_idx: int, *, group: Any, dp_size: int) -> None:
    """Raise ``RuntimeError`` on every data-parallel rank when some ranks' training data ends at this batch
    and others' does not (an ``IterableDataset`` that yields fewer items on some ranks): the ranks would
    then run different collectives and hang, or a rank would end its epoch alone. One 2-element all-reduce
    per step, only for training data without a length (a sized dataset is split evenly by the sampler).
    Call from ``on_train_batch_start``, before the step's collectives.
    """
    if dp_size <= 1:  # first: this runs every step
        return
    loaders = dataloaders_in(trainer.train_dataloader)
    if not loaders or all(isinstance(getattr(dl, "dataset", None), Sized) for dl in loaders):
        return
    epoch_loop = trainer.fit_loop.epoch_loop
    last = bool(epoch_loop.batch_progress.is_last_batch)
    # the fit ends after this step anyway: an uneven tail there changes nothing
    if 0 < trainer.max_steps <= trainer.global_step + 1 or batch_idx + 1 >= trainer.num_training_batches:
        return
    device = trainer.strategy.root_device
    flags = torch.zeros(dp_size, dtype=torch.int32, device=device)
    flags[dist.get_rank(group)] = int(last)
    dist.all_reduce(flags, group=group)
    ended = [r for r, f in enumerate(flags.tolist()) if f]
    if ended and len(ended) < dp_size:
        raise RuntimeError(
            f"The training data of data-parallel rank(s) {ended} ends after batch {batch_idx} of epoch"
            f" {trainer.current_epoch} while the other {dp_size - len(ended)} rank(s) have more: every"
            " data-parallel rank must get the same number of batches. Make the IterableDataset yield the same"
            " number of items on every rank (e.g. cut each shard to the shortest, or pad it), or use a"
            " map-style dataset, which the DistributedSampler splits evenly."
        )
