"""transformers' router load-balancing loss taken over the global batch: one all-reduce of its statistics per step.

A HuggingFace mixture of experts (Qwen3-MoE, Mixtral, OLMoE, ...) adds ``router_aux_loss_coef * aux_loss`` to its loss,
with ``aux_loss = load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)`` computed on the tokens
of one forward. Under data parallelism each rank sees its own tokens, and the mean of the ranks' losses is not the loss
on the global batch (a product of two token means). :func:`global_router_loss` swaps, for the length of a step, the
function in the model's modeling module for one that reduces its per-expert sums over the data-parallel group
(:func:`lightning_dist.parallelize.moe.reduce_stats`) and then normalizes as one device would.

Reason: the loss is a module-level function that the model's forward looks up by name; transformers offers no hook.
Gate: :data:`lightning_dist._compat.TRANSFORMERS_MOE_TESTED`; and on first use in a process the decomposition is held
to the model's own function on the rank's tokens, so a modeling module whose loss is another formula is refused
instead of replaced. Test: ``tests/unit/test_integrations.py``, ``tests/distributed/test_moe.py``.

Also read, not patched: the experts implementation a module runs (:func:`experts_implementation`) and whether
transformers' grouped GEMM serves a dtype on a device (:func:`grouped_mm_refusal`, a probe), so that the strategies
refuse ``grouped_mm`` in float64 on CPU at set-up. Without the private function the probe answers None (no refusal).
Test: ``tests/unit/test_moe.py``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_dist._compat import TRANSFORMERS_MOE_TESTED, require_tested
from lightning_dist.parallelize.moe import reduce_stats, switch_loss

NAME = "load_balancing_loss_func"
_CHECKED: set[int] = set()  # ids of the original functions already held to the decomposition in this process


def router_loss_modules(model: nn.Module) -> list[Any]:
    """The transformers modeling modules of `model`'s classes that define the router load-balancing loss."""
    found = []
    for mod in model.modules():
        module = sys.modules.get(type(mod).__module__)
        name = getattr(module, "__name__", "")
        if name.startswith("transformers.") and callable(getattr(module, NAME, None)) and module not in found:
            found.append(module)
    return found


def router_loss_in_use(model: nn.Module) -> Optional[str]:
    """The class of the outermost module of `model` that adds a router load-balancing loss to its loss (a transformers
    mixture of experts with ``output_router_logits`` and a non-zero ``router_aux_loss_coef``), or None."""
    if not router_loss_modules(model):
        return None
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if getattr(cfg, "output_router_logits", False) and getattr(cfg, "router_aux_loss_coef", 0):
            return type(mod).__name__
    return None


