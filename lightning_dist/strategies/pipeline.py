"""PipelineStrategy: ``torch.distributed.pipelining`` schedules inside Lightning's training loop.

What the LightningModule must provide (checked on every rank before the first collective):

* the network under ``self.<network>`` (default ``self.model``): an ``nn.Sequential``, or a module with a
  stem, one ``nn.ModuleList`` of blocks and a head, whose forward is its children in registration order
  (see :mod:`lightning_dist.parallelize.pipeline`); it takes one tensor and returns one tensor. Or an
  unmodified HuggingFace causal LM (``LlamaForCausalLM``, ``GPT2LMHeadModel``...): called with
  ``input_ids`` and keyword inputs (``attention_mask``, ``position_ids``: split into micro-batches and
  given to every stage) and ``labels`` (HF's loss convention), it returns a ``CausalLMOutputWithPast``
  whose ``loss`` and ``logits`` are the single-device values (see :mod:`~lightning_dist.parallelize.pipeline_hf`);
* ``pipeline_loss(output, target) -> Tensor``: the mean loss of one micro-batch, used by the schedule's
  backward (gradients are averaged over micro-batches, as for a mean over the batch); not needed by a HF
  model called with ``labels`` (each micro-batch's loss is divided by the whole batch's labelled tokens);
* weights tied across stages (a head tied to the token embedding) are held by each stage that uses them,
  their gradients summed between those stages' ranks every step (Megatron's embedding group); the
  checkpoint holds the tensor once, under the unsplit model's name for it, and every copy loads from it;
* batches ``(inputs, target, ...)``, or a ``pipeline_target(batch)`` hook returning the target;
* for ``split="balanced"``: ``example_input_array`` set to one micro-batch of inputs;
* a forward that is its children run in order: checked on ``example_input_array`` before any collective,
  else on the first micro-batch against a host copy of the unsplit network (one verdict for all ranks).

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

Checkpoints are sharded (each stage writes its own parameters under their single-device names, optimizer
states keyed by name); a pp=2 checkpoint loads into any pipeline layout or, converted with torch's
``dcp_to_torch_save``, into the plain single-device module.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

import lightning.pytorch as pl
from lightning_dist import checkpoint as ckpt
from lightning_dist._integrations.lightning import route_clip_grad_by_norm
from lightning_dist.mesh import PP, TP, MeshSpec
from lightning_dist.parallelize import pipeline as plan
from lightning_dist.parallelize import ParallelizeConfig, pipeline_model
from lightning_dist.parallelize.compile import check_compile_option
from lightning_dist.parallelize.pipeline_schedule import (
    SCHEDULES,
    PipelineRunner,
    global_grad_norm,
    grads_by_layout,
    returned_loss_gradients,
    schedule_problems,
)
from lightning_dist.parallelize.pipeline_hf import hf_example_inputs, hf_labels_loss, is_hf_causal_lm, labelled_tokens
from lightning_dist.parallelize.pipeline_tied import (
    save_tied_once,
    sum_tied_gradients,
    tied_aliases,
    tied_checkpoint_keys,
    tied_gradient_groups,
    tied_problems,
)
from lightning_dist.parallelize.tp import TPEntry, format_plan, resolve_stage_plan
from lightning_dist.strategies.base import MeshStrategy

log = logging.getLogger(__name__)

_PENDING = object()  # training_step is running: the network call takes the target from its inputs or the batch
# keyword inputs of a HF causal LM that every stage takes (split into micro-batches along dim 0)
_HF_STAGE_INPUTS = frozenset({"attention_mask", "position_ids", "token_type_ids"})


class PipelineStrategy(MeshStrategy):
    """Pipeline parallelism on the mesh's ``pp`` dim with torch's schedules; the rest of the ranks do data parallelism.

    Args:
        pp: pipeline degree; default: all devices (divided by ``tp`` and integer data-parallel sizes).
        schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"``, ``"zero_bubble"`` (ZBV, 2 stages per rank)
            or ``"interleaved_zero_bubble"``.
        n_microbatches: micro-batches per step; every batch must divide into them. Default ``2 * pp``.
        stages_per_rank: stages each rank runs (interleaved schedules); default from the schedule.
        split: ``"balanced"`` (measured forward+backward time per block on ``example_input_array``),
            ``"params"`` (parameter count), manual split points (block indices where stages 1.. start), or
            ``"auto"``: balanced when the module has an ``example_input_array``, else by parameters.
        network: attribute of the LightningModule holding the network to pipeline.
        allow_batchnorm: pipeline BatchNorm layers anyway (with a warning): their statistics come from one
            micro-batch, so they differ from single-device training.
        reshard_after_forward: FSDP2 option on the data-parallel dims (False keeps parameters gathered
            across the micro-batches of a step).
        record_timeline: record each rank's F/B/W actions per step (see ``PipelineBubble``).
        tp: tensor-parallel degree inside each stage (the mesh is ``pp x dp x tp``); 1: none.
        tp_plan: the tensor-parallel plan when ``tp > 1``: ``"auto"``, a built-in plan name or a mapping
            ``{module-name glob: style}`` (see :mod:`lightning_dist.parallelize.tp`). It is checked on the
            whole network (every pattern must match somewhere), then each stage applies the entries of the
            modules it holds. The network's output must be whole on every tensor rank (the loss sees it):
            give a sharded head ``colwise_gather``. Sequence parallelism is not available inside stages.
        compile: True to ``torch.compile`` each block of each stage (after tensor parallelism, before FSDP2),
            or block class names to compile. Not with the zero-bubble schedules: their split backward (input
            gradients first, weight gradients later) needs each block's autograd graph, which a compiled
            block replaces with one node.
        activation_checkpointing: True to checkpoint each block of each stage (recompute its activations in
            backward), or block class names.
        **kwargs: mesh and checkpoint options of :class:`MeshStrategy` (``dp_replicate``, ``dp_shard``...).
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        *,
        pp: Optional[int] = None,
        schedule: str = "1f1b",
        n_microbatches: Optional[int] = None,
        stages_per_rank: Optional[int] = None,
        split: Union[plan.Split, str] = "auto",
        network: str = "model",
        allow_batchnorm: bool = False,
        reshard_after_forward: bool = False,
        record_timeline: bool = False,
        tp: int = 1,
        tp_plan: Union[str, Mapping[str, Any]] = "auto",
        compile: Union[bool, Sequence[str]] = False,
        activation_checkpointing: Union[bool, Sequence[str]] = False,
        **kwargs: Any,
    ) -> None:
        problems = check_compile_option(compile)
        if compile is not False and "zero_bubble" in schedule:
            problems.append(f"`compile` with schedule={schedule!r} is not supported: the zero-bubble split backward"
                            " needs each block's autograd graph; use schedule='1f1b' or 'interleaved_1f1b'.")
        if compile is not False and kwargs.get("parallelize_fn") is not None:
            problems.append("`compile` is applied by the built-in pipeline plan, which `parallelize_fn` replaces.")
        if problems:
            raise ValueError(f"Invalid {type(self).__name__} configuration:\n  - " + "\n  - ".join(problems))
        if kwargs.get("save_distributed_checkpoint") is False:
            raise ValueError("PipelineStrategy writes sharded checkpoints (save_distributed_checkpoint=True): each"
                             " stage saves its own parameters. For one file, convert the directory with torch's"
                             " `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` (weights under 'state_dict').")
        if not isinstance(tp_plan, (str, Mapping)):
            raise TypeError(f"`tp_plan` must be 'auto', a built-in plan name or a mapping of pattern -> style;"
                            f" got {type(tp_plan).__name__}.")
        super().__init__(pp=1 if pp is None else pp, tp=tp, **kwargs)
        self.tp_plan = dict(tp_plan) if isinstance(tp_plan, Mapping) else tp_plan
        self.compile = compile
        self.activation_checkpointing = activation_checkpointing
        self.tp_entries: list[TPEntry] = []
        """The resolved tensor-parallel plan (on the whole LightningModule; filled in ``parallelize``)."""
        if schedule not in SCHEDULES:
            raise ValueError(f"`schedule={schedule!r}` must be one of {sorted(SCHEDULES)}.")
        self._pp_auto = pp is None
        self.schedule = schedule
        self.stages_per_rank = SCHEDULES[schedule][1] if stages_per_rank is None else stages_per_rank
        self._n_microbatches = n_microbatches
        self.split_option = split
        self.network = network
        self.allow_batchnorm = allow_batchnorm
        self.reshard_after_forward = reshard_after_forward
        self.record_timeline = record_timeline
        self.timelines: list[dict] = []
        self.split: Optional[plan.PipelineSplit] = None
        self.last_loss: Optional[Tensor] = None
        self._local_stages: list[int] = []
        self._runner: Optional[PipelineRunner] = None
        self._target: Any = None
        self._batch: Any = None
        self._hf = False  # a HuggingFace causal LM: keyword inputs, `labels`, a ModelOutput returned
        self._tied: list[tuple[Tensor, Any, bool]] = []  # (parameter, group of its holders' ranks, counted in the norm)
        # (checkpoint key, keys of its copies, saved by this rank) of each tied parameter: saved once
        self._tied_keys: list[tuple[str, tuple[str, ...], bool]] = []
        self._stash: Optional[list[tuple[Tensor, Optional[Tensor]]]] = None
        self._returned: Optional[tuple[Tensor, Any, int]] = None  # (output leaf, target, micro-batches) of the step
        self._unsplit: Optional[nn.Module] = None  # CPU copy of the network until the first batch checked the stages

    # ---- configuration -------------------------------------------------------------------------
    @property
    def n_microbatches(self) -> int:
        return 2 * self._sizes["pp"] if self._n_microbatches is None else self._n_microbatches

    @property
    def local_stages(self) -> list[int]:
        """Indices of the pipeline stages this rank runs (set up in ``setup``)."""
        return list(self._local_stages)

    @override
    def pipeline_view(self) -> "PipelineStrategy":
        """This strategy is its own :class:`~lightning_dist.parallelize.pipeline.PipelineView`."""
        return self

    @property
    def stage_modules(self) -> list[nn.Module]:
        """This rank's stage modules as the schedule runs them (empty before ``setup``)."""
        return [] if self._runner is None else list(self._runner.views)

    def pop_timelines(self) -> list[dict]:
        """The recorded step timelines since the last call (``record_timeline=True``), handed over once."""
        out, self.timelines = self.timelines, []
        return out

    @property
    def num_stages(self) -> int:
        return self._sizes["pp"] * self.stages_per_rank

    @override
    def mesh_spec(self) -> MeshSpec:
        if self._pp_auto:  # all devices left after tp and explicit data-parallel sizes
            rest = self.num_nodes * self.num_processes // self._sizes["tp"]
            for name in ("dp_replicate", "dp_shard"):
                if isinstance(self._sizes[name], int):
                    rest //= self._sizes[name]
                else:
                    self._sizes[name] = 1
            self._sizes["pp"] = max(1, rest)
        return super().mesh_spec()

    @override
    def validate_config(self, spec: MeshSpec) -> None:
        pp, problems = spec.size(PP), []
        problems += schedule_problems(self.schedule, pp, self.n_microbatches, self.stages_per_rank)
        module = self.lightning_module
        net = getattr(module, self.network, None)
        if self._is_pipelined(net):
            return  # the same Trainer again (validate/test after fit): already split and checked
        if plan.is_pipelined_module(net):
            problems.append(f"{type(module).__name__}.{self.network} was already split by another PipelineStrategy;"
                            " build a fresh module (or load a checkpoint into one) for a new Trainer.")
        elif not isinstance(net, nn.Module):
            problems.append(f"{type(module).__name__}.{self.network} must be the network to pipeline (an nn.Module);"
                            f" got {type(net).__name__}. Set `network=` to the attribute that holds it.")
        if not callable(getattr(module, "pipeline_loss", None)) and not (
                isinstance(net, nn.Module) and is_hf_causal_lm(net)):  # HF models: the `labels` convention
            problems.append(f"{type(module).__name__} has no `pipeline_loss(output, target)` method: the pipeline"
                            " schedule computes the loss of each micro-batch on the last stage with it.")
        if problems or net is None:
            raise ValueError(f"Invalid {type(self).__name__} configuration:\n  - " + "\n  - ".join(problems))
        # split arithmetic (TypeError for a network of another shape) and tied weights with parameter counts;
        # the balanced split is checked again once measured
        mode = self.split_mode()
        check = plan.plan_split(net, self.num_stages, split="params" if mode == "balanced" else mode)
        plan.check_splittable(net, check, allow_batchnorm=self.allow_batchnorm)
        if spec.size(TP) > 1:
            resolve_stage_plan(module, net, self.tp_plan, tp=spec.size(TP))
        if mode == "balanced" and getattr(module, "example_input_array", None) is None and not is_hf_causal_lm(net):
            raise ValueError(f'split="balanced" profiles each block on a sample micro-batch: set'
                             f" `{type(module).__name__}.example_input_array` to one micro-batch of inputs,"
                             ' or pass split="params".')
        sample = self._sample(net)
        if sample is not None:  # the stages must compute the model's own forward (else: the first batch, in `_run`)
            plan.check_staged_forward(net, sample)

    def _sample(self, net: nn.Module) -> Any:
        """``example_input_array`` on the network's device and floating dtype; None without one (or on meta).

        A HuggingFace causal LM gets keyword inputs: ``example_input_array`` (ids, or a mapping), else ids
        built from its config (:func:`~lightning_dist.parallelize.pipeline_hf.hf_example_inputs`).
        """
        example = getattr(self.lightning_module, "example_input_array", None)
        first = next(iter(net.parameters()), None)
        if first is None or first.is_meta:
            return None
        if is_hf_causal_lm(net):
            if example is None:
                return hf_example_inputs(net)
            example = dict(example) if isinstance(example, Mapping) else {"input_ids": example}
            return {k: torch.as_tensor(v).to(first.device) for k, v in example.items()}
        if example is None:
            return None
        sample = torch.as_tensor(example).to(first.device)
        dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), None)
        return sample.to(dtype) if dtype is not None and sample.is_floating_point() else sample

    def split_mode(self) -> Any:
        """The split that will be used: ``split`` with ``"auto"`` resolved for the attached module."""
        if isinstance(self.split_option, str) and self.split_option == "auto":
            net = getattr(self.lightning_module, self.network, None)
            has_sample = getattr(self.lightning_module, "example_input_array", None) is not None or (
                isinstance(net, nn.Module) and is_hf_causal_lm(net))  # HF: a sample from the config
            return "balanced" if has_sample else "params"
        return self.split_option

    # ---- model set-up --------------------------------------------------------------------------
    def _is_pipelined(self, net: Any) -> bool:
        return plan.is_pipelined_module(net) and net.runner == self._run

    @override
    def already_parallelized(self) -> bool:
        # stages without FSDP or TP hold plain tensors: the split itself marks a pipelined module
        return self._is_pipelined(getattr(self.lightning_module, self.network, None)) or super().already_parallelized()

    @override
    def parallelize(self, module: pl.LightningModule) -> None:
        net = getattr(module, self.network)
        if self._is_pipelined(net):
            return
        mesh, pp = self.mesh, self.mesh.size(PP)
        self._hf = is_hf_causal_lm(net)
        costs = None
        mode = self.split_mode()
        sample = self._sample(net)
        if sample is None and not any(p.is_meta for p in net.parameters()):
            # no sample micro-batch: the staged forward is compared with this copy on the first batch (in `_run`)
            self._unsplit = plan.host_copy(net)
        if mode == "balanced":
            assert sample is not None
            # profiled on global rank 0 alone (the others would compete for its cores), the same split everywhere
            costs = plan.profile_costs(net, plan.network_layout(net), sample) if self.global_rank == 0 else None
            costs = self.broadcast(costs)
            log.debug("pipeline block costs (ms): stem %s, blocks %s, head %s", *costs)
        self.split = plan.plan_split(net, self.num_stages, split=mode, costs=costs)
        plan.check_splittable(net, self.split, allow_batchnorm=self.allow_batchnorm)
        stage_ranks = plan.stage_ranks(self.num_stages, pp, SCHEDULES[self.schedule][2])  # type: ignore[arg-type]
        pp_rank = mesh.local_rank(PP) if pp > 1 else 0
        self._local_stages = [s for s, r in enumerate(stage_ranks) if r == pp_rank]
        rank_zero_info(self.split.format(stage_ranks))
        entries = None
        if mesh.size(TP) > 1:  # one plan checked on the whole network; each stage applies the entries it holds
            entries = self.tp_entries = resolve_stage_plan(module, net, self.tp_plan, tp=mesh.size(TP))
            rank_zero_info(format_plan(self.tp_entries, tp=mesh.size(TP)))
        # the same assembly as every strategy: split, then parallelize_model per stage (TP, AC, compile, FSDP2)
        config = ParallelizeConfig(zero_stage=3 if self.reshard_after_forward else 2,
                                   activation_checkpointing=self.activation_checkpointing, compile=self.compile,
                                   tp_entries=entries, tp_owner=module)
        tied = self._tied_groups(net, stage_ranks)  # before the split drops the rest of the network
        self._tied_keys = tied_checkpoint_keys(net, plan.tied_stages(net, self.split), stage_ranks, pp_rank=pp_rank,
                                               prefix=f"{self.network}.")
        container, views = pipeline_model(net, mesh, config, split=self.split, stage_indices=self._local_stages)
        # the parameters as parallelized (FSDP2 replaces them with sharded ones), found by single-device name
        held = dict(container.named_parameters(remove_duplicate=False))
        self._tied = [(next(held[n] for n in names if n in held), group, counted) for names, group, counted in tied]
        setattr(module, self.network, container)  # the rest of the network is dropped here
        self._runner = PipelineRunner(views, self._local_stages, stage_ranks, schedule=self.schedule,
                                      device=self.root_device, group=mesh.group(PP) if pp > 1 else None)
        container.runner = self._run

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
        if self._unsplit is not None:
            self._check_first_batch(x[: batch // m])
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
        if not callable(getattr(module, "pipeline_loss", None)) and not (
                isinstance(net, nn.Module) and is_hf_causal_lm(net)):  # HF models: the `labels` convention
            raise ValueError(f"{type(module).__name__} has no `pipeline_loss(output, target)` method and the network"
                             " call got no `labels`: the pipeline schedule needs a loss for each micro-batch.")
        return self._pipeline_target(self._batch), module.pipeline_loss

    def _tied_groups(self, net: nn.Module, stage_ranks: Sequence[int]) -> list[tuple[tuple[str, ...], Any, bool]]:
        """Tied parameters across stages (see :mod:`~lightning_dist.parallelize.pipeline_tied`), refused or grouped."""
        assert self.split is not None
        tied = plan.tied_stages(net, self.split)
        problems = tied_problems(tied, stage_ranks, dp_size=self.mesh.dp_size, tp_size=self.mesh.size(TP))
        if problems:
            raise ValueError("Cannot pipeline tied parameters:\n  - " + "\n  - ".join(problems))
        if tied:
            rank_zero_info(f"pipeline: tied parameters {[list(n) for n, _ in tied]}: gradients summed over their stages")
        return tied_gradient_groups(tied, stage_ranks, spec=self.mesh.spec, rank=self.global_rank) if tied else []

    def _check_first_batch(self, sample: Tensor) -> None:
        """The staged forward against the unsplit copy on the first micro-batch; refused on every rank if any differs."""
        assert self._unsplit is not None
        unsplit, self._unsplit = self._unsplit, None
        dtype = next((p.dtype for p in unsplit.parameters() if p.is_floating_point()), None)
        sample = sample.detach().cpu()
        problem = plan.staged_forward_problem(unsplit, sample.to(dtype) if dtype and sample.is_floating_point() else sample)
        flag = torch.tensor(float(problem is not None), device=self.root_device)
        if torch.distributed.is_initialized():  # data-parallel ranks see different batches: one verdict for all
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item():
            raise ValueError(problem or "The pipeline stages compute a different network than the model's forward on"
                             " another rank's first micro-batch: its forward does work outside the child modules.")

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
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == "fit" and not self.lightning_module.automatic_optimization:
            # the schedule computes the gradients itself: a loss rescaled before manual_backward would be ignored
            raise ValueError(
                f"{type(self).__name__} supports automatic optimization only (found"
                f" `{type(self.lightning_module).__name__}.automatic_optimization = False`): the pipeline schedule"
                " runs forward and backward inside the network call. Use automatic optimization, with"
                " `accumulate_grad_batches` for accumulation."
            )
        super().setup(trainer)
        # Lightning clips each process's gradients alone; the norm must span every stage (and FSDP shard)
        route_clip_grad_by_norm(self.precision_plugin, self._clip_grad_by_norm)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        skip = {id(p) for p, _, counted in self._tied if not counted}  # a tied copy counts once in the norm
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None and id(p) not in skip]
        total = global_grad_norm(grads, self.mesh.group(PP) if self.mesh.size(PP) > 1 else None, device=self.root_device)
        # torch's rule (coefficient max_norm / (norm + 1e-6), at most 1), one foreach call per gradient layout
        coef = min(1.0, float(clip_val) / (total.item() + 1e-6))
        for group in grads_by_layout(grads):
            torch._foreach_mul_(group, coef)

    # ---- checkpoints: each stage holds only its own keys ----------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.model is not None
        fitting = self.lightning_module.trainer.state.fn == "fit"
        return ckpt.load_stage(self.broadcast(checkpoint_path), model=self.model,
                               optimizers=self.optimizers if fitting else (),
                               weights_only=True if weights_only is None else weights_only,
                               aliases=tied_aliases(self._tied_keys))

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return save_tied_once(super().lightning_module_state_dict(), self._tied_keys)  # a tied weight once

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # keyed by parameter name: stages hold different parameters, so list-indexed param_groups would collide
        return save_tied_once(ckpt.name_keyed_optimizer_state(self.model, optimizer), self._tied_keys, optimizer=True)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        aliases = tied_aliases(self._tied_keys)
        if aliases:  # consolidation gives every name of the plain model's state_dict the saved tensor
            checkpoint = {**checkpoint, ckpt.TIED_KEY: aliases}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def teardown(self) -> None:
        if self._runner is not None:
            self._runner.clear()
        super().teardown()


__all__ = ["PipelineStrategy"]
