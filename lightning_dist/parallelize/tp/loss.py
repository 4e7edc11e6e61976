"""Loss parallelism: the output head's logits stay sharded on the vocabulary, the loss is torch's ``loss_parallel``.

Notes: docs/internals.md, "lightning_dist/parallelize/tp/loss.py"."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

# what loss_parallel computes on vocabulary-sharded logits (torch's custom ops: log_softmax and nll_loss)
_LOSSES = {F.cross_entropy, F.nll_loss}
_LOG_SOFTMAX = {F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax}  # still sharded: nll_loss follows
# layout-only functions of the logits: their results are followed like the logits themselves
_LAYOUT = {torch.reshape, torch.flatten, torch.transpose} | {
    getattr(torch.Tensor, name)
    for name in "view reshape flatten float double to contiguous __getitem__ transpose permute squeeze unsqueeze"
    " type_as narrow".split()
}
# reading metadata or detaching (logging, metrics outside the loss): no compute on the sharded values
_NEUTRAL = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like} | {
    getattr(torch.Tensor, name) for name in "size dim detach requires_grad_ register_hook retain_grad".split()
}


def _name(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    if getattr(func, "__objclass__", None) is not None or "Tensor" in getattr(func, "__qualname__", "").split(".")[0]:
        return f"Tensor.{name}"
    return f"F.{name}" if getattr(func, "__module__", "") == "torch.nn.functional" else f"torch.{name}"


class LogitsGuard(TorchFunctionMode):
    """Refuses any use of the vocabulary-sharded logits other than the cross-entropy loss (see the module)."""

    def __init__(self, head: str) -> None:
        super().__init__()
        self.head = head
        self.followed: list[torch.Tensor] = []  # held, so their ids stay unique while the step runs
        self.served = False

    def follow(self, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor):
            self.followed.append(tensor)

    def _is_followed(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and any(value is t for t in self.followed)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        neutral = getattr(func, "__name__", "") == "__get__" or func in _NEUTRAL  # attribute reads (.shape, .device)
        if neutral or not any(self._is_followed(a) for a in tree_flatten((args, kwargs))[0]):
            return func(*args, **kwargs)
        if func not in _LAYOUT and func not in _LOG_SOFTMAX and func not in _LOSSES:  # refused before it runs
            raise ValueError(
                f"loss_parallel=True keeps the logits of {self.head!r} sharded on the vocabulary, and torch's"
                f" loss_parallel computes only cross-entropy on them; training_step used them in {_name(func)}. Compute"
                " the loss with F.cross_entropy (or nn.CrossEntropyLoss) on the logits and class-index targets, or pass"
                " loss_parallel=False (the default: the head's logits are all-gathered and any loss works)."
            )
        out = func(*args, **kwargs)
        if func in _LOSSES:
            self.served = True
            # the replicated loss as a plain tensor (its gradient flows back into the DTensor graph): logging it and
            # adding plain terms work as without loss_parallel
            if isinstance(out, DTensor) and all(p.is_replicate() for p in out.placements):
                out = out.to_local()
        else:
            self.follow(out)
        return out


@contextlib.contextmanager
def loss_parallel_step(head: nn.Module | None, guard: LogitsGuard | None) -> Iterator[None]:
    """torch's ``loss_parallel`` around a step; with `guard`, the logits of `head` are checked from its output on."""
    from torch.distributed.tensor.parallel import loss_parallel

    handle, entered = None, []
    if guard is not None and head is not None:

        def start(module: nn.Module, args: Any, out: Any) -> None:
            guard.follow(out)
            if not entered:  # from the head on: the compiled blocks before it never trace under the mode
                guard.__enter__()
                entered.append(True)

        handle = head.register_forward_hook(start)
    context = loss_parallel()
    context.__enter__()
    try:
        yield
    finally:
        context.__exit__(None, None, None)  # torch's context does not turn its ops off when the step raises
        if handle is not None:
            handle.remove()
        if entered:
            guard.__exit__(None, None, None)
        guard is not None and guard.followed.clear()


def head_entry(entries: Sequence[Any]) -> Any:
    """The plan's one ``colwise_gather`` entry (the output head) that ``loss_parallel=True`` keeps sharded.

    Raises ValueError when the plan has none or several (the whole plan is listed in the message)."""
    heads = [e for e in entries if e.active and e.style == "colwise_gather"]
    if len(heads) != 1:
        listed = ", ".join(f"{e.fqn}: {e.style}" for e in entries if e.active) or "(empty)"
        raise ValueError(
            "loss_parallel=True keeps the output head's logits sharded on the vocabulary: the tensor-parallel plan"
            f" must give exactly one layer, the output head, style 'colwise_gather'; it has {len(heads)}"
            f" ({[e.fqn for e in heads]}). Plan: {listed}. Give only the head 'colwise_gather', or pass"
            " loss_parallel=False."
        )
    return heads[0]


__all__ = ["LogitsGuard", "head_entry", "loss_parallel_step"]
