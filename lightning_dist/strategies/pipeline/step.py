"""One step of :class:`~lightning_dist.strategies.PipelineStrategy`: the network call and its gradients.

Notes: docs/internals.md, "lightning_dist/strategies/pipeline/step.py"."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_dist.mesh import PP
from lightning_dist.parallelize.cp import shift_labels
from lightning_dist.parallelize.cp_probe import evaluating, module_names
from lightning_dist.parallelize.pipeline.hf import hf_labels_loss, labelled_tokens
from lightning_dist.parallelize.pipeline.output import (
    PipelineOutput,
    check_target,
    loss_leaf,
    output_term_problem,
    reached_leaves,
    returned_loss_problem,
)
from lightning_dist.parallelize.pipeline.schedule import returned_loss_gradients
from lightning_dist.parallelize.pipeline.tied import sum_tied_gradients
from lightning_dist.strategies.pipeline.setup import first_batch_problem


class NetworkCall(NamedTuple):
    """One network call, for ``pipeline_loss`` and ``backward``: what the step saw, the last stage's output
    (evaluation, on its rank), the batch loss (a leaf in training), the schedule's target, training or not."""

    out: Any
    local: Optional[Tensor]
    loss: Optional[Tensor]
    target: Any
    train: bool
    loss_fn: Any = None  # the schedule's per-micro-batch loss and micro-batch count (the opt-in's direct-use check)
    m: int = 1


