"""What ``training_step`` / ``validation_step`` see of a pipelined network's output, and what the step returns.

Notes: docs/internals.md, "lightning_dist/parallelize/pipeline/output.py"."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

_ALLOWED = {
    Tensor.shape.__get__,
    Tensor.dtype.__get__,
    Tensor.device.__get__,
    Tensor.ndim.__get__,
    Tensor.size,
    Tensor.dim,
    Tensor.requires_grad.__get__,
    Tensor.is_floating_point,
    Tensor.__len__,
    Tensor.layout.__get__,
}


def refusal(owner: str, what: str, where: str) -> str:
    return (
        f"{owner} used the pipelined network's output ({what}) in {where}: under PipelineStrategy the output"
        " exists only on the last pipeline stage, one micro-batch at a time; every rank receives the loss as"
        " a scalar. Compute the loss with `loss = self.pipeline_loss(out, target)` (a HuggingFace model:"
        " `out = self.model(input_ids, labels=labels); loss = out.loss`) and put every other term on the"
        f" output into `{owner}.pipeline_loss(output, target)`; or pass `PipelineStrategy(broadcast_output=True)`"
        " to broadcast the whole output from the last stage to every pipeline rank each step (its bytes to"
        " each pp rank per step: at a language model's vocabulary, more than the pipeline itself)."
    )


class PipelineOutput(Tensor):
    """A stand-in for the pipelined network's output: its shape and dtype, no storage; refuses its values.

    ``owner`` names the LightningModule and ``where`` the step in the refusal; ``step`` identifies the network
    call it came from (a stand-in of an earlier call is not served).
    """

    owner: str
    where: str
    step: int

    @staticmethod
    def __new__(cls, shape: tuple, dtype: torch.dtype, device: torch.device, *, owner: str, where: str, step: int):
        out = Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        out.owner, out.where, out.step = owner, where, step
        return out

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return f"PipelineOutput(shape={tuple(self.shape)}, dtype={self.dtype}: held by the last pipeline stage)"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func in _ALLOWED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        from torch.utils._pytree import tree_leaves

        me = next(a for a in tree_leaves((args, kwargs or {})) if isinstance(a, PipelineOutput))
        name = getattr(func, "__name__", str(func))
        raise ValueError(refusal(me.owner, f"`{name}`", me.where))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        raise ValueError(refusal("The LightningModule", f"`{func}`", "a step"))


def loss_leaf(loss: Tensor) -> Tensor:
    """The batch loss as the step's leaf: ``backward`` finds, through it, how the returned loss used it."""
    return loss.detach().clone().requires_grad_()


def reached_leaves(loss: Tensor) -> set[int]:
    """The ids of the leaf tensors `loss`'s autograd graph reaches (its ``AccumulateGrad`` nodes' variables).

    ``backward`` asks ``autograd.grad`` for the returned loss's gradients on these only: a returned loss that is
    the pipeline's loss (scaled) reaches none of the parameters, and asking for all of them cost more than the
    rest of the step's own work on a small model (autograd builds an input edge for each). Written by hand: torch
    has no public "leaves of this graph" query.
    """
    # Node wrappers are made on demand and freed with their last reference, and a freed wrapper's id is reused by
    # the next one (torch 2.11 does: every node but the root looked seen, so no leaf was found): `seen` holds the
    # visited nodes themselves, which keeps their ids unique for the walk.
    seen: dict[int, Any] = {}
    leaves: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return leaves


def _fix(owner: str) -> str:
    return (
        f" Put every term that depends on the output into `{owner}.pipeline_loss(output, target)` (the mean loss"
        " of one micro-batch); terms on the parameters alone (weight penalties) may stay in training_step."
    )


def output_term_problem(owner: str) -> str:
    """The refusal of a returned loss whose gradient on the (broadcast) output differs from the schedule's."""
    return (
        f"{owner}.training_step returned a loss that uses the network's output differently from the mean of"
        " `pipeline_loss` over the micro-batches, which is all the pipeline schedule back-propagates through the"
        " stages (e.g. a scaled loss, or an extra term on the output): that part of its gradient would be lost."
        + _fix(owner)
    )


def returned_loss_problem(d_loss: Optional[Tensor | float], scale: float, owner: str) -> Optional[str]:
    """Why the returned loss cannot be served, from its gradient on the step's loss leaf (None: it can).

    The schedule back-propagated ``scale`` x the batch loss through the stages (``scale``: Lightning's
    ``1 / accumulate_grad_batches``); the returned loss must hold exactly that one copy of it. Every rank
    computes this from the same scalar with the same code: one verdict, no collective.
    """
    fix = _fix(owner)
    if d_loss is None:
        return (
            f"{owner}.training_step returned a loss that does not contain the pipeline's loss (the value of"
            " `self.pipeline_loss(out, target)` or HF's `out.loss`), whose gradient the schedule already"
            " back-propagated through the stages." + fix
        )
    got = float(d_loss)
    if abs(got - scale) > 1e-6 * abs(scale):
        return (
            f"{owner}.training_step returned a loss that uses the network's output differently from the mean of"
            f" `pipeline_loss` over the micro-batches (its gradient on that loss is {got / scale:g} x, not 1 x),"
            " which is all the pipeline schedule back-propagates through the stages (e.g. a scaled loss, or"
            " the loss used twice): that part of its gradient would be lost." + fix
        )
    return None


def check_target(served: Any, given: Any, owner: str) -> None:
    """``pipeline_loss(out, target)`` answers with the schedule's loss: only for the target the schedule used."""
    if given is served:
        return
    same = (
        isinstance(given, Tensor)
        and isinstance(served, Tensor)
        and given.shape == served.shape
        and torch.equal(given.to(served.device), served)
    )
    if not same:
        raise ValueError(
            f"{owner}.pipeline_loss(out, target) was called with a target other than the one the pipeline"
            " schedule computed the loss with (`pipeline_target(batch)`, by default `batch[1]`): define"
            f" `{owner}.pipeline_target(batch)` to return the target training_step passes."
        )


def serve_pipeline_loss(module: Any, serve: Callable[[Any, Any, Callable], Optional[Tensor]]) -> Optional[Callable]:
    """Route ``module.pipeline_loss`` through `serve` (one instance attribute); returns the original, or None.

    ``serve(output, target, original)`` returns the loss for the network call's output, or None for any
    other tensor (then the original computes it: a reference copy of the module, a plain tensor).
    """
    original = getattr(module, "pipeline_loss", None)
    if not callable(original):
        return None

    def pipeline_loss(output: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        served = serve(output, target, original) if not args and not kwargs else None
        return original(output, target, *args, **kwargs) if served is None else served

    pipeline_loss.__wrapped__ = original  # type: ignore[attr-defined]
    object.__setattr__(module, "pipeline_loss", pipeline_loss)
    return original


def unserve_pipeline_loss(module: Any, original: Optional[Callable]) -> None:
    """Undo :func:`serve_pipeline_loss` (the class's method again, or the instance attribute it replaced)."""
    current = module.__dict__.get("pipeline_loss")
    if current is None or getattr(current, "__wrapped__", None) is not original:
        return
    del module.__dict__["pipeline_loss"]
    if getattr(original, "__self__", None) is not module:  # an instance attribute of the user's (a lambda)
        object.__setattr__(module, "pipeline_loss", original)


__all__ = [
    "PipelineOutput",
    "check_target",
    "loss_leaf",
    "output_term_problem",
    "reached_leaves",
    "refusal",
    "returned_loss_problem",
    "serve_pipeline_loss",
    "unserve_pipeline_loss",
]
