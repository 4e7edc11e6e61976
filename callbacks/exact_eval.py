"""Exact distributed validation and test: every sample scored once, every rank in lock-step.

``DistributedSampler`` pads the dataset with repeated samples so that every rank gets the same number
(10 samples on 3 ranks are scored as 12). Dropping the padding instead would leave ranks with different
step counts, and a sharded model (FSDP, tensor or pipeline parallel) then hangs in a collective.
:class:`ExactEvaluation` keeps the padding (every rank runs the same steps and collectives) but knows
which rows are padding and exposes a per-batch mask; :class:`ExactMetric` applies it to any
torchmetrics metric.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, Sampler
from torchmetrics import Metric
from torchmetrics.wrappers.abstract import WrapperMetric
from typing_extensions import override

from lightning_dist.callbacks.sampler_epoch import _loaders
from lightning_dist.mesh import data_parallel_info

__all__ = ["ExactEvaluation", "ExactMetric", "ExactBatchSampler", "exact_eval_mask"]

_EVAL_STAGES = (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)


class ExactBatchSampler(Sampler[list[int]]):
    """Batches of this data-parallel rank's share of ``range(num_samples)``, padded like
    ``DistributedSampler`` (global position ``p = rank + j * num_replicas``; positions ``>= num_samples``
    repeat an earlier sample) so every rank yields the same number of batches of the same sizes;
    :meth:`mask` tells which rows of a batch are real. Never drops samples. With ``full_batches`` the last
    batch is padded to ``batch_size`` as well (for pipelines that split every batch into micro-batches).
    """

    def __init__(self, *, num_samples: int, num_replicas: int, rank: int, batch_size: int, full_batches: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"`batch_size={batch_size}` must be >= 1.")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"`rank={rank}` must be in [0, num_replicas={num_replicas}).")
        if num_samples < 1:
            raise ValueError(f"ExactBatchSampler needs a non-empty dataset, got num_samples={num_samples}.")
        self.num_samples, self.num_replicas, self.rank, self.batch_size = num_samples, num_replicas, rank, batch_size
        self.full_batches = full_batches
        self.per_rank = math.ceil(num_samples / num_replicas)
        """Samples per rank, padding included (the same on every rank)."""

    def _positions(self, batch_idx: int) -> range:
        start = batch_idx * self.batch_size
        stop = start + self.batch_size if self.full_batches else min(start + self.batch_size, self.per_rank)
        return range(start, stop)

    def __iter__(self):
        for b in range(len(self)):
            yield [(self.rank + j * self.num_replicas) % self.num_samples for j in self._positions(b)]

    def __len__(self) -> int:
        return math.ceil(self.per_rank / self.batch_size)

    def mask(self, batch_idx: int) -> Tensor:
        """Bool tensor over the rows of batch `batch_idx`: True for real samples, False for padding."""
        return torch.tensor([
            j < self.per_rank and self.rank + j * self.num_replicas < self.num_samples for j in self._positions(batch_idx)
        ])


def _exact_loader(dl: Any, *, num_replicas: int, rank: int, full_batches: bool = False) -> DataLoader:
    """`dl` rebuilt with an :class:`ExactBatchSampler` (same dataset, collate function and workers)."""
    if type(dl) is not DataLoader:
        raise TypeError(
            f"ExactEvaluation rebuilds the evaluation DataLoader, but got a {type(dl).__name__}; return a plain"
            " `torch.utils.data.DataLoader` from `val_dataloader`/`test_dataloader`."
        )
    dataset = dl.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"ExactEvaluation needs a map-style dataset with `__len__`, got {type(dataset).__name__}: an iterable"
            " dataset cannot be split into exact shards by index."
        )
    batch_size = dl.batch_size if dl.batch_size is not None else getattr(dl.batch_sampler, "batch_size", None)
    if not isinstance(batch_size, int):
        raise ValueError(
            f"ExactEvaluation could not read a batch size from the evaluation loader (batch_sampler"
            f" {type(dl.batch_sampler).__name__}); build it with `DataLoader(dataset, batch_size=...)`."
        )
    sampler = ExactBatchSampler(
        num_samples=len(dataset), num_replicas=num_replicas, rank=rank, batch_size=batch_size, full_batches=full_batches
    )
    return DataLoader(
        dataset, batch_sampler=sampler, num_workers=dl.num_workers, collate_fn=dl.collate_fn,
        pin_memory=dl.pin_memory, timeout=dl.timeout, worker_init_fn=dl.worker_init_fn,
        multiprocessing_context=dl.multiprocessing_context, generator=dl.generator,
        prefetch_factor=dl.prefetch_factor if dl.num_workers > 0 else None,
        persistent_workers=dl.persistent_workers, pin_memory_device=dl.pin_memory_device,
    )


class ExactEvaluation(Callback):
    """Score every validation/test sample exactly once under any data-parallel layout.

    The callback rebuilds each validation/test DataLoader with an :class:`ExactBatchSampler` over the
    data-parallel group (``dp`` of the pack's meshes, Lightning's ``data_parallel`` dim, or the DDP world;
    tensor/pipeline ranks of one replica get the same samples). Every rank runs the same number of steps
    of the same sizes; the rows that repeat a sample are marked in a per-batch mask. It also points every
    torchmetrics metric of the model at the data-parallel group, and logs ``{prefix}_samples``, the number
    of samples evaluated (the dataset length).

    User contract: update metrics only through the mask. Wrap metrics in :class:`ExactMetric` (the mask
    is applied for you), or slice with :func:`exact_eval_mask` yourself. A plain
    ``self.log("val_loss", loss, sync_dist=True)`` still averages the padded rows; log a wrapped
    ``MeanMetric`` of per-sample losses instead.

    Example::

        from torchmetrics import MeanMetric
        from torchmetrics.classification import MulticlassAccuracy
        from lightning_dist.callbacks import ExactEvaluation, ExactMetric

        class Model(LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(8, 3)
                self.val_acc = ExactMetric(MulticlassAccuracy(num_classes=3, average="micro"))
                self.val_loss = ExactMetric(MeanMetric())

            def validation_step(self, batch, batch_idx):
                x, y = batch
                logits = self.net(x)
                self.val_acc.update(logits, y)  # padded rows are dropped here
                self.val_loss.update(F.cross_entropy(logits, y, reduction="none"))
                self.log("val_acc", self.val_acc)
                self.log("val_loss", self.val_loss)

        Trainer(strategy="ddp", devices=4, callbacks=[ExactEvaluation()])

    The evaluation loaders must be plain ``DataLoader`` objects over map-style datasets with a
    ``batch_size``; their sampler (and ``drop_last``) is replaced, the order within a rank is the
    dataset order. Training loaders are not touched.
    """

    def __init__(self, *, log_count: bool = True, full_batches: bool = False) -> None:
        self.log_count = log_count
        """Log ``val_samples`` / ``test_samples``: samples scored, summed over the data-parallel group."""
        self.full_batches = full_batches
        """Pad the last batch to the full batch size too (pipelines that split every batch into micro-batches)."""
        self.mask: Optional[Tensor] = None
        """The mask of the batch being evaluated (None outside evaluation batches)."""
        self.last_count: Optional[int] = None
        """Samples scored in the last evaluation epoch, over the whole data-parallel group."""
        self._count: Optional[Tensor] = None
        self._dp: tuple = (None, 1, 0)
        self._strategy: Any = None

    # ---- loader replacement ------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._dp = data_parallel_info(trainer.strategy)
        group = self._dp[0]
        for metric in pl_module.modules():
            if isinstance(metric, ExactMetric):
                metric.mask_source = self
            if isinstance(metric, Metric) and group is not None and metric.process_group is None:
                metric.process_group = group  # sync over dp only: tensor/pipeline ranks hold the same samples
        strategy = trainer.strategy
        if self._strategy is None:
            # `Strategy.process_dataloader` is Lightning's designated point to change a loader after the
            # sampler injection and before iteration; wrap it on this strategy instance only
            original = strategy.process_dataloader

            def process_dataloader(dataloader: object) -> object:
                dataloader = original(dataloader)
                if trainer.state.stage in _EVAL_STAGES:
                    _, size, rank = self._dp
                    dataloader = _exact_loader(dataloader, num_replicas=size, rank=rank, full_batches=self.full_batches)
                return dataloader

            strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]
            self._strategy = strategy

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._strategy is not None:
            del self._strategy.process_dataloader  # the instance attribute: the class method is back
            self._strategy = None

    # ---- per-batch mask and count ------------------------------------------------------------
    def _batch_start(self, loaders: Any, pl_module: LightningModule, batch_idx: int, dataloader_idx: int) -> None:
        dl = _loaders(loaders)[dataloader_idx]
        sampler = getattr(dl, "batch_sampler", None)
        if not isinstance(sampler, ExactBatchSampler):
            raise RuntimeError(
                "ExactEvaluation: the evaluation loader was not rebuilt by the callback (was it created before"
                " `setup`, or replaced afterwards?)."
            )
        self.mask = sampler.mask(batch_idx).to(pl_module.device)
        if self._count is None:
            self._count = torch.zeros((), dtype=torch.long, device=pl_module.device)
        self._count += self.mask.sum()

    def _epoch_end(self, pl_module: LightningModule, prefix: str) -> None:
        count = self._count if self._count is not None else torch.zeros((), dtype=torch.long, device=pl_module.device)
        group, size, _ = self._dp
        if size > 1:
            dist.all_reduce(count, group=group)  # dp group only: every dp rank holds different samples
        if self.log_count:
            pl_module.log(f"{prefix}_samples", count.to(torch.float64).item(), sync_dist=False, reduce_fx="sum")
        self.last_count = int(count)
        self._count, self.mask = None, None

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count = None

    @override
    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count = None

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._batch_start(trainer.val_dataloaders, pl_module, batch_idx, dataloader_idx)

    @override
    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._batch_start(trainer.test_dataloaders, pl_module, batch_idx, dataloader_idx)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_end(pl_module, "val")

    @override
    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_end(pl_module, "test")


def exact_eval_mask(pl_module: LightningModule) -> Tensor:
    """The mask of the current validation/test batch (True = a real sample, False = padding)."""
    for cb in pl_module.trainer.callbacks:
        if isinstance(cb, ExactEvaluation):
            if cb.mask is None:
                raise RuntimeError("exact_eval_mask() is only available inside validation/test batches.")
            return cb.mask
    raise RuntimeError("exact_eval_mask() needs the ExactEvaluation callback in `Trainer(callbacks=[...])`.")


class ExactMetric(WrapperMetric):
    """Wrap a torchmetrics metric so that padded evaluation rows never reach it.

    ``update(*args, mask=None, **kwargs)`` keeps the rows where the mask is True in every tensor argument
    whose first dim matches the mask; without `mask`, the mask of the current batch from the
    :class:`ExactEvaluation` callback is used (the callback finds wrappers among the model's modules).
    ``compute``/``reset``/``sync`` go to the wrapped metric, which syncs over the data-parallel group.
    Outside evaluation (no current mask) updates pass through unmasked; a batch that is padding only
    (possible on the last step of some ranks) leaves the metric untouched.
    """

    def __init__(self, metric: Metric, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(metric, Metric):
            raise TypeError(f"ExactMetric wraps a torchmetrics `Metric`, got {type(metric).__name__}.")
        self.metric = metric
        self.mask_source: Optional[ExactEvaluation] = None
        """The callback whose current mask is used when `update` gets no mask (set by the callback)."""

    def _mask(self, mask: Optional[Tensor]) -> Optional[Tensor]:
        if mask is not None:
            return mask
        return None if self.mask_source is None else self.mask_source.mask

    def _select(self, args: tuple, kwargs: dict, mask: Optional[Tensor]) -> tuple[tuple, dict]:
        if mask is None:
            return args, kwargs
        mask = mask.to(torch.bool)
        pick = lambda a: a[mask.to(a.device)] if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == mask.shape[0] else a
        return tuple(pick(a) for a in args), {k: pick(v) for k, v in kwargs.items()}

    def update(self, *args: Any, mask: Optional[Tensor] = None, **kwargs: Any) -> None:
        mask = self._mask(mask)
        if mask is not None and not bool(mask.any()):
            return  # a batch of padding only: many metrics refuse empty inputs, and there is nothing to add
        args, kwargs = self._select(args, kwargs, mask)
        self.metric.update(*args, **kwargs)

    def forward(self, *args: Any, mask: Optional[Tensor] = None, **kwargs: Any) -> Any:
        mask = self._mask(mask)
        if mask is not None and not bool(mask.any()):
            return None  # nothing to score in this batch (see `update`)
        args, kwargs = self._select(args, kwargs, mask)
        return self.metric(*args, **kwargs)

    def compute(self) -> Any:
        return self.metric.compute()

    def reset(self) -> None:
        self.metric.reset()
        super().reset()
