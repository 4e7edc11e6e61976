"""Mesh-aware synchronized BatchNorm: statistics pooled over the data-parallel group only.

Notes: docs/internals.md, "callbacks/sync_batchnorm.py"."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.autograd import Function
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from lightning_dist._compat import torch_sync_batchnorm_function
from lightning_dist.mesh import data_parallel_info

__all__ = [
    "DataParallelBatchNorm",
    "MeshSyncBatchNorm",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
    "sync_or_warn_batchnorm",
    "unsynced_batchnorm",
    "warn_unsynced_batchnorm",
]

# the plain class to restore, by number of input dims the original accepted
_PLAIN_BN = {"BatchNorm1d": nn.BatchNorm1d, "BatchNorm2d": nn.BatchNorm2d, "BatchNorm3d": nn.BatchNorm3d}


def _channel_view(t: Tensor, ndim: int) -> Tensor:
    """(C,) -> (1, C, 1, ...) to broadcast against an (N, C, *) input."""
    return t.view(1, -1, *([1] * (ndim - 2)))


class _SyncBatchNormFn(Function):
    """BatchNorm over the union of the group's batches.

    Hand-written because torch's ``SyncBatchNorm`` kernel needs CUDA tensors when it syncs; this one uses
    only ``all_gather``/``all_reduce`` and therefore runs on CPU/gloo. CUDA inputs use torch's function
    instead (see :func:`uses_torch_kernels`).
    Forward: each rank sends (mean, M2, count) per channel, combined with Chan's parallel formula
    (numerically stable, ranks with different batch sizes weighted by their counts). Backward: the two
    per-channel sums of the input gradient (sum dy, sum dy*(x-mean)) are all-reduced, so every rank gets
    the gradient of the sum of all ranks' losses w.r.t. its own inputs; weight/bias grads stay local
    (the data-parallel gradient reduction sums/averages them like every other parameter).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, group_size):  # type: ignore[override]
        dims = [0] + list(range(2, x.dim()))
        stat_dtype = torch.promote_types(x.dtype, torch.float32)
        xs = x.to(stat_dtype)
        channels = x.shape[1]
        n_local = x.numel() // channels if channels else 0
        if n_local > 0:
            mean_l = xs.mean(dims)
            m2_l = (xs - _channel_view(mean_l, x.dim())).pow(2).sum(dims)
        else:  # an empty local batch contributes nothing but must still join the collective
            mean_l = xs.new_zeros(channels)
            m2_l = xs.new_zeros(channels)
        local = torch.stack([mean_l, m2_l, mean_l.new_full((channels,), float(n_local))])
        gathered = [torch.empty_like(local) for _ in range(group_size)]
        dist.all_gather(gathered, local.contiguous(), group=group)
        stats = torch.stack(gathered)  # (ranks, 3, C)
        means, m2s, counts = stats[:, 0], stats[:, 1], stats[:, 2]
        n = counts.sum(0)
        if bool((n <= 1).any()):
            raise ValueError(
                f"Expected more than 1 value per channel when training across the group, got {int(n[0])}"
                f" (input shape {tuple(x.shape)} on this rank)."
            )
        mean = (counts * means).sum(0) / n
        m2 = (m2s + counts * (means - mean).pow(2)).sum(0)
        var = m2 / n
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            # identical inputs on every rank -> identical running statistics; unbiased variance like torch
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((m2 / (n - 1)).to(running_var.dtype), alpha=momentum)
        xhat = (xs - _channel_view(mean, x.dim())) * _channel_view(invstd, x.dim())
        y = xhat
        if weight is not None:
            y = y * _channel_view(weight.to(stat_dtype), x.dim())
        if bias is not None:
            y = y + _channel_view(bias.to(stat_dtype), x.dim())
        ctx.save_for_backward(x, weight, mean, invstd, n)
        ctx.group, ctx.has_bias = group, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weight, mean, invstd, n = ctx.saved_tensors
        dims = [0] + list(range(2, x.dim()))
        stat_dtype = mean.dtype
        dys = dy.to(stat_dtype)
        xmu = x.to(stat_dtype) - _channel_view(mean, x.dim())
        sum_dy = dys.sum(dims)
        sum_dy_xmu = (dys * xmu).sum(dims)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(weight.dtype if weight is not None else dy.dtype)
        if ctx.needs_input_grad[0]:
            sums = torch.stack([sum_dy, sum_dy_xmu])
            dist.all_reduce(sums, group=ctx.group)
            mean_dy, mean_dy_xmu = sums[0] / n, sums[1] / n
            scale = invstd if weight is None else invstd * weight.to(stat_dtype)
            grad_x = (
                dys - _channel_view(mean_dy, x.dim()) - xmu * _channel_view(invstd.pow(2) * mean_dy_xmu, x.dim())
            ) * _channel_view(scale, x.dim())
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def uses_torch_kernels(device: torch.device) -> bool:
    """Whether :class:`DataParallelBatchNorm` syncs an input on `device` with torch's SyncBatchNorm function.

    Its kernels exist for CUDA only (they refuse CPU tensors); everywhere else the hand-written
    :class:`_SyncBatchNormFn` runs (all-gather / all-reduce only, so gloo works).
    """
    return torch.device(device).type == "cuda"


