"""Fault-tolerant replica groups (``fault_tolerance=``): the Lightning glue around torchft.

Each replica group (one index of ``dp_replicate``) is its own launched job whose mesh has ``dp_replicate=1``;
the gradient average across the groups and the per-step quorum are torchft's (``_integrations/torchft.py``); what a
healing group receives, and the training loader that asks each step's quorum, are in ``heal.py``.
Notes: docs/fault_tolerance.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_dist._compat import torchft_available
from lightning_dist.strategies.base import MeshStrategy

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the lighthouse's address
SYNC_EVERY = 100  # DiLoCo's default inner steps per sync: torchft's example (the DiLoCo paper uses 500)


@dataclass(frozen=True, kw_only=True)
class FaultTolerance:
    """Fault-tolerant replica groups with torchft: ``HybridShardStrategy(dp_replicate=N, fault_tolerance=...)``."""

    replica_group: int
    """This job's replica group, 0 .. dp_replicate - 1 (each replica group is its own launched job)."""
    lighthouse: Optional[str] = None
    """The lighthouse's address (``http://host:29510``). None: the ``TORCHFT_LIGHTHOUSE`` environment variable, else
    a lighthouse embedded in replica group 0 on this machine, at ``http://127.0.0.1:<lighthouse_port>``."""
    lighthouse_port: int = 29510
    """The embedded lighthouse's port (one machine only)."""
    min_replicas: int = 1
    """The fewest replica groups a step commits with; also the embedded lighthouse's quorum size (set it to
    dp_replicate to start every group's first step together)."""
    timeout: float = 60.0
    """Seconds for the cross-group all-reduce, the commit vote and the healing transfer."""
    quorum_timeout: float = 60.0
    """Seconds a step waits for its quorum from the lighthouse before the job fails."""
    connect_timeout: float = 30.0
    """Seconds to reach the lighthouse at start-up before the job fails with its address."""
    join_timeout: float = 60.0
    """The embedded lighthouse's wait for heartbeating groups that have not asked for the quorum yet."""
    sync: str = "step"
    """``"step"``: every step averages the gradients across the groups (the result of plain hsdp). ``"diloco"``: the
    groups train on their own and every ``sync_every`` steps torchft's DiLoCo averages the pseudo-gradients (global
    weights - local weights) and the outer optimizer steps the global weights (docs/fault_tolerance.md, DiLoCo)."""
    sync_every: Optional[int] = None
    """DiLoCo's inner steps between two syncs (H); None: :data:`SYNC_EVERY`. Only with ``sync="diloco"``."""
    outer_optimizer: Optional[Callable[[Iterable[Any]], torch.optim.Optimizer]] = None
    """DiLoCo's outer optimizer: a ``torch.optim.Optimizer`` class, a factory ``params -> optimizer``, or (YAML)
    ``{"class_path": "torch.optim.SGD", "init_args": {...}}``. None: SGD, lr 0.7, momentum 0.9, Nesterov (the DiLoCo
    paper's). Only with ``sync="diloco"``."""

    def problems(self, dp_replicate: Any) -> list[str]:
        """Every configuration problem, in words with the values (none: empty)."""
        out = []
        if isinstance(dp_replicate, bool) or not isinstance(dp_replicate, int) or dp_replicate < 1:
            out.append(
                f"fault_tolerance needs `dp_replicate` to be the number of replica groups (an integer >= 1), not"
                f" {dp_replicate!r}: each replica group is its own job, e.g. dp_replicate=2."
            )
            dp_replicate = None
        group = self.replica_group
        if isinstance(group, bool) or not isinstance(group, int) or group < 0:
            out.append(f"`FaultTolerance(replica_group={group!r})` must be an integer >= 0 (this job's group).")
        elif dp_replicate is not None and group >= dp_replicate:
            out.append(
                f"`FaultTolerance(replica_group={group})` is outside dp_replicate={dp_replicate}: the groups are"
                f" 0 .. {dp_replicate - 1}."
            )
        low = self.min_replicas
        if isinstance(low, bool) or not isinstance(low, int) or low < 1:
            out.append(f"`FaultTolerance(min_replicas={low!r})` must be an integer >= 1.")
        elif dp_replicate is not None and low > dp_replicate:
            out.append(
                f"`FaultTolerance(min_replicas={low})` exceeds dp_replicate={dp_replicate}: no step could commit."
            )
        for name in ("timeout", "quorum_timeout", "connect_timeout", "join_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                out.append(f"`FaultTolerance({name}={value!r})` must be a positive number of seconds.")
        port = self.lighthouse_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            out.append(f"`FaultTolerance(lighthouse_port={port!r})` must be a port number, 1 .. 65535.")
        if self.lighthouse is not None and (
            not isinstance(self.lighthouse, str) or not self.lighthouse.startswith(("http://", "https://"))
        ):
            out.append(
                f"`FaultTolerance(lighthouse={self.lighthouse!r})` must be the lighthouse's URL, e.g."
                " 'http://lighthouse-host:29510', or None."
            )
        return out + self._sync_problems(dp_replicate)

    def _sync_problems(self, dp_replicate: Optional[int]) -> list[str]:
        if self.sync not in ("step", "diloco"):
            return [f"`FaultTolerance(sync={self.sync!r})` must be 'step' (every step) or 'diloco' (every sync_every)."]
        if self.sync == "step":
            given = [
                f"{n}={getattr(self, n)!r}" for n in ("sync_every", "outer_optimizer") if getattr(self, n) is not None
            ]
            if given:
                return [f"`FaultTolerance({', '.join(given)})` applies to sync='diloco' only: pass sync='diloco'."]
            return []
        out = []
        every = self.sync_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            out.append(
                f"`FaultTolerance(sync_every={every!r})` must be an integer >= 1 (DiLoCo's inner steps per sync)."
            )
        if dp_replicate is not None and dp_replicate < 2:
            out.append(
                f"sync='diloco' averages pseudo-gradients across replica groups; dp_replicate={dp_replicate} has one."
                " Pass dp_replicate >= 2 (one job per group), or sync='step'."
            )
        try:
            outer_optimizer_factory(self.outer_optimizer)
        except (TypeError, ValueError, ImportError) as err:
            out.append(str(err))
        return out

    @property
    def diloco(self) -> bool:
        return self.sync == "diloco"

    @property
    def inner_steps(self) -> int:
        """DiLoCo's inner steps per sync, the default filled in."""
        return self.sync_every or SYNC_EVERY


def _default_outer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def outer_optimizer_factory(value: Any) -> Callable[[Any], Any]:
    """``params -> optimizer`` for ``FaultTolerance(outer_optimizer=value)``; TypeError/ValueError naming the value."""
    if value is None:
        return _default_outer
    if isinstance(value, Mapping):
        import importlib

        if set(value) - {"class_path", "init_args"} or not isinstance(value.get("class_path"), str):
            raise ValueError(
                f"`FaultTolerance(outer_optimizer={dict(value)!r})`: a dict names the class as LightningCLI does,"
                " {'class_path': 'torch.optim.SGD', 'init_args': {'lr': 0.7, 'momentum': 0.9, 'nesterov': True}}."
            )
        module, _, name = value["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name, None) if module else None
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(
                f"`FaultTolerance(outer_optimizer={{'class_path': {value['class_path']!r}}})` is not a"
                " torch.optim.Optimizer class; e.g. 'torch.optim.SGD'."
            )
        return functools.partial(cls, **dict(value.get("init_args") or {}))
    if (isinstance(value, type) and not issubclass(value, torch.optim.Optimizer)) or not callable(value):
        raise TypeError(
            f"`FaultTolerance(outer_optimizer={value!r})` must be a torch.optim.Optimizer class, a factory"
            " `params -> optimizer` (e.g. functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)),"
            " or None for that default."
        )
    return value


FaultToleranceArg = Union[FaultTolerance, Mapping[str, Any], None]


def as_fault_tolerance(value: FaultToleranceArg) -> tuple[Optional[FaultTolerance], list[str]]:
    """(the option as a :class:`FaultTolerance`, problems): a dict (LightningCLI YAML) is read by field name."""
    if value is None or isinstance(value, FaultTolerance):
        return value, []
    if isinstance(value, Mapping):
        names = {f.name for f in dataclasses.fields(FaultTolerance)}
        unknown = sorted(set(value) - names)
        if unknown or "replica_group" not in value:
            why = f"unknown keys {unknown}" if unknown else "no 'replica_group'"
            return None, [f"`fault_tolerance={dict(value)!r}`: {why}; the keys are {sorted(names)}."]
        return FaultTolerance(**value), []
    return None, [
        f"`fault_tolerance={value!r}` must be a FaultTolerance(replica_group=...) or a dict of its fields, or None."
    ]


class ReplicaGroupsMixin(MeshStrategy):
    """``fault_tolerance=``: the replicate dim as torchft replica groups (mixed into :class:`HybridShardStrategy`)."""

    _ft: Optional[FaultTolerance] = None
    _ft_groups = 1
    _manager: Any = None
    _lighthouse: Any = None
    _quorum_open = False
    _diloco: Optional[contextlib.ExitStack] = None  # torchft's DiLoCo, entered (its hooks on the inner optimizer)
    _inner_steps = 0

    def _take_fault_tolerance(self, value: FaultToleranceArg, kwargs: dict[str, Any], zero_stage: int) -> list[str]:
        """Read ``fault_tolerance`` before ``MeshStrategy.__init__``: the job's own mesh gets ``dp_replicate=1``."""
        config, problems = as_fault_tolerance(value)
        self.committed_steps: deque[dict[str, Any]] = deque(maxlen=10_000)
        """The last 10,000 optimizer steps under fault tolerance, each ``{"step", "participants", "committed", "epoch",
        "batch"}``: torchft's step counter after it, the groups in it, and the batch trained (its index in the epoch,
        per training loader; every group's part of that global batch)."""
        if config is None:
            return problems
        groups = kwargs.get("dp_replicate", "auto")
        problems += config.problems(groups)
        if not torchft_available():
            problems.append(
                "fault_tolerance needs torchft, which is not installed: pip install 'lightning-dist[fault-tolerance]'."
            )
        if zero_stage == 1:
            problems.append(
                "fault_tolerance with zero_stage=1 is not supported yet (ZeroRedundancyOptimizer's sharded state"
                " would have to be healed shard by shard): pass zero_stage=2 or 3."
            )
        if kwargs.get("pp", 1) != 1:
            problems.append("fault_tolerance with pipeline parallelism (pp > 1) is not supported yet: set pp=1.")
        if not problems:
            self._ft, self._ft_groups = config, groups
            kwargs["dp_replicate"] = 1  # inside one replica group; the groups are torchft's
        return problems

    @property
    def fault_tolerance(self) -> Optional[FaultTolerance]:
        """The fault-tolerance configuration (None: off)."""
        return self._ft

    @property
    def manager(self) -> Any:
        """This rank's ``torchft.Manager`` once set up (None without fault tolerance)."""
        return self._manager

    def lighthouse_address(self) -> tuple[str, bool]:
        """(the lighthouse's address, True when replica group 0 embeds it)."""
        assert self._ft is not None
        given = self._ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV) or None
        return (given, False) if given else (f"http://127.0.0.1:{self._ft.lighthouse_port}", True)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self._ft is not None and self._stage() is not None:  # validate/test/predict: each group on its own
            self._join_replica_groups()

    def _stage(self) -> Optional[str]:
        """``"fit"`` while fitting, ``"train"`` while its training loop runs (its loaders are built), else None."""
        try:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        except RuntimeError:  # not attached to a Trainer
            return None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return None
        return "train" if trainer.state.stage == RunningStage.TRAINING else "fit"

    def _join_replica_groups(self) -> None:
        from lightning_dist._integrations import torchft as ft

        config = self._ft
        assert config is not None and self.cluster_environment is not None
        address, embedded = self.lighthouse_address()
        who = f"replica group {config.replica_group} rank {self.global_rank}"
        if embedded and config.replica_group == 0 and self.global_rank == 0:
            self._lighthouse = ft.start_lighthouse(
                port=config.lighthouse_port, min_replicas=config.min_replicas, join_timeout=config.join_timeout
            )
            print(f"torchft lighthouse embedded in replica group 0 at {address}", flush=True)
        ft.check_lighthouse(address, timeout=config.connect_timeout, who=who)  # every rank, before the manager
        self._manager = ft.make_manager(
            replica_group=config.replica_group,
            group_rank=self.global_rank,
            group_size=self.world_size,
            store_addr=self.cluster_environment.main_address,
            store_port=self.cluster_environment.main_port,
            lighthouse=address,
            min_replicas=config.min_replicas,
            device_type=self.root_device.type,
            timeout=config.timeout,
            quorum_timeout=config.quorum_timeout,
            connect_timeout=config.connect_timeout,
        )
        rank_zero_info(
            f"replica group {config.replica_group} of {self._ft_groups} (torchft), lighthouse {address};"
            f" min_replicas={config.min_replicas}"
        )

    @override
    def apply_parallelism(self) -> None:
        super().apply_parallelism()
        if self._manager is None or self._ft.diloco:  # DiLoCo: no per-step average; each group trains on its own
            return
        from torch.distributed.tensor import DTensor

        from lightning_dist._integrations.torchft import average_across_replica_groups, replicate_for_replica_groups

        module = self.lightning_module
        if self._parallelize_fn is None and not _has_data_parallel(module):
            # a group of one data-parallel rank: the plan applies no data parallelism, but the cross-group average
            # hooks into it: DDP (one bucketed all-reduce per step; plain tensors), or FSDP2 on the one-rank mesh for
            # DTensor parameters (tensor parallelism), roots only (one all-reduce per root, not per block)
            from lightning_dist.parallelize.fsdp import apply_fsdp, roots

            if any(isinstance(p, DTensor) for p in module.parameters()):
                config = self.parallelize_config()
                apply_fsdp(
                    module,
                    self.mesh.fsdp_mesh(),
                    units=[],
                    reshard_after_forward=False,
                    mp_policy=config.mp_policy,
                    offload_policy=config.offload_policy,
                )
            else:
                replicate_for_replica_groups(roots(module), self.mesh.dp_group)
        if average_across_replica_groups(module, self._manager) == 0:
            raise ValueError(
                "fault_tolerance averages gradients through FSDP2's or DDP's hooks, but the model has neither (a"
                " parallelize_fn without fully_shard?). Apply lightning_dist.parallelize.apply_fsdp in it."
            )

    # ---- data: in training each replica group reads its own part of the global batch -------------------------
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._ft is None or self._stage() != "train":  # evaluation: each group scores the whole set itself
            return super().distributed_sampler_kwargs
        size = self.mesh.dp_size
        return {"num_replicas": self._ft_groups * size, "rank": self._ft.replica_group * size + self.mesh.dp_rank}

    # ---- the step: the heal state; the quorum as its batch is read; the commit vote before the optimizer step --
    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self._manager is None:
            return
        if len(self.optimizers) != 1:
            raise ValueError(
                f"fault_tolerance commits one optimizer step per training step; configure_optimizers returned"
                f" {len(self.optimizers)} optimizers. Combine them into one (parameter groups)."
            )
        from lightning_dist._integrations.torchft import register_state
        from lightning_dist.strategies import heal

        module, optimizer, manager = self.lightning_module, self.optimizers[0], self._manager
        # a healing group loads these in this order, in the read of its first batch (the quorum is asked there; under
        # DiLoCo in its sync, inside the optimizer step, where DiLoCo adds its own state: global weights, outer state)
        wrap = functools.partial(_healing, manager=manager if self._ft.diloco else None)
        register_state(manager, "model", lambda: heal.module_state(module), wrap(heal.load_module_state, module))
        register_state(
            manager,
            "optimizer",
            lambda: heal.local_tree(optimizer.state_dict()),
            wrap(heal.load_optimizer_state, optimizer),
        )
        register_state(
            manager, "trainer", lambda: heal.training_state(trainer), wrap(heal.load_training_state, trainer)
        )

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._manager is None or not self._ft.diloco:
            return
        from lightning_dist._integrations.torchft import diloco
        from lightning_dist.strategies.heal import LocalShardState

        # here, not at set-up: DiLoCo copies the global weights now, after a checkpoint or callback loaded them
        module = self.lightning_module
        outer = outer_optimizer_factory(self._ft.outer_optimizer)(module.parameters())
        if not isinstance(outer, torch.optim.Optimizer):
            raise TypeError(
                f"`FaultTolerance(outer_optimizer={self._ft.outer_optimizer!r})` returned {type(outer).__name__}, not a"
                " torch.optim.Optimizer: a factory takes the parameters and returns the optimizer."
            )
        self._diloco = contextlib.ExitStack()
        inner = self.optimizers[0]
        self._diloco.enter_context(diloco(self._manager, module, inner, LocalShardState(outer), self._ft.inner_steps))
        self._inner_steps = 0

    # ---- data: each batch is read after the step's quorum ----------------------------------------------------
    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)
        if self._manager is None or self._stage() != "train":
            return dataloader
        from lightning.fabric.utilities.data import has_len

        from lightning_dist.strategies.heal import group_loader

        if not has_len(dataloader):
            raise ValueError(
                f"fault_tolerance needs a training loader with a length (a map-style dataset), got"
                f" {type(dataloader).__name__} without one: each batch is read after the step's quorum, so that a"
                " healing replica group reads the batch the others read, and Lightning reads an unsized loader one"
                " batch ahead. Use a map-style Dataset (or give the IterableDataset a __len__)."
            )
        return group_loader(dataloader, _no_quorum if self._ft.diloco else self._ask_quorum)  # DiLoCo's: at sync

    def _ask_quorum(self) -> None:
        """The step's quorum, before its first batch is read (synchronous: a healing group loads the healthy state
        here and then reads the batch at the healthy group's position)."""
        if self._manager is None or self._quorum_open:
            return
        config = self._ft
        try:
            self._manager.start_quorum()
        except HealError:
            raise
        except Exception as err:
            address, _ = self.lighthouse_address()
            raise RuntimeError(
                f"replica group {config.replica_group} rank {self.global_rank}: no quorum from the torchft"
                f" lighthouse at {address} within quorum_timeout={config.quorum_timeout:g} s ({err})."
                " Is the lighthouse running?"
            ) from err
        self._quorum_open = True

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._manager is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._ft.diloco:
            return self._diloco_step(optimizer, closure, model, **kwargs)
        from lightning.pytorch.core.optimizer import LightningOptimizer

        from lightning_dist._integrations.torchft import CommitGate

        if not self._quorum_open:
            raise RuntimeError(
                "fault_tolerance: an optimizer step without a quorum. The quorum is asked when the training loader"
                " hands out a batch (the strategy wraps it in process_dataloader); a batch read another way has none."
            )
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        gate = CommitGate(inner, self._manager)
        model = model if model is not None else self.lightning_module
        result = self.precision_plugin.optimizer_step(gate, model=model, closure=closure, **kwargs)
        self._quorum_open = False
        self._record(bool(gate.committed))
        return result

    def _diloco_step(self, optimizer: Any, closure: Any, model: Any, **kwargs: Any) -> Any:
        """The inner step; every ``sync_every`` of them DiLoCo's hook on the inner optimizer syncs after it: the quorum
        (a group behind heals there), the pseudo-gradients' all-reduce, the commit vote, the outer step."""
        manager, config = self._manager, self._ft
        assert self._diloco is not None, "DiLoCo is entered at on_train_start"
        self._inner_steps += 1
        syncs = self._inner_steps % config.inner_steps == 0
        trained = []

        def step_closure() -> Any:
            out = closure()
            trained.append(True)  # an error after this is the optimizer's or DiLoCo's sync, not the training step's
            return out

        before = manager.current_step()
        try:
            result = super().optimizer_step(optimizer, step_closure, model, **kwargs)
        except Exception as err:
            if not (syncs and trained):
                raise
            address, _ = self.lighthouse_address()
            raise RuntimeError(
                f"replica group {config.replica_group} rank {self.global_rank}: DiLoCo's sync after inner step"
                f" {self._inner_steps} failed ({err}): the quorum from the torchft lighthouse at {address} (within"
                f" quorum_timeout={config.quorum_timeout:g} s), the pseudo-gradients' all-reduce or the commit vote"
                f" (timeout={config.timeout:g} s). Is the lighthouse running?"
            ) from err
        if syncs:
            self._record(manager.current_step() > before)
        return result

    def _record(self, committed: bool) -> None:
        from lightning_dist.strategies.heal import group_loaders

        trainer = self.lightning_module.trainer
        self.committed_steps.append(
            {
                "step": self._manager.current_step(),
                "participants": self._manager.num_participants(),
                "committed": committed,
                "epoch": trainer.current_epoch,
                "batch": [loader.position - 1 for loader in group_loaders(trainer)],
            }
        )

    @override
    def teardown(self) -> None:
        diloco, self._diloco = self._diloco, None
        if diloco is not None:
            diloco.close()  # DiLoCo's hooks off the inner optimizer
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.shutdown(wait=False)
        lighthouse, self._lighthouse = self._lighthouse, None
        if lighthouse is not None:
            lighthouse.shutdown()
        super().teardown()


def _has_data_parallel(module: torch.nn.Module) -> bool:
    from torch.distributed._composable.replicate import DDP
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, (FSDPModule, DDP)) for m in module.modules())


class HealError(RuntimeError):
    """A failure while loading the state a healthy replica group sent (not a quorum failure)."""


def _no_quorum() -> None:
    """DiLoCo asks the quorum at its sync, not before each batch."""


def _healing(load: Any, target: Any, *, manager: Any = None) -> Any:
    """`load` of a healthy group's state into `target`, errors as :class:`HealError`. With `manager` (DiLoCo): not at
    step 0, where torchft's ``init_sync`` makes every group but one heal at the first sync: each group keeps its own
    first interval there (DiLoCo's own state brings that group's global weights and outer optimizer state)."""

    def apply(state: Any) -> None:
        if manager is not None and manager.current_step() == 0:
            return
        try:
            load(target, state)
        except Exception as err:
            raise HealError(f"fault_tolerance: loading the healthy replica group's state failed: {err}") from err

    return apply
