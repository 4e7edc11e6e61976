"""A transformers mixture of experts' router load-balancing loss under a pipeline: its router layers report to
:class:`~lightning_dist.parallelize.moe.StagedRouterLoss` through forward hooks.

Reason: the model computes that loss inside its own forward from every layer's router logits at once, which no
pipeline stage holds; transformers names its router modules only in the private ``_can_record_outputs``
(``"router_logits": OutputRecorder(<router class>, index=<the logits' place in its output>)``). The hooks read each
router's logits (the statistics of :func:`transformers_moe._stats`, the padding mask of the micro-batch the stage
runs) and join the micro-batch's share of the loss to the output of the module holding the router (the experts
block: the router's logits themselves feed only transformers' recorder, not the stage's output).
Gate: :data:`lightning_dist._compat.TRANSFORMERS_MOE_TESTED`; on the first counting call the statistics are held to the
model's own ``load_balancing_loss_func`` (as :func:`transformers_moe.global_router_loss` does). Test:
``tests/distributed/test_moe.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor, nn

from lightning_dist._compat import TRANSFORMERS_MOE_TESTED, require_tested
from lightning_dist._integrations.transformers_moe import (
    _CHECKED,
    NAME,
    _hold_to,
    _stats,
    router_loss_in_use,
    router_loss_modules,
)
from lightning_dist.parallelize.moe import RouterStats, join_loss, staged_router_loss, switch_loss


@dataclass(frozen=True)
class RouterLossSpec:
    """What a transformers model's router loss needs: its experts, top-k, coefficient and router layers."""

    num_experts: int
    top_k: int
    coef: float
    router: type
    """The router modules' class (transformers records their output ``index`` as the router logits)."""
    index: int
    count: int
    """Router modules in the whole model."""


def router_loss_spec(model: nn.Module) -> Optional[RouterLossSpec]:
    """The spec of `model`'s router loss when it adds one (:func:`router_loss_in_use`) and its routers can be found,
    else None."""
    if router_loss_in_use(model) is None:
        return None
    owner = next((m for m in model.modules() if hasattr(m, "router_aux_loss_coef")), None)
    recorder = None
    for mod in model.modules():
        # Reason: transformers' private map of the outputs its hooks record
        recorder = (getattr(type(mod), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            break
    target = getattr(recorder, "target_class", None)
    experts, top_k = getattr(owner, "num_experts", None), getattr(owner, "num_experts_per_tok", None)
    if owner is None or not isinstance(target, type) or not isinstance(experts, int) or not isinstance(top_k, int):
        return None
    index = int(getattr(recorder, "index", 0) or 0)
    count = sum(isinstance(m, target) for m in model.modules())
    return RouterLossSpec(experts, top_k, float(owner.router_aux_loss_coef), target, index, count) if count else None


class StageRouterHooks:
    """Forward hooks on a pipeline stage's router modules (those of the spec's class it holds) and their parents,
    active only inside a :class:`StagedRouterLoss` pass; the stage's pre-hook notes the micro-batch's mask."""

    def __init__(self, stage: nn.Module, spec: RouterLossSpec, loss_fn: Any) -> None:
        require_tested("transformers", TRANSFORMERS_MOE_TESTED, patch="the router loss of a pipeline stage")
        self.spec, self.loss_fn, self.mask = spec, loss_fn, None
        self.pending: dict[int, Tensor] = {}
        self.last: Optional[tuple] = None  # the last counted call's logits and mask (for `hold`)
        held = dict(stage.named_modules())
        self.handles = [stage.register_forward_pre_hook(self._note_mask, with_kwargs=True)]
        self.routers = 0
        for name, router in held.items():
            if not isinstance(router, spec.router):
                continue
            parent = held[name.rpartition(".")[0]] if "." in name else stage
            self.handles.append(router.register_forward_hook(self._router_hook(spec.index, parent)))
            self.handles.append(parent.register_forward_hook(self._parent_hook))
            self.routers += 1

    def _note_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.mask = kwargs.get("attention_mask")

    def _router_hook(self, index: int, parent: nn.Module) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            staged = staged_router_loss()
            if staged is None:
                return
            logits = output[index] if isinstance(output, (tuple, list)) else output
            logits = logits.reshape(-1, logits.shape[-1])
            mask = self.mask if self.mask is not None and self.mask.numel() == logits.shape[0] else None
            counts, probs, rows = _stats((logits,), self.spec.num_experts, self.spec.top_k, mask)
            if staged.mode == "count":
                self.last = (logits.detach(), mask, switch_loss(counts, probs, rows).detach())
            share = staged.take(module, RouterStats(counts, probs, rows))
            if share is not None:
                self.pending[id(parent)] = share

        return hook

    def _parent_hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        share = self.pending.pop(id(module), None)
        if share is None:
            return None
        if isinstance(output, Tensor):
            return join_loss(output, share)
        first = next(i for i, o in enumerate(output) if isinstance(o, Tensor) and o.is_floating_point())
        return type(output)((join_loss(o, share) if i == first else o) for i, o in enumerate(output))

    def hold(self) -> None:
        """After a counting pass (once per process): its last call's statistics give the model's own loss function's
        value on those logits, or RuntimeError (another formula: the pack cannot split it over the stages)."""
        last, self.last = self.last, None
        if last is None or id(self.loss_fn) in _CHECKED or _is_fake(last[0]):
            return
        logits, mask, ours = last
        _hold_to(self.loss_fn, ours, (logits,), self.spec.num_experts, self.spec.top_k, mask)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def original_loss_function(model: nn.Module) -> Any:
    """The model's own ``load_balancing_loss_func`` (the first modeling module that defines it)."""
    return getattr(router_loss_modules(model)[0], NAME)


__all__ = ["RouterLossSpec", "StageRouterHooks", "original_loss_function", "router_loss_spec"]
