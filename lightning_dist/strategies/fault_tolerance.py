"""Fault-tolerant replica groups (``fault_tolerance=``): the Lightning glue around torchft, per step.

Each replica group (one index of ``dp_replicate``) is its own launched job whose mesh has ``dp_replicate=1``;
the gradient average across the groups and the per-step quorum are torchft's (``_integrations/torchft.py``); what a
healing group receives, and the training loader that asks each step's quorum, are in ``heal.py``; the configuration
in ``ft_config.py``; ``sync="diloco"`` in ``diloco.py``. After each step the figures the user sees are logged
(:class:`ReplicaGroupFigures`). A checkpoint also keeps torchft's step counter and DiLoCo's state
(:func:`checkpoint_entry`, :func:`check_checkpoint_entry`). Notes: docs/fault_tolerance.md.
"""

from __future__ import annotations

import functools
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dist._compat import torchft_available
from lightning_dist.strategies.base import MeshStrategy
from lightning_dist.strategies.diloco import DiLoCoSync
from lightning_dist.strategies.ft_config import LIGHTHOUSE_ENV, FaultTolerance, FaultToleranceArg, as_fault_tolerance

REPLICA_GROUP_DIM = "replica_group"  # the ledger's dim for torchft's all-reduce across the replica groups
CHECKPOINT_KEY = "fault_tolerance"  # a checkpoint's entry: torchft's step counter, DiLoCo's state


