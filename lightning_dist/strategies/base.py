"""MeshStrategy: the base of every strategy of the pack.

Notes: docs/internals.md, "lightning_dist/strategies/base.py"."""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_dist._integrations.lightning import (
    distributed_sampler_for_stateful_loaders,
    optimizers_to_device,
    route_gradient_clipping,
    set_module_device_mesh,
    set_sampler_epoch,
    sync_ddp_if_available,
)
from lightning_dist._integrations.torch_distributed import clear_dtensor_sharding_cache
from lightning_dist.grads import clip_grads_by_norm_, clip_grads_by_value_
from lightning_dist.mesh import CP, DIM_NAMES, DP_CP, TP, DistMesh, MeshSpec
from lightning_dist.options import ModelOptions, TPPlan
from lightning_dist.parallelize.ac import ACOption
from lightning_dist.parallelize.sync import broadcast_module_states, materialize_in_sync, shared_seed
from lightning_dist.precision import precision_dtypes
from lightning_dist.strategies._checkpoints import ShardedCheckpointMixin
from lightning_dist.strategies._processes import ProcessesMixin, as_timeout

log = logging.getLogger(__name__)

ParallelizeFn = Callable[[nn.Module, DistMesh], Optional[nn.Module]]


def attach_mesh(module: pl.LightningModule, mesh: DistMesh) -> None:
    """Expose the mesh to the user's module: ``self.device_mesh`` (the 4-D DeviceMesh) in ``configure_model``.

    One of the two places the pack writes into the user's LightningModule (:func:`serve_pipeline_loss`); Lightning's own
    ``LightningModule.device_mesh`` property reads it.
    """
    set_module_device_mesh(module, mesh.device_mesh)


# while a strategy serves a module's `pipeline_loss`: (a weak reference to what it serves, the attribute it replaced);
# nothing here keeps the module alive
_SERVED_LOSS: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref, Any]] = weakref.WeakKeyDictionary()
_NOTHING = object()


def _served_loss(module: nn.Module) -> Optional[functools.partial]:
    """What :func:`serve_pipeline_loss` put on `module`, while it is there (None: nothing is served)."""
    ref, _ = _SERVED_LOSS.get(module, (None, None))
    served = None if ref is None else ref()
    return served if served is not None and module.__dict__.get("pipeline_loss") is served else None


def serve_pipeline_loss(module: pl.LightningModule, serve: Callable[..., Any]) -> Optional[Callable]:
    """Route ``module.pipeline_loss(...)`` to ``serve(original, ...)`` until :func:`unserve_pipeline_loss`; returns
    the module's own ``pipeline_loss`` (None: it has none, or a strategy serves it already).

    The other place the pack writes into the user's LightningModule (beside :func:`attach_mesh`): one instance
    attribute, a ``functools.partial`` of `serve` (the pipeline's and context parallelism's loss hook).
    """
    original = getattr(module, "pipeline_loss", None)
    if not callable(original) or _served_loss(module) is not None:
        return None
    served = functools.partial(serve, original)
    _SERVED_LOSS[module] = (weakref.ref(served), module.__dict__.get("pipeline_loss", _NOTHING))
    module.__dict__["pipeline_loss"] = served
    return original


def unserve_pipeline_loss(module: pl.LightningModule, original: Optional[Callable]) -> None:
    """Undo :func:`serve_pipeline_loss` (given what it returned): the class's method again, or the instance's own."""
    served = _served_loss(module)
    if original is None or served is None or served.args[0] is not original:
        return
    _, previous = _SERVED_LOSS.pop(module)
    del module.__dict__["pipeline_loss"]
    if previous is not _NOTHING:
        module.__dict__["pipeline_loss"] = previous


def _check_size(name: str, value: Any, allow_auto: bool) -> list[str]:
    if allow_auto and value == "auto":
        return []
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = 'an integer >= 1 or "auto"' if allow_auto else "an integer >= 1"
        return [f"`{name}={value!r}` must be {what}."]
    return []