def _stats(gate_logits: tuple, num_experts: int, top_k: int, attention_mask: Optional[Tensor]) -> tuple:
    """(selections per expert, router probability per expert, rows) summed over the layers, in float32 as
    transformers computes them."""
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer in gate_logits:
        weights = torch.nn.functional.softmax(layer.to(device), dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        row_mask = torch.ones(weights.shape[0], dtype=torch.float32, device=device) if mask is None else mask
        counts = counts + torch.zeros_like(counts).scatter_add_(
            0, selected.reshape(-1), row_mask.repeat_interleave(top_k)
        )
        probs = probs + (weights.float() * row_mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + row_mask.sum()
    return counts, probs, rows


def _global_loss(original: Callable, group: Any) -> Callable:
    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if gate_logits is None or not isinstance(gate_logits, tuple) or num_experts is None:
            return original(gate_logits, num_experts, top_k, attention_mask)
        counts, probs, rows = _stats(gate_logits, num_experts, top_k, attention_mask)
        if id(original) not in _CHECKED:
            _hold_to(original, switch_loss(counts, probs, rows), gate_logits, num_experts, top_k, attention_mask)
        return switch_loss(*reduce_stats(counts, probs, rows, group))

    return load_balancing_loss_func


def _hold_to(original: Callable, ours: Tensor, *args: Any) -> None:
    """The decomposition on this rank's tokens equals the model's own function, or RuntimeError (one process)."""
    with torch.no_grad():
        theirs = original(*args)
    if not isinstance(theirs, Tensor) or not torch.allclose(ours.detach().double(), theirs.double(), rtol=1e-5):
        raise RuntimeError(
            f"{original.__module__}.{NAME} is not the Switch-Transformer load-balancing loss lightning-dist reduces"
            f" over the data-parallel ranks (on this rank's tokens: {float(ours):.6g} vs the model's {theirs!r}). Pass"
            " moe_aux_loss='local' to the strategy to keep each rank's own auxiliary loss."
        )
    _CHECKED.add(id(original))


def experts_implementation(module: nn.Module) -> Optional[str]:
    """The experts implementation transformers runs `module` with (``"eager"``, ``"grouped_mm"``...), None for a module
    transformers does not dispatch."""
    # Reason: transformers keeps the choice in the config's underscore attribute (set by `experts_implementation=`)
    choice = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return choice if isinstance(choice, str) else None


@functools.lru_cache(maxsize=None)
def grouped_mm_refusal(dtype: torch.dtype, device: str) -> Optional[str]:
    """What transformers' grouped GEMM raises for `dtype` on `device` (None: it serves them): the function its
    ``grouped_mm`` experts call, run on a two-expert product of tiny inputs (it picks torch's kernel or its own loop
    by release and device, so the probe asks it rather than torch). None too when this transformers has no such
    function (nothing to refuse)."""
    # Reason: `_grouped_mm` is private; the public experts forward needs a whole experts module to run
    try:
        from transformers.integrations.moe import _grouped_mm
    except ImportError:
        return None
    x = torch.ones(4, 8, dtype=dtype, device=device)
    weight = torch.ones(2, 8, 8, dtype=dtype, device=device).transpose(-2, -1)  # [E, out, in], as experts hold it
    offsets = torch.tensor([2, 4], dtype=torch.int32, device=device)
    try:
        _grouped_mm(x, weight, offs=offsets)
    except (RuntimeError, NotImplementedError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def grouped_mm_problems(model: nn.Module, *, dtype: torch.dtype | None, device: torch.device) -> list[str]:
    """The experts modules of `model` that transformers runs with ``experts_implementation="grouped_mm"`` in a dtype or
    on a device torch's grouped GEMM does not serve (float64 on CPU), as one problem naming them and the fix.
    `dtype`: what the precision converts the model to (None: each module's own). One process, no collective."""
    from lightning_dist.parallelize.ep import find_experts

    refused: dict[tuple[torch.dtype, str], list[tuple[str, nn.Module]]] = {}
    for name, module in find_experts(model):
        if experts_implementation(module) != "grouped_mm":
            continue
        run_dtype = dtype if dtype is not None else next(module.parameters()).dtype
        why = grouped_mm_refusal(run_dtype, str(device))
        if why is not None:
            refused.setdefault((run_dtype, why), []).append((name, module))
    problems = []
    for (run_dtype, why), modules in refused.items():
        (first, module), more = modules[0], len(modules) - 1
        others = f" and {more} more experts module{'s' if more > 1 else ''}" if more else ""
        problems.append(
            f"{first} ({type(module).__name__}){others} run transformers' experts_implementation='grouped_mm', which"
            f" torch does not serve in {run_dtype} on {device.type} ({why}). Load the model with"
            ' experts_implementation="eager" (from_pretrained(..., experts_implementation="eager") or in its config;'
            ' model.set_experts_implementation("eager") on a built one): each expert then runs its own matmuls.'
        )
    return problems


@contextlib.contextmanager
def global_router_loss(model: nn.Module, group: Any) -> Iterator[list[str]]:
    """For the length of the block, `model`'s router load-balancing loss is the one of the global batch over `group`
    (the data-parallel ranks, cp included). Yields the modeling modules it swapped the function in."""
    modules = router_loss_modules(model)
    if not modules:
        yield []
        return
    require_tested("transformers", TRANSFORMERS_MOE_TESTED, patch="global router load-balancing loss")
    originals = [getattr(m, NAME) for m in modules]
    try:
        for module, original in zip(modules, originals):
            setattr(module, NAME, _global_loss(original, group))
        yield [m.__name__ for m in modules]
    finally:
        for module, original in zip(modules, originals):
            setattr(module, NAME, original)


__all__ = [
    "experts_implementation",
    "global_router_loss",
    "grouped_mm_problems",
    "grouped_mm_refusal",
    "router_loss_in_use",
    "router_loss_modules",
]