class ReplicaGroupsMixin(MeshStrategy):
    """``fault_tolerance=``: the replicate dim as torchft replica groups (mixed into :class:`HybridShardStrategy`)."""

    _ft: Optional[FaultTolerance] = None
    _ft_groups = 1
    _manager: Any = None
    _lighthouse: Any = None
    _quorum_open = False
    _diloco: Optional[DiLoCoSync] = None
    _quorum_started: Optional[float] = None  # when this step's quorum was asked (a heal in it is timed from there)
    _gate: Any = None  # the commit gate around the optimizer, built at its first step (one per optimizer)
    _pending_diloco: Optional[dict[str, Any]] = None  # DiLoCo's state from a checkpoint, until DiLoCo is entered

    def _take_fault_tolerance(self, value: FaultToleranceArg, kwargs: dict[str, Any], zero_stage: int) -> list[str]:
        """Read ``fault_tolerance`` before ``MeshStrategy.__init__``: the job's own mesh gets ``dp_replicate=1``."""
        config, problems = as_fault_tolerance(value)
        self.committed_steps: deque[dict[str, Any]] = deque(maxlen=10_000)
        """The last 10,000 optimizer steps under fault tolerance, each ``{"step", "participants", "committed", "epoch",
        "batch"}``: torchft's step counter after it, the groups in it, and the batch trained (its index in the epoch,
        per training loader; every group's part of that global batch)."""
        self.figures = ReplicaGroupFigures()
        """What the progress bar and the loggers show (``ft/participants``, ``ft/failures``, ``ft/heal_s``)."""
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
            problems.append(
                f"fault_tolerance with pp={kwargs['pp']} on {type(self).__name__}: pipelines are PipelineStrategy's;"
                " pass PipelineStrategy(pp=..., dp_replicate=..., fault_tolerance=...)."
            )
        if not problems:
            self._ft, self._ft_groups = config, groups
            kwargs["dp_replicate"] = 1  # inside one replica group; the groups are torchft's
        return problems

    @property
    def fault_tolerance(self) -> Optional[FaultTolerance]:
        """The fault-tolerance configuration (None: off)."""
        return self._ft

    @property
    def replica_groups(self) -> int:
        """Fault-tolerant replica groups (``dp_replicate`` as given); 1 without fault tolerance."""
        return self._ft_groups if self._ft is not None else 1

    @property
    def outside_group_dim(self) -> Optional[str]:
        """What :class:`~lightning_dist.callbacks.CommunicationLedger` calls the process group outside this job's mesh:
        torchft's, across the replica groups (``"replica_group"``); None without fault tolerance."""
        return REPLICA_GROUP_DIM if self._ft is not None else None

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
        self._hook_replica_average()

    def _hook_replica_average(self) -> None:
        """The average across the groups through the data-parallel hooks of the backward (FSDP2's, DDP's)."""
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

    def _average_gradients_now(self) -> None:
        """Average the gradients held now over the participating groups, one all-reduce per dtype (a strategy that
        computes them outside the data-parallel hooks calls it at the end of its backward under ``sync="step"``:
        pipelines)."""
        assert self._manager is not None and not self._ft.diloco, "a per-step average across the replica groups"
        from lightning_dist._integrations.torchft import average_gradients

        grads = [p.grad for p in self.lightning_module.parameters() if p.grad is not None]
        average_gradients(grads, self._manager)

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
        from lightning_dist.parallelize import shard_state
        from lightning_dist.strategies import heal

        module, optimizer, manager = self.lightning_module, self.optimizers[0], self._manager
        # a healing group loads these in this order, in the read of its first batch (the quorum is asked there; under
        # DiLoCo in its sync, inside the optimizer step, where DiLoCo adds its own state: global weights, outer state)
        wrap = functools.partial(_healing, manager=manager if self._ft.diloco else None)
        register_state(
            manager, "model", lambda: shard_state.module_state(module), wrap(shard_state.load_module_state, module)
        )
        register_state(
            manager,
            "optimizer",
            lambda: shard_state.optimizer_state(optimizer),
            wrap(shard_state.load_optimizer_state, optimizer),
        )
        register_state(
            manager,
            "trainer",
            lambda: heal.training_state(trainer),
            wrap(heal.load_training_state, trainer, healed=self._healed),  # loaded last: the heal is over
        )

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._manager is None or not self._ft.diloco:
            return
        # here, not at set-up: DiLoCo copies the global weights now, after a checkpoint or callback loaded them
        self._diloco = DiLoCoSync(
            self._manager,
            self.lightning_module,
            self.optimizers[0],
            outer_optimizer=self._ft.outer_optimizer,
            every=self._ft.inner_steps,
        )
        from lightning_dist._integrations.torchft import register_state

        # a healing group also takes over the inner-step count (DiLoCo registered its global weights and outer state)
        sync = self._diloco
        register_state(
            self._manager,
            "diloco",
            sync.heal_state,
            _healing(DiLoCoSync.load_heal_state, sync, manager=self._manager),
        )
        pending, self._pending_diloco = self._pending_diloco, None
        if pending is not None:  # the checkpoint was loaded before DiLoCo existed (Lightning restores after setup)
            self._diloco.load_state_dict(pending)

    # ---- checkpoints: torchft's step counter; under DiLoCo its outer optimizer, global weights, inner steps -----
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if self._manager is not None:  # while fitting (every rank: DiLoCo's state gathers DTensor shards)
            diloco = self._diloco.state_dict() if self._diloco is not None else self._pending_diloco
            checkpoint = {**checkpoint, CHECKPOINT_KEY: checkpoint_entry(self._ft, self._manager, diloco)}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self._restore_fault_tolerance(super().load_checkpoint(checkpoint_path, weights_only), checkpoint_path)

    def _restore_fault_tolerance(self, checkpoint: dict[str, Any], checkpoint_path: _PATH) -> dict[str, Any]:
        """Take torchft's step counter (and DiLoCo's state) from a loaded `checkpoint`; returns it."""
        entry = checkpoint.get(CHECKPOINT_KEY)  # left in: the LightningModule's on_load_checkpoint sees it too
        if self._manager is None:  # not fitting, or no fault tolerance
            if entry is not None and self._ft is None and self._stage() is not None:
                rank_zero_warn(
                    f"{checkpoint_path} is from a fault-tolerant run (sync={entry['sync']!r}); this run has no"
                    " fault_tolerance: its weights and optimizer load, torchft's step counter and DiLoCo's state are"
                    " dropped."
                )
            return checkpoint
        if not check_checkpoint_entry(entry, self._ft, checkpoint_path):
            return checkpoint
        self._manager.load_state_dict(entry["manager"])
        if self._ft.diloco:
            if self._diloco is not None:
                self._diloco.load_state_dict(entry["diloco"])
            else:
                self._pending_diloco = entry["diloco"]  # loaded when DiLoCo is entered, at on_train_start
        return checkpoint

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
        self._quorum_started = time.perf_counter()
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
        if not self._quorum_open:
            raise RuntimeError(
                "fault_tolerance: an optimizer step without a quorum. The quorum is asked when the training loader"
                " hands out a batch (the strategy wraps it in process_dataloader); a batch read another way has none."
            )
        gate = self._commit_gate(optimizer)
        model = model if model is not None else self.lightning_module
        result = self.precision_plugin.optimizer_step(gate, model=model, closure=closure, **kwargs)
        self._quorum_open = False
        self._record(bool(gate.committed))
        return result

    def _commit_gate(self, optimizer: Any) -> Any:
        """The commit gate around `optimizer` (the same every step: built once)."""
        from lightning.pytorch.core.optimizer import LightningOptimizer

        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if self._gate is None or self._gate.optimizer is not inner:
            from lightning_dist._integrations.torchft import CommitGate

            self._gate = CommitGate(inner, self._manager)
        self._gate.committed = None
        return self._gate

    def _diloco_step(self, optimizer: Any, closure: Any, model: Any, **kwargs: Any) -> Any:
        """The inner step; every ``sync_every`` of them DiLoCo's sync after it, where a group behind heals."""
        config, sync = self._ft, self._diloco
        assert sync is not None, "DiLoCo is entered at on_train_start"

        def failed(inner_step: int, err: Exception) -> RuntimeError:
            address, _ = self.lighthouse_address()
            return RuntimeError(
                f"replica group {config.replica_group} rank {self.global_rank}: DiLoCo's sync after inner step"
                f" {inner_step} failed ({err}): the quorum from the torchft lighthouse at {address} (within"
                f" quorum_timeout={config.quorum_timeout:g} s), the pseudo-gradients' all-reduce or the commit vote"
                f" (timeout={config.timeout:g} s). Is the lighthouse running?"
            )

        inner_step = super().optimizer_step
        self._quorum_started = time.perf_counter()  # a heal in this step's sync is timed from here
        result, committed = sync.step(
            lambda step_closure: inner_step(optimizer, step_closure, model, **kwargs), closure, failed=failed
        )
        if committed is not None:
            self._record(committed)
        return result

    def _healed(self) -> None:
        """This group just loaded a healthy group's state: the heal took since the quorum was asked."""
        assert self._quorum_started is not None, "a heal happens in a quorum"
        self.figures.healed(time.perf_counter() - self._quorum_started)

    def _record(self, committed: bool) -> None:
        from lightning_dist.strategies.heal import group_loaders

        trainer = self.lightning_module.trainer
        participants = self._manager.num_participants()
        self.committed_steps.append(
            {
                "step": self._manager.current_step(),
                "participants": participants,
                "committed": committed,
                "epoch": trainer.current_epoch,
                "batch": [loader.position - 1 for loader in group_loaders(trainer)],
            }
        )
        self.figures.stepped(participants, committed)
        # the module's own logging path (allowed in optimizer_step): the progress bar, and every logger. CPU tensors:
        # numbers would become device tensors (a blocking host-to-device copy each) that the progress bar reads back
        # with .item() every step, six waits for the accelerator per step; on the CPU Lightning never syncs
        self.lightning_module.log_dict(self.figures.as_tensors(), prog_bar=True, on_step=True, on_epoch=False)

    @override
    def teardown(self) -> None:
        self._pending_diloco = None
        self._gate = None
        diloco, self._diloco = self._diloco, None
        if diloco is not None:
            diloco.close()
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.shutdown(wait=False)
        lighthouse, self._lighthouse = self._lighthouse, None
        if lighthouse is not None:
            lighthouse.shutdown()
        super().teardown()


