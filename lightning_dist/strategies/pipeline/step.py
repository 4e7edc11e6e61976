"""One step of :class:`~lightning_dist.strategies.PipelineStrategy`: the network call, what the LightningModule sees of
its output and loss, and the gradients the returned loss adds. Notes: docs/internals.md."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_dist.parallelize.cp import shift_labels
from lightning_dist.parallelize.cp_probe import evaluating, module_names
from lightning_dist.parallelize.moe import StagedRouterLoss
from lightning_dist.parallelize.pipeline.hf import hf_labels_loss, labelled_tokens
from lightning_dist.parallelize.pipeline.schedule import PipelineRunner
from lightning_dist.strategies.pipeline.setup import first_batch_problem


@dataclass(eq=False)
class PipelineRun:
    """What the strategy's set-up made for its steps: the runner (its device, pp group), call convention, cp."""

    runner: PipelineRunner
    layout: Any  # the split's NetworkLayout (its call_inputs / call_output)
    n_microbatches: int
    pp_rank: int
    cp: Any = None
    network: str = "model"
    unsplit: Optional[nn.Module] = None  # a host copy, compared with the stages on the first batch (then dropped)
    calls: int = 0
    router: Optional[StagedRouterLoss] = None  # the router loss over the global batch (a `router_loss` method)
    dp_group: Optional[Any] = None  # where router statistics are summed (dp ranks, cp included; None: this rank's)
    dp_size: int = 1
    counted: bool = True  # run the router's counting pass (False once a training step did not use the router loss)
    router_coef: Optional[float] = None  # a transformers model's router loss coefficient
    router_hooks: list = field(default_factory=list)  # the stages' router hooks (a transformers model)


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
    """A stand-in for the pipelined network's output: its shape and dtype, no storage; it refuses its values."""

    owner: str
    where: str
    step: int
    storage_free: ClassVar[bool] = True  # what a memory tracker reads (never a storage, never a value)

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
        me = next(a for a in tree_leaves((args, kwargs or {})) if isinstance(a, PipelineOutput))
        raise ValueError(refusal(me.owner, f"`{getattr(func, '__name__', func)}`", me.where))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        raise ValueError(refusal("The LightningModule", f"`{func}`", "a step"))


def reached_leaves(loss: Tensor) -> set[int]:
    """The ids of the leaf tensors `loss`'s autograd graph reaches (torch has no public query)."""
    # a freed Node wrapper's id is reused by the next one: `seen` holds the visited nodes, keeping ids unique
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


def output_term_problem(owner: str, how: str = "e.g. a scaled loss, or an extra term on the output") -> str:
    """The refusal of a returned loss whose gradient on the (broadcast) output differs from the schedule's."""
    return (
        f"{owner}.training_step returned a loss that uses the network's output differently from the mean of"
        f" `pipeline_loss` over the micro-batches, which is all the pipeline schedule back-propagates through the"
        f" stages ({how}): that part of its gradient would be lost." + _fix(owner)
    )


def returned_loss_problem(d_loss: Optional[Tensor | float], scale: float, owner: str) -> Optional[str]:
    """Why the returned loss cannot be served, from its gradient `d_loss` on the step's loss leaf (None: it can)."""
    if d_loss is None:
        return (
            f"{owner}.training_step returned a loss that does not contain the pipeline's loss (the value of"
            " `self.pipeline_loss(out, target)` or HF's `out.loss`), whose gradient the schedule already"
            " back-propagated through the stages." + _fix(owner)
        )
    got = float(d_loss)
    if abs(got - scale) > 1e-6 * abs(scale):
        return output_term_problem(
            owner,
            f"its gradient on that loss is {got / scale:g} x, not 1 x: e.g. a scaled loss, or the loss used twice",
        )
    return None


