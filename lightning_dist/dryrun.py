"""Dry run at scale: one training step of rank r of W on one CPU, with a fake process group and fake tensors.

Notes: docs/internals.md, "lightning_dist/dryrun.py"."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_dist.atomic import atomic_write
from lightning_dist.dryrun_report import DryRunReport
from lightning_dist.mesh import CP, DIM_NAMES, DP_REPLICATE, DP_SHARD, PP, TP, MeshSpec

# strategies whose setup the dry run can replay (the DeepSpeed offload engine starts its own communication)
_UNSUPPORTED = ("OffloadStrategy",)


@dataclass(frozen=True, kw_only=True)
class DryRunConfig:
    """What to simulate: a model, a strategy and a cluster."""

    model: str
    """Class path of the LightningModule, e.g. ``lightning_dist.models.gpt.CharGPT``."""
    init_args: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the model class (nested ``class_path`` / ``init_args`` allowed)."""
    strategy: str = "hsdp"
    """A registered strategy name (``hsdp``, ``tp``, ``pipeline``...) or a class path."""
    strategy_args: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the strategy (``pp=4, tp=8``...)."""
    world_size: int
    """Number of ranks (devices) of the simulated job."""
    devices_per_node: int
    """Devices per node; the world size must be a multiple of it."""
    precision: str = "bf16-mixed"
    """Lightning precision flag."""
    batch_size: int = 8
    """Samples per data-parallel rank per step (all pipeline micro-batches together)."""
    seq_len: Optional[int] = None
    """Sequence length of token models (default: the model's ``block_size``)."""
    device_memory: Optional[float] = None
    """Bytes per device to check the fit against (None: no verdict)."""
    optimizer: str = "adamw"
    """Optimizer the planner assumes (the model's ``configure_optimizers`` is what runs)."""
    ranks: Optional[tuple[int, ...]] = None
    """Ranks to simulate (default: :func:`representative_ranks`)."""

    def to_json(self) -> str:
        return json.dumps(
            {**dataclasses.asdict(self), "init_args": dict(self.init_args), "strategy_args": dict(self.strategy_args)}
        )

    @classmethod
    def from_json(cls, text: str) -> "DryRunConfig":
        data = json.loads(text)
        if data.get("ranks") is not None:
            data["ranks"] = tuple(data["ranks"])
        return cls(**data)


def check_cluster(world_size: int, devices_per_node: int) -> None:
    """ValueError unless the nodes are full (the planner's rule, same message)."""
    for name, value in (("world_size", world_size), ("devices_per_node", devices_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}={value!r}` must be an integer >= 1.")
    if world_size > devices_per_node and world_size % devices_per_node:
        raise ValueError(
            f"world_size={world_size} is not divisible by devices_per_node={devices_per_node}:"
            " nodes must be full; pick a world size that is a multiple of the devices per node."
        )


def representative_ranks(spec: MeshSpec) -> list[int]:
    """The ranks whose shards or stages differ: rank 0 of each pipeline stage (its first dp / tp shard)
    and the last rank (last pipeline stage, last ``dp_shard`` and ``tp`` shard: FSDP2's trailing chunks
    are the ones that can be short or empty)."""
    spec = spec if spec.resolved else spec.resolve()
    per_stage = spec.world_size // spec.size(PP)
    ranks = [s * per_stage for s in range(spec.size(PP))]
    if spec.world_size - 1 not in ranks:
        ranks.append(spec.world_size - 1)
    return ranks


# ---- one rank (runs in its own process) --------------------------------------------------------------------
def _strategy(config: DryRunConfig) -> Any:
    """The strategy object, built as ``Trainer(strategy=...)`` builds it (registry name or class path).

    With ``fault_tolerance=`` the strategy is built once with it (its own checks, the same errors; no lighthouse is
    reached before set-up), then without: the plain layout, whose ``dp_replicate`` replicas stand for the replica
    groups (each group's own job has the mesh of one replica, and its all-reduce across the groups the bytes of the
    plain ``dp_replicate`` one: docs/planner.md, "Fault-tolerant replica groups")."""
    from lightning.pytorch.strategies import StrategyRegistry

    cls = _strategy_class(config)
    args = dict(config.strategy_args)
    if config.strategy in StrategyRegistry:
        args = {**StrategyRegistry[config.strategy]["init_params"], **args}
    if args.get("fault_tolerance") is not None:
        cls(**args)
        args.pop("fault_tolerance")
    return cls(**args)


def _replica_groups(config: DryRunConfig) -> Optional[int]:
    """The fault-tolerant replica groups of ``config`` (its ``dp_replicate``); None without ``fault_tolerance=``."""
    args = dict(config.strategy_args)
    return args.get("dp_replicate") if args.get("fault_tolerance") is not None else None


def _strategy_class(config: DryRunConfig) -> type:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_dist import inputs

    # the pack's names are in the registry: importing `lightning_dist` registers them
    if config.strategy in StrategyRegistry:
        return StrategyRegistry[config.strategy]["strategy"]
    if "." in config.strategy:
        return inputs.import_class(config.strategy)
    raise ValueError(
        f"Unknown strategy {config.strategy!r}: use a registered name ({sorted(StrategyRegistry)}) or a class path."
    )


# what the dry run calls on a strategy besides Lightning's hooks: the pack's mesh strategies have them
_REPLAYED = ("mesh_spec", "validate_config", "use_mesh", "allocate_under", "prepare_model")


def _check_replayable(cls: type) -> None:
    # the strategies are known by what they answer, not imported: auto_parallel (verify=True) imports the dry run
    chooser = getattr(cls, "strategy_name", None) == "auto_parallel"
    if not isinstance(cls, type) or not all(callable(getattr(cls, name, None)) for name in _REPLAYED) or chooser:
        name = getattr(cls, "__name__", repr(cls))
        raise ValueError(
            f"The dry run replays the pack's mesh strategies; {name} is not one (the DeepSpeed offload"
            " engine communicates on its own; auto_parallel picks one: dry-run that one). Plan it with"
            " `lightning-dist plan`."
        )


def _batch_maker(module: Any, config: DryRunConfig) -> Any:
    """``fn(n) -> batch`` of ``n`` samples (fake tensors under FakeTensorMode): token ids and targets for
    the pack's GPT family, or the module's own ``dry_run_batch(n, seq_len)``. Made before the model is split."""
    import torch

    hook = getattr(module, "dry_run_batch", None)
    if callable(hook):
        return lambda n: hook(n, config.seq_len)
    cfg = _model_config(module)
    if cfg is None:
        raise TypeError(
            f"{type(module).__name__}: the dry run builds token batches for models with"
            " `self.model.config.vocab_size` (the pack's GPT family); define"
            " `dry_run_batch(batch_size, seq_len) -> batch` on the LightningModule for other models."
        )
    seq = config.seq_len or cfg.block_size
    return lambda n: (torch.randint(0, cfg.vocab_size, (n, seq)), torch.randint(0, cfg.vocab_size, (n, seq)))


def _model_config(module: Any) -> Any:
    cfg = getattr(getattr(module, "model", None), "config", None)
    return cfg if hasattr(cfg, "vocab_size") else None


def _stage_inputs(strategy: Any, module: Any, batch: tuple[Any, Any]) -> tuple[list[Any], Any]:
    """(input (shape, dtype) of each pipeline block, output (shape, dtype)) of the unsplit network on one
    micro-batch, from one forward under the step's precision context on fake tensors standing in for the meta
    parameters and batch (fake CPU tensors: a mixture of experts' experts run on the routing the step assumes,
    :class:`UniformRouting`, whose index tensors hold values; on the meta device they cannot)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    from lightning_dist.parallelize.ep import assume_routing
    from lightning_dist.parallelize.pipeline import split as plan

    net = getattr(module, strategy.network)
    layout = plan.network_layout(net)
    container = net if layout.block_list is None else net.get_submodule(layout.block_list)
    shapes: list[Any] = [None] * len(layout.blocks)
    hooks = [
        container._modules[key].register_forward_pre_hook(
            lambda mod, args, i=i: shapes.__setitem__(i, (tuple(args[0].shape), args[0].dtype))
        )
        for i, key in enumerate(layout.blocks)
    ]
    loss_fn = getattr(module, "pipeline_loss", None)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), assume_routing(UniformRouting(), net):
            like = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in (*net.named_parameters(), *net.named_buffers())}
            x, y = (torch.empty(t.shape, dtype=t.dtype) for t in batch[:2])
            with strategy.precision_plugin.train_step_context():
                out = functional_call(net, like, (x,))
                if not isinstance(out, torch.Tensor):  # a transformers model's output: its logits are the pipeline's
                    out = out.logits
                loss = (
                    loss_fn(out, y)
                    if callable(loss_fn)
                    else torch.empty((), dtype=torch.promote_types(out.dtype, torch.float32))
                )
    finally:
        for h in hooks:
            h.remove()
    return shapes, {"out": (tuple(out.shape), out.dtype), "loss": ((), loss.dtype)}


class _PeerAnswers:
    """What this rank's pipeline peers would send it (a :class:`~lightning_dist.parallelize.pipeline.schedule.
    PipelinePeer`), for the reads the fake process group cannot answer: the previous stage's output (this stage's
    input, from a meta forward of the unsplit network) and the network's output and loss (from the same forward)."""

    def __init__(self, strategy: Any, boundaries: list[Any], output: Any, batch_size: int) -> None:
        self.strategy, self.boundaries, self.output, self.batch_size = strategy, boundaries, output, batch_size

    def stage_input(self, stage: int) -> tuple[tuple[int, ...], Any]:
        shape, dtype = self.boundaries[self.strategy.split.stages[stage].blocks[0]]
        return (self.batch_size // self.strategy.n_microbatches, *shape[1:]), dtype

    def last_stage_meta(self, key: tuple) -> tuple[tuple[int, ...], Any]:
        if key[0] == "out":  # the joined micro-batch outputs
            shape, dtype = self.output["out"]
            return (self.batch_size, *shape[1:]), dtype
        return self.output["loss"]


def simulate_rank(config: DryRunConfig, rank: int) -> dict[str, Any]:
    """One training step of ``rank`` on the fake process group (call in a fresh process; see the module doc)."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from lightning.pytorch.trainer.states import TrainerFn
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_dist import inputs
    from lightning_dist._compat import init_fake_process_group, torch_pipelining_exchanges_meta
    from lightning_dist._integrations.torch_distributed import build_replicate_reducers, ddp_on_fake_process_group
    from lightning_dist.mesh import DistMesh
    from lightning_dist.parallelize.ep import assume_routing, find_experts
    from lightning_dist.parallelize.pipeline.split import pipeline_view
    from lightning_dist.parallelize.units import find_block_lists

    start = time.perf_counter()
    check_cluster(config.world_size, config.devices_per_node)
    nodes = max(1, config.world_size // config.devices_per_node)
    per_node = min(config.devices_per_node, config.world_size)
    # the cluster environment Lightning reads (processes started externally, as under torchrun / SLURM)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % per_node),
            "NODE_RANK": str(rank // per_node),
            "WORLD_SIZE": str(config.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1",
        }
    )
    _check_replayable(_strategy_class(config))
    strategy = _strategy(config)
    torch.manual_seed(0)
    module = inputs.build_meta_model(config.model, dict(config.init_args))
    if not isinstance(module, pl.LightningModule):
        raise TypeError(f"{config.model!r} is not a LightningModule; the dry run runs its training_step.")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=per_node,
        num_nodes=nodes,
        strategy=strategy,
        precision=config.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=1,
    )
    trainer.state.fn = TrainerFn.FITTING
    strategy.connect(module)
    module.trainer = trainer
    # no fit loop runs, so there is no result collection to log into: `self.log` calls are dropped
    module.log = module.log_dict = lambda *args, **kwargs: None
    # the strategy's own validation, before any process group (the same errors as on the cluster)
    spec = strategy.mesh_spec()
    strategy.validate_config(spec)
    init_fake_process_group(rank=rank, world_size=config.world_size)
    patches = contextlib.ExitStack()
    try:
        patches.enter_context(ddp_on_fake_process_group())  # torch's DDP reducer (replicated layouts) on the fake group
        mesh = DistMesh.build(spec, "cpu")
        strategy.use_mesh(mesh)
        pipelined = pipeline_view(strategy) is not None
        if pipelined and not torch_pipelining_exchanges_meta():
            raise RuntimeError(
                f"The dry run of a pipeline needs torch's stage metadata exchange (torch >= 2.13); torch"
                f" {torch.__version__} infers each stage's shapes by sending its outputs to the next stage's rank,"
                " which the dry run's fake process group cannot carry. Dry-run pipelines on torch 2.13 or newer (the"
                " real run works on this torch)."
            )
        micro = strategy.n_microbatches if pipelined else 1
        if config.batch_size % micro:
            raise ValueError(f"batch_size={config.batch_size} does not divide into n_microbatches={micro}.")
        make_batch, cfg = _batch_maker(module, config), _model_config(module)
        with torch.device("meta"):
            meta_batch = make_batch(config.batch_size // micro)
        boundaries, output = _stage_inputs(strategy, module, meta_batch) if pipelined else (None, None)
        shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
        ep = int(getattr(strategy, "ep", 1) or 1)
        # a mixture of experts: the routing the step assumes (fake tensors hold no router choices)
        routing = UniformRouting() if find_experts(module) else None
        moe = inputs.moe_spec(module) if ep > 1 else None  # the experts, read before expert parallelism splits them
        in_blocks = {
            f"{list_name}.{n}" for list_name, blocks in find_block_lists(module) for n, _ in blocks.named_parameters()
        }
        # the strategy's own setup: the model prepared on the meta device in its order (dtype, parallelize: TP,
        # pipeline split, AC, FSDP2 / replicate), then materialized with its optimizers as fake tensors
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        strategy.allocate_under(fake)
        if pipelined:  # the fake group delivers no values: what the pp peers would send comes from the meta forward
            strategy.answer_peers_with(_PeerAnswers(strategy, boundaries, output, config.batch_size))
        strategy.setup(trainer)
        # DDP's one-time set-up (its broadcast from rank 0) out of the measured step, as a real run's steady step
        build_replicate_reducers(strategy.model)
        built = time.perf_counter()
        planned = plan_rank(strategy, module, cfg, config, spec, shapes, in_blocks, boundaries, moe=moe)
        optimizers = [getattr(o, "_optimizer", o) for o in strategy.optimizers]
        if routing is not None:  # the ep dispatch sizes its all-to-alls from it, experts without ep run on its choices
            patches.enter_context(assume_routing(routing, module))
        with fake:
            recorder, peak, states = _step(strategy, make_batch(config.batch_size), optimizers, warm_up=pipelined)
        staging = None
        if getattr(strategy, "_async_checkpoint", False):
            # async_checkpoint=True: the host copy a background save stages, measured as the writer measures it
            # (`local_tensor_bytes`) on the state the strategy's own save collects
            from lightning_dist.checkpoint_async import local_tensor_bytes

            with fake:
                saved = [strategy.lightning_module_state_dict(), *(strategy.optimizer_state(o) for o in optimizers)]
            staging = local_tensor_bytes(saved)
        heal_bytes = None
        if _replica_groups(config) is not None:
            # what a healthy group sends a healing one: the model and optimizer state fault_tolerance registers
            from lightning_dist.checkpoint_async import local_tensor_bytes
            from lightning_dist.parallelize.shard_state import module_state, optimizer_state

            with fake:
                heal_bytes = local_tensor_bytes([module_state(module), *(optimizer_state(o) for o in optimizers)])
        return {
            "rank": rank,
            "coords": spec.coords(rank),
            "mesh": dict(zip(DIM_NAMES, spec.shape)),
            "states": states,
            **peak,  # peak_total_bytes, peak_activation_bytes, peak_breakdown
            "checkpoint_staging_bytes": staging,
            "replica_groups": _replica_groups(config),
            "heal_bytes": heal_bytes,
            "collectives": _collective_rows(recorder, mesh, rank, config.world_size, ep),
            "planned": planned,
            "seconds": time.perf_counter() - start,
            "build_seconds": built - start,
            "stages": list(strategy.local_stages) if pipelined else None,
            "routing": routing and routing.description,  # what the experts' rows (the ep all-to-alls) assume
        }
    finally:
        patches.close()
        dist.destroy_process_group()


@dataclass(frozen=True)
class UniformRouting:
    """The routing the dry run assumes (fake tensors hold no router choices): each rank's ``N k`` (token, choice) rows
    split evenly over the experts, the first ``N k mod E`` experts one row more; the planner's assumption
    (``planner.UNIFORM_ROUTING``). The :class:`~lightning_dist.parallelize.ep.RoutingStandIn` of a mixture of
    experts' dry run, with expert parallelism or without."""

    description = "uniform routing: each rank's tokens x top_k rows split evenly over the experts (as the planner)"

    def rows_per_expert(self, rows: int, experts: int) -> list[int]:
        return [rows // experts + (e < rows % experts) for e in range(experts)]

    @contextlib.contextmanager
    def concrete(self) -> Iterator[None]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from lightning_dist._integrations.torch_memtracker import counted_outside_fake_mode

        # tensors made in the block hold values, the fake ones stay fake; the step's tracker counts both
        with unset_fake_temporarily(), counted_outside_fake_mode():
            yield


def _step(strategy: Any, batch: Any, optimizers: list, *, warm_up: bool) -> tuple[Any, dict, dict]:
    """One training step as Lightning's loop runs it: the strategy's ``training_step`` and ``backward`` (the
    pipeline strategy runs its schedule in them), then each optimizer's step. Returns the recorder of its
    collectives, MemTracker's peak figures (forward and backward) and the model-state bytes after the step.

    ``warm_up``: one untracked step first, so that the measured step is a steady one, as every step after the
    first of a real run (which a ledger's ``skip_steps=1`` compares): a pipeline schedule's first step infers
    its stages' shapes, with autograd calls on leaf inputs that MemTracker's backward hooks cannot follow. Its
    gradients stay until the measured step's ``zero_grad``, as in Lightning's loop.
    """
    from lightning_dist import measure
    from lightning_dist._integrations.torch_memtracker import peak_figures, step_tracker
    from lightning_dist.callbacks.ledger import CollectiveRecorder

    def forward_backward() -> None:
        # Lightning's closure order: training_step, then zero_grad, then backward; the last step's gradients live
        # until that zero_grad (under a pipeline, through the whole schedule, which runs inside training_step)
        out = strategy.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, Mapping) else out
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        strategy.backward(loss, optimizers[0] if optimizers else None)

    if warm_up:
        forward_backward()
        for opt in optimizers:
            opt.step()
    tracker = step_tracker()  # the one MemoryReport(track_step=...) puts around a real step
    tracker.track_external(strategy.model, *optimizers)
    with CollectiveRecorder() as recorder:
        with tracker:
            forward_backward()
            peak = peak_figures(tracker)
        for opt in optimizers:
            opt.step()
        states = measure.model_state_bytes(strategy.model, optimizers)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
    return recorder, peak, states


def _collective_rows(recorder: Any, mesh: Any, rank: int, world: int, ep: int = 1) -> list[dict[str, Any]]:
    """The recorded calls per (op, dim) as the ledger counts them: calls, payload bytes, group size."""
    sizes = recorder.group_sizes(mesh=mesh, rank=rank, world=world, ep=ep)
    return [
        {"op": op, "dim": dim, "calls": calls, "payload_bytes": nbytes, "group_size": sizes[dim]}
        for (op, dim), (calls, nbytes) in sorted(recorder.totals(mesh=mesh, rank=rank, world=world, ep=ep).items())
    ]


def plan_rank(
    strategy: Any,
    module: Any,
    cfg: Any,
    config: DryRunConfig,
    spec: MeshSpec,
    shapes: Mapping[str, tuple[int, ...]],
    in_blocks: set[str],
    boundaries: Optional[list],
    *,
    moe: Optional[Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """The planner's prediction for this rank, from the model's shapes and the plan the strategy chose.

    Parameters this rank holds ``P``: those of its pipeline stage, at their tensor-parallel local shape
    (from the resolved TP plan). Then :func:`~lightning_dist.planner.model_state_bytes` /
    :func:`~lightning_dist.planner.data_parallel_traffic` over ``dp_shard`` x ``dp_replicate``,
    :func:`~lightning_dist.planner.tp_activation_traffic` (+ the gathered head), the stage-boundary sends
    and :func:`~lightning_dist.planner.activation_bytes`. Under expert parallelism (``moe``: the arguments of
    :class:`~lightning_dist.planner.MoEShape`, read off the unsplit model) the routed experts'
    :func:`~lightning_dist.planner.ep_state_bytes` / :func:`~lightning_dist.planner.ep_fsdp_traffic` and the
    all-to-alls of :func:`~lightning_dist.planner.ep_all_to_all` under uniform routing (:class:`UniformRouting`).
    """
    import math

    from lightning_dist import planner, rules
    from lightning_dist.parallelize.pipeline.split import pipeline_view
    from lightning_dist.parallelize.units import find_block_lists

    state = planner.state_bytes(precision=config.precision, optimizer=config.optimizer)
    act_bytes = planner.PRECISIONS[config.precision][1]
    pipelined = pipeline_view(strategy) is not None
    # HSDP / TP cast parameters for compute with FSDP2's MixedPrecisionPolicy: everything runs in the compute
    # dtype. Pipeline stages run under Lightning's autocast: parameters gathered in their stored dtype, the
    # residual stream (and so the backward's activation gradients) in float32.
    resid_bytes = planner.PRECISIONS[config.precision][0] if pipelined else act_bytes
    if pipelined:
        state = dataclasses.replace(state, gather=state.param)
    local_shape = {
        f"{e.fqn}.{name}": local for e in getattr(strategy, "tp_entries", []) if e.active for name, _, local in e.shapes
    }
    names = [n for n, _ in module.named_parameters() if n in shapes] or list(shapes)
    numel = {n: math.prod(local_shape.get(n, shapes[n])) for n in names}
    P = sum(numel.values())
    root = sum(v for n, v in numel.items() if n not in in_blocks)
    R, T, C = spec.size(DP_REPLICATE), spec.size(TP), spec.size(CP)
    S = spec.size(DP_SHARD) * C  # context parallelism: FSDP2 shards over dp_shard x cp
    zero = (3 if strategy.reshard_after_forward else 2) if pipelined else strategy.zero_stage
    replicate_only = not pipelined and rules.replicates(zero_stage=zero, dp_shard=S, tp=T, cp=C)
    dp = R * S
    ep = int(getattr(strategy, "ep", 1) or 1)
    # ep runs under FSDP2 only (the strategies refuse the rest): ZeRO-3's formulas; a pipeline stage holds some of the
    # MoE layers only, which `moe` (the whole model's) does not say: no ep plan there
    ep_planned = ep > 1 and moe is not None and not pipelined
    if ep_planned:
        dense, experts = planner.ep_state_bytes(
            P - moe["expert_params"], moe["expert_params"], shard_size=S, ep=ep, state=state, tp=T
        )
        memory = planner.MemoryBreakdown(
            params=dense.params + experts.params,
            grads=dense.grads + experts.grads,
            optimizer=dense.optimizer + experts.optimizer,
        )
        traffic = planner.ep_fsdp_traffic(
            P - moe["expert_params"],
            moe["expert_params"],
            state=state,
            shard_size=S,
            replicate_size=R,
            ep=ep,
            root_params=root,
            tp=T,
        )
    elif replicate_only:
        memory = planner.model_state_bytes(P, state=state, zero_stage=zero if zero == 1 else 0, shard_size=dp)
        traffic = (
            planner.data_parallel_traffic(
                P, state=state, zero_stage=zero if zero == 1 else 0, shard_size=S, replicate_size=R
            )
            if dp > 1
            else []
        )
    else:  # FSDP2 keeps only the dim-0 shards at rest for stages 2 and 3
        memory = planner.model_state_bytes(P, state=state, zero_stage=3 if dp > 1 else 0, shard_size=S)
        traffic = (
            planner.data_parallel_traffic(
                P, state=state, zero_stage=zero, shard_size=S, replicate_size=R, root_params=root
            )
            if dp > 1
            else []
        )
    traffic = planner.with_cp_dims(traffic, C)
    seq = config.seq_len or getattr(cfg, "block_size", 1)
    if ep_planned:
        tokens = config.batch_size * seq // C  # this rank's tokens per MoE layer (its tp group's, alike on each)
        spans = rules.ep_spans_tp(ep, T)  # then each tp rank dispatches its share and the rows are gathered back
        tp_rank = strategy.mesh.local_rank(TP) if spans else 0
        traffic += planner.ep_all_to_all(
            rows=planner.ep_rows(tokens, moe["top_k"], ep=ep, tp=T, tp_rank=tp_rank),
            received=tokens * moe["top_k"] / T if spans else None,  # uniform routing: the ep peers' mean share
            hidden=moe["hidden"],
            bytes_per_element=act_bytes,
            experts=moe["experts"],
            ep=ep,
            layers=moe["layers"],
        )
        if spans:
            traffic += planner.ep_tp_gathers(
                tokens=tokens,
                hidden=moe["hidden"],
                top_k=moe["top_k"],
                tp=T,
                bytes_per_element=act_bytes,
                layers=moe["layers"],
            )
    hidden, vocab = getattr(cfg, "n_embd", None), getattr(cfg, "vocab_size", None)
    # every stage this rank holds (interleaved and V schedules hold several): their blocks, the stem, the head
    local = list(strategy.local_stages) if pipelined else [0]
    stages = strategy.split.num_stages if pipelined else 1
    m = strategy.n_microbatches if pipelined else 1
    stage_blocks = (
        {s: len(strategy.split.stages[s].blocks) for s in local}
        if pipelined
        else {0: sum(len(b) for _, b in find_block_lists(module))}
    )
    blocks = sum(stage_blocks.values())
    has_head = stages - 1 in local
    head_gathered = any(
        e.style == "colwise_gather" and e.active
        for e in getattr(strategy, "tp_entries", [])
        if not pipelined or e.fqn.endswith("lm_head")
    )
    if T > 1 and hidden is not None:
        rows = 2  # row-parallel layers per block: attention and MLP; read off the plan where the blocks differ (MoE)
        if not pipelined:
            prefixes = tuple(f"{name}." for name, _ in find_block_lists(module))
            entries = [e for e in getattr(strategy, "tp_entries", []) if e.active and e.style == "rowwise"]
            rows = max(1, sum(e.fqn.startswith(prefixes) for e in entries) // max(blocks, 1)) if entries else rows
        # half the all-reduces are forward outputs (compute dtype), half backward input gradients (residual dtype)
        traffic += planner.tp_activation_traffic(
            batch=config.batch_size,
            seq=seq // C,  # the tokens of this rank's sequence chunks
            hidden=hidden,
            blocks=blocks,
            tp=T,
            bytes_per_element=(act_bytes + resid_bytes) / 2,
            row_parallel_per_block=rows,
            sequence_parallel=getattr(strategy, "sequence_parallel", False),
        )
        if (
            has_head and head_gathered and vocab is not None
        ):  # the colwise_gather head: logits gathered, input grad reduced
            tokens = config.batch_size * seq // C
            traffic.append(
                planner.Collective(
                    op="all_gather", dim=TP, group_size=T, payload_bytes=tokens * vocab * act_bytes, what="logits"
                )
            )
            traffic.append(
                planner.Collective(
                    op="all_reduce",
                    dim=TP,
                    group_size=T,
                    payload_bytes=tokens * hidden * resid_bytes,
                    what="head input gradient",
                )
            )
    cp_state = getattr(strategy, "cp_state", None)
    if C > 1 and cp_state is not None and cp_state.network is not None:
        from lightning_dist.parallelize import cp as context_parallel

        traffic += (
            context_parallel.planned_attention_traffic(
                cp_state.network,
                find_block_lists(module),
                batch=config.batch_size,
                seq=seq,
                cp=C,
                tp=T,
                bytes_per_element=act_bytes,
                style=cp_state.cp.style,
            )
            or []
        )
    if pipelined and stages > 1 and boundaries is not None:
        import torch

        from lightning_dist.rules import SCHEDULES, stage_ranks

        owner = stage_ranks(stages, spec.size(PP), SCHEDULES[strategy.schedule][2])

        def boundary(s: int) -> int:  # bytes of one micro-batch's input of stage s (and of its gradient)
            shape, dtype = boundaries[strategy.split.stages[s].blocks[0]]
            return config.batch_size // m * math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()

        # each local stage sends its output forward and its input gradient back, per micro-batch, to a stage
        # held by another pp rank (adjacent stages on one rank, as in a V schedule, hand over in memory)
        sent = 0
        for s in strategy.local_stages:
            if s < stages - 1 and owner[s + 1] != owner[s]:
                sent += m * boundary(s + 1)
            if s > 0 and owner[s - 1] != owner[s]:
                sent += m * boundary(s)
        traffic.append(
            planner.Collective(
                op="send_recv",
                dim=PP,
                group_size=spec.size(PP),
                payload_bytes=sent,
                what="activations + their gradients",
            )
        )
        # the batch loss from the last stage's rank to each other pp rank (`PipelineRunner._loss_to_all`)
        traffic.append(planner.pipeline_loss_transfer(spec.size(PP), last_stage=stages - 1 in strategy.local_stages))
    activation = None
    if hidden is not None and cfg is not None:
        # each local stage holds its micro-batches in flight at the peak (1F1B: stages - s of them; GPipe: all m);
        # for several stages per rank the sum of each one's 1F1B count is an estimate (their peaks need not meet)
        activation = sum(
            planner.activation_bytes(
                planner.BlockShape(
                    hidden=hidden,
                    heads=cfg.n_head,
                    mlp_hidden=cfg.mlp_ratio * hidden,
                    vocab=vocab,
                    kv_heads=getattr(cfg, "n_kv_head", None),
                ),
                tokens=config.batch_size // m * seq // C,  # context parallelism: each rank holds seq / cp tokens
                blocks=n_blocks,
                tp=T,
                bytes_per_element=act_bytes,
                residual_bytes=resid_bytes,
                micro_batches_held=(m if strategy.schedule == "gpipe" else min(stages - s, m)) if pipelined else 1,
                stem=s == 0,
                head=s == stages - 1,
                head_gathered=head_gathered,
                autocast=pipelined,
                checkpointed=getattr(strategy, "activation_checkpointing", False) or False,
                offloaded=bool(getattr(strategy, "offload_activations", False)),
            )
            for s, n_blocks in stage_blocks.items()
        )
    from lightning_dist.callbacks import _planned

    merged: dict[tuple[str, str], float] = {}
    for c in traffic:
        # the recorder's name for the group (one group can be several dims: cp and dp_shard_cp when dp_shard=1)
        c = dataclasses.replace(
            c,
            dim=_planned.dim_label(
                c.dim, mesh=strategy.mesh, rank=strategy.global_rank, world=config.world_size, ep=ep
            ),
        )
        if c.group_size > 1:
            # the recorder counts each side of a point-to-point transfer; the planner's payload is what one rank
            # sends, and a stage receives as many bytes as it sends (activations in, their gradients back)
            for op in ("send", "recv") if c.op == "send_recv" else (c.op,):
                merged[(op, c.dim)] = merged.get((op, c.dim), 0.0) + c.payload_bytes
    staged = memory.params + memory.optimizer  # what a checkpoint holds of this rank's states
    groups, heal = _replica_groups(config), None
    if groups is not None:
        import torch

        trained = [n for n, p in module.named_parameters() if p.requires_grad]  # each has an Adam `step` scalar
        heal = planner.heal_transfer(
            P,
            state=state,
            zero_stage=0 if replicate_only or dp == 1 else 3,
            shard_size=S,
            replica_groups=groups,
            tensors=len(trained) if state.optimizer else 0,
            step_bytes=torch.empty((), dtype=torch.get_default_dtype()).element_size(),
            buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
        ).payload_bytes
    return {
        "heal_bytes": heal,
        "checkpoint_staging_bytes": staged if getattr(strategy, "_async_checkpoint", False) else None,
        "states": {**memory.to_dict()},
        "collectives": [{"op": o, "dim": d, "payload_bytes": v} for (o, d), v in sorted(merged.items())],
        "peak_activation_bytes": activation,
        "params_local": P,
    }


# ---- the driver: one process per representative rank -------------------------------------------------------
def dry_run(
    config: DryRunConfig, *, timeout: float = 600.0, python: str = sys.executable, jobs: Optional[int] = None
) -> DryRunReport:
    """Simulate each representative rank in its own process and collect the figures (in rank order).

    Checks the cluster and the mesh arithmetic here first (same errors as the strategy), so a bad layout
    fails before any process starts; a rank's error (e.g. the tensor-parallel plan's head check) is raised
    here as the same exception type with the rank's message (the first failing rank's, in rank order).

    ``jobs``: rank processes run at once (default: one per CPU core, at most one per rank); each simulated
    rank is one mostly single-threaded process, so on ``jobs`` <= cores each one's time is its own.
    """
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    check_cluster(config.world_size, config.devices_per_node)
    _check_replayable(_strategy_class(config))
    strategy_sizes = {k: v for k, v in dict(config.strategy_args).items() if k in DIM_NAMES}
    if all(isinstance(v, int) for v in strategy_sizes.values()) and strategy_sizes:
        MeshSpec(
            world_size=config.world_size,
            devices_per_node=min(config.devices_per_node, config.world_size),
            **{"dp_replicate": "auto", "dp_shard": "auto", **strategy_sizes},
        )
    ranks = list(config.ranks) if config.ranks is not None else _representative_for(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_JOB_ENV)}
    if jobs is not None and (not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"dry_run(jobs={jobs!r}): give the number of rank processes to run at once (>= 1), or None.")
    workers = max(1, min(jobs or os.cpu_count() or 1, len(ranks)))
    with tempfile.TemporaryDirectory() as tmp:

        def simulate(rank: int) -> tuple[Optional[dict], str]:
            out = os.path.join(tmp, f"rank{rank}.json")
            cmd = [
                python,
                "-m",
                "lightning_dist.dryrun",
                "--config",
                config.to_json(),
                "--out",
                out,
                "--rank",
                str(rank),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            with contextlib.suppress(FileNotFoundError), open(out) as f:
                return json.load(f), proc.stderr
            return None, proc.stderr

        with ThreadPoolExecutor(max_workers=workers) as pool:  # threads only wait on the rank processes
            done = list(pool.map(simulate, ranks))
    results = []
    for data, stderr in done:
        if data is None or "error" in data:
            kind, message = data["error"] if data else ("RuntimeError", stderr[-4000:])
            exc = {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)
            raise exc(message)
        results.append(data)
    return DryRunReport(config=config, ranks=results)


def _main(argv: Optional[Sequence[str]] = None) -> int:
    """Worker entry point (``python -m lightning_dist.dryrun``): one rank, result as JSON in ``--out``."""
    import argparse
    import logging
    import warnings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    config = DryRunConfig.from_json(args.config)
    try:
        result = simulate_rank(config, args.rank)
    except (ValueError, TypeError, ImportError, RuntimeError) as err:
        result = {"error": [type(err).__name__, str(err)]}
    atomic_write(args.out, lambda f: json.dump(result, f), mode="w")
    return 0


def _representative_for(config: DryRunConfig) -> list[int]:
    """The strategy's resolved mesh (its own ``mesh_spec``, with its ``"auto"`` rules) -> representative ranks.

    Pure arithmetic on a strategy given the devices the Trainer would give it: runs in the driver's process.
    """
    import torch

    check_cluster(config.world_size, config.devices_per_node)
    per_node = min(config.devices_per_node, config.world_size)
    strategy = _strategy(config)
    strategy.parallel_devices = [torch.device("cpu")] * per_node
    strategy.num_nodes = max(1, config.world_size // per_node)
    return representative_ranks(strategy.mesh_spec())


# launcher and scheduler variables of the calling job (a torchrun / SLURM rank running auto_parallel's
# verification): the simulated rank sets its own, and must not be taken for a rank of that job
_JOB_ENV = (
    "TORCHELASTIC_",
    "SLURM_",
    "GROUP_",
    "ROLE_",
    "LOCAL_WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "OMPI_",
    "PMI_",
)


if __name__ == "__main__":
    sys.exit(_main())
