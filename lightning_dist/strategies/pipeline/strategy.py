"""PipelineStrategy: ``torch.distributed.pipelining`` schedules inside Lightning's training loop.
Notes: docs/internals.md."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_dist import checkpoint as ckpt
from lightning_dist import rules
from lightning_dist._integrations.transformers_moe import router_loss_in_use
from lightning_dist._integrations.transformers_routers import (
    StageRouterHooks,
    original_loss_function,
    router_loss_spec,
)
from lightning_dist.mesh import DP_CP, PP, TP, MeshSpec
from lightning_dist.parallelize import ParallelizeConfig, pipeline_model
from lightning_dist.parallelize.ac import check_offload_device
from lightning_dist.parallelize.cp_probe import probe_inputs
from lightning_dist.parallelize.ep import ep_problems, find_experts
from lightning_dist.parallelize.moe import StagedRouterLoss, router_loss_methods
from lightning_dist.parallelize.pipeline import split as plan
from lightning_dist.parallelize.pipeline.checks import host_copy, tied_stages
from lightning_dist.parallelize.pipeline.schedule import PipelinePeer, PipelineRunner, schedule_problems
from lightning_dist.parallelize.pipeline.stages import is_pipelined_module
from lightning_dist.parallelize.pipeline.tied import save_tied_once, tied_aliases, tied_checkpoint_keys
from lightning_dist.parallelize.tp.apply import resolve_stage_plan
from lightning_dist.parallelize.tp.plan import format_plan
from lightning_dist.parallelize.tp.vocab import TPEntry
from lightning_dist.rules import SCHEDULES
from lightning_dist.strategies.base import serve_pipeline_loss, unserve_pipeline_loss
from lightning_dist.strategies.fault_tolerance import ReplicaGroupsMixin
from lightning_dist.strategies.ft_config import FaultToleranceArg
from lightning_dist.strategies.pipeline import setup as checks
from lightning_dist.strategies.pipeline.step import PipelineProbe, PipelineRun, PipelineStep

log = logging.getLogger(__name__)


class PipelineStrategy(ReplicaGroupsMixin):
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
        tp_plan: the tensor-parallel plan when ``tp > 1``, checked on the whole network, applied per stage; the
            output must be whole on every tensor rank (a sharded head: ``colwise_gather``); no sequence parallelism.
            ``activation_checkpointing`` and ``compile`` apply per block of each stage (neither compile nor
            selective checkpointing with the zero-bubble schedules).
        broadcast_output: give every pp rank the network's whole output (broadcast from the last stage each step).
            Default False: the steps see a stand-in that answers ``pipeline_loss(out, target)`` / HF ``out.loss``
            with the batch loss and refuses any other use. Predict always broadcasts.
        fault_tolerance: a :class:`~lightning_dist.strategies.ft_config.FaultTolerance`: the ``dp_replicate``
            replicas are torchft replica groups, each its own job (``sync="step"``; docs/fault_tolerance.md).
        **kwargs: mesh, model and checkpoint options of :class:`MeshStrategy` (``dp_replicate``, ``dp_shard``,
            ``tp_plan``, ``activation_checkpointing``, ``compile``...).
    """

    strategy_name = "pipeline"
    _applies_tp_plan = True

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
        broadcast_output: bool = False,
        fault_tolerance: FaultToleranceArg = None,
        **kwargs: Any,
    ) -> None:
        problems = checks.option_problems(schedule=schedule, options=kwargs)
        problems += self._take_fault_tolerance(fault_tolerance, kwargs, 3 if reshard_after_forward else 2)
        if self._ft is not None and self._ft.diloco:
            problems.append(
                "fault_tolerance with sync='diloco' under PipelineStrategy is not supported yet (DiLoCo's state in"
                " a checkpoint is one rank's, and a pipeline rank holds one stage): use sync='step', or DiLoCo with"
                " hsdp/fsdp2."
            )
        if schedule not in SCHEDULES:
            problems.insert(0, f"`schedule={schedule!r}` must be one of {sorted(SCHEDULES)}.")
        if kwargs.get("cp_network", "auto") not in ("auto", network):
            problems.append(
                f"`cp_network={kwargs['cp_network']!r}` differs from `network={network!r}`: a pipeline splits the"
                " sequences of the network it pipelines. Pass `network` only."
            )
        kwargs["cp_network"] = network
        self._defer_problems(problems)  # raised by MeshStrategy with the mesh's and the model options' problems
        super().__init__(pp=1 if pp is None else pp, tp=tp, **kwargs)
        self.broadcast_output = bool(broadcast_output)
        self.tp_entries: list[TPEntry] = []  # the resolved tensor-parallel plan, filled in `parallelize`
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
        self._pipeline: Optional[PipelineRun] = None  # made by `parallelize`
        self._peer: Optional[PipelinePeer] = None  # see `answer_peers_with`
        self._plan: Optional[tuple[checks.PipelinePlan, Optional[list[TPEntry]]]] = None  # see `_checked_plan`
        self._uncounted: list[Tensor] = []  # tied weights' copies left out of the gradient norm (one copy counts)
        self._tied_keys: list[tuple[str, tuple[str, ...], bool]] = []  # see `tied_checkpoint_keys`
        self._step: Optional[PipelineStep] = None  # the running step, dropped at its end (training: by backward)
        self._own_loss: Any = None  # the module's pipeline_loss while the strategy serves it
        self._cp_probe_inputs: Optional[tuple[Tensor, str]] = None  # made before the split (stage 0 holds the vocab)
        self._ep_probe_inputs: Optional[tuple[Tensor, str]] = None  # the same for the ep self-check (one per run)
        self.ep_check_report: Any = None

    @property
    def n_microbatches(self) -> int:
        return 2 * self._sizes["pp"] if self._n_microbatches is None else self._n_microbatches

    def answer_peers_with(self, peer: PipelinePeer) -> None:
        """Take what the other pp ranks' stages would send (their metadata, the output's shape) from `peer` instead
        of the pp group: for a process group that delivers no values (the dry run). Call before ``setup``."""
        self._peer = peer

    @property
    def local_stages(self) -> list[int]:
        """Indices of the pipeline stages this rank runs (set up in ``setup``)."""
        return list(self._local_stages)

    @override
    def pipeline_view(self) -> "PipelineStrategy":
        """This strategy is its own :class:`~lightning_dist.parallelize.pipeline.split.PipelineView`."""
        return self

    @property
    def stage_modules(self) -> list[nn.Module]:
        """This rank's stage modules as the schedule runs them (empty before ``setup``)."""
        return [] if self._pipeline is None else list(self._pipeline.runner.views)

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
        if self.offload_activations:  # the root device is known only once Lightning set the devices
            check_offload_device(True, self.root_device)
        pp, problems = spec.size(PP), []
        problems += schedule_problems(self.schedule, pp, self.n_microbatches, self.stages_per_rank)
        if spec.cp > 1 and self.broadcast_output:
            problems.append(
                f"broadcast_output=True with cp={spec.cp}: each rank's output holds its part of the sequences only."
                " Use the default stand-in (pipeline_loss(out, target) / HF out.loss), or cp=1."
            )
        module = self.lightning_module
        net = getattr(module, self.network, None)
        if self._is_pipelined(net):
            return  # the same Trainer again (validate/test after fit): already split and checked
        problems += checks.module_problems(module, self.network, net)
        if isinstance(net, nn.Module) and (moe := router_loss_in_use(net)) is not None and not router_loss_spec(net):
            # the routers the stages' hooks report from (the loss needs every layer's statistics) are not found
            problems.append(
                f"{moe} adds a router load-balancing loss computed from every layer's router statistics together"
                " (config.output_router_logits=True, router_aux_loss_coef > 0), and lightning-dist cannot find its"
                " router modules (transformers' _can_record_outputs['router_logits']) or its num_experts /"
                " num_experts_per_tok, which the stages need to count the routing before the schedule. Set"
                " output_router_logits=False (or router_aux_loss_coef=0) to pipeline it, or train it with"
                " hsdp/fsdp2/tp, where that loss is taken over the global batch."
            )
        if self.ep > 1 and isinstance(net, nn.Module):  # each stage's experts split over ep ranks of its dp_shard x
            # cp (x tp): its ep peers run the same schedule, so they exchange each micro-batch's tokens together
            problems += ep_problems(net, ep=self.ep, dp_shard=spec.size("dp_shard"), cp=spec.cp, tp=spec.size(TP))
        if problems or net is None:
            raise ValueError(f"Invalid {type(self).__name__} configuration:\n  - " + "\n  - ".join(problems))
        self._plan = self._checked_plan(module, net, spec.size(TP))  # `parallelize` uses it

    def _checked_plan(
        self, module: Any, net: nn.Module, tp: int
    ) -> tuple[checks.PipelinePlan, Optional[list[TPEntry]]]:
        """The split plan (a balanced split is measured in ``parallelize``) and the TP plan on the whole network."""
        setup = checks.plan_pipeline(
            module, net, self.num_stages, self.split_mode(), allow_batchnorm=self.allow_batchnorm
        )
        return setup, resolve_stage_plan(module, net, self.tp_plan, tp=tp) if tp > 1 else None

    def split_mode(self) -> Any:
        """The split that will be used: ``split`` with ``"auto"`` resolved for the attached module."""
        return checks.resolve_split_mode(self.split_option, self.lightning_module, self.network)

    def _is_pipelined(self, net: Any) -> bool:
        return is_pipelined_module(net) and net.runner == self._run

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
        # made by `validate_config`, unless it did not run for this network
        (setup, entries), self._plan = self._plan or self._checked_plan(module, net, mesh.size(TP)), None
        layout = setup.layout
        sample = None if setup.sample is None else layout.place_sample(setup.sample, net)  # on the device now
        # no sample micro-batch: the staged forward is compared with this copy on the first batch (see `PipelineRun`)
        unsplit = host_copy(net) if sample is None and not any(p.is_meta for p in net.parameters()) else None
        self.split = setup.split
        example = getattr(module, "example_input_array", None)
        if self._cp is not None:  # cp's self-check batch, one sequence per micro-batch (see `check_context_parallel`)
            self._cp_probe_inputs = probe_inputs(net, mesh.cp_size, example=example, rows=self.n_microbatches)
        if self.ep > 1 and self.self_check:  # the experts' self-check batch (see `check_split_model`)
            self._ep_probe_inputs = probe_inputs(net, 1, example=example, rows=self.n_microbatches)
        if setup.mode == "balanced":
            assert sample is not None
            # profiled on global rank 0 alone (the others would compete for its cores), the same split everywhere
            costs = layout.profile(net, sample) if self.global_rank == 0 else None
            costs = self.broadcast(costs)
            log.debug("pipeline block costs (ms): stem %s, blocks %s, head %s", *costs)
            self.split = plan.plan_split(net, self.num_stages, split="balanced", costs=costs, layout=layout)
        stage_ranks = rules.stage_ranks(self.num_stages, pp, SCHEDULES[self.schedule][2])  # type: ignore[arg-type]
        pp_rank = mesh.local_rank(PP) if pp > 1 else 0
        self._local_stages = [s for s, r in enumerate(stage_ranks) if r == pp_rank]
        rank_zero_info(self.split.format(stage_ranks))
        if entries is not None:
            self.tp_entries = entries
            rank_zero_info(format_plan(entries, tp=mesh.size(TP)))
        config = ParallelizeConfig(
            zero_stage=3 if self.reshard_after_forward else 2,
            activation_checkpointing=self.activation_checkpointing,
            compile=self.compile,
            selective_ac_ops=self.selective_ac_ops,
            offload_activations=self.offload_activations,
            tp_entries=entries,
            tp_owner=module,
            recompute_context=self._cp.active if self._cp is not None else None,
            split_backward="zero_bubble" in self.schedule,
            ep=self.ep,
            ep_capacity_factor=self.model_options.ep_capacity_factor,
        )
        # before the split drops the rest of the network
        served = router_loss_methods(net)  # answered with the global batch's loss (see `_router_loss`)
        spec = router_loss_spec(net)  # a transformers model's router loss (its stages' routers report by hooks)
        loss_of = original_loss_function(net) if spec is not None else None
        tied_names = tied_stages(net, self.split)
        tied = checks.tied_groups(tied_names, stage_ranks, mesh=self.mesh, rank=self.global_rank)
        self._tied_keys = tied_checkpoint_keys(net, tied_names, stage_ranks, pp_rank=pp_rank, prefix=f"{self.network}.")
        container, views = pipeline_model(net, mesh, config, split=self.split, stage_indices=self._local_stages)
        # the parameters as parallelized (FSDP2 replaces them with sharded ones), found by single-device name
        held = dict(container.named_parameters(remove_duplicate=False))
        tied = [(next(held[n] for n in names if n in held), group, counted) for names, group, counted in tied]
        self._uncounted = [p for p, _, counted in tied if not counted]
        setattr(module, self.network, container)  # the rest of the network is dropped here
        group = mesh.group(PP) if pp > 1 else None
        runner = PipelineRunner(
            views,
            self._local_stages,
            stage_ranks,
            schedule=self.schedule,
            device=self.root_device,
            group=group,
            tied=[(p, g) for p, g, _ in tied],
            peer=self._peer,
        )
        self._pipeline = PipelineRun(
            runner,
            layout,
            n_microbatches=self.n_microbatches,
            pp_rank=pp_rank,
            cp=self._cp,
            network=self.network,
            unsplit=unsplit,
        )
        if served or spec is not None:
            dp = mesh.size(DP_CP) if self.moe_aux_loss == "global" else 1  # "local": each rank's own tokens
            run = self._pipeline
            run.router = StagedRouterLoss(joint_experts=spec.num_experts if spec is not None else 0)
            run.dp_group, run.dp_size = mesh.group(DP_CP) if dp > 1 else None, dp
            if spec is not None:
                run.router_coef = spec.coef
                run.router_hooks = [StageRouterHooks(view, spec, loss_of) for view in views]
        container.runner = self._run
        for name in served:
            setattr(container, name, self._router_loss)

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
        module = self.lightning_module
        if self._own_loss is None:
            # `self.pipeline_loss(out, target)` on the network call's output answers with the pipeline's batch loss
            self._own_loss = serve_pipeline_loss(module, self._serve_loss)

    @override
    def teardown(self) -> None:
        if self._pipeline is not None:
            self._pipeline.runner.clear()  # the router hooks stay: inert outside a step, needed by a later validate
        if self.lightning_module is not None:
            unserve_pipeline_loss(self.lightning_module, self._own_loss)
        self._own_loss, self._step = None, None
        super().teardown()

    # context parallelism: the network call cuts the sequences (see `step.cut_for_cp`)
    @override
    def _check_cp_model(self) -> None:
        if not self._is_pipelined(getattr(self.lightning_module, self.network, None)):  # checked before its split
            super()._check_cp_model()

    @override
    def _attach_cp(self) -> None:
        # no hook on the network's inputs and no target server: the pipeline step cuts the batch before the schedule
        # splits it into micro-batches, and gives each micro-batch's loss its chunks of the target
        assert self._cp is not None
        self._cp.attach(getattr(self.lightning_module, self.network), hook=False)

    @override
    def step_context(self) -> Any:
        # the network call holds the attention mode around the schedule itself (not around the first-batch check)
        return contextlib.nullcontext()

    @override
    def cp_probe(self) -> Optional[tuple[Any, str]]:
        found, self._cp_probe_inputs = self._cp_probe_inputs, None
        if found is None or self._pipeline is None:
            return None
        inputs, sample = found
        dtype = next(iter(self._pipeline.runner.params)).dtype if inputs.is_floating_point() else None
        owner, inputs = type(self.lightning_module).__name__, inputs.to(self.root_device, dtype)
        return PipelineProbe(self._pipeline, owner, inputs), f"{sample} (one per micro-batch)"

    @override
    def check_context_parallel(self) -> None:
        probed = self._cp_probe_due and self.self_check
        try:
            super().check_context_parallel()
        finally:
            if probed and self._pipeline is not None:
                self._pipeline.runner.clear()  # the probe's schedules (its own batch shape) are not training's

    @override
    def check_split_model(self) -> None:
        """Under ep, each stage's experts modules held to whole copies of them through one schedule on a probe batch."""
        found, self._ep_probe_inputs = self._ep_probe_inputs, None
        if found is None or self._pipeline is None:
            if self.ep > 1 and self.self_check and found is None and self._pipeline is not None:
                rank_zero_warn(
                    "expert-parallel self-check skipped: no probe batch for the pipelined network (set"
                    " `example_input_array` on the LightningModule to have the split experts checked at setup)."
                )
            return
        from lightning_dist.parallelize.self_check import check_experts

        inputs, sample = found
        run, m = self._pipeline, self.n_microbatches
        x = inputs.to(self.root_device).roll(self.distributed_sampler_kwargs["rank"], dims=1)
        if x.is_floating_point():
            x = x.to(next(iter(run.runner.params)).dtype)

        def step() -> None:
            # a projection of the output on fixed random weights: every output element gets a gradient
            weights: dict = {}

            def loss(out: Tensor, _: Any) -> Tensor:
                key = (tuple(out.shape), out.dtype)
                if key not in weights:
                    g = torch.Generator().manual_seed(4321)
                    weights[key] = torch.randn(key[0], generator=g, dtype=torch.float64).to(out.device, out.dtype)
                return (out * weights[key]).sum()

            with torch.compiler.set_stance("force_eager"):
                run.runner.step(x, n_microbatches=m, loss_fn=loss, target=x, keep_output=False)

        try:
            step()  # a new schedule's first step also infers its stages' metadata on stand-in values: not checked
            for p in run.runner.params:
                p.grad = None
            module = self.lightning_module
            experts = find_experts(module)
            report = check_experts(
                module,
                step,
                experts,
                dp_group=self.mesh.dp_group if self.mesh.dp_size > 1 else None,
                describe=f"expert parallelism (ep={self.ep}) under {type(self).__name__}",
                backward=False,
            )
        finally:
            run.runner.clear()  # the probe's schedules (its own batch shape) are not training's
        self.ep_check_report = report
        rank_zero_info(
            f"expert-parallel self-check ({sample}, through the schedule): {report.blocks} experts module(s) on this"
            f" rank, outputs and expert gradients match whole copies (worst relative difference {report.worst:.1e});"
            f" {report.seconds:.2f} s. self_check=False skips it."
        )

    def _new_step(self, batch: Any = None, *, training: bool = False) -> PipelineStep:
        assert self._pipeline is not None, "a pipeline step before `parallelize`"
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        return PipelineStep(
            self._pipeline,
            module,
            batch,
            own_loss=self._own_loss,
            training=training,
            # fake tensors (`allocate_under`: the dry run) hold no values for the returned-loss check to compare
            values=self._allocation_mode is None,
            shows=self.broadcast_output or (trainer is not None and trainer.predicting),
            record=self.record_timeline,
        )

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        """The pipelined network's call: the whole schedule, in the running step's state."""
        if self._step is None:  # a call outside any step hook: a forward-only step of its own, until the next one
            self._step = self._new_step()
        step = self._step
        out = step.run(args, kwargs)
        if step.loss is not None:  # a training call: its batch loss and timeline are the strategy's records
            self.last_loss = step.loss
            if step.timeline is not None:
                self.timelines.append(step.timeline)
                step.timeline = None
        return out

    def _router_loss(self) -> Tensor:
        """The pipelined network's router loss (its method marked ``router_loss``), from the step's counting pass."""
        step = self._step
        if step is None or step.aux is None:
            run = self._pipeline
            why = (
                "the first training step did not use it, so the steps since run without the router's counting pass"
                if run is not None and not run.counted
                else "it is answered in training_step, after the network call, only"
            )
            raise RuntimeError(
                f"The pipelined {self.network}'s router load-balancing loss is not available here: {why}. Under"
                f" PipelineStrategy call self.{self.network}(inputs) and then its router loss in every training_step"
                " (each step counts the routing over the global batch before its schedule runs)."
            )
        return step.aux

    def _serve_loss(self, original: Any, output: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        served = None if args or kwargs or self._step is None else self._step.serve(output, target, original)
        return original(output, target, *args, **kwargs) if served is None else served

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # the network call finds the target in the step's batch (HF `labels`, or `pipeline_target(batch)`)
        self._step = step = self._new_step(args[0] if args else kwargs["batch"], training=True)
        module = self.lightning_module
        # `self.log` calls wait for the step's end: a logged returned loss holding a weight penalty holds only the
        # parameters of this rank's stages; it is logged as one device's value (the penalty summed over pp)
        logged: list[tuple[tuple, dict]] = []
        had_own = "log" in module.__dict__
        own = module.__dict__.get("log")
        module.log = lambda *a, **k: logged.append((a, k))
        try:
            out = super().training_step(*args, **kwargs)
            if step.pending:
                raise RuntimeError(
                    f"training_step did not call self.{self.network}(inputs): under PipelineStrategy"
                    " the network call runs the pipeline's forward and backward."
                )
        except BaseException:
            self._step = None
            raise
        finally:
            if had_own:
                module.log = own
            else:
                del module.log
        returned = out.get("loss") if isinstance(out, Mapping) else out
        step.finish(returned)  # a step that counted the routing runs its schedule now
        whole = step.whole_loss(returned)
        for a, k in logged:
            value = k["value"] if "value" in k else (a[1] if len(a) > 1 else None)
            if whole is not None and value is returned:
                a, k = ((a[0], whole, *a[2:]), k) if "value" not in k else (a, {**k, "value": whole})
            module.log(*a, **k)
        return out

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        step, self._step = self._step, None  # the training step ends with the backward that adds its gradients
        if step is None or step.grads is None:
            raise RuntimeError(
                "PipelineStrategy.backward was called without a pipeline step: under this strategy the"
                f" network call self.{self.network}(inputs) in training_step runs forward and backward."
            )
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        # Lightning divides the loss by accumulate_grad_batches before backward; scale the schedule's grads alike
        step.backward(closure_loss, 1.0 / self.lightning_module.trainer.accumulate_grad_batches)
        if self._manager is not None:  # fault_tolerance: across the replica groups (no hook saw the schedule's)
            self._average_gradients_now()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def _evaluation_step(self, hook: Any, args: tuple, kwargs: dict) -> Any:
        self._step = self._new_step()  # forward-only network calls; dropped with the step
        try:
            return hook(*args, **kwargs)
        finally:
            self._step = None

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().predict_step, args, kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._manager is not None:  # fault_tolerance: the quorum's commit vote around the step
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # without it the step stays out of the replica groups' glue: MeshStrategy's own step
        return super(ReplicaGroupsMixin, self).optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def _hook_replica_average(self) -> None:
        """Nothing to hook: the schedule's gradients are averaged across the groups in :meth:`backward`."""

    @override
    def optimizer_gradients(self, optimizer: Any) -> tuple[list[Tensor], list[Tensor]]:
        grads, _ = super().optimizer_gradients(optimizer)
        # a weight tied across stages has a copy (summed gradient) on each holder: all are clipped, one is counted
        skip = {id(p.grad) for p in self._uncounted if p.grad is not None}
        return grads, [g for g in grads if id(g) not in skip]

    @override
    def grad_norm_group(self) -> Optional[Any]:
        return None if self._pipeline is None else self._pipeline.runner.group  # the stages hold distinct parameters

    # checkpoints: sharded, each stage its own keys (optimizer states by name), a tied weight once
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.model is not None
        self.wait_for_checkpoint()  # it may be the one being written
        fitting = self.lightning_module.trainer.state.fn == "fit"
        checkpoint = ckpt.load_stage(
            self.broadcast(checkpoint_path),
            model=self.model,
            optimizers=self.optimizers if fitting else (),
            weights_only=True if weights_only is None else weights_only,
            aliases=tied_aliases(self._tied_keys),  # every copy of a tied weight reads the one saved tensor
        )
        return self._restore_fault_tolerance(checkpoint, checkpoint_path)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return save_tied_once(super().lightning_module_state_dict(), self._tied_keys)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        # keyed by parameter name: the stages' list-indexed `param_groups` would collide
        return save_tied_once(ckpt.name_keyed_optimizer_state(self.model, optimizer), self._tied_keys, optimizer=True)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        aliases = tied_aliases(self._tied_keys)  # consolidation gives every name of a tied weight the saved tensor
        super().save_checkpoint(
            {**checkpoint, ckpt.TIED_KEY: aliases} if aliases else checkpoint, filepath, storage_options
        )


__all__ = ["PipelineStrategy"]