def returned_loss_gradients(
    loss: Tensor, out: Tensor, target: Any, *, n_microbatches: int, scale: float, pipeline_loss: Any, params: list
) -> tuple[bool, list[tuple[Tensor, Tensor]]]:
    """(Whether ``d loss / d out`` on the broadcast output differs from the schedule's, the other terms' gradients
    on `params`)."""
    grads = torch.autograd.grad(loss, [out, *params], allow_unused=True)
    user_out = grads[0] if grads[0] is not None else torch.zeros_like(out)
    differs = False
    if isinstance(target, Tensor):  # torch's schedules take tensor targets only
        with torch.enable_grad():
            chunks = zip(out.tensor_split(n_microbatches), target.tensor_split(n_microbatches))
            scheduled = sum(pipeline_loss(o, t) for o, t in chunks) * (scale / n_microbatches)
            (sched_out,) = torch.autograd.grad(scheduled, out)
        gap = (user_out - sched_out).double().abs().max() / sched_out.double().abs().max().clamp_min(1e-300)
        # rounding of the two summation orders: ~1e-16 in float64, a few ulps in bf16; a real difference is O(1)
        differs = bool(gap > max(1e-6, 16 * torch.finfo(out.dtype).eps))
    return differs, [(p, g) for p, g in zip(params, grads[1:]) if g is not None]


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


class NetworkCall(NamedTuple):
    """One network call, for ``pipeline_loss`` and ``backward``."""

    out: Any
    local: Optional[Tensor]
    loss: Optional[Tensor]
    target: Any
    train: bool
    loss_fn: Any = None  # the schedule's per-micro-batch loss and count (the opt-in's direct-use check)
    m: int = 1


class _Call(nn.Module):
    """A deferred schedule run as a module call, so module hooks (the memory trackers) see its stages inside one."""

    def __init__(self, job: Any) -> None:
        super().__init__()
        self.job = job

    def forward(self) -> Any:
        return self.job()


