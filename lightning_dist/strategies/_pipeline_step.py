"""The training-step side of :class:`~lightning_dist.strategies.pipeline.PipelineStrategy`.

Calling the network inside ``training_step`` runs the whole schedule (forward and backward; forward only in
evaluation). The output stays on the last stage; every pp rank gets the batch loss as one scalar and a
:class:`~lightning_dist.parallelize.pipeline_output.PipelineOutput` stand-in that answers
``self.pipeline_loss(out, target)`` (HF: ``out.loss``) with it and refuses any other use, on every rank
(``broadcast_output=True``, and predict: the whole output broadcast instead). The gradients come from the
schedule (the mean of ``pipeline_loss`` over the micro-batches); terms the returned loss adds on the
parameters (a weight penalty) get their gradients in ``backward``, and a returned loss that does not hold
exactly one copy of the pipeline's loss is refused on every rank (a check on the scalar). They are
held aside during ``training_step`` and added to ``.grad`` in the strategy's ``backward``, so Lightning's
closure (training_step -> zero_grad -> backward), gradient accumulation and manual optimization keep
their meaning. Gradient-norm clipping uses the global norm across stages (and FSDP shards).
``strategy.last_loss`` holds the mean ``pipeline_loss`` of the last step's micro-batches on every pp rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.mesh import PP
from lightning_dist.parallelize.pipeline_hf import hf_labels_loss, labelled_tokens
from lightning_dist.parallelize.pipeline_output import (
    PipelineOutput,
    check_target,
    loss_leaf,
    output_term_problem,
    returned_loss_problem,
)
from lightning_dist.parallelize.pipeline_schedule import returned_loss_gradients
from lightning_dist.parallelize.pipeline_setup import first_batch_problem
from lightning_dist.parallelize.pipeline_tied import sum_tied_gradients
from lightning_dist.strategies.base import MeshStrategy


class _Served(NamedTuple):
    """One network call, for ``pipeline_loss`` and ``backward``: what the step saw, the last stage's output
    (evaluation, on its rank), the batch loss (a leaf in training), the schedule's target, training or not."""

    out: Any
    local: Optional[Tensor]
    loss: Optional[Tensor]
    target: Any
    train: bool
    loss_fn: Any = None  # the schedule's per-micro-batch loss and micro-batch count (the opt-in's direct-use check)
    m: int = 1


_PENDING = object()  # training_step is running: the network call takes the target from its inputs or the batch