class MeshStrategy(ProcessesMixin, ShardedCheckpointMixin):
    """Lightning strategy over the pack's named device mesh.

    Args:
        pp, dp_replicate, dp_shard, cp, tp: mesh sizes; ``"auto"`` data-parallel sizes shard inside a node
            and replicate across nodes. ``cp``: context parallelism, each sequence split over `cp` ranks.
        cp_style: ``"ulysses"`` (all-to-all of q/k/v to head shards; every device; the heads must divide by cp) or
            ``"ring"`` (torch's ring attention: key/value chunks rotate over the cp ranks, every rank keeps every head;
            CPU and CUDA kernels, no attention dropout).
        cp_network: the attribute of the LightningModule holding the network called with the token ids
            (``"auto"``: ``model``, else its one child).
        self_check: under context parallelism, tensor parallelism and expert parallelism, run one forward and
            backward of a probe batch through the split model at setup, compare the outputs and the gradients with
            the unsplit computation, and refuse a difference naming the module and the likely reason
            (``docs/self_checks.md``; its cost is printed once). ``False`` skips it, for a model known to be exact.
        moe_aux_loss: ``"global"``: a HuggingFace mixture of experts' router load-balancing loss is the one of the
            global batch, as one device computes it (its per-expert sums all-reduced over the data-parallel ranks
            each step); ``"local"``: each rank's own loss on its tokens, averaged (what plain DDP gives).
        allow_cross_node_tp: accept a ``tp`` group larger than one node.
        activation_checkpointing: ``True``/``"full"`` recompute each block in backward; ``"selective"`` keep
            the outputs of matmuls, attention and collectives and recompute the rest; ``"every:N"`` full
            checkpointing of every N-th block; or block class names (see :mod:`lightning_dist.parallelize.ac`).
        selective_ac_ops: the ops whose outputs ``"selective"`` keeps (``["aten.mm", ...]``); default
            :data:`~lightning_dist.parallelize.ac.SELECTIVE_AC_OPS`.
        offload_activations: move the tensors each block saves for backward to pinned host memory (CUDA only;
            the blocks ``activation_checkpointing`` leaves uncheckpointed).
        compile: True to ``torch.compile`` each block (after activation checkpointing, before FSDP2, as
            torchtitan does), or block class names to compile.
        tp_plan: the tensor-parallel plan of :class:`TensorParallelStrategy` and :class:`PipelineStrategy`
            (``"auto"``, a built-in plan name or ``{module-name glob: style}``).
        ep: expert parallelism: each group of ``ep`` ranks of ``dp_shard`` holds every expert of a mixture of experts
            once, ``E / ep`` per rank (``docs/moe.md``); 1: none.
        ep_capacity_factor: None (default): every token reaches the experts it chose (dropless, one device's result).
            A number drops tokens, which **changes the result**: in ep's dispatch each expert takes at most
            ``ceil(factor x pairs / experts)`` of a rank's (token, choice) pairs, the first in token order.
            These seven are one :class:`~lightning_dist.options.ModelOptions` (``model_options``), applied by the
            built-in plan; with ``parallelize_fn`` call :func:`lightning_dist.parallelize.apply_ac` /
            ``apply_compile`` inside it instead.
        parallelize_fn: ``fn(model, mesh)`` that parallelizes the LightningModule in place, replacing the
            strategy's built-in plan (for models the built-in plans do not cover).
        save_distributed_checkpoint: True: sharded DCP directory; False: one consolidated file.
        async_checkpoint: True: a (sharded) save stages the state in host memory and returns; the shards are
            written in the background and committed once every rank has written (``lightning_dist.checkpoint_async``).
        process_group_backend: ``"gloo"``/``"nccl"``; default from the device (cpu -> gloo, cuda -> nccl).
        timeout: collective timeout, seconds (a number) or a ``datetime.timedelta``; a failing rank makes the
            others exit after at most this long (under the pack's launcher add up to 3 s: it polls its children
            every 0.5 s, then gives them 2 s to end).
    """

    def __init__(
        self,
        *,
        pp: int = 1,
        dp_replicate: Union[int, Literal["auto"]] = "auto",
        dp_shard: Union[int, Literal["auto"]] = "auto",
        cp: int = 1,
        tp: int = 1,
        cp_style: str = "ulysses",
        cp_network: str = "auto",
        self_check: bool = True,
        moe_aux_loss: str = "global",
        allow_cross_node_tp: bool = False,
        activation_checkpointing: ACOption = False,
        selective_ac_ops: Optional[Sequence[str]] = None,
        offload_activations: bool = False,
        compile: Union[bool, Sequence[str]] = False,
        tp_plan: TPPlan = "auto",
        ep: int = 1,
        ep_capacity_factor: Optional[float] = None,
        parallelize_fn: Optional[ParallelizeFn] = None,
        save_distributed_checkpoint: bool = True,
        async_checkpoint: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta, None] = default_pg_timeout,
    ) -> None:
        timeout = as_timeout(timeout, type(self).__name__)
        super().__init__()
        from lightning_dist.parallelize.cp import cp_style_problems

        problems = _check_size("pp", pp, False) + _check_size("tp", tp, False) + _check_size("cp", cp, False)
        problems += cp_style_problems(cp_style, cp)
        problems += _check_size("dp_replicate", dp_replicate, True) + _check_size("dp_shard", dp_shard, True)
        if async_checkpoint and not save_distributed_checkpoint:
            problems.append(
                "`async_checkpoint=True` writes sharded checkpoints in the background; it needs"
                " `save_distributed_checkpoint=True` (a consolidated file is gathered on rank 0 first)."
            )
        if not isinstance(self_check, bool):
            problems.append(f"`self_check={self_check!r}` must be True or False.")
        if moe_aux_loss not in ("global", "local"):
            problems.append(
                f"`moe_aux_loss={moe_aux_loss!r}` must be 'global' (a mixture of experts' router loss over the global"
                " batch, as one device computes it) or 'local' (each data-parallel rank's own, averaged)."
            )
        if parallelize_fn is not None and not callable(parallelize_fn):
            problems.append(f"`parallelize_fn={parallelize_fn!r}` must be callable as fn(model, mesh).")
        if parallelize_fn is None and type(self) is MeshStrategy:  # the base: its subclasses hold the plans
            problems.append(
                f"{type(self).__name__} has no built-in plan: pass `parallelize_fn=fn(model, mesh)`, or use one of"
                " the pack's strategies (HybridShardStrategy 'hsdp', FullyShardStrategy 'fsdp2',"
                " TensorParallelStrategy 'tp', PipelineStrategy 'pipeline')."
            )
        options = ModelOptions(
            activation_checkpointing=activation_checkpointing,
            selective_ac_ops=selective_ac_ops,
            offload_activations=offload_activations,
            compile=compile,
            tp_plan=tp_plan,
            ep=ep,
            ep_capacity_factor=ep_capacity_factor,
        )
        problems += options.problems(parallelize_fn=parallelize_fn, applies_tp_plan=self._applies_tp_plan)
        # a subclass's own problems (`_defer_problems`), listed with these in one error
        problems = list(getattr(self, "_deferred_problems", ())) + problems
        if problems:
            raise ValueError(f"Invalid {type(self).__name__} configuration:\n  - " + "\n  - ".join(problems))
        self._sizes = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp}
        self.model_options = options.normalized()
        """What the built-in plan applies to the model (one type for every strategy)."""
        self._mesh_arg_names: tuple[tuple[str, str], ...] = ()  # a subclass's own name of a dim (shard_size)
        self.cp_style = cp_style
        self.cp_network = cp_network
        self._cp: Any = None  # the ContextParallel state (cp > 1), built with the mesh
        self._cp_loss: Any = None  # the module's own pipeline_loss while cp serves it the target's chunks
        self.self_check = self_check
        self.moe_aux_loss = moe_aux_loss
        self.cp_probe_report: Any = None
        """What context parallelism's self-check measured (a :class:`~lightning_dist.parallelize.cp_probe.ProbeReport`;
        None: it did not run)."""
        self._cp_probe_due = False  # set by `prepare_model` for a model this setup parallelized under cp
        self._allow_cross_node_tp = allow_cross_node_tp
        self._parallelize_fn = parallelize_fn
        self._mesh: Optional[DistMesh] = None
        self._loss_group: Any = None  # the mesh's groups `reduce` and `on_train_batch_start` use (see `use_mesh`)
        self._dp_group: Any = None
        self._dp_size = 1
        self._device_mesh = None
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._async_checkpoint = bool(async_checkpoint)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._allocation_mode: Any = None
        self.num_nodes = 1

    _applies_tp_plan = False  # True where the built-in plan applies `tp_plan` (tensor parallelism, pipelines)

    def _defer_problems(self, problems: Sequence[str]) -> None:
        """A subclass's configuration problems, found before it calls ``MeshStrategy.__init__``: raised there in one
        ValueError with the mesh's and the model options' (every problem listed at once)."""
        self._deferred_problems = [*getattr(self, "_deferred_problems", ()), *problems]

    @property
    def activation_checkpointing(self) -> ACOption:
        return self.model_options.activation_checkpointing

    @property
    def selective_ac_ops(self) -> Optional[Sequence[str]]:
        return self.model_options.selective_ac_ops

    @property
    def offload_activations(self) -> bool:
        return self.model_options.offload_activations

    @property
    def compile(self) -> Union[bool, Sequence[str]]:
        return self.model_options.compile

    @property
    def tp_plan(self) -> TPPlan:
        return self.model_options.tp_plan

    @property
    def ep(self) -> int:
        return self.model_options.ep

    def pipeline_view(self) -> Optional[Any]:
        """This strategy's pipeline for callbacks and tools, as a
        :class:`~lightning_dist.parallelize.pipeline.split.PipelineView` (layout, local stages, stage modules,
        timelines); None when the strategy does not pipeline. Callbacks read this, never a strategy's class."""
        return None

    # ---- mesh ----------------------------------------------------------------------------------
    def mesh_spec(self) -> MeshSpec:
        """The resolved mesh for this job; pure arithmetic, identical on every rank, raises ValueError."""
        return MeshSpec(
            world_size=self.num_nodes * self.num_processes,
            devices_per_node=self.num_processes,
            allow_cross_node_tp=self._allow_cross_node_tp,
            arg_names=self._mesh_arg_names,
            **self._sizes,
        ).resolve()

    @property
    def device_mesh(self):
        """The 5-D DeviceMesh (``self.mesh.device_mesh``)."""
        return self.mesh.device_mesh

    @property
    def mesh(self) -> DistMesh:
        if self._mesh is None:
            raise RuntimeError(
                f"{type(self).__name__}.mesh is built in `setup_environment`; it is not available before"
                " `Trainer.fit/validate/test/predict` starts."
            )
        return self._mesh

    @override
    def setup_environment(self) -> None:
        # validate the whole configuration on every rank before the first collective
        spec = self.mesh_spec()
        self.check_model()
        self.validate_config(spec)
        ParallelStrategy.setup_environment(self)
        distributed_sampler_for_stateful_loaders()  # before Lightning builds the training loader
        self._setup_distributed()
        self.use_mesh(DistMesh.build(spec, self.root_device.type))
        rank_zero_info(spec.format_plan())
        if self._async_checkpoint:  # its process group now, on every rank, not inside the first save
            self.checkpoint_writer().prepare()

    def use_mesh(self, mesh: DistMesh) -> None:
        """Adopt a built mesh (``setup_environment``; the dry run builds one on a fake process group)."""
        from lightning_dist.parallelize.cp import ContextParallel, CPGroup

        self._mesh = mesh
        self._device_mesh = mesh.device_mesh
        # looked up once: `reduce` and `on_train_batch_start` run every step
        self._loss_group, self._dp_group, self._dp_size = mesh.loss_group, mesh.dp_group, mesh.dp_size
        assert self.lightning_module is not None
        attach_mesh(self.lightning_module, mesh)
        if mesh.cp_size > 1:
            self._cp = ContextParallel(
                CPGroup(
                    mesh.cp_size,
                    mesh.local_rank(CP),
                    mesh.group(CP),
                    dp_group=mesh.dp_group,
                    dp_size=mesh.dp_size,
                    style=self.cp_style,
                )
            )

    def validate_config(self, spec: MeshSpec) -> None:
        """Subclasses check option combinations against the resolved mesh here (raise ValueError)."""

    def check_model(self) -> None:
        """What every strategy refuses in the model before any collective (one process, the same on every rank):
        experts that transformers runs with a grouped GEMM torch does not serve in the run's dtype on this device."""
        from lightning_dist._integrations.transformers_moe import grouped_mm_problems

        if self.lightning_module is None:
            return
        problems = grouped_mm_problems(self.lightning_module, dtype=self._run_dtype(), device=self.root_device)
        if problems:
            raise ValueError(f"Invalid {type(self).__name__} configuration:\n  - " + "\n  - ".join(problems))

    def _run_dtype(self) -> Optional[torch.dtype]:
        """The dtype the model computes in once set up: the precision's (``64-true``, ``bf16-true``; FSDP2's compute
        dtype under ``*-mixed``), None when that is the model's own (``32-true`` converts nothing)."""
        dtypes = precision_dtypes(self.precision_plugin, default=None)
        if dtypes is None or (not dtypes.mixed and dtypes.param == torch.float32):
            return None
        return dtypes.compute

    # ---- data parallel dim ---------------------------------------------------------------------
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.mesh.dp_size, "rank": self.mesh.dp_rank}

    @override
    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Tensor:
        """Reduce over the data-parallel ranks (tensor/pipeline peers hold the same samples) and the context-parallel
        ones (each holds part of the same sequences: the mean over them is the whole sequences' loss)."""
        if isinstance(tensor, Tensor):
            import torch
            import torch.distributed as dist

            group = group if group is not None else self._loss_group
            if group is not None and dist.get_world_size(group) == 1:  # one rank (pp or tp only): nothing to reduce
                mean = reduce_op is None or str(reduce_op).lower() in ("mean", "avg", "reduceop.avg")
                return tensor if tensor.is_floating_point() or not mean else tensor.to(torch.get_default_dtype())
            return sync_ddp_if_available(tensor, group, reduce_op)
        return tensor

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        # a loader restored mid-epoch that fast-forwards its sampler when iterated (torchdata's StatefulDataLoader)
        # is iterated before Lightning sets the resumed epoch: give the sampler that epoch now (Lightning's value)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and hasattr(dataloader, "load_state_dict"):
            set_sampler_epoch(dataloader, trainer.fit_loop.epoch_progress.current.processed)
        return dataloader

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._dp_size == 1:  # one data-parallel rank: nothing can run out alone
            return
        from lightning_dist.callbacks.guards import check_data_runs_out_together

        # iterable data that ends on some dp ranks only: refuse on every rank before the step's collectives
        assert self.lightning_module is not None
        check_data_runs_out_together(
            self.lightning_module.trainer, batch_idx, group=self._dp_group, dp_size=self._dp_size
        )

    # ---- model set-up --------------------------------------------------------------------------
    def parallelize(self, module: pl.LightningModule) -> None:
        """Parallelize the LightningModule in place (subclasses apply their built-in plan)."""
        raise NotImplementedError

    def already_parallelized(self) -> bool:
        """True when the model was parallelized before (a later ``validate``/``test`` on the same module)."""
        assert self.model is not None
        return _is_parallelized(self.model)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if any(isinstance(mod, FullyShardedDataParallel) for mod in self.model.modules()):
            raise TypeError(
                "Found modules wrapped in FSDP1 `FullyShardedDataParallel`; the pack shards with FSDP2."
                " Remove the wrapping: the strategy applies sharding itself."
            )
        seed = self.prepare_model(trainer)
        # tensors are allocated from here on: the dry run's fake tensors (see `allocate_under`)
        with self._allocation_mode or contextlib.nullcontext():
            self.materialize_model(seed)
            self.barrier()
            if self._allocation_mode is None:  # evaluation too: a wrong split gives wrong metrics
                self.check_context_parallel()
            if trainer.state.fn == TrainerFn.FITTING:
                self.setup_optimizers(trainer)
            self.setup_precision_plugin()
            # Lightning clips each process's gradients alone, with foreach calls that refuse plain tensors mixed
            # with DTensors: the strategy's clipping spans every shard and stage (Trainer's clipping and
            # self.clip_gradients)
            route_gradient_clipping(
                self.precision_plugin, by_norm=self.clip_grad_by_norm, by_value=self.clip_grad_by_value
            )
            if trainer.state.fn == TrainerFn.FITTING:
                optimizers_to_device(self.optimizers, self.root_device)

    def allocate_under(self, mode: Any) -> None:
        """``setup`` materializes the model and builds its optimizers under `mode` (a ``TorchDispatchMode``).

        The dry run passes torch's ``FakeTensorMode``: the model is prepared on the meta device as on the
        cluster (:meth:`prepare_model`), then held as fake tensors (shapes and dtypes, no storage).
        """
        self._allocation_mode = mode

    def prepare_model(self, trainer: pl.Trainer) -> Optional[int]:
        """The model's set-up before materialization, in its one order (``setup``; the dry run on a fake group):
        dtype, BatchNorm sync, device, rank 0's eager tensors, parallelize (TP, pipeline split, AC, FSDP2 or
        replicate). Returns the shared seed :meth:`materialize_model` initializes meta tensors with (None: none).
        """
        assert self.model is not None
        # `trainer.validate()` after `fit()` sets up the same module again: it is already parallelized
        parallelized = self.already_parallelized()
        # dtype first (cheap on meta or full tensors), then device, then parallelize, then materialize
        self.model = self.precision_plugin.convert_module(self.model)
        if trainer.state.fn == TrainerFn.FITTING and not parallelized:
            self._sync_batchnorm()
        if not _has_meta(self.model):
            self.model.to(self.root_device)
        # replicas and tensor/pipeline peers start from one model whatever each rank seeded: rank 0's eagerly
        # built tensors (broadcast before splitting), and one shared seed for what is still on the meta device
        seed = shared_seed(self.root_device) if _has_meta(self.model) else None
        if self._cp is not None:  # the model's cp problems, on every rank before the first collective
            self._check_cp_model()
        if not parallelized:
            broadcast_module_states(self.model)
            clear_dtensor_sharding_cache()  # a model trained before in this process leaves torch's plans behind
            self.apply_parallelism()
        if self._cp is not None:
            self._attach_cp()
        self._cp_probe_due = not parallelized and self._cp is not None
        return seed

    def materialize_model(self, seed: Optional[int]) -> None:
        """Meta tensors left after :meth:`prepare_model` allocated on the root device and initialized in sync."""
        assert self.model is not None
        if seed is not None and _has_meta(self.model):
            missing = materialize_in_sync(self.model, self.root_device, seed=seed)
            if missing:
                rank_zero_warn(
                    f"Parameter initialization incomplete: modules {sorted(set(missing))} have parameters or"
                    " buffers left uninitialized because they do not define `reset_parameters()`."
                )

    def check_split_model(self) -> None:
        """The self-check of a strategy that changes the model's math, run once before the first training step (weights
        loaded by callbacks at fit start are in place then); none here."""

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # on whole sequences (cp's split has its own check, `check_context_parallel`): every cp rank computes alike
        with self._cp.unsplit() if self._cp is not None else contextlib.nullcontext():
            self.check_split_model()

    def apply_parallelism(self) -> None:
        """The user's ``parallelize_fn`` or the built-in :meth:`parallelize` (:meth:`prepare_model` calls it once, on a
        model that is not parallelized yet)."""
        if self._parallelize_fn is not None:
            self._parallelize_fn(self.lightning_module, self.mesh)
        else:
            self.parallelize(self.lightning_module)

    # ---- context parallelism (cp > 1) -----------------------------------------------------------
    def _check_cp_model(self) -> None:
        from lightning_dist.parallelize.cp import cp_model_problems, cp_style_problems, find_network

        if self.cp_style == "ring":  # torch's private ring functions: an untested torch refused at set-up, every rank
            from lightning_dist._compat import check_torch_ring_attention

            check_torch_ring_attention()
        problems = cp_style_problems(self.cp_style, self.mesh.cp_size, self.root_device.type)
        problems += cp_model_problems(
            find_network(self.lightning_module, self.cp_network),
            cp=self.mesh.cp_size,
            tp=self.mesh.size(TP),
            style=self.cp_style,
        )
        if problems:
            raise ValueError("Invalid context parallelism for this model:\n  - " + "\n  - ".join(problems))

    def _attach_cp(self) -> None:
        """5. context parallelism, after every other step (it changes no weight: a hook on the network's inputs and
        the attention mode held around each step), for the built-in plans and a ``parallelize_fn`` alike."""
        from lightning_dist.parallelize.cp import apply_cp

        apply_cp(self.lightning_module, self._cp, network=self.cp_network)
        if self._cp_loss is None:
            cp = self._cp

            def serve(original: Callable, output: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
                chunks = None if args or kwargs else cp.split_target(output, target)
                return original(output, target, *args, **kwargs) if chunks is None else original(output, chunks)

            self._cp_loss = serve_pipeline_loss(self.lightning_module, serve) or False

    def check_context_parallel(self) -> None:
        """Context parallelism's self-check of the materialized, parallelized model, once per model (``setup``;
        ``self_check=False`` skips it): a probe batch split and unsplit, forward and backward
        (:mod:`~lightning_dist.parallelize.cp_probe`). Collective: every rank runs it, every rank refuses together."""
        due, self._cp_probe_due = self._cp_probe_due, False
        if not (due and self.self_check):
            return
        from lightning_dist.parallelize.cp_probe import run_cp_probe

        found = self.cp_probe()
        if found is None:
            rank_zero_warn(
                "The context-parallel self-check found no probe batch for this network (no `example_input_array`,"
                " no nn.Embedding or nn.Linear to make one for): it did not run. Set `example_input_array` to token"
                " ids of the network, or pass self_check=False to silence this."
            )
            return
        probe, sample = found
        params = [(n, p) for n, p in self.lightning_module.named_parameters() if p.requires_grad]
        describe = f"context-parallel (cp={self.mesh.cp_size}, {self.cp_style})"
        self.cp_probe_report = run_cp_probe(probe, self._cp, params, sample=sample)
        self.reshard()
        rank_zero_info(self.cp_probe_report.format(describe))

    def cp_probe(self) -> Optional[tuple[Any, str]]:
        """(the self-check's way to run a probe batch through this strategy's model, the batch in words), or None
        when no batch can be made. Here: through the network's cp hook (the pipeline runs its schedule instead)."""
        from lightning_dist.parallelize.cp_probe import NetworkProbe, probe_inputs

        network = self._cp.network
        example = getattr(self.lightning_module, "example_input_array", None)
        found = probe_inputs(network, self.mesh.cp_size, example=example)
        if found is None:
            return None
        inputs, sample = found
        dtype = next(network.parameters()).dtype if inputs.is_floating_point() else None
        name = next(n for n, m in self.lightning_module.named_modules() if m is network)
        context = self.precision_plugin.forward_context
        return NetworkProbe(
            self._cp, network, name, inputs.to(self.root_device, dtype), forward_context=context
        ), sample

    @property
    def cp_state(self) -> Any:
        """Context parallelism's state (:class:`~lightning_dist.parallelize.cp.ContextParallel`: the hooked network,
        the cp group), None without cp."""
        return self._cp

    @property
    def cp_attention_calls(self) -> int:
        """Attention calls that ran through context parallelism's exchange (all-to-all or ring) so far; 0 without cp."""
        return self._cp.calls if self._cp is not None else 0

    def step_context(self) -> Any:
        """The context every training/validation/test step runs in (subclasses add theirs around it): context
        parallelism's attention mode under cp; a mixture of experts' router loss over the global batch."""
        stack = contextlib.ExitStack()
        if self._cp is not None:
            stack.enter_context(self._cp.active())
        if self.moe_aux_loss == "global" and self.mesh.size(DP_CP) > 1:
            from lightning_dist._integrations.transformers_moe import global_router_loss
            from lightning_dist.parallelize.moe import global_balance_loss

            group = self.mesh.group(DP_CP)
            stack.enter_context(global_balance_loss(group))  # the pack's own MoE layers
            stack.enter_context(global_router_loss(self.lightning_module, group))  # a transformers model's
        return stack

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._cp is not None:
            raise RuntimeError(
                "predict under context parallelism would return each rank's part of the sequences"
                f" (cp={self.mesh.cp_size}). Predict with cp=1 (the checkpoint loads into any mesh)."
            )
        return super().predict_step(*args, **kwargs)

    def _sync_batchnorm(self) -> None:
        """``Trainer(sync_batchnorm=True)``: BatchNorm pooled over the dp ranks; else warn if it trains unsynced."""
        from lightning_dist.callbacks.sync_batchnorm import sync_or_warn_batchnorm

        self.model = sync_or_warn_batchnorm(
            self.model, sync=self._layer_sync is not None, group=self.mesh.dp_group, dp_size=self.mesh.dp_size
        )

    # ---- gradient clipping (Trainer(gradient_clip_val=...), LightningModule.clip_gradients) -----------
    def optimizer_gradients(self, optimizer: Any) -> tuple[list[Tensor], list[Tensor]]:
        """(the gradients of ``optimizer``'s parameters this rank holds, those of them counted in the norm)."""
        grads = list(
            {id(p): p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None}.values()
        )
        return grads, grads

    def grad_norm_group(self) -> Optional[Any]:
        """The process group whose ranks hold distinct parameters (pipeline stages); None: every rank holds all."""
        return None

    def clip_grad_by_norm(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        """torch's ``clip_grad_norm_`` on the whole model: the global norm over every shard and stage."""
        grads, counted = self.optimizer_gradients(optimizer)
        clip_grads_by_norm_(grads, clip_val, counted=counted, group=self.grad_norm_group(), device=self.root_device)

    def clip_grad_by_value(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        """torch's ``clip_grad_value_``: each rank clamps the gradient elements it holds."""
        clip_grads_by_value_(self.optimizer_gradients(optimizer)[0], clip_val)

    # ---- memory at rest --------------------------------------------------------------------------
    def reshard(self) -> None:
        """Free gathered FSDP2 parameters (roots stay gathered after a forward-only pass until a backward)."""
        from torch.distributed.fsdp import FSDPModule

        if self.model is not None:
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    @override
    def teardown(self) -> None:
        self.wait_for_checkpoint()  # the end of fit (or a failure) waits for a background save
        if self._cp_loss is not None:
            if self._cp_loss is not False and self.lightning_module is not None:
                unserve_pipeline_loss(self.lightning_module, self._cp_loss)
            self._cp_loss = None
        if self._cp is not None:
            self._cp.detach()  # a later fit/validate builds its own (the hook must not split twice)
        super().teardown()

    @override
    def on_validation_end(self) -> None:
        self.reshard()  # validation runs forward only: do not keep the roots gathered into training

    @override
    def on_test_end(self) -> None:
        self.reshard()

    @override
    def on_predict_end(self) -> None:
        self.reshard()

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}={self._sizes[n]}" for n in DIM_NAMES)
        return f"{type(self).__name__}({sizes})"


def _is_parallelized(module: nn.Module) -> bool:
    """True when FSDP2, replicate or tensor parallelism was already applied to `module` or a submodule."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.tensor import DTensor

    for m in module.modules():
        registry = _get_registry(m) or {}
        if "fully_shard" in registry or "replicate" in registry:
            return True
    return any(isinstance(p, DTensor) for p in module.parameters())


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))
