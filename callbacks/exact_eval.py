"""Exact distributed validation, test and predict: every sample scored once, every rank in lock-step.

Notes: docs/internals.md, "callbacks/exact_eval.py"."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, Sampler
from torchmetrics import Metric
from torchmetrics.wrappers.abstract import WrapperMetric
from typing_extensions import override

from lightning_dist._integrations.lightning import unwrap_strategy_methods, wrap_strategy_methods
from lightning_dist.callbacks.sampler_epoch import dataloaders_in
from lightning_dist.data import samples_per_rank
from lightning_dist.mesh import data_parallel_info
from lightning_dist.parallelize.pipeline.split import pipeline_view

__all__ = ["ExactEvaluation", "ExactMetric", "ExactBatchSampler", "exact_eval_mask"]

_EVAL_STAGES = (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING, RunningStage.PREDICTING)
# the strategy methods this callback wraps on the strategy instance (setup) and unwraps (teardown)
_WRAPPED = ("process_dataloader", "validation_step", "test_step", "predict_step", "reduce")
_MODES = ("trim", "mask")


class ExactBatchSampler(Sampler[list[int]]):
    """Batches of this data-parallel rank's share of ``range(num_samples)`` (global position
    ``p = rank + j * num_replicas``, the order of ``DistributedSampler(shuffle=False)``); every rank yields
    the same number of batches. Never drops samples.

    ``trim=False`` (mask mode): the share is padded like ``DistributedSampler`` (positions ``>= num_samples``
    repeat an earlier sample) so every rank's batches have the same sizes; :meth:`mask` tells which rows
    are real. With ``full_batches`` the last batch is padded to ``batch_size`` as well (pipelines that
    split every batch into micro-batches).

    ``trim=True``: only real samples; a rank with fewer real samples spreads them over the same number of
    batches (sizes <= ``batch_size``, the first ones full), so a batch is empty only where a rank has fewer
    samples than steps (``batch_size=1`` with a dataset not divisible by the ranks, or fewer samples than
    ranks): see :meth:`empty_anywhere`.
    """

    def __init__(
        self,
        *,
        num_samples: int,
        num_replicas: int,
        rank: int,
        batch_size: int,
        full_batches: bool = False,
        trim: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"`batch_size={batch_size}` must be >= 1.")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"`rank={rank}` must be in [0, num_replicas={num_replicas}).")
        if num_samples < 1:
            raise ValueError(f"ExactBatchSampler needs a non-empty dataset, got num_samples={num_samples}.")
        if trim and full_batches:
            raise ValueError("`full_batches=True` pads batches: it needs `trim=False` (ExactEvaluation(mode='mask')).")
        self.num_samples, self.num_replicas, self.rank, self.batch_size = num_samples, num_replicas, rank, batch_size
        self.full_batches, self.trim = full_batches, trim
        self.per_rank = samples_per_rank(num_samples, num_replicas)
        """Samples per rank, padding included (the same on every rank)."""
        self.sizes = self.trimmed_sizes(rank) if trim else None
        """Trim mode: the number of real rows of each batch of this rank."""

    def real_count(self, rank: int) -> int:
        """Real (not repeated) samples of data-parallel rank `rank`."""
        return max(0, math.ceil((self.num_samples - rank) / self.num_replicas))

    def trimmed_sizes(self, rank: int) -> list[int]:
        """Batch sizes of `rank` in trim mode: its real samples over ``len(self)`` batches of <= batch_size,
        the first ones full, none empty while the rank has at least one sample per batch."""
        steps, left, sizes = len(self), self.real_count(rank), []
        for b in range(steps):
            size = min(self.batch_size, left - (steps - 1 - b)) if left >= steps - b else min(1, left)
            sizes.append(size)
            left -= size
        return sizes

    def empty_anywhere(self) -> bool:
        """True when some rank gets an empty batch in trim mode (the same answer on every rank)."""
        return any(0 in self.trimmed_sizes(r) for r in range(self.num_replicas))

    def _positions(self, batch_idx: int) -> range:
        if self.sizes is not None:
            start = sum(self.sizes[:batch_idx])
            return range(start, start + self.sizes[batch_idx])
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
        return torch.tensor(
            [
                j < self.per_rank and self.rank + j * self.num_replicas < self.num_samples
                for j in self._positions(batch_idx)
            ],
            dtype=torch.bool,
        )


class _EmptyBatchCollate:
    """The loader's collate function, which also builds an empty batch (no index): the collated first sample
    of the dataset with every tensor cut to 0 rows, so the batch keeps its structure, dtypes and shapes."""

    def __init__(self, collate_fn: Any, dataset: Any) -> None:
        self.collate_fn, self.dataset = collate_fn, dataset

    def __call__(self, samples: list) -> Any:
        if samples:
            return self.collate_fn(samples)
        return apply_to_collection(self.collate_fn([self.dataset[0]]), Tensor, lambda t: t[:0])


def _exact_loader(
    dl: Any,
    *,
    num_replicas: int,
    rank: int,
    full_batches: bool = False,
    trim: bool = False,
    may_skip: bool = True,
    same_sizes: bool = False,
) -> DataLoader:
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
        num_samples=len(dataset),
        num_replicas=num_replicas,
        rank=rank,
        batch_size=batch_size,
        full_batches=full_batches,
        trim=trim,
    )
    if trim and len(dataset) < num_replicas:
        # a rank without any sample would log no key, and the epoch-end sync of `self.log` would hang
        raise ValueError(
            f"ExactEvaluation: the evaluation dataset has {len(dataset)} samples for {num_replicas} data-parallel"
            " ranks, so some rank has none to evaluate. Evaluate on at most"
            f" {len(dataset)} data-parallel ranks, or use ExactEvaluation(mode='mask') with ExactMetric."
        )
    if trim and not may_skip and sampler.empty_anywhere():
        raise ValueError(
            f"ExactEvaluation: {len(dataset)} evaluation samples on {num_replicas} data-parallel ranks with"
            f" batch_size={batch_size} leave some rank an empty last batch, and this strategy's forward runs"
            " collectives, so no rank may skip a step. Use batch_size >= 2, a dataset size divisible by"
            f" {num_replicas}, or ExactEvaluation(mode='mask') with ExactMetric."
        )
    if trim and same_sizes and len({tuple(sampler.trimmed_sizes(r)) for r in range(num_replicas)}) > 1:
        raise ValueError(
            f"ExactEvaluation: {len(dataset)} evaluation samples in batches of {batch_size} on {num_replicas}"
            " data-parallel pipelines give the pipelines batches of different sizes, so they would run"
            " different numbers of micro-batches and their data-parallel collectives would wait on each other."
            " Use ExactEvaluation(mode='mask', full_batches=True) with ExactMetric, or a dataset size divisible"
            f" by {num_replicas} x batch_size."
        )
    collate = _EmptyBatchCollate(dl.collate_fn, dataset) if trim else dl.collate_fn
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=dl.num_workers,
        collate_fn=collate,
        pin_memory=dl.pin_memory,
        timeout=dl.timeout,
        worker_init_fn=dl.worker_init_fn,
        multiprocessing_context=dl.multiprocessing_context,
        generator=dl.generator,
        prefetch_factor=dl.prefetch_factor if dl.num_workers > 0 else None,
        persistent_workers=dl.persistent_workers,
        pin_memory_device=dl.pin_memory_device,
    )


def _float_mean(reduce: Any) -> Any:
    """`strategy.reduce` that averages integer tensors in float64.

    ``self.log(..., sync_dist=True)`` divides the synced sum of ``value * batch_size`` by the mean of the
    integer batch-size counts, and Lightning's ``_sync_ddp`` writes that mean back into the integer tensor
    (``copy_``), truncating it: harmless while padding makes every rank's count equal, but trimmed counts
    (31 samples on 4 ranks: mean 7.75 -> 7) would inflate the logged mean by 31/28.
    """

    def run(tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if isinstance(tensor, Tensor) and not tensor.is_floating_point() and str(reduce_op).lower() in ("mean", "avg"):
            tensor = tensor.to(torch.float64)  # counts: exact in float64; a new tensor, the caller's stays intact
        return reduce(tensor, group, reduce_op)

    return run


class ExactEvaluation(Callback):
    """Score every validation/test/predict sample exactly once under any data-parallel layout.

    The callback rebuilds each validation/test/predict DataLoader with an :class:`ExactBatchSampler` over
    the data-parallel group (``dp`` of the pack's meshes, Lightning's ``data_parallel`` dim, or the DDP
    world; tensor/pipeline ranks of one replica get the same samples). Every rank runs the same number of
    steps. It also points every torchmetrics metric of the model at the data-parallel group, and logs
    ``{prefix}_samples``, the number of samples evaluated (the dataset length).

    ``mode="trim"`` (default, for unchanged projects): the repeated rows never reach the user's step; a
    rank's batches may be shorter than ``batch_size`` (the real samples are spread over the same number of
    steps). Metrics, ``len(batch)`` counts and ``self.log(..., sync_dist=True)`` epoch means (Lightning
    weights them by the real batch sizes) equal one device. Only where a rank has fewer samples than steps
    (``batch_size=1`` and a dataset not divisible by the ranks) is a batch empty: that rank skips the
    user's step under Lightning's DDP (its eval forward runs no collective); strategies whose forward runs
    collectives (FSDP, tensor/pipeline parallel, DeepSpeed) refuse that layout up front. A step skipped on
    one rank must not ``self.log(..., on_step=True, sync_dist=True)`` (that syncs per step).

    ``mode="mask"``: the padding stays (every batch the same size; with ``full_batches=True`` the last one
    too), for models that need fixed batch shapes, e.g. a pipeline that splits every batch into whole
    micro-batches. Under a pipelining strategy with several data-parallel pipelines, trim mode refuses
    layouts whose pipelines would get batches of different sizes (different micro-batch counts). The user then updates
    metrics through the mask: wrap them in :class:`ExactMetric` or
    slice with :func:`exact_eval_mask`; a plain ``self.log(..., sync_dist=True)`` averages padded rows too.

    Example (an existing project, unchanged but for the callback)::

        class Model(LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(8, 3)
                self.val_acc = MulticlassAccuracy(num_classes=3, average="micro")

            def validation_step(self, batch, batch_idx):
                x, y = batch
                logits = self.net(x)
                self.val_acc.update(logits, y)
                self.log("val_acc", self.val_acc)
                self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)

        Trainer(strategy="ddp", devices=4, callbacks=[ExactEvaluation()])

    The evaluation loaders must be plain ``DataLoader`` objects over map-style datasets with a
    ``batch_size``; their sampler (and ``drop_last``) is replaced, the order within a rank is the
    dataset order. Training loaders are not touched.
    """

    def __init__(self, *, mode: str = "trim", log_count: bool = True, full_batches: bool = False) -> None:
        if mode not in _MODES:
            raise ValueError(f"ExactEvaluation(mode={mode!r}): choose 'trim' (default) or 'mask'.")
        if full_batches and mode != "mask":
            raise ValueError("ExactEvaluation(full_batches=True) pads batches: use it with mode='mask'.")
        self.mode = mode
        """``"trim"``: padded rows removed from the batches; ``"mask"``: kept and marked by :attr:`mask`."""
        self.log_count = log_count
        """Log ``val_samples`` / ``test_samples``: samples scored, summed over the data-parallel group."""
        self.full_batches = full_batches
        """Mask mode: pad the last batch to the full batch size too (pipelines that split every batch)."""
        self.mask: Optional[Tensor] = None
        """The mask of the batch being evaluated (None outside evaluation batches); all True in trim mode."""
        self.last_count: Optional[int] = None
        """Samples scored in the last evaluation epoch, over the whole data-parallel group."""
        self._count: Optional[Tensor] = None
        self._dp: tuple = (None, 1, 0)
        self._strategy: Any = None
        self._skip = False  # the current batch is empty (trim mode): the user's step is not called

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
            # sampler injection and before iteration; wrapped on this strategy instance only
            # Lightning's DDP runs no collective in an eval forward, so a rank may skip an empty batch
            may_skip = isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)) and not isinstance(
                strategy, DeepSpeedStrategy
            )
            # a pipeline splits a batch into as many micro-batches as its size allows: dp replicas must agree
            same_sizes = pipeline_view(strategy) is not None

            def exact_loaders(original: Any) -> Any:
                def process_dataloader(dataloader: object) -> object:
                    dataloader = original(dataloader)
                    if trainer.state.stage in _EVAL_STAGES:
                        _, size, rank = self._dp
                        dataloader = _exact_loader(
                            dataloader,
                            num_replicas=size,
                            rank=rank,
                            full_batches=self.full_batches,
                            trim=self.mode == "trim",
                            may_skip=may_skip,
                            same_sizes=same_sizes,
                        )
                    return dataloader

                return process_dataloader

            # an empty batch (trim mode): the strategy's step is not run, the hooks around it are
            wrap_strategy_methods(
                strategy,
                {
                    "process_dataloader": exact_loaders,
                    "validation_step": self._skipping,
                    "test_step": self._skipping,
                    "predict_step": self._skipping,
                    "reduce": _float_mean,
                },
            )
            self._strategy = strategy

    def _skipping(self, step: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            return None if self._skip else step(*args, **kwargs)

        return run

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._strategy is not None:
            unwrap_strategy_methods(self._strategy, _WRAPPED)  # the class methods are back
            self._strategy = None

    # ---- per-batch mask and count ------------------------------------------------------------
    def _batch_start(self, loaders: Any, pl_module: LightningModule, batch_idx: int, dataloader_idx: int) -> None:
        dl = dataloaders_in(loaders)[dataloader_idx]
        sampler = getattr(dl, "batch_sampler", None)
        if not isinstance(sampler, ExactBatchSampler):
            raise RuntimeError(
                "ExactEvaluation: the evaluation loader was not rebuilt by the callback (was it created before"
                " `setup`, or replaced afterwards?)."
            )
        self.mask = sampler.mask(batch_idx).to(pl_module.device)
        self._skip = self.mask.numel() == 0
        if self._count is None:
            self._count = torch.zeros((), dtype=torch.long, device=pl_module.device)
        self._count += self.mask.sum()

    def _epoch_end(self, pl_module: LightningModule, prefix: Optional[str]) -> None:
        count = self._count if self._count is not None else torch.zeros((), dtype=torch.long, device=pl_module.device)
        group, size, _ = self._dp
        if size > 1:
            dist.all_reduce(count, group=group)  # dp group only: every dp rank holds different samples
        if self.log_count and prefix is not None:
            # already summed over dp and equal on every rank: "max" keeps it, and sync_dist spares Lightning's warning
            pl_module.log(f"{prefix}_samples", count.to(torch.float64).item(), sync_dist=True, reduce_fx="max")
        self.last_count = int(count)
        self._count, self.mask, self._skip = None, None, False

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count = None

    @override
    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._count = None

    @override
    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
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
    def on_predict_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._batch_start(trainer.predict_dataloaders, pl_module, batch_idx, dataloader_idx)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_end(pl_module, "val")

    @override
    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_end(pl_module, "test")

    @override
    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_end(pl_module, None)  # predict cannot log: the count is in `last_count`


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

        def pick(a: Any) -> Any:
            return a[mask.to(a.device)] if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == mask.shape[0] else a

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
