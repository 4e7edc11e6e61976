"""The training-step side of :class:`~lightning_dist.strategies.pipeline.PipelineStrategy`.

``training_step``/``validation_step``/``predict_step`` stay as they are: calling the network runs the
whole schedule (forward and backward in training, forward only otherwise) and returns the last stage's
output on every pipeline rank, so the loss computed from it, ``self.log`` and the progress bar see the
single-device value. The gradients come from the schedule (the mean of ``pipeline_loss`` over the
micro-batches); terms the returned loss adds on the parameters (a weight penalty) get their gradients in
``backward``, and a loss that uses the output otherwise is refused on every rank. They are
held aside during ``training_step`` and added to ``.grad`` in the strategy's ``backward``, so Lightning's
closure (training_step -> zero_grad -> backward), gradient accumulation and manual optimization keep
their meaning. Gradient-norm clipping uses the global norm across stages (and FSDP shards).
``strategy.last_loss`` holds the mean ``pipeline_loss`` of the last step's micro-batches on every pp rank.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.mesh import PP
from lightning_dist.parallelize.pipeline_hf import hf_labels_loss, labelled_tokens
from lightning_dist.parallelize.pipeline_schedule import returned_loss_gradients
from lightning_dist.parallelize.pipeline_setup import first_batch_problem
from lightning_dist.parallelize.pipeline_tied import sum_tied_gradients
from lightning_dist.strategies.base import MeshStrategy

_PENDING = object()  # training_step is running: the network call takes the target from its inputs or the batch
# keyword inputs of a HF causal LM that every stage takes (split into micro-batches along dim 0)
_HF_STAGE_INPUTS = frozenset({"attention_mask", "position_ids", "token_type_ids"})


class PipelineStepMixin(MeshStrategy):
    # a MeshStrategy subclass, not a plain mixin: AutoParallelStrategy becomes the strategy it picks by
    # assigning `__class__`, which Python allows only along the same chain of first bases
    """Network call, ``training_step``, ``backward`` and clipping of the pipeline strategy (its state: see
    ``PipelineStrategy.__init__``)."""

    # ---- running the pipeline ------------------------------------------------------------------
    def _inputs(self, args: tuple, kwargs: dict) -> tuple[Tensor, dict, Optional[Tensor]]:
        """(first stage's input, inputs every stage takes, HF labels) of a call of the pipelined network."""
        if not self._hf:
            if len(args) != 1 or kwargs or not isinstance(args[0], Tensor):
                raise TypeError("A pipelined network takes exactly one tensor argument (the batch of inputs).")
            return args[0], {}, None
        kwargs = dict(kwargs)
        if len(args) > 1 or (args and "input_ids" in kwargs):
            raise TypeError("A pipelined HuggingFace model takes `input_ids` (positionally or by name) and keyword inputs.")
        x = args[0] if args else kwargs.pop("input_ids", None)
        labels = kwargs.pop("labels", None)
        for key in ("use_cache", "return_dict"):  # the stages never cache; the call returns a ModelOutput anyway
            kwargs.pop(key, None)
        unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _HF_STAGE_INPUTS)
        if not isinstance(x, Tensor) or unknown:
            raise TypeError(f"A pipelined HuggingFace model takes `input_ids` (a tensor) and the keyword inputs"
                            f" {sorted(_HF_STAGE_INPUTS)} and `labels`; got {type(x).__name__} and {unknown or 'no others'}.")
        return x, {k: v for k, v in kwargs.items() if v is not None}, labels

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        """The pipelined network's call: the whole schedule, returning the last stage's output on every pp rank."""
        x, extra, labels = self._inputs(args, kwargs)
        module = self.lightning_module
        train = self._target is not None and torch.is_grad_enabled() and module.training
        m, batch = self.n_microbatches, x.shape[0]
        if batch % m:
            if train:
                raise ValueError(f"The batch of {batch} samples does not divide into n_microbatches={m} micro-batches;"
                                 f" use a batch size (per data-parallel rank) that is a multiple of {m}.")
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
        out, loss, record = self._runner.step(x, n_microbatches=m, loss_fn=loss_fn, target=target, timeline=events,
                                              kwargs=extra)
        if train:
            sum_tied_gradients(self._tied)
            if out.is_floating_point():
                # a leaf: `backward` finds what training_step's loss did with the output (see `_extra_gradients`)
                out = out.detach().requires_grad_()
                self._returned = (out, target, m, loss_fn)
            self._target = None
            self._stash = [(p, p.grad) for p in params]
            for p, g in zip(params, held):
                p.grad = g
            self.last_loss = loss
            if events is not None:
                self.timelines.append({**record, "rank": self.mesh.local_rank(PP) if self.mesh.size(PP) > 1 else 0,
                                       "events": events, "n_microbatches": m})
        if not self._hf:
            return out
        from transformers.modeling_outputs import CausalLMOutputWithPast

        # HF's labels convention: the model's output carries the mean loss over the labelled tokens
        return CausalLMOutputWithPast(loss=None if labels is None else hf_labels_loss(out, labels), logits=out)

    def _loss_of_step(self, labels: Optional[Tensor], m: int) -> tuple[Any, Any]:
        """The schedule's target and per-micro-batch loss: HF ``labels``, or ``pipeline_target``/``pipeline_loss``."""
        module = self.lightning_module
        if labels is not None:
            # each micro-batch's summed loss over the whole batch's labelled tokens (x m: the runner divides by m),
            # so the micro-batches add up to the batch mean whatever tokens each one holds
            share = labelled_tokens(labels).clamp_min(1) / m
            return labels, lambda out, tgt: hf_labels_loss(out, tgt, num_items=share)
        if not callable(getattr(module, "pipeline_loss", None)):
            raise ValueError(f"{type(module).__name__} has no `pipeline_loss(output, target)` method and the network"
                             " call got no `labels`: the pipeline schedule needs a loss for each micro-batch.")
        return self._pipeline_target(self._batch), module.pipeline_loss

    def _pipeline_target(self, batch: Any) -> Tensor:
        module = self.lightning_module
        hook = getattr(module, "pipeline_target", None)
        if callable(hook):
            return hook(batch)
        if isinstance(batch, (tuple, list)) and len(batch) >= 2:
            return batch[1]
        raise TypeError(f"Cannot find the target in a batch of type {type(batch).__name__}: batches must be"
                        f" (inputs, target, ...), or define `{type(module).__name__}.pipeline_target(batch)`.")

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
            raise RuntimeError(f"training_step did not call self.{self.network}(inputs): under PipelineStrategy"
                               " the network call runs the pipeline's forward and backward.")
        return out

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        if self._stash is None:
            raise RuntimeError("PipelineStrategy.backward was called without a pipeline step: under this strategy the"
                               f" network call self.{self.network}(inputs) in training_step runs forward and backward.")
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

        The schedule back-propagated the mean of ``pipeline_loss`` over the micro-batches. The returned loss
        may add terms on the parameters (a weight penalty): their gradients, on the parameters this rank
        holds, are returned here to be added. A loss that uses the network's output otherwise than that
        mean (a scaled loss, a term on the output) would need another backward through every stage: refused,
        on every rank (one flag all-reduced), before any gradient is applied.
        """
        returned, self._returned = self._returned, None
        if returned is None or not isinstance(loss, Tensor) or not loss.requires_grad:
            return []
        out, target, m, loss_fn = returned
        differs, extra = returned_loss_gradients(
            loss, out, target, n_microbatches=m, scale=scale, pipeline_loss=loss_fn,
            params=[p for p in self.model.parameters() if p.requires_grad])
        mismatch = torch.tensor(float(differs), device=self.root_device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(mismatch, op=torch.distributed.ReduceOp.MAX)
        if mismatch.item():
            name = type(self.lightning_module).__name__
            raise ValueError(
                f"{name}.training_step returned a loss that uses the network's output differently from the mean of"
                f" `pipeline_loss` over the micro-batches, which is all the pipeline schedule back-propagates through the"
                " stages (e.g. a scaled loss, or an extra term on the output): that part of its gradient would be lost."
                f" Put every term that depends on the output into `{name}.pipeline_loss(output, target)` (the mean loss"
                " of one micro-batch); terms on the parameters alone (weight penalties) may stay in training_step."
            )
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