class DataParallelBatchNorm(_BatchNorm):
    """BatchNorm whose training-mode statistics are pooled over a process group.

    State-dict keys are those of :class:`torch.nn.BatchNorm2d` (``weight``, ``bias``, ``running_mean``,
    ``running_var``, ``num_batches_tracked``), so a checkpoint of a converted model loads into the plain
    model unchanged. Eval mode uses the running statistics locally. Without a group (or a group of one
    rank) it behaves exactly like plain BatchNorm. Build it with :func:`convert_sync_batchnorm`.
    """

    def __init__(
        self, num_features: int, *, process_group: Any = None, plain_class: str = "BatchNorm2d", **kwargs: Any
    ):
        super().__init__(num_features, **kwargs)
        self.process_group = process_group
        """The group statistics are pooled over (``None``: no sync)."""
        self.plain_class = plain_class
        """Name of the ``torch.nn`` BatchNorm class this layer replaced (used by :func:`revert_sync_batchnorm`)."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def __getstate__(self) -> dict:
        # process groups cannot be pickled or deep-copied: a copy is a local (single-device) BatchNorm
        state = self.__dict__.copy()
        state["process_group"] = None
        return state

    def _group_size(self) -> int:
        if self.process_group is None or not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        group_size = self._group_size()
        if not self.training or group_size == 1:
            return super().forward(input)  # eval mode, or nothing to sync with: plain BatchNorm
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        # torch's CUDA kernels (2x faster than the hand-written path on GPU); the hand-written path for CPU/gloo
        sync_fn = torch_sync_batchnorm_function() if uses_torch_kernels(input.device) else _SyncBatchNormFn
        return sync_fn.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps,
            factor,
            self.process_group,
            group_size,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", synced_ranks={self._group_size()}"


def _swap_modules(module: nn.Module, make) -> nn.Module:
    """Replace every module for which `make(child)` returns a new module, reusing the same tensors."""
    new = make(module)
    if new is not None:
        return new
    for name, child in module.named_children():
        replaced = _swap_modules(child, make)
        if replaced is not child:
            setattr(module, name, replaced)
    return module


def _copy_state(src: _BatchNorm, dst: _BatchNorm) -> _BatchNorm:
    # the same Parameter and buffer objects: a wrapper that already holds them (DDP) keeps working
    if src.affine:
        dst.weight, dst.bias = src.weight, src.bias
    if src.track_running_stats:
        dst.running_mean, dst.running_var = src.running_mean, src.running_var
        dst.num_batches_tracked = src.num_batches_tracked
    dst.train(src.training)
    return dst


def convert_sync_batchnorm(module: nn.Module, *, process_group: Any) -> nn.Module:
    """Replace every ``torch.nn`` BatchNorm layer (1d/2d/3d, or ``nn.SyncBatchNorm``) with
    :class:`DataParallelBatchNorm` syncing over `process_group`; returns the (possibly new) root module.

    Layers already converted get `process_group` set. Parameters and buffers are reused, not copied.
    """

    def make(m: nn.Module) -> Optional[nn.Module]:
        if isinstance(m, DataParallelBatchNorm):
            m.process_group = process_group
            return m
        if isinstance(m, _BatchNorm):
            plain = type(m).__name__ if type(m).__name__ in _PLAIN_BN else "BatchNorm2d"
            new = DataParallelBatchNorm(
                m.num_features,
                eps=m.eps,
                momentum=m.momentum,
                affine=m.affine,
                track_running_stats=m.track_running_stats,
                process_group=process_group,
                plain_class=plain,
                device="meta",  # every tensor is replaced by the original one just below
            )
            return _copy_state(m, new)
        return None

    return _swap_modules(module, make)


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Turn every :class:`DataParallelBatchNorm` back into the plain ``torch.nn`` BatchNorm it replaced
    (for export or a single-device run); returns the (possibly new) root module."""

    def make(m: nn.Module) -> Optional[nn.Module]:
        if not isinstance(m, DataParallelBatchNorm):
            return None
        new = _PLAIN_BN[m.plain_class](
            m.num_features,
            eps=m.eps,
            momentum=m.momentum,
            affine=m.affine,
            track_running_stats=m.track_running_stats,
            device="meta",
        )
        return _copy_state(m, new)

    return _swap_modules(module, make)