class PipelineStepMixin(MeshStrategy):
    # a MeshStrategy subclass, not a plain mixin: AutoParallelStrategy becomes the strategy it picks by
    # assigning `__class__`, which Python allows only along the same chain of first bases
    """Network call, ``training_step``, ``backward`` and clipping of the pipeline strategy (its state: see
    ``PipelineStrategy.__init__``)."""

    # ---- running the pipeline ------------------------------------------------------------------
    def _inputs(self, args: tuple, kwargs: dict) -> tuple[Tensor, dict, Optional[Tensor]]:
        """(first stage's input, inputs every stage takes, HF labels) of a call of the pipelined network."""
        assert self.split is not None
        return self.split.layout.call_inputs(args, kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        """The pipelined network's call: the whole schedule; returns what every pp rank sees of the output."""
        x, extra, labels = self._inputs(args, kwargs)
        module = self.lightning_module
        train = self._target is not None and torch.is_grad_enabled() and module.training
        m, batch = self.n_microbatches, x.shape[0]
        if batch % m:
            if train:
                raise ValueError(
                    f"The batch of {batch} samples does not divide into n_microbatches={m} micro-batches;"
                    f" use a batch size (per data-parallel rank) that is a multiple of {m}."
                )
            m = max(d for d in range(1, m + 1) if batch % d == 0)  # forward-only programs take any count
        assert self._runner is not None
        if self._unsplit is not None:  # once: the staged forward against the unsplit copy (one verdict for all)
            unsplit, self._unsplit = self._unsplit, None
            problem = first_batch_problem(unsplit, x[: batch // m], self.root_device)
            if problem is not None:
                raise ValueError(problem)
        target, loss_fn = None, None
        if train:
            target, loss_fn = self._loss_of_step(labels, m)
        params = list(self.model.parameters())
        if train:  # the schedule's gradients go aside; `backward` adds them to .grad
            held = [p.grad for p in params]
            for p in params:
                p.grad = None
        events: Optional[list] = [] if self.record_timeline and train else None
        out, loss, record = self._runner.step(
            x, n_microbatches=m, loss_fn=loss_fn, target=target, timeline=events, kwargs=extra
        )
        if train:
            sum_tied_gradients(self._tied)
            self._target = None
            self._stash = [(p, p.grad) for p in params]
            for p, g in zip(params, held):
                p.grad = g
            self.last_loss = loss
            loss = loss_leaf(loss)  # `backward` reads through it how the returned loss used it
            if events is not None:
                self.timelines.append(
                    {
                        **record,
                        "rank": self.mesh.local_rank(PP) if self.mesh.size(PP) > 1 else 0,
                        "events": events,
                        "n_microbatches": m,
                    }
                )
        shown = self._shown_output(out, train, key=("out", train, tuple(x.shape), m))
        if not train and labels is not None:  # HF's eval loss: computed on the last stage, a scalar to every rank
            loss = self._runner.from_last_stage(None if out is None else hf_labels_loss(out, labels), ("loss", "eval"))
        self._served = _Served(shown, None if train else out, loss, target, train, loss_fn, m)
        assert self.split is not None
        return self.split.layout.call_output(shown, loss, labels)  # a HF model: its ModelOutput

    def _shown_output(self, out: Optional[Tensor], train: bool, *, key: tuple) -> Tensor:
        """What the step sees of the output: a stand-in (default), or the whole output broadcast (the opt-in,
        predict)."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        predicting = trainer is not None and trainer.predicting
        assert self._runner is not None
        if self.broadcast_output or predicting:
            whole = self._runner.from_last_stage(out, key)
            # a leaf: `backward` finds what training_step's loss did with the output (see `_extra_gradients`)
            return whole.requires_grad_() if train and whole.is_floating_point() else whole
        shape, dtype = self._runner.output_meta(out, key)
        self._calls += 1
        where = "training_step" if train else "an evaluation step (validation_step / test_step)"
        return PipelineOutput(
            shape, dtype, self.root_device, owner=type(module).__name__, where=where, step=self._calls
        )

    def _serve_loss(self, output: Any, target: Any, original: Any) -> Optional[Tensor]:
        """``pipeline_loss(out, target)`` on the network call's output: the batch loss (None: not that output)."""
        served, owner = self._served, type(self.lightning_module).__name__
        if isinstance(output, PipelineOutput) and (served is None or output is not served.out):
            raise RuntimeError(
                f"{owner}.pipeline_loss got the output of an earlier call of the pipelined network:"
                " call the network and its loss in the same step."
            )
        if served is None or output is not served.out:
            return None
        if served.train:
            check_target(served.target, target, owner)
            return served.loss
        if not isinstance(output, PipelineOutput):  # the whole output is here (opt-in, predict): computed as usual
            return None
        assert self._runner is not None
        value = None if served.local is None else original(served.local, target)  # the whole batch: one device's value
        return self._runner.from_last_stage(value, ("loss", "eval"))

    def _loss_of_step(self, labels: Optional[Tensor], m: int) -> tuple[Any, Any]:
        """The schedule's target and per-micro-batch loss: HF ``labels``, or ``pipeline_target``/``pipeline_loss``."""
        module = self.lightning_module
        if labels is not None:
            # each micro-batch's summed loss over the whole batch's labelled tokens (x m: the runner divides by m),
            # so the micro-batches add up to the batch mean whatever tokens each one holds
            share = labelled_tokens(labels).clamp_min(1) / m
            return labels, lambda out, tgt: hf_labels_loss(out, tgt, num_items=share)
        if not callable(getattr(module, "pipeline_loss", None)):
            raise ValueError(
                f"{type(module).__name__} has no `pipeline_loss(output, target)` method and the network"
                " call got no `labels`: the pipeline schedule needs a loss for each micro-batch."
            )
        loss = module.pipeline_loss
        return self._pipeline_target(self._batch), getattr(loss, "__wrapped__", loss)  # the user's own, not the server

    def _pipeline_target(self, batch: Any) -> Tensor:
        module = self.lightning_module
        hook = getattr(module, "pipeline_target", None)
        if callable(hook):
            return hook(batch)
        if isinstance(batch, (tuple, list)) and len(batch) >= 2:
            return batch[1]
        raise TypeError(
            f"Cannot find the target in a batch of type {type(batch).__name__}: batches must be"
            f" (inputs, target, ...), or define `{type(module).__name__}.pipeline_target(batch)`."
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._batch = args[0] if args else kwargs["batch"]
        self._target = _PENDING  # the network call finds the target (HF `labels`, or `pipeline_target(batch)`)
        self._stash = None
        try:
            out = super().training_step(*args, **kwargs)
        except BaseException:
            self._target = None
            raise
        if self._target is not None:
            self._target = None
            raise RuntimeError(
                f"training_step did not call self.{self.network}(inputs): under PipelineStrategy"
                " the network call runs the pipeline's forward and backward."
            )
        return out

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        if self._stash is None:
            raise RuntimeError(
                "PipelineStrategy.backward was called without a pipeline step: under this strategy the"
                f" network call self.{self.network}(inputs) in training_step runs forward and backward."
            )
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        # Lightning divides the loss by accumulate_grad_batches before backward; scale the schedule's grads alike
        scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        extra = self._extra_gradients(closure_loss, scale)
        for p, g in self._stash:
            if g is None:
                continue
            g = g * scale if scale != 1.0 else g
            p.grad = g if p.grad is None else p.grad + g
        for p, g in extra:
            p.grad = g if p.grad is None else p.grad + g
        self._stash = None
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def _extra_gradients(self, loss: Tensor, scale: float) -> list[tuple[Tensor, Tensor]]:
        """Gradients of the terms of training_step's loss that the schedule did not back-propagate.

        The schedule back-propagated the mean of ``pipeline_loss`` over the micro-batches; the step's loss
        (what ``pipeline_loss(out, target)`` / ``out.loss`` answered) is a leaf, so one backward through the
        returned loss's own small graph gives its gradient on that leaf (it must be ``scale``: one copy of the
        loss, as the schedule assumed; checked on the scalar, one verdict on every rank) and the gradients of
        the other terms (weight penalties) on the parameters this rank holds. With ``broadcast_output=True``
        a loss computed from the output directly is compared with the schedule's (a loss pass over the output).
        """
        served, self._served = self._served, None
        if served is None or not served.train:
            return []
        owner = type(self.lightning_module).__name__
        params = [p for p in self.model.parameters() if p.requires_grad]
        direct = (
            isinstance(served.out, Tensor) and not isinstance(served.out, PipelineOutput) and served.out.requires_grad
        )
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            raise ValueError(returned_loss_problem(None, scale, owner))
        inputs = [served.loss, *([served.out] if direct else []), *params]
        grads = list(torch.autograd.grad(loss, inputs, allow_unused=True, retain_graph=direct))
        d_loss = grads.pop(0)
        if direct and grads.pop(0) is not None:  # the opt-in output used outside pipeline_loss
            if d_loss is not None:
                raise ValueError(output_term_problem(owner))
            return self._direct_output_gradients(loss, served, scale, params)
        problem = returned_loss_problem(d_loss, scale, owner)
        if problem is not None:
            raise ValueError(problem)
        return [(p, g) for p, g in zip(params, grads) if g is not None]

    def _direct_output_gradients(
        self, loss: Tensor, served: "_Served", scale: float, params: list[Tensor]
    ) -> list[tuple[Tensor, Tensor]]:
        """``broadcast_output=True`` and a loss computed from the output itself: its gradient on the output must be
        the schedule's (one more loss pass over the output, on every rank; one flag all-reduced)."""
        differs, extra = returned_loss_gradients(
            loss,
            served.out,
            served.target,
            n_microbatches=served.m,
            scale=scale,
            pipeline_loss=served.loss_fn,
            params=params,
        )
        mismatch = torch.tensor(float(differs), device=self.root_device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(mismatch, op=torch.distributed.ReduceOp.MAX)
        if mismatch.item():
            raise ValueError(output_term_problem(type(self.lightning_module).__name__))
        return extra

    @override
    def optimizer_gradients(self, optimizer: Any) -> tuple[list[Tensor], list[Tensor]]:
        grads, _ = super().optimizer_gradients(optimizer)
        # a weight tied across stages has a copy (summed gradient) on each holder: all are clipped, one is counted
        skip = {id(p.grad) for p, _, counted in self._tied if not counted and p.grad is not None}
        return grads, [g for g in grads if id(g) not in skip]

    @override
    def grad_norm_group(self) -> Optional[Any]:
        return self.mesh.group(PP) if self.mesh.size(PP) > 1 else None  # the stages hold distinct parameters


__all__ = ["PipelineStepMixin"]
