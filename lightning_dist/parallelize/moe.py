"""The router load-balancing loss of a mixture of experts, over the global batch under data parallelism.

Notes: docs/internals.md, "lightning_dist/parallelize/moe.py"."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("lightning_dist_moe_group", default=None)


@dataclass(frozen=True)
class RouterStats:
    """One forward's routing, summed over its tokens."""

    counts: Tensor
    """Token choices per expert ``[E]`` (no gradient)."""
    probs: Tensor
    """Router probability per expert, summed over the tokens ``[E]`` (graded)."""
    rows: Tensor
    """Number of tokens (a scalar)."""

    @staticmethod
    def of(chosen: Tensor, probs: Tensor, n_experts: int) -> RouterStats:
        """From the chosen experts ``[N, k]`` and the per-expert probabilities ``[N, E]`` of `N` tokens."""
        idx = chosen.reshape(-1)
        # bincount as an index_add: its size is known before the values (fake tensors have none: the dry run)
        counts = torch.zeros(n_experts, dtype=idx.dtype, device=idx.device).index_add_(0, idx, torch.ones_like(idx))
        counts = counts.to(probs.dtype)
        return RouterStats(counts, probs.sum(0), torch.tensor(float(probs.shape[0]), dtype=probs.dtype))


# Differentiable collectives for the routing. torch's public ones (torch.distributed.nn.functional) are deprecated
# in favour of a private module; these two need only the public c10d calls.
class _AllReduceSum(torch.autograd.Function):
    """Sum over `group`; the gradient of each rank's input is the sum of every rank's output gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        out = x.clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of the rows of `x` (uneven splits); the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, recv: list, send: list, group: Any) -> Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        torch.distributed.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        torch.distributed.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def all_reduce_sum(x: Tensor, group: Any) -> Tensor:
    """`x` summed over `group`, differentiable."""
    return _AllReduceSum.apply(x, group)


def all_to_all(x: Tensor, recv: list[int], send: list[int], group: Any) -> Tensor:
    """The rows of `x` exchanged over `group` (`send[i]` rows to rank i, `recv[i]` from it), differentiable."""
    return _AllToAll.apply(x, recv, send, group)


def reduce_stats(counts: Tensor, probs: Tensor, rows: Tensor, group: Any) -> tuple[Tensor, Tensor, Tensor]:
    """The statistics summed over `group` (None: as they are): counts and rows in one all-reduce, the
    probabilities in a differentiable one (its backward sums every rank's gradient)."""
    if group is None:
        return counts, probs, rows
    numbers = torch.cat([counts.detach(), rows.detach().reshape(1).to(counts)])
    torch.distributed.all_reduce(numbers, group=group)
    return numbers[:-1], all_reduce_sum(probs, group), numbers[-1]


def switch_loss(counts: Tensor, probs: Tensor, rows: Tensor) -> Tensor:
    """``E * sum_e (counts_e / rows) * (probs_e / rows)``."""
    return torch.sum((counts / rows) * (probs / rows)) * counts.numel()


def balance_loss(stats: RouterStats) -> Tensor:
    """The load-balancing loss of `stats`, over the global batch when a step runs under :func:`global_balance_loss`."""
    counts, probs, rows = reduce_stats(stats.counts, stats.probs, stats.rows, _GROUP.get())
    return switch_loss(counts, probs, rows.to(probs.device))


@contextlib.contextmanager
def global_balance_loss(group: Any) -> Iterator[None]:
    """:func:`balance_loss` reduces over `group` (the data-parallel ranks, cp included) inside the block."""
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


__all__ = [
    "RouterStats",
    "all_reduce_sum",
    "all_to_all",
    "balance_loss",
    "global_balance_loss",
    "reduce_stats",
    "switch_loss",
]