class PipelineStep:
    """The state of one step: its batch, its last network call and, in training, the schedule's gradients held
    aside until :meth:`backward`. `own_loss`: the module's own ``pipeline_loss``."""

    def __init__(
        self,
        run: PipelineRun,
        module: Any,
        batch: Any = None,
        *,
        own_loss: Any = None,
        training: bool = False,
        values: bool = True,
        shows: bool = False,
        record: bool = False,
    ) -> None:
        self.run_state, self.module, self.batch, self.own_loss = run, module, batch, own_loss
        self.owner = type(module).__name__
        self.values = values  # False: fake tensors (the dry run), the returned loss checked for the pipeline's only
        self.shows = shows  # the step sees the output's values (broadcast_output=True, predict), not a stand-in
        self.record = record  # record the training call's F/B/W actions
        self.pending = training  # training_step runs and has not called the network yet
        self.call: Optional[NetworkCall] = None
        self.grads: Optional[list[tuple[Tensor, Optional[Tensor]]]] = None  # the schedule's, until backward
        self.loss: Optional[Tensor] = None
        self.timeline: Optional[dict] = None
        self.aux: Optional[Tensor] = None  # the router loss of the global batch (a leaf), after a counting pass
        self.aux_term: Optional[Tensor] = None  # its part of the returned loss (the same on every rank)
        self.deferred: Optional[tuple] = None  # the training schedule's inputs, run by `finish`

    def run(self, args: tuple, kwargs: dict) -> Any:
        """The pipelined network's call: the whole schedule; returns what every pp rank sees of the output."""
        run, module = self.run_state, self.module
        x, extra, labels = run.layout.call_inputs(args, kwargs)
        train = self.pending and torch.is_grad_enabled() and module.training
        m, batch = run.n_microbatches, x.shape[0]
        if batch % m:
            if train:
                raise ValueError(
                    f"The batch of {batch} samples does not divide into n_microbatches={m} micro-batches;"
                    f" use a batch size (per data-parallel rank) that is a multiple of {m}."
                )
            m = max(d for d in range(1, m + 1) if batch % d == 0)  # forward-only programs take any count
        runner = run.runner
        if run.unsplit is not None:  # once: the staged forward against the unsplit copy (one verdict for all)
            unsplit, run.unsplit = run.unsplit, None
            problem = first_batch_problem(unsplit, x[: batch // m], runner.device)
            if problem is not None:
                raise ValueError(problem)
        cp, count, given = run.cp, None, None
        if cp is not None:  # each sequence cut to this rank's chunks before the micro-batch split (dim 0)
            x, extra, labels, count = cut_for_cp(cp, x, extra, labels)
        target, loss_fn = None, None
        if train:
            given, loss_fn = self._loss_of_step(labels, m, count)
            # the schedule's target: the chunks matching this rank's part of the sequences (HF labels: cut above)
            target = cut_target(cp, given, self.owner) if cp is not None and count is None else given
        aux = None
        if train and run.router is not None and run.counted:  # the schedule runs once the returned loss is known
            out, loss = self._counted(x, extra, target, loss_fn, m)
            aux = self.aux
        elif not train and run.router_coef is not None:  # the forward counts the routing: its loss has the term too
            assert run.router is not None
            with run.router.counting(m):
                out, loss = self._schedule(x, extra, target, loss_fn, m, train)
            _, dtype = runner.output_meta(out, ("dtype",))  # the loss's dtype: the output's, at least float32
            aux = self._reduce_router(torch.promote_types(dtype, torch.float32))
        else:
            out, loss = self._schedule(x, extra, target, loss_fn, m, train)
        shown = self._shown_output(out, train, key=("out", train, tuple(x.shape), m), device=x.device)
        if not train and labels is not None:  # HF's eval loss: computed on the last stage, a scalar to every rank
            # under cp: this rank's sum over the whole sequences' tokens / cp (the loss group's mean is the batch's)
            options = {} if cp is None else cp_share(cp, count)
            value = None if out is None else hf_labels_loss(out, labels, **options)
            loss = runner.from_last_stage(value, ("loss", "eval"))
        # the target as training_step passes it (whole sequences), for `pipeline_loss(out, target)`'s check
        self.call = NetworkCall(shown, None if train else out, loss, given, train, loss_fn, m)
        if run.router_coef is None:
            return run.layout.call_output(shown, loss, labels)  # a HF model: its ModelOutput
        return run.layout.call_output(shown, loss, labels, aux=aux, coef=run.router_coef)

    def _schedule(self, x: Tensor, extra: dict, target: Any, loss_fn: Any, m: int, train: bool) -> tuple[Any, Any]:
        """Run the schedule once; in training its gradients go aside (see :meth:`backward`), the loss is a leaf."""
        run, runner = self.run_state, self.run_state.runner
        params = runner.params  # the schedule accumulates gradients into these only
        if train:  # the schedule's gradients go aside; `backward` adds them to .grad
            held = [p.grad for p in params]
            for p in params:
                p.grad = None
        events: Optional[list] = [] if self.record and train else None
        # every stage's attention under context parallelism's mode (its checkpointed blocks recompute under it too)
        with run.cp.active() if run.cp is not None else contextlib.nullcontext():
            out, loss, record = runner.step(
                x,
                n_microbatches=m,
                loss_fn=loss_fn,
                target=target,
                timeline=events,
                kwargs=extra,
                keep_output=self.shows,  # else the step sees a stand-in: no output values kept
            )
        if train:
            self.pending = False
            self.grads = [(p, p.grad) for p in params]
            for p, g in zip(params, held):
                p.grad = g
            self.loss = loss
            loss = loss.detach().clone().requires_grad_()
            if events is not None:
                self.timeline = {**record, "rank": run.pp_rank, "events": events, "n_microbatches": m}
        return out, loss

    def _counted(self, x: Tensor, extra: dict, target: Any, loss_fn: Any, m: int) -> tuple[Any, Tensor]:
        """The router's counting pass (forward only, from the RNG state training starts from); the schedule waits for
        :meth:`finish`."""
        run, runner = self.run_state, self.run_state.runner
        assert run.router is not None
        devices = [runner.device] if runner.device.type == "cuda" else []
        cp = run.cp.active() if run.cp is not None else contextlib.nullcontext()
        with torch.random.fork_rng(devices=devices), run.router.counting(m), cp, torch.no_grad():
            out, _, _ = runner.step(x, n_microbatches=m, kwargs=extra, keep_output=True)
            value = None if out is None else sum(map(loss_fn, out.tensor_split(m), target.tensor_split(m))) / m
            loss = runner.from_last_stage(value, ("loss", "counted"))
            aux = self._reduce_router(loss.dtype)
        self.pending, self.loss, self.deferred = False, loss, (x, extra, target, loss_fn, m)
        self.aux = aux.requires_grad_()
        if out is not None and not self.shows:  # the step sees a stand-in: no values kept
            out = torch.empty(out.shape, dtype=out.dtype, device="meta")
        return out, loss.detach().clone().requires_grad_()

    def _reduce_router(self, dtype: torch.dtype) -> Tensor:
        """After a counting pass: the router loss of the global batch (see ``StagedRouterLoss.reduce``), checked."""
        run = self.run_state
        assert run.router is not None
        aux = run.router.reduce(run.dp_group, run.runner.group, run.runner.device)
        for hooks in run.router_hooks:
            hooks.hold()
        rows = run.router.totals.get("joint", (None, None))[1]
        if self.values and rows is not None and not rows > 0:  # the same total on every rank: all refuse alike
            raise RuntimeError(
                "The pipelined network's router loss counted no token: its stages' router modules did not report"
                " (lightning-dist found them by class before the split). Report this with the model's class; set"
                " output_router_logits=False to pipeline it without the router loss."
            )
        return aux.to(dtype)

    def finish(self, returned: Any) -> None:
        """After training_step, a counted step's schedule: the router loss weighted as the returned loss weighs it."""
        if self.deferred is None:
            return
        (x, extra, target, loss_fn, m), self.deferred = self.deferred, None
        run, aux = self.run_state, self.aux
        assert run.router is not None and aux is not None
        weight = None
        if isinstance(returned, Tensor) and returned.requires_grad:
            (weight,) = torch.autograd.grad(returned, [aux], retain_graph=True, allow_unused=True)
        if weight is None:
            run.counted = False  # the steps do not use the router loss: no counting pass from now on
        counted = self.loss
        with run.router.attaching(weight.detach() * run.dp_size) if weight is not None else contextlib.nullcontext():
            _Call(lambda: self._schedule(x, extra, target, loss_fn, m, True))()
        self.aux_term = None if weight is None else weight.detach() * aux.detach()
        if self.values and counted is not None and self.loss is not None:
            gap = (self.loss.double() - counted.double()).abs() / counted.double().abs().clamp_min(1e-30)
            if gap > max(1e-6, 64 * torch.finfo(counted.dtype).eps):
                raise RuntimeError(
                    f"The pipelined network's training pass gave the batch loss {float(self.loss):.8g}, its router"
                    f" counting pass (forward only, same batch and RNG state) {float(counted):.8g}: its forward is"
                    " not deterministic, so the routing the router loss was taken over is not the one trained."
                    " Make the forward deterministic (torch.use_deterministic_algorithms(True)), or train the router"
                    " loss with hsdp/fsdp2/tp."
                )

    def _shown_output(self, out: Optional[Tensor], train: bool, *, key: tuple, device: Any) -> Tensor:
        """What the step sees of the output: a stand-in on `device`, or the whole output (the opt-in, predict)."""
        run = self.run_state
        if self.shows:
            whole = run.runner.from_last_stage(out, key)
            # a leaf: `backward` finds what training_step's loss did with the output (see `_extra_gradients`)
            return whole.requires_grad_() if train and whole.is_floating_point() else whole
        shape, dtype = run.runner.output_meta(out, key)
        run.calls += 1
        where = "training_step" if train else "an evaluation step (validation_step / test_step)"
        return PipelineOutput(shape, dtype, device, owner=self.owner, where=where, step=run.calls)

    def _loss_of_step(self, labels: Optional[Tensor], m: int, count: Optional[Tensor] = None) -> tuple[Any, Any]:
        """The step's target and per-micro-batch loss (`count`: cp's labelled tokens of the whole sequences)."""
        if labels is not None:
            # each micro-batch's summed loss over the whole batch's labelled tokens (x m: the runner divides by m),
            # so the micro-batches add up to the batch mean whatever tokens each one holds
            if count is not None:
                options = cp_share(self.run_state.cp, count, m)
            else:
                options = {"num_items": labelled_tokens(labels).clamp_min(1) / m}
            return labels, lambda out, tgt: hf_labels_loss(out, tgt, **options)
        loss = self.own_loss or getattr(self.module, "pipeline_loss", None)
        if not callable(loss):
            raise ValueError(
                f"{self.owner} has no `pipeline_loss(output, target)` method and the network"
                " call got no `labels`: the pipeline schedule needs a loss for each micro-batch."
            )
        hook = getattr(self.module, "pipeline_target", None)
        if callable(hook):
            return hook(self.batch), loss
        if isinstance(self.batch, (tuple, list)) and len(self.batch) >= 2:
            return self.batch[1], loss
        raise TypeError(
            f"Cannot find the target in a batch of type {type(self.batch).__name__}: batches must be"
            f" (inputs, target, ...), or define `{self.owner}.pipeline_target(batch)`."
        )

    def serve(self, output: Any, target: Any, original: Any) -> Optional[Tensor]:
        """``pipeline_loss(out, target)`` on the step's last network call's output; None: the module's own loss."""
        call = self.call
        if call is None or output is not call.out:
            if isinstance(output, PipelineOutput):
                raise RuntimeError(
                    f"{self.owner}.pipeline_loss got the output of an earlier call of the pipelined network:"
                    " call the network and its loss in the same step."
                )
            return None
        if call.train:
            check_target(call.target, target, self.owner)
            return call.loss
        if not isinstance(output, PipelineOutput):  # the whole output is here (opt-in, predict): computed as usual
            return None
        run = self.run_state
        if run.cp is not None:  # this rank's part of the sequences: the target's matching chunks
            target = cut_target(run.cp, target, self.owner)
        value = None if call.local is None else original(call.local, target)  # the whole batch: one device's value
        return run.runner.from_last_stage(value, ("loss", "eval"))

    def whole_loss(self, returned: Any) -> Optional[Tensor]:
        """The value one device would have for the returned loss (its other terms summed over the pp ranks)."""
        call = self.call
        if call is None or not isinstance(returned, Tensor) or returned.dim() != 0 or call.loss is None:
            return None
        if returned is call.loss:  # the pipeline's loss itself (no other terms): the same on every rank already
            return returned.detach()
        base = call.loss.detach().to(returned.dtype)
        if self.aux_term is not None:  # the router loss's term: the global batch's already, on every rank
            base = base + self.aux_term.to(returned.dtype)
        extra = returned.detach() - base  # this rank's share of the other terms (0 without any)
        if self.run_state.runner.group is not None:
            dist.all_reduce(extra, group=self.run_state.runner.group)
        return base + extra

    def backward(self, closure_loss: Tensor, scale: float) -> None:
        """Add the schedule's gradients (times `scale`) and those of the returned loss's other terms to ``.grad``."""
        assert self.grads is not None, "backward of a step whose network call ran no schedule backward"
        extra = self._extra_gradients(closure_loss, scale)
        scheduled = ((p, g * scale if scale != 1.0 else g) for p, g in self.grads if g is not None)  # one at a time
        for p, g in itertools.chain(scheduled, extra):
            p.grad = g if p.grad is None else p.grad + g
        self.grads = None

    def _extra_gradients(self, loss: Tensor, scale: float) -> list[tuple[Tensor, Tensor]]:
        """Gradients of the returned loss's terms the schedule did not back-propagate (weight penalties)."""
        call, self.call = self.call, None
        if call is None or not call.train:
            return []
        direct = isinstance(call.out, Tensor) and not isinstance(call.out, PipelineOutput) and call.out.requires_grad
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            raise ValueError(returned_loss_problem(None, scale, self.owner))
        reached = reached_leaves(loss)  # the parameters the returned loss's other terms use (none: the loss alone)
        reached.discard(id(call.loss))
        params = [p for p in self.module.parameters() if p.requires_grad and id(p) in reached] if reached else []
        inputs = [call.loss, *([call.out] if direct else []), *params]
        grads = list(torch.autograd.grad(loss, inputs, allow_unused=True, retain_graph=direct))
        d_loss = grads.pop(0)
        if not direct or grads.pop(0) is None:
            # without values, a gradient on the loss stands for the one copy of it the real run checks it holds
            problem = returned_loss_problem(d_loss if self.values or d_loss is None else scale, scale, self.owner)
            if problem is not None:
                raise ValueError(problem)
            return [(p, g) for p, g in zip(params, grads) if g is not None]
        # the opt-in output used outside pipeline_loss: its gradient there must be the schedule's (one more loss pass)
        if d_loss is not None:
            raise ValueError(output_term_problem(self.owner))
        differs, extra = returned_loss_gradients(
            loss, call.out, call.target, n_microbatches=call.m, scale=scale, pipeline_loss=call.loss_fn, params=params
        )
        mismatch = torch.tensor(float(differs), device=self.run_state.runner.device)
        if dist.is_initialized():  # one verdict on every rank
            dist.all_reduce(mismatch, op=dist.ReduceOp.MAX)
        if mismatch.item():
            raise ValueError(output_term_problem(self.owner))
        return extra


def cut_for_cp(cp: Any, x: Tensor, extra: dict, labels: Optional[Tensor]) -> tuple[Tensor, dict, Any, Any]:
    """Context parallelism's cut of one network call, before the micro-batch split: the input and every ``[B, S,
    ...]`` keyword input cut to this rank's chunks, ``position_ids`` added, HF ``labels`` shifted then cut. Returns
    (input, keyword inputs, labels, labelled tokens of the whole sequences or None)."""
    values = {**extra, _INPUT: x}
    count = None
    if labels is not None:
        values[_LABELS] = shifted = shift_labels(labels)
        count = cp.cp.labelled_tokens(shifted)  # over the dp ranks' batches too: the global batch's token mean
    values = cp.split_sequences(x, values)
    return values.pop(_INPUT), values, values.pop(_LABELS, None), count


_INPUT, _LABELS = "\0input", "\0labels"  # keys no keyword input has


def cp_share(cp: Any, count: Tensor, m: int = 1) -> dict:
    """``hf_labels_loss`` options for this rank's shifted chunks: divided by the whole sequences' labelled tokens,
    / cp (gradients average over cp) and / m (the runner divides each micro-batch by m)."""
    return {"num_items": count.clamp_min(1) / (cp.cp.size * m), "shifted": True}


def cut_target(cp: Any, target: Any, owner: str) -> Tensor:
    """`target`'s chunks matching the last cut (:func:`cut_for_cp`); refused on every rank unless ``[batch, seq,
    ...]`` with the inputs' sequence length."""
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
    """Context parallelism's self-check passes (:mod:`~lightning_dist.parallelize.cp_probe`) through the schedule:
    `inputs` (one sequence per micro-batch) cut as a network call cuts them in the split pass, whole in the unsplit
    one. Every pp rank runs it."""

    def __init__(self, run: PipelineRun, owner: str, inputs: Tensor) -> None:
        self.run_state, self.owner, self.inputs = run, owner, inputs
        self.order = min(run.runner.local_stages)  # the first stage's rank runs the forward's first modules

    def run(self, *, split: bool, loss: Any, index: Tensor, position_ids: Optional[Tensor] = None) -> Optional[Tensor]:
        cp, runner, x = self.run_state.cp, self.run_state.runner, self.inputs
        if position_ids is None and not split:  # every stage takes them under cp; the split adds its own
            position_ids = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        extra = {} if position_ids is None else {"position_ids": position_ids}
        target = index
        if split:
            x, extra, _, _ = cut_for_cp(cp, x, extra, None)
            target = cut_target(cp, index, self.owner)
        mode = cp.active() if split else cp.unsplit()  # the unsplit pass's checkpointed blocks recompute without it
        # eager where blocks are compiled: a compile for the probe's sizes would mark training's sizes dynamic
        eager = torch.compiler.set_stance("force_eager")
        with evaluating(*runner.views), mode, eager, torch.set_grad_enabled(loss is not None):
            out, _, _ = runner.step(
                x, n_microbatches=x.shape[0], loss_fn=loss, target=target, kwargs=extra, keep_output=True
            )
        return None if out is None else out.detach()

    def modules(self) -> list[tuple[str, Any]]:
        return [pair for view in self.run_state.runner.views for pair in module_names(view, self.run_state.network)]


__all__ = [
    "NetworkCall",
    "PipelineOutput",
    "PipelineProbe",
    "PipelineRun",
    "PipelineStep",
    "check_target",
    "cp_share",
    "cut_for_cp",
    "cut_target",
    "output_term_problem",
    "reached_leaves",
    "refusal",
    "returned_loss_gradients",
    "returned_loss_problem",
]
