"""Subclasses of torch's ``MemTracker`` / ``ModTracker`` (private :mod:`torch.distributed._tools`) for a step.

One tracker serves the dry run (fake tensors on a fake process group) and
:class:`~lightning_dist.callbacks.MemoryReport`'s ``track_step`` (a real step), so the two peaks are the same
measurement of the same code path. On a torch release outside
:data:`~lightning_dist._compat.TORCH_PIPELINING_TESTED` :func:`step_tracker` raises a ``RuntimeError`` naming
the release and the fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_UNFAKED_BLOCKS = [0]  # depth of `counted_outside_fake_mode` blocks


@contextlib.contextmanager
def counted_outside_fake_mode() -> Iterator[None]:
    """A block run with the fake mode unset (``unset_fake_temporarily``: the dry run's experts forward, whose index
    tensors must hold values) whose ops :func:`step_tracker`'s tracker still counts: torch 2.13+'s MemTracker skips
    every op run under another fake mode than the one it was entered in (DTensor's sharding propagation), and there
    none is."""
    _UNFAKED_BLOCKS[0] += 1
    try:
        yield
    finally:
        _UNFAKED_BLOCKS[0] -= 1


def step_tracker() -> Any:
    """A fresh ``MemTracker`` for one step of any strategy (pipelined steps included); enter it around
    ``training_step`` + ``backward``, after ``track_external(model, *optimizers)``.

    Reasons for the two overrides (upstream: no issue found):

    - torch's ModTracker resets the modules in progress to none ("Global") at the end of each backward; a
      pipeline schedule runs its backwards inside the network's forward (inside ``training_step``), so the end
      of a backward goes back to the modules in progress when it started;
    - no backward hook on inputs that are autograd leaves (a stage's received activation): torch's multi-grad
      hooks refuse leaves under ``autograd.grad(inputs=...)``, which zero-bubble schedules call for the input
      gradients;
    - a pipelined network's output on a rank is a stand-in with no storage (its class marked ``storage_free``:
      :class:`~lightning_dist.strategies.pipeline.step.PipelineOutput`): nothing held;
    - no optimizer-step hooks: the tracked window ends before any optimizer step, and Lightning's automatic
      optimization runs ``training_step`` + ``backward`` as the closure inside ``optimizer.step``, whose pre-hook
      would file every tensor of the step as optimizer state;
    - the ops of a :func:`counted_outside_fake_mode` block are counted: torch 2.13+ compares the active fake mode with
      ``_fake_mode_on_entry`` (the one it was entered in) and skips the op where they differ.
    """
    from lightning_dist._compat import check_torch_internals

    check_torch_internals("step_tracker (MemTracker / ModTracker subclasses)")
    from torch._guards import active_fake_mode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

    class Modules(ModTracker):
        def _maybe_set_engine_callback(self) -> None:
            if self._has_callback:
                return
            outer = set(self.parents)
            super()._maybe_set_engine_callback()

            def restore() -> None:
                self.parents = set(outer)

            torch.autograd.Variable._execution_engine.queue_callback(restore)

        def _fw_pre_hook(self, mod: Any, input: Any) -> None:
            args, spec = tree_flatten(input)
            leaf = [isinstance(a, torch.Tensor) and a.requires_grad and a.grad_fn is None for a in args]
            if any(leaf):
                input = tree_unflatten([a.detach() if x else a for a, x in zip(args, leaf)], spec)
            super()._fw_pre_hook(mod, input)

    class Tracker(MemTracker):
        _entry_fake_mode: Any = None

        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = Modules()

        # Reason: torch's private `_fake_mode_on_entry` (2.13+; earlier releases count every op): inside a counted
        # block the active mode (none) stands in for it
        @property
        def _fake_mode_on_entry(self) -> Any:
            return active_fake_mode() if _UNFAKED_BLOCKS[0] else self._entry_fake_mode

        @_fake_mode_on_entry.setter
        def _fake_mode_on_entry(self, mode: Any) -> None:
            self._entry_fake_mode = mode

        def _register_global_optimizer_hook(self) -> None:
            self._optimizer_hook_handles = None

        def _track_inputs_or_outputs(self, args: Any) -> int:
            stand_ins = lambda t: None if getattr(type(t), "storage_free", False) else t  # noqa: E731
            return super()._track_inputs_or_outputs(tree_map_only(torch.Tensor, stand_ins, args))

    return Tracker()


def peak_figures(tracker: Any) -> dict[str, Any]:
    """The tracker's peak snapshot as the dry run reports it: ``peak_total_bytes``, ``peak_activation_bytes``
    (activations saved for backward and the temporaries live with them at the peak) and ``peak_breakdown``
    (bytes per MemTracker category: Parameter, Gradient, Activation, Temp, Optstate, Buffer, Input)."""
    peak = tracker.get_tracker_snapshot("peak")
    dev = next(iter(peak.values())) if peak else {}
    cat = {str(getattr(k, "value", k)): int(v) for k, v in dev.items()}
    return {
        "peak_total_bytes": cat.get("Total", 0),
        "peak_activation_bytes": cat.get("Activation", 0) + cat.get("Temp", 0),
        "peak_breakdown": cat,
    }


__all__ = ["counted_outside_fake_mode", "peak_figures", "step_tracker"]
