"""The router load-balancing loss of a mixture of experts, over the global batch under data parallelism and, split
over a pipeline's stages and micro-batches, under any schedule (:class:`StagedRouterLoss`).

Notes: docs/internals.md, "lightning_dist/parallelize/moe.py"; docs/moe.md."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("lightning_dist_moe_group", default=None)
_STAGED: contextvars.ContextVar[Optional[StagedRouterLoss]] = contextvars.ContextVar(
    "lightning_dist_moe_staged", default=None
)
ROUTER_LOSS_MARK = "pipelined_router_loss"


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


def _row_bounds(n: int, group: Any) -> tuple[list[int], int]:
    """(rows per rank of `group` when `n` rows are split as ``torch.tensor_split`` does, this rank's first row)."""
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    sizes = [n // size + (r < n % size) for r in range(size)]
    return sizes, sum(sizes[:rank])


def _gather_rows(x: Tensor, sizes: list[int], group: Any) -> Tensor:
    """Every rank's rows of `x` (`sizes[r]` rows on rank r) in rank order, padded to one size for the all-gather."""
    most = max(sizes)
    padded = x if x.shape[0] == most else torch.cat([x, x.new_zeros(most - x.shape[0], *x.shape[1:])])
    parts = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


class _OwnRows(torch.autograd.Function):
    """This rank's share of rows that every rank of `group` holds alike; the backward gathers every rank's gradient
    of its share, so each rank's input gradient is whole, as a tensor held alike must have."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        ctx.sizes, start = _row_bounds(x.shape[0], group)
        return x[start : start + ctx.sizes[torch.distributed.get_rank(group)]].clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return _gather_rows(grad, ctx.sizes, ctx.group), None


class _AllRows(torch.autograd.Function):
    """Every rank's rows (the inverse of :class:`_OwnRows`); the backward keeps this rank's share of a gradient held
    alike on every rank of `group`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, n: int, group: Any) -> Tensor:
        ctx.sizes, ctx.start = _row_bounds(n, group)
        ctx.rows = x.shape[0]
        return _gather_rows(x, ctx.sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return grad[ctx.start : ctx.start + ctx.rows].contiguous(), None, None


def own_rows(x: Tensor, group: Any) -> Tensor:
    """This rank's share of the rows of `x`, held alike on every rank of `group` (differentiable, see ``_OwnRows``)."""
    return _OwnRows.apply(x, group)


def all_rows(x: Tensor, n: int, group: Any) -> Tensor:
    """The `n` rows whose shares the ranks of `group` hold (differentiable, see ``_AllRows``)."""
    return _AllRows.apply(x, n, group)


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


def router_loss(method: Callable) -> Callable:
    """Marks a network's method that returns its router load-balancing loss from the last forward's
    :class:`RouterStats` (``MoEGPT.aux_loss``): under a pipeline the strategy answers it with the loss of the global
    batch (:class:`StagedRouterLoss`)."""
    setattr(method, ROUTER_LOSS_MARK, True)
    return method


def router_loss_methods(net: nn.Module) -> list[str]:
    """The names of `net`'s methods marked by :func:`router_loss`."""
    cls = type(net)
    return [n for n in dir(cls) if not n.startswith("_") and getattr(getattr(cls, n, None), ROUTER_LOSS_MARK, False)]


class _AddLoss(torch.autograd.Function):
    """`out` unchanged; its backward also gives `loss` the gradient 1 (the loss joins the backward of `out`)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, loss: Tensor) -> Tensor:
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        shape, dtype, device = ctx.loss_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


def routed(module: nn.Module, out: Tensor, stats: RouterStats) -> Tensor:
    """What a router layer returns: `out`, plus, inside :class:`StagedRouterLoss`'s passes, `stats` counted (the
    counting pass) or this micro-batch's share of the global loss joined to the backward of `out` (training)."""
    staged = _STAGED.get()
    if staged is None:
        return out
    share = staged.take(module, stats)
    return out if share is None else join_loss(out, share)


def join_loss(out: Tensor, loss: Tensor) -> Tensor:
    """`out` unchanged, its backward also giving `loss` the gradient 1."""
    return _AddLoss.apply(out, loss)


def staged_router_loss() -> Optional[StagedRouterLoss]:
    """The :class:`StagedRouterLoss` whose pass is running (None outside them)."""
    return _STAGED.get()


@dataclass(eq=False)
class StagedRouterLoss:
    """The router load-balancing loss of a pipelined network over the global batch, exact under any schedule.

    ``sum_e f_e P_e`` multiplies two sums over every token, and 1F1B back-propagates a micro-batch before the later
    ones ran forward. So :meth:`counting` runs a forward-only pass that sums each layer's choices and probabilities
    (:meth:`reduce`: over the data-parallel ranks, the value over the pp ranks); in the training pass
    (:meth:`attaching`) each micro-batch adds ``weight * E * sum_e C_e p_e / N^2`` with the counted ``C``, ``N``
    fixed, which is linear in its probabilities: the micro-batches' gradients add up to the global loss's.

    `joint_experts` > 0: one loss over every router layer of the network together (transformers' formula: the
    statistics summed over the layers before the product, so over the pp ranks too), of that many experts; else one
    loss per layer, summed (the pack's ``MoEGPT``)."""

    joint_experts: int = 0
    mode: str = ""  # "count" | "attach" | ""
    layers: list = field(default_factory=list)  # [module, [[counts, probs, rows] per call]] in first-call order
    calls: int = 0  # the counting pass's micro-batches
    weight: Optional[Tensor] = None
    totals: dict = field(default_factory=dict)  # id(module) -> (counts, rows) of the global batch

    @contextlib.contextmanager
    def _active(self, mode: str) -> Iterator[None]:
        self.mode, token = mode, _STAGED.set(self)
        try:
            yield
        finally:
            _STAGED.reset(token)
            self.mode = ""

    def counting(self, n_microbatches: int) -> contextlib.AbstractContextManager:
        """The forward-only pass: each router layer's counts, probabilities and rows summed over the last
        `n_microbatches` calls (a new schedule's metadata inference calls each stage once more before them)."""
        self.layers, self.totals, self.calls = [], {}, n_microbatches
        return self._active("count")

    def attaching(self, weight: Tensor) -> contextlib.AbstractContextManager:
        """The training pass: each micro-batch's share of `weight` x the loss joins its backward."""
        self.weight = weight
        return self._active("attach")

    def take(self, module: nn.Module, stats: RouterStats) -> Optional[Tensor]:
        """Counting: `stats` noted for `module` (None). Training: this micro-batch's share of the loss, which must
        join the backward of the layer's output (None outside the passes)."""
        if self.mode == "count":
            row = next((r for r in self.layers if r[0] is module), None)
            if row is None:
                self.layers.append(row := [module, []])
            # summed in float64: a count held in bfloat16 is exact only up to 256
            values = (stats.counts, stats.probs, stats.rows)
            row[1].append([t.detach().to(device=stats.probs.device, dtype=torch.float64) for t in values])
            return None
        if self.mode != "attach" or self.weight is None:
            return None
        key = "joint" if self.joint_experts else id(module)
        if key not in self.totals or (self.joint_experts and not any(r[0] is module for r in self.layers)):
            raise RuntimeError(
                f"The router layer {type(module).__name__} ran in the training pass but not in the counting pass"
                " before it: the pipelined network's forward must call the same router layers in both."
            )
        counts, rows = (t.to(stats.probs) for t in self.totals[key])
        # the loss's own arithmetic (transformers' order, in the probabilities' dtype): the gradient rounds the same
        return self.weight.to(stats.probs) * switch_loss(counts, stats.probs, rows)

    def reduce(self, dp_group: Any, pp_group: Any, device: Any) -> Tensor:
        """After :meth:`counting`: the counts summed over `dp_group` (one all-reduce) are fixed for the training pass;
        returns the loss of the global batch over the layers of every pp rank (one more all-reduce), in float64 on
        `device` (a stage may hold no router layer)."""
        sums = [[sum(x) for x in zip(*calls[-self.calls :])] for _, calls in self.layers]
        if self.joint_experts:  # one set of statistics over the layers (none held: zeros, the others' still count)
            n = self.joint_experts
            zero = torch.zeros(n, dtype=torch.float64, device=device)
            sums = [[sum(x) for x in zip(*sums)]] if sums else [[zero, zero, zero.new_zeros(())]]
        flat = torch.cat([torch.cat([c, p, r.reshape(1)]) for c, p, r in sums] or [torch.zeros(0, device=device)])
        flat = flat.to(device=device, dtype=torch.float64)
        if dp_group is not None and flat.numel():
            torch.distributed.all_reduce(flat, group=dp_group)
        value = torch.zeros((), dtype=torch.float64, device=device)
        if self.joint_experts:  # the statistics over every stage's layers; the same loss on every rank
            if pp_group is not None:
                torch.distributed.all_reduce(flat, group=pp_group)
            n = self.joint_experts
            self.totals["joint"] = (flat[:n], flat[-1])
            return switch_loss(flat[:n], flat[n : 2 * n], flat[-1])
        for (module, _), part in zip(self.layers, flat.split([2 * c.numel() + 1 for c, _, _ in sums])):
            n = (part.numel() - 1) // 2
            c, p, r = part[:n], part[n : 2 * n], part[-1]
            self.totals[id(module)] = (c, r)
            value = value + switch_loss(c, p, r)
        if pp_group is not None:
            torch.distributed.all_reduce(value, group=pp_group)
        return value


__all__ = [
    "ROUTER_LOSS_MARK",
    "RouterStats",
    "StagedRouterLoss",
    "all_reduce_sum",
    "all_rows",
    "all_to_all",
    "balance_loss",
    "global_balance_loss",
    "join_loss",
    "own_rows",
    "reduce_stats",
    "routed",
    "router_loss",
    "router_loss_methods",
    "staged_router_loss",
    "switch_loss",
]
