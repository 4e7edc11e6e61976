"""HybridShardStrategy: FSDP2 over a (dp_replicate x dp_shard) mesh, with ZeRO-style stages."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dist._compat import CUDA_AVAILABLE, fully_shard_api
from lightning_dist.mesh import MeshSpec
from lightning_dist.parallelize import ParallelizeConfig, parallelize_model
from lightning_dist.parallelize.ac import check_offload_device
from lightning_dist.parallelize.ep import ep_problems
from lightning_dist.precision import precision_dtypes
from lightning_dist.strategies.fault_tolerance import ReplicaGroupsMixin
from lightning_dist.strategies.ft_config import FaultToleranceArg


class HybridShardStrategy(ReplicaGroupsMixin):
    """Hybrid sharded data parallelism with FSDP2 (``Trainer(strategy="hsdp")``; ``"fsdp2"`` = full sharding).

    Parameters are sharded inside groups of ``shard_size`` ranks and replicated across the groups, so
    parameter gathers stay inside a node while only a gradient all-reduce crosses nodes.

    Args:
        shard_size: ranks per shard group. ``"auto"``: the devices of one node; ``1``: pure replication
            (DDP-like); ``"full"`` or the world size: full sharding (FSDP/ZeRO-3 over all ranks).
        zero_stage: ``3`` reshard parameters after forward (least memory); ``2`` keep them unsharded
            until backward (one all-gather fewer per step); ``1`` replicate parameters and gradients
            (all-reduce) and shard only the optimizer state (torch's ``ZeroRedundancyOptimizer``).
        units: FSDP units: ``"auto"`` (each block of the model's block list) or module class names.
        offload_policy: an FSDP2 ``CPUOffloadPolicy`` (see ``OffloadStrategy`` for the managed version).
        fault_tolerance: a :class:`~lightning_dist.strategies.ft_config.FaultTolerance` (or a dict of its fields):
            each of the ``dp_replicate`` replica groups is its own job, and torchft averages gradients across the groups
            that are alive (docs/fault_tolerance.md). None: off.
        **kwargs: the mesh, model and checkpoint options of :class:`MeshStrategy` (``dp_replicate``,
            ``activation_checkpointing``, ``compile``, ``timeout``...).
    """

    _ep_check_pending = False  # set by apply_parallelism under ep; the check runs before the first step

    strategy_name = "hsdp"

    def __init__(
        self,
        *,
        shard_size: Union[int, Literal["auto", "full"]] = "auto",
        zero_stage: Literal[1, 2, 3] = 3,
        units: Union[str, Sequence[str]] = "auto",
        offload_policy: Optional[Any] = None,
        fault_tolerance: FaultToleranceArg = None,
        **kwargs: Any,
    ) -> None:
        problems = []
        ep = kwargs.get("ep", 1)
        if isinstance(ep, int) and ep > 1 and zero_stage == 1:
            problems.append(
                f"ep={ep} shards each expert over the data-parallel ranks left with FSDP2; zero_stage=1 replicates"
                " parameters instead: pass zero_stage=2 or 3."
            )
        if zero_stage not in (1, 2, 3):
            problems.append(f"`zero_stage={zero_stage!r}` must be 1, 2 or 3.")
        elif zero_stage == 1 and offload_policy is not None:
            problems.append(
                "`offload_policy` offloads FSDP2-sharded parameters; zero_stage=1 replicates them"
                " (nothing would be offloaded): pass zero_stage=2 or 3."
            )
        if shard_size == "full":
            kwargs.setdefault("dp_replicate", 1)
            shard = "auto"
        elif shard_size == "auto" or (
            isinstance(shard_size, int) and not isinstance(shard_size, bool) and shard_size >= 1
        ):
            shard = shard_size
        else:
            problems.append(f'`shard_size={shard_size!r}` must be an integer >= 1, "auto" or "full".')
            shard = "auto"
        if kwargs.get("dp_shard", "auto") != "auto" and shard != "auto":
            problems.append(f"Pass either shard_size={shard_size!r} or dp_shard={kwargs['dp_shard']!r}, not both.")
        elif shard != "auto":
            kwargs["dp_shard"] = shard
        problems += self._take_fault_tolerance(fault_tolerance, kwargs, zero_stage)  # dp_replicate: torchft's groups
        self._defer_problems(problems)  # raised by MeshStrategy with the mesh's and the model options' problems
        super().__init__(**kwargs)
        if shard != "auto":
            self._mesh_arg_names = (("dp_shard", "shard_size"),)  # mesh errors name what the user wrote
        self.zero_stage = zero_stage
        self.units = units
        self.offload_policy = offload_policy

    @override
    def validate_config(self, spec: MeshSpec) -> None:
        if self.offload_activations:  # the root device is known only once Lightning set the devices
            check_offload_device(True, self.root_device)
        if getattr(self.offload_policy, "pin_memory", False) and not CUDA_AVAILABLE:
            # FSDP2 would fail deep inside fully_shard ("Cannot access accelerator device")
            raise ValueError(
                "offload_policy=CPUOffloadPolicy(pin_memory=True) needs a CUDA device (pinning host"
                " memory needs an accelerator): pass CPUOffloadPolicy(pin_memory=False) on CPU."
            )
        # the model's experts and the mesh, on every rank before any collective
        problems = []
        if self.ep > 1 and spec.size("pp") > 1:
            problems.append(
                f"ep={self.ep} with pp={spec.size('pp')}: expert parallelism composes with data, context and tensor"
                " parallelism here; pipeline with PipelineStrategy(pp=..., ep=...)."
            )
        if self.lightning_module is not None:  # ep borrows its ranks from dp_shard x cp
            problems += ep_problems(
                self.lightning_module, ep=self.ep, dp_shard=spec.size("dp_shard"), cp=spec.cp, tp=spec.size("tp")
            )
        if problems:
            raise ValueError(f"Invalid {type(self).__name__} configuration:\n  - " + "\n  - ".join(problems))
        if self.zero_stage == 1 and spec.cp > 1:
            raise ValueError(
                f"zero_stage=1 replicates parameters over the data-parallel ranks; with cp={spec.cp} the"
                " context-parallel ranks must average gradients too, which the pack does with FSDP2 over"
                " dp_shard x cp. Use zero_stage=2 or 3 with cp > 1."
            )
        if self.zero_stage == 1 and spec.size("dp_shard") > 1 and spec.size("dp_replicate") > 1:
            rank_zero_warn(
                "zero_stage=1 replicates parameters over all data-parallel ranks; the dp_replicate x dp_shard"
                " split only matters for stages 2 and 3."
            )

    def mp_policy(self) -> Optional[Any]:
        """FSDP2 mixed precision from Lightning's precision flag (``bf16-mixed``: bf16 compute, fp32 reduce)."""
        dtypes = precision_dtypes(self.precision_plugin, default=None)
        if dtypes is None or not dtypes.mixed:
            return None
        dtype = dtypes.compute
        _, MixedPrecisionPolicy, _, _ = fully_shard_api()
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    def parallelize_config(self) -> ParallelizeConfig:
        """What ``parallelize_model`` applies for this strategy's options (subclasses add TP plans etc.)."""
        return ParallelizeConfig(
            zero_stage=self.zero_stage,
            units=self.units,
            activation_checkpointing=self.activation_checkpointing,
            selective_ac_ops=self.selective_ac_ops,
            offload_activations=self.offload_activations,
            mp_policy=self.mp_policy(),
            offload_policy=self.offload_policy,
            compile=self.compile,
            recompute_context=self._cp.active if self._cp is not None else None,
            ep=self.ep,
            ep_capacity_factor=self.model_options.ep_capacity_factor,
        )

    @override
    def parallelize(self, module: pl.LightningModule) -> None:
        parallelize_model(module, self.mesh, self.parallelize_config())

    @override
    def apply_parallelism(self) -> None:
        super().apply_parallelism()
        self._ep_check_pending = self.ep > 1 and self.self_check  # once per parallelization

    @override
    def check_split_model(self) -> None:
        self._check_experts()

    def _check_experts(self) -> None:
        """Under ep, each experts module held to a whole copy of it, forward and backward (what the optimizer steps on),
        once per parallelization: each data-parallel rank runs its own probe sample (a rolled copy of one)."""
        due, self._ep_check_pending = self._ep_check_pending, False
        if not due:
            return
        from lightning_dist.parallelize.ep import find_experts
        from lightning_dist.parallelize.self_check import check_experts, run_first_probe

        module = self.lightning_module
        experts = find_experts(module)
        report = run_first_probe(
            module,
            lambda run: check_experts(
                module, run, experts, dp_group=self.mesh.dp_group, describe=f"expert parallelism (ep={self.ep})"
            ),
            roll=self.distributed_sampler_kwargs["rank"],
        )
        if report is None:
            rank_zero_warn(
                "expert-parallel self-check skipped: no probe sample runs through the model (set `example_input_array`"
                " on the LightningModule to have the split experts checked against whole copies at setup)."
            )
            return
        self.ep_check_report = report
        rank_zero_info(
            f"expert-parallel self-check: {report.blocks} experts module(s), outputs and expert gradients after the"
            f" dispatch and the data-parallel reduction, match whole copies (worst relative difference"
            f" {report.worst:.1e}); {report.seconds:.2f} s. self_check=False skips it."
        )

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self.zero_stage == 1 and self.mesh.dp_size > 1:
            self._shard_optimizers()

    def _shard_optimizers(self) -> None:
        """ZeRO-1: wrap each optimizer in ZeroRedundancyOptimizer over `dp` and repoint its LR schedulers."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        wrapped = []
        for optimizer in self.optimizers:
            if isinstance(optimizer, ZeroRedundancyOptimizer):
                wrapped.append(optimizer)
                continue
            groups = [dict(g) for g in optimizer.param_groups]
            # `defaults` can hold keys the constructor does not take (AdamW's 'decoupled_weight_decay')
            accepted = inspect.signature(type(optimizer).__init__).parameters
            defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
            zero = ZeroRedundancyOptimizer(
                groups, optimizer_class=type(optimizer), process_group=self.mesh.dp_group, **defaults
            )
            for config in self.lr_scheduler_configs:
                if config.scheduler.optimizer is optimizer:
                    config.scheduler.optimizer = zero
            wrapped.append(zero)
        self.optimizers = wrapped


class FullyShardStrategy(HybridShardStrategy):
    """FSDP2 full sharding over all data-parallel ranks (``Trainer(strategy="fsdp2")``)."""

    strategy_name = "fsdp2"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("shard_size", "full")
        super().__init__(**kwargs)