def checkpoint_entry(config: FaultTolerance, manager: Any, diloco: Optional[dict[str, Any]]) -> dict[str, Any]:
    """A checkpoint's ``fault_tolerance`` entry (plain containers and tensors): the sync mode, torchft's
    ``{"step", "batches_committed"}``, and under DiLoCo its :meth:`DiLoCoSync.state_dict`."""
    entry: dict[str, Any] = {"sync": config.sync, "manager": dict(manager.state_dict())}
    if config.diloco:
        entry["diloco"] = diloco
    return entry


def check_checkpoint_entry(entry: Optional[dict[str, Any]], config: FaultTolerance, path: Any) -> bool:
    """Whether a checkpoint's ``fault_tolerance`` entry (None: a checkpoint of a run without fault tolerance) can
    be restored into a run configured by `config`: False (a rank-0 warning: torchft's counters start at 0) for a
    plain checkpoint, ValueError naming both sides for another sync mode."""
    if entry is None:
        rank_zero_warn(
            f"{path} is not from a fault-tolerant run: its weights and optimizer load, torchft's step counter starts"
            + (" at 0 and DiLoCo's outer optimizer and global weights start afresh." if config.diloco else " at 0.")
        )
        return False
    saved = entry.get("sync")
    if saved == config.sync and config.diloco and entry.get("diloco") is None:
        raise ValueError(
            f"{path} is from a sync='diloco' run saved before DiLoCo was entered (no outer optimizer state or global"
            " weights in it): resume from a checkpoint saved during training."
        )
    if saved != config.sync:
        raise ValueError(
            f"{path} is from a fault-tolerant run with sync={saved!r}, this run has"
            f" FaultTolerance(sync={config.sync!r}): the state of one does not continue the other. Resume with"
            f" sync={saved!r}, or load only the weights (LightningModule.load_state_dict) and start afresh."
        )
    return True