class PipelineStep:
    """The state of one step of `strategy` (a :class:`~lightning_dist.strategies.pipeline.strategy.PipelineStrategy`).

    ``training=True`` (made by ``training_step``): the first network call runs forward and backward, its
    gradients are held aside (``grads``) until :meth:`backward` adds them to ``.grad``. Otherwise (evaluation
    steps, a network call outside any step) every call runs forward only. ``call`` is the step's last
    network call, the one ``pipeline_loss(out, target)`` answers for.

    It reads the strategy's set-up (the runner, tied weights, options) and writes the strategy's records
    of finished steps (``last_loss``, ``timelines``, the count of network calls).
    """

    def __init__(self, strategy: Any, batch: Any = None, *, training: bool = False, values: bool = True) -> None:
        self.strategy = strategy
        self.batch = batch
        self.values = (
            values  # False: fake tensors (the dry run), the returned loss checked for the pipeline's loss only
        )
        self.pending = training  # training_step runs and has not called the network yet
        self.call: Optional[NetworkCall] = None
        self.grads: Optional[list[tuple[Tensor, Optional[Tensor]]]] = None  # the schedule's, until backward

    # ---- the network call ----------------------------------------------------------------------
    def run(self, args: tuple, kwargs: dict) -> Any:
        """The pipelined network's call: the whole schedule; returns what every pp rank sees of the output."""
        strategy = self.strategy
        x, extra, labels = strategy.split.layout.call_inputs(args, kwargs)
        module = strategy.lightning_module
        train = self.pending and torch.is_grad_enabled() and module.training
        m, batch = strategy.n_microbatches, x.shape[0]
        if batch % m:
            if train:
                raise ValueError(
                    f"The batch of {batch} samples does not divide into n_microbatches={m} micro-batches;"
                    f" use a batch size (per data-parallel rank) that is a multiple of {m}."
                )
            m = max(d for d in range(1, m + 1) if batch % d == 0)  # forward-only programs take any count
        runner = strategy._runner
        assert runner is not None
        if strategy._unsplit is not None:  # once: the staged forward against the unsplit copy (one verdict for all)
            unsplit, strategy._unsplit = strategy._unsplit, None
            problem = first_batch_problem(unsplit, x[: batch // m], strategy.root_device)
            if problem is not None:
                raise ValueError(problem)
        cp, count, given = strategy._cp, None, None
        if cp is not None:  # each sequence cut to this rank's chunks before the micro-batch split (dim 0)
            x, extra, labels, count = cut_for_cp(cp, x, extra, labels)
        target, loss_fn = None, None
        if train:
            given, loss_fn = self._loss_of_step(labels, m, count)
            # the schedule's target: the chunks matching this rank's part of the sequences (HF labels: cut above)
            target = cut_target(cp, given, type(module).__name__) if cp is not None and count is None else given
        params = runner.params  # the schedule accumulates gradients into these only
        if train:  # the schedule's gradients go aside; `backward` adds them to .grad
            held = [p.grad for p in params]
            for p in params:
                p.grad = None
        events: Optional[list] = [] if strategy.record_timeline and train else None
        shows = self._shows_values()
        # every stage's attention under context parallelism's mode (its checkpointed blocks recompute under it too)
        with cp.active() if cp is not None else contextlib.nullcontext():
            out, loss, record = runner.step(
                x,
                n_microbatches=m,
                loss_fn=loss_fn,
                target=target,
                timeline=events,
                kwargs=extra,
                keep_output=shows,  # else the step sees a stand-in: no output values kept
            )
        if train:
            sum_tied_gradients(strategy._tied)
            self.pending = False
            self.grads = [(p, p.grad) for p in params]
            for p, g in zip(params, held):
                p.grad = g
            strategy.last_loss = loss
            loss = loss_leaf(loss)  # `backward` reads through it how the returned loss used it
            if events is not None:
                mesh = strategy.mesh
                rank = mesh.local_rank(PP) if mesh.size(PP) > 1 else 0
                strategy.timelines.append({**record, "rank": rank, "events": events, "n_microbatches": m})
        shown = self._shown_output(out, train, shows, key=("out", train, tuple(x.shape), m), device=x.device)
        if not train and labels is not None:  # HF's eval loss: computed on the last stage, a scalar to every rank
            value = None
            if out is not None:
                # under cp: this rank's sum over the whole sequences' tokens / cp (the loss group's mean is the batch's)
                value = (
                    hf_labels_loss(out, labels) if cp is None else hf_labels_loss(out, labels, **cp_share(cp, count))
                )
            loss = runner.from_last_stage(value, ("loss", "eval"))
        # the target as training_step passes it (whole sequences), for `pipeline_loss(out, target)`'s check
        self.call = NetworkCall(shown, None if train else out, loss, given, train, loss_fn, m)
        return strategy.split.layout.call_output(shown, loss, labels)  # a HF model: its ModelOutput

    def _shows_values(self) -> bool:
        """Whether the step sees the output's values (``broadcast_output=True``, predict) or a stand-in."""
        trainer = getattr(self.strategy.lightning_module, "_trainer", None)
        return self.strategy.broadcast_output or (trainer is not None and trainer.predicting)

    def _shown_output(self, out: Optional[Tensor], train: bool, shows: bool, *, key: tuple, device: Any) -> Tensor:
        """What the step sees of the output: a stand-in on `device` (default), or the whole output broadcast (the
        opt-in, predict: `shows`)."""
        strategy = self.strategy
        module = strategy.lightning_module
        if shows:
            whole = strategy._runner.from_last_stage(out, key)
            # a leaf: `backward` finds what training_step's loss did with the output (see `_extra_gradients`)
            return whole.requires_grad_() if train and whole.is_floating_point() else whole
        shape, dtype = strategy._runner.output_meta(out, key)
        strategy._calls += 1
        where = "training_step" if train else "an evaluation step (validation_step / test_step)"
        return PipelineOutput(shape, dtype, device, owner=type(module).__name__, where=where, step=strategy._calls)

    def _loss_of_step(self, labels: Optional[Tensor], m: int, count: Optional[Tensor] = None) -> tuple[Any, Any]:
        """The step's target and per-micro-batch loss: HF ``labels``, or ``pipeline_target``/``pipeline_loss``.
        `count`: context parallelism's labelled tokens of the whole sequences (`labels`: this rank's shifted chunks)."""
        module = self.strategy.lightning_module
        if labels is not None:
            # each micro-batch's summed loss over the whole batch's labelled tokens (x m: the runner divides by m),
            # so the micro-batches add up to the batch mean whatever tokens each one holds
            if count is not None:
                kw = cp_share(self.strategy._cp, count, m)
                return labels, lambda out, tgt: hf_labels_loss(out, tgt, **kw)
            share = labelled_tokens(labels).clamp_min(1) / m
            return labels, lambda out, tgt: hf_labels_loss(out, tgt, num_items=share)
        if not callable(getattr(module, "pipeline_loss", None)):
            raise ValueError(
                f"{type(module).__name__} has no `pipeline_loss(output, target)` method and the network"
                " call got no `labels`: the pipeline schedule needs a loss for each micro-batch."
            )
        loss = module.pipeline_loss
        return self._pipeline_target(), getattr(loss, "__wrapped__", loss)  # the user's own, not the server

    def _pipeline_target(self) -> Tensor:
        module, batch = self.strategy.lightning_module, self.batch
        hook = getattr(module, "pipeline_target", None)
        if callable(hook):
            return hook(batch)
        if isinstance(batch, (tuple, list)) and len(batch) >= 2:
            return batch[1]
        raise TypeError(
            f"Cannot find the target in a batch of type {type(batch).__name__}: batches must be"
            f" (inputs, target, ...), or define `{type(module).__name__}.pipeline_target(batch)`."
        )

    # ---- backward ------------------------------------------------------------------------------
    def check_called(self) -> None:
        """At the end of ``training_step``: the step must have called the network (which ran the schedule)."""
        if self.pending:
            raise RuntimeError(
                f"training_step did not call self.{self.strategy.network}(inputs): under PipelineStrategy"
                " the network call runs the pipeline's forward and backward."
            )

    def whole_loss(self, returned: Any, group: Any) -> Optional[Tensor]:
        """The value one device would have for the returned loss: the pipeline's batch loss plus the other terms
        (a weight penalty) summed over the pp ranks, each of which holds its stages' parameters only. One scalar
        all-reduced over `group` when the returned loss is not the pipeline's loss itself (every pp rank runs the
        same ``training_step``, so all of them or none); None when the step returned no loss tensor or did not
        call the network."""
        import torch.distributed as dist

        call = self.call
        if call is None or not isinstance(returned, Tensor) or returned.dim() != 0 or call.loss is None:
            return None
        if returned is call.loss:  # the pipeline's loss itself (no other terms): the same on every rank already
            return returned.detach()
        base = call.loss.detach().to(returned.dtype)
        extra = returned.detach() - base  # this rank's share of the other terms (0 without any)
        if group is not None:
            dist.all_reduce(extra, group=group)
        return base + extra

    def backward(self, closure_loss: Tensor, scale: float) -> None:
        """Add the schedule's gradients (times `scale`) and those of the returned loss's other terms to ``.grad``."""
        assert self.grads is not None, "backward of a step whose network call ran no schedule backward"
        extra = self._extra_gradients(closure_loss, scale)
        for p, g in self.grads:
            if g is None:
                continue
            g = g * scale if scale != 1.0 else g
            p.grad = g if p.grad is None else p.grad + g
        for p, g in extra:
            p.grad = g if p.grad is None else p.grad + g
        self.grads = None

    def _extra_gradients(self, loss: Tensor, scale: float) -> list[tuple[Tensor, Tensor]]:
        """Gradients of the terms of training_step's loss that the schedule did not back-propagate.

        The schedule back-propagated the mean of ``pipeline_loss`` over the micro-batches; the step's loss
        (what ``pipeline_loss(out, target)`` / ``out.loss`` answered) is a leaf, so one backward through the
        returned loss's own small graph gives its gradient on that leaf (it must be ``scale``: one copy of the
        loss, as the schedule assumed; checked on the scalar, one verdict on every rank) and the gradients of
        the other terms (weight penalties) on the parameters this rank holds. With ``broadcast_output=True``
        a loss computed from the output directly is compared with the schedule's (a loss pass over the output).
        """
        call, self.call = self.call, None
        if call is None or not call.train:
            return []
        strategy = self.strategy
        owner = type(strategy.lightning_module).__name__
        direct = isinstance(call.out, Tensor) and not isinstance(call.out, PipelineOutput) and call.out.requires_grad
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            raise ValueError(returned_loss_problem(None, scale, owner))
        reached = reached_leaves(loss)  # the parameters the returned loss's other terms use (none: the loss alone)
        reached.discard(id(call.loss))
        params = [p for p in strategy.model.parameters() if p.requires_grad and id(p) in reached] if reached else []
        inputs = [call.loss, *([call.out] if direct else []), *params]
        grads = list(torch.autograd.grad(loss, inputs, allow_unused=True, retain_graph=direct))
        d_loss = grads.pop(0)
        if direct and grads.pop(0) is not None:  # the opt-in output used outside pipeline_loss
            if d_loss is not None:
                raise ValueError(output_term_problem(owner))
            return self._direct_output_gradients(loss, call, scale, params)
        # without values, a gradient on the loss stands for the one copy of it the real run checks it holds
        problem = returned_loss_problem(d_loss if self.values or d_loss is None else scale, scale, owner)
        if problem is not None:
            raise ValueError(problem)
        return [(p, g) for p, g in zip(params, grads) if g is not None]

    def _direct_output_gradients(
        self, loss: Tensor, call: NetworkCall, scale: float, params: list[Tensor]
    ) -> list[tuple[Tensor, Tensor]]:
        """``broadcast_output=True`` and a loss computed from the output itself: its gradient on the output must be
        the schedule's (one more loss pass over the output, on every rank; one flag all-reduced)."""
        differs, extra = returned_loss_gradients(
            loss,
            call.out,
            call.target,
            n_microbatches=call.m,
            scale=scale,
            pipeline_loss=call.loss_fn,
            params=params,
        )
        mismatch = torch.tensor(float(differs), device=self.strategy.root_device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(mismatch, op=torch.distributed.ReduceOp.MAX)
        if mismatch.item():
            raise ValueError(output_term_problem(type(self.strategy.lightning_module).__name__))
        return extra


def cut_for_cp(cp: Any, x: Tensor, extra: dict, labels: Optional[Tensor]) -> tuple[Tensor, dict, Any, Any]:
    """Context parallelism's cut of one network call, before the schedule splits it into micro-batches (dim 0): the
    first stage's input and every ``[B, S, ...]`` keyword input cut to this rank's chunks, ``position_ids`` added
    (every stage takes them), HF ``labels`` shifted over the whole sequences, then cut. Returns (input, keyword
    inputs, labels, labelled tokens of the whole sequences; None without labels)."""
    values = {**extra, _INPUT: x}
    count = None
    if labels is not None:
        values[_LABELS] = shifted = shift_labels(labels)
        count = cp.cp.labelled_tokens(shifted)  # over the dp ranks' batches too: the global batch's token mean
    values = cp.split_sequences(x, values)
    return values.pop(_INPUT), values, values.pop(_LABELS, None), count


_INPUT, _LABELS = "\0input", "\0labels"  # keys no keyword input has


def cp_share(cp: Any, count: Tensor, m: int = 1) -> dict:
    """``hf_labels_loss`` options for this rank's shifted chunks: the sum over them divided by the whole sequences'
    labelled tokens / cp (gradients average over the cp ranks), and / m (the runner divides each micro-batch by m)."""
    return {"num_items": count.clamp_min(1) / (cp.cp.size * m), "shifted": True}


def cut_target(cp: Any, target: Any, owner: str) -> Tensor:
    """`target`'s chunks matching the last cut (:func:`cut_for_cp`): refused, on every rank (each holds the same
    target shape), unless it is ``[batch, seq, ...]`` with the inputs' sequence length."""
    call = cp.last
    if not (isinstance(target, Tensor) and target.dim() >= 2 and target.shape[1] == call.seq_len):
        got = tuple(target.shape) if isinstance(target, Tensor) else type(target).__name__
        raise ValueError(
            f"Context parallelism (cp={cp.cp.size}) gives each rank's pipeline_loss the target's chunks matching its"
            f" part of the sequences: the target ({owner}.pipeline_target(batch), by default batch[1]) must be"
            f" [batch, seq, ...] with the inputs' sequence length {call.seq_len}; got {got}. Use per-token targets,"
            " or cp=1."
        )
    return target.index_select(1, call.positions.to(target.device))


class PipelineProbe:
    """Context parallelism's self-check passes (:mod:`~lightning_dist.parallelize.cp_probe`) through the pipeline
    schedule: `inputs` (one sequence per micro-batch) cut as the network call cuts a batch (:func:`cut_for_cp`,
    :func:`cut_target`) in the split pass, whole with ``position_ids`` 0, 1, ... in the unsplit one; the schedule's loss
    is the probe's and its target each token's index. Every pp rank runs it (the schedule is collective)."""

    def __init__(self, strategy: Any, inputs: Tensor) -> None:
        self.strategy, self.inputs = strategy, inputs
        self.order = min(strategy.local_stages)  # the first stage's rank runs the forward's first modules

    def run(self, *, split: bool, loss: Any, index: Tensor, position_ids: Optional[Tensor] = None) -> Optional[Tensor]:
        strategy = self.strategy
        cp, runner, x = strategy._cp, strategy._runner, self.inputs
        if position_ids is None and not split:  # every stage takes them under cp; the split adds its own
            position_ids = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        extra = {} if position_ids is None else {"position_ids": position_ids}
        target = index
        if split:
            x, extra, _, _ = cut_for_cp(cp, x, extra, None)
            target = cut_target(cp, index, type(strategy.lightning_module).__name__)
        mode = cp.active() if split else cp.unsplit()  # the unsplit pass's checkpointed blocks recompute without it
        # eager where blocks are compiled: a compile for the probe's sizes would mark training's sizes dynamic
        eager = torch.compiler.set_stance("force_eager")
        with evaluating(*runner.views), mode, eager, torch.set_grad_enabled(loss is not None):
            out, _, _ = runner.step(
                x, n_microbatches=x.shape[0], loss_fn=loss, target=target, kwargs=extra, keep_output=True
            )
        if loss is not None:
            sum_tied_gradients(strategy._tied)  # as each training step does
        return None if out is None else out.detach()

    def modules(self) -> list[tuple[str, Any]]:
        return [pair for view in self.strategy._runner.views for pair in module_names(view, self.strategy.network)]


def serve_loss(strategy: Any, call: Optional[NetworkCall], output: Any, target: Any, original: Any) -> Optional[Tensor]:
    """``pipeline_loss(out, target)``: the batch loss when `output` is what `call` (the step's last network call,
    None: no step or no call) returned; None for any other tensor (the module's own loss computes it)."""
    owner = type(strategy.lightning_module).__name__
    if isinstance(output, PipelineOutput) and (call is None or output is not call.out):
        raise RuntimeError(
            f"{owner}.pipeline_loss got the output of an earlier call of the pipelined network:"
            " call the network and its loss in the same step."
        )
    if call is None or output is not call.out:
        return None
    if call.train:
        check_target(call.target, target, owner)
        return call.loss
    if not isinstance(output, PipelineOutput):  # the whole output is here (opt-in, predict): computed as usual
        return None
    if strategy._cp is not None:  # this rank's part of the sequences: the target's matching chunks
        target = cut_target(strategy._cp, target, owner)
    value = None if call.local is None else original(call.local, target)  # the whole batch: one device's value
    return strategy._runner.from_last_stage(value, ("loss", "eval"))


__all__ = ["NetworkCall", "PipelineProbe", "PipelineStep", "cp_share", "cut_for_cp", "cut_target", "serve_loss"]