def unsynced_batchnorm(module: nn.Module) -> list[str]:
    """Names of the BatchNorm layers of `module` that keep per-rank statistics (not synced over a group)."""
    return [
        n
        for n, m in module.named_modules()
        if isinstance(m, _BatchNorm)
        and m.track_running_stats
        and not isinstance(m, (DataParallelBatchNorm, nn.SyncBatchNorm))
    ]


def warn_unsynced_batchnorm(module: nn.Module, *, dp_size: int) -> bool:
    """Warn once (rank 0) when `module` trains BatchNorm layers with per-replica statistics over `dp_size`
    data-parallel ranks; returns whether it warned."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    names = unsynced_batchnorm(module)
    if dp_size <= 1 or not names:
        return False
    rank_zero_warn(
        f"BatchNorm layers {names[:5]}{' ...' if len(names) > 5 else ''} train with data parallelism over"
        f" {dp_size} ranks without synced statistics: each replica normalizes with its own part of the batch,"
        " so the replicas' running statistics will differ and the model differs from one device's. Add"
        " `lightning_dist.callbacks.MeshSyncBatchNorm()` to the Trainer's callbacks (or pass"
        " `Trainer(sync_batchnorm=True)`); freeze them (eval mode) if that is intended.",
        category=UserWarning,
    )
    return True


def sync_or_warn_batchnorm(module: nn.Module, *, sync: bool, group: Any, dp_size: int) -> nn.Module:
    """What the pack's strategies do with BatchNorm before training: ``Trainer(sync_batchnorm=True)``
    (`sync`) converts every layer to :class:`DataParallelBatchNorm` over the data-parallel `group` (torch's
    SyncBatchNorm needs accelerators and would pool over tensor/pipeline peers too); otherwise
    :func:`warn_unsynced_batchnorm`. Returns the (possibly new) root module."""
    if sync:
        return convert_sync_batchnorm(module, process_group=group if dp_size > 1 else None)
    warn_unsynced_batchnorm(module, dp_size=dp_size)
    return module


def _partition_group(group: Any, dp_size: int, group_size: int) -> Any:
    """This rank's group of `group_size` consecutive ranks of its data-parallel group.

    Every rank must create every subgroup in the same order, so the dp groups of all ranks are
    exchanged first (there is one dp group per tp/pp coordinate).
    """
    world = dist.get_world_size()
    mine = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    dp_groups = sorted({tuple(g) for g in everyone})
    result = None
    for ranks in dp_groups:
        for start in range(0, dp_size, group_size):
            chunk = list(ranks[start : start + group_size])
            pg = dist.new_group(chunk)
            if dist.get_rank() in chunk:
                result = pg
    return result


class MeshSyncBatchNorm(Callback):
    """Convert every BatchNorm layer to one whose statistics are pooled over the data-parallel group.

    Works with the pack's strategies (the ``dp`` mesh dim, never tensor/pipeline ranks), Lightning's
    ``ModelParallelStrategy`` (its ``data_parallel`` dim) and DDP (the world), on CPU/gloo and CUDA/nccl.
    Ranks with different batch sizes are weighted by their sample counts; running statistics stay
    identical on all ranks; eval mode is local. The layers are converted in ``setup``, before the strategy
    wraps or shards the model, so BatchNorm layers must exist after ``__init__`` (not only created in
    ``configure_model``). Checkpoints keep plain BatchNorm keys; :func:`revert_sync_batchnorm` gives back a
    plain model for export.

    Example::

        from lightning_dist.callbacks import MeshSyncBatchNorm

        trainer = Trainer(strategy="ddp", devices=4, callbacks=[MeshSyncBatchNorm()])
        # per node of 8 GPUs: MeshSyncBatchNorm(group_size=8)

    Do not combine with ``Trainer(sync_batchnorm=True)``.
    """

    def __init__(self, *, group_size: Optional[int] = None) -> None:
        if group_size is not None and (
            not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1
        ):
            raise ValueError(f"`group_size={group_size!r}` must be None (the whole dp group) or an integer >= 1.")
        self.group_size = group_size
        """Sync over groups of this many consecutive data-parallel ranks; None: the whole ``dp`` group."""
        self._group: Any = None
        self._warned = False

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Lightning reads `_layer_sync` to apply torch's SyncBatchNorm in `strategy.setup`; both would fight
        if getattr(trainer.strategy, "_layer_sync", None) is not None:
            raise ValueError(
                "MeshSyncBatchNorm converts BatchNorm itself: remove `sync_batchnorm=True` from the Trainer."
            )
        group, dp_size, _ = data_parallel_info(trainer.strategy)
        size = dp_size if self.group_size is None else self.group_size
        if dp_size % size:
            raise ValueError(
                f"MeshSyncBatchNorm(group_size={self.group_size}) does not divide the {dp_size} data-parallel"
                f" ranks; pick a divisor of {dp_size} (or None for all of them)."
            )
        if self._group is None and size > 1:
            self._group = group if size == dp_size else _partition_group(group, dp_size, size)
            if self._group is None:  # the world: make it explicit so the layers sync
                self._group = dist.group.WORLD
        convert_sync_batchnorm(pl_module, process_group=self._group)  # None (one rank): plain BatchNorm

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        plain = [
            n
            for n, m in pl_module.named_modules()
            if isinstance(m, _BatchNorm) and not isinstance(m, DataParallelBatchNorm)
        ]
        if plain:
            raise RuntimeError(
                f"MeshSyncBatchNorm: BatchNorm layers {plain[:5]} were created after `setup` (in"
                " `configure_model`?) and are not synced. Create them in `__init__`, or call"
                " `lightning_dist.callbacks.convert_sync_batchnorm(module, process_group=...)` in"
                " `configure_model` before sharding."
            )
        if not self._warned and not any(isinstance(m, _BatchNorm) for m in pl_module.modules()):
            self._warned = True  # once per callback, on rank 0: the same model on every rank
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            norms = sorted(
                {
                    type(m).__name__
                    for m in pl_module.modules()
                    if type(m).__name__.endswith("Norm") and not any(True for _ in m.children())
                }
            )
            rank_zero_warn(
                f"MeshSyncBatchNorm: {type(pl_module).__name__} has no BatchNorm layer, so there is nothing to"
                " synchronize"
                + (f" ({', '.join(norms)} normalize each sample alone and need no sync)" if norms else "")
                + ". Remove the callback, or add the BatchNorm layers in `__init__`."
            )