def _has_data_parallel(module: torch.nn.Module) -> bool:
    from torch.distributed._composable.replicate import DDP
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, (FSDPModule, DDP)) for m in module.modules())


class HealError(RuntimeError):
    """A failure while loading the state a healthy replica group sent (not a quorum failure)."""


def _no_quorum() -> None:
    """DiLoCo asks the quorum at its sync, not before each batch."""


def _healing(load: Any, target: Any, *, manager: Any = None, healed: Optional[Callable[[], None]] = None) -> Any:
    """`load` of a healthy group's state into `target`, errors as :class:`HealError`, then `healed()`. With `manager`
    (DiLoCo): not at step 0, where torchft's ``init_sync`` makes every group but one heal at the first sync: each group
    keeps its own first interval there (DiLoCo's own state brings that group's global weights and outer optimizer
    state)."""

    def apply(state: Any) -> None:
        if manager is not None and manager.current_step() == 0:
            return
        try:
            load(target, state)
        except Exception as err:
            raise HealError(f"fault_tolerance: loading the healthy replica group's state failed: {err}") from err
        if healed is not None:
            healed()

    return apply


class ReplicaGroupFigures:
    """What a replica group shows its user, per optimizer step (under DiLoCo, per sync): ``ft/participants``, the
    groups in the step's quorum; ``ft/failures``, the failures this group has seen (each group that left the quorum
    between two steps, and each step that did not commit); ``ft/heal_s``, the seconds of this group's last heal, from
    asking the quorum to the healthy state loaded (0: none yet; every group but one heals at the first step)."""

    def __init__(self) -> None:
        self.participants = 0
        self.failures = 0
        self.heals = 0
        self.heal_s = 0.0

    def stepped(self, participants: int, committed: bool) -> None:
        self.failures += max(0, self.participants - participants) + (not committed)
        self.participants = participants

    def healed(self, seconds: float) -> None:
        self.heals += 1
        self.heal_s = seconds

    def as_dict(self) -> dict[str, float]:
        return {"ft/participants": self.participants, "ft/failures": self.failures, "ft/heal_s": self.heal_s}

    def as_tensors(self) -> dict[str, torch.Tensor]:
        """:meth:`as_dict` as CPU tensors in the dtype Lightning logs numbers in (float32 unless the default dtype is
        wider): logged, they stay on the CPU, so reading them back (the progress bar, every step) waits for nothing."""
        dtype = torch.get_default_dtype()
        dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        return {k: torch.tensor(float(v), dtype=dtype) for k, v in self.as_dict().items()}
