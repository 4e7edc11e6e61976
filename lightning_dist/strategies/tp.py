"""TensorParallelStrategy: DTensor tensor parallelism on ``tp``, FSDP2 over the data-parallel dims (3-D)."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dist._compat import TP_SEQUENCE_PARALLEL_WITH_DP_HANGS
from lightning_dist.mesh import TP, MeshSpec
from lightning_dist.parallelize import ParallelizeConfig, parallelize_model
from lightning_dist.parallelize.self_check import (
    SelfCheckReport,
    SplitRunError,
    check_split_model,
    run_first_probe,
    split_run,
)
from lightning_dist.parallelize.tp.loss import LogitsGuard, head_entry, loss_parallel_step
from lightning_dist.parallelize.tp.plan import ResolvedPlan, format_plan, resolve_tp_plan
from lightning_dist.parallelize.tp.probe import check_probe, probe_output, split_failure
from lightning_dist.parallelize.tp.vocab import TPEntry
from lightning_dist.parallelize.units import select_units
from lightning_dist.strategies.hsdp import HybridShardStrategy


class TensorParallelStrategy(HybridShardStrategy):
    """Tensor parallelism from a declarative plan, composed with hybrid sharding on one mesh (``strategy="tp"``).

    The mesh is ``dp_replicate x dp_shard x tp``: each ``tp`` group (consecutive ranks, inside a node) splits every
    planned layer; FSDP2 then shards what TP left over ``dp_shard`` and replicates over ``dp_replicate``. All ranks of
    a ``tp`` group get the same samples; ``self.log(..., sync_dist=True)`` and metrics reduce over the data-parallel
    ranks only (``docs/strategies/tp.md``).

    Args:
        tp: tensor-parallel degree; ``"auto"``: the devices of one node.
        tp_plan: ``"auto"`` (the built-in plan that matches the model), a built-in plan name (``"hf"``: the
            HuggingFace model's own, ``"transformer"``: from the structure, ``"mlp"``) or a mapping
            ``{module-name glob: style}``. One of :class:`MeshStrategy`'s model options.
        sequence_parallel: run norms/dropout between the parallel regions on sequence shards
            (reduce-scatter/all-gather instead of all-reduce; activations between regions are 1/tp).
        sequence_dim: the activation dim that sequence parallelism splits (``[B, T, C]``: 1).
        loss_parallel: keep the output head's logits sharded on the vocabulary and run the training, validation and
            test steps and the backward inside torch's ``loss_parallel``; the loss must be cross-entropy on those
            logits (anything else is refused at the first step). Needs a plan with exactly one ``colwise_gather``
            layer (the head).
        dp_replicate, dp_shard: data-parallel sizes (``"auto"``: shard inside a node, replicate across nodes).
        zero_stage: 3 or 2 (FSDP2 reshards parameters after forward or not); 1 needs ``tp=1``.
        plan: the former name of ``tp_plan``, accepted with a DeprecationWarning until 0.2.
        self_check: at setup, hold each split block's output and gradients on a probe sample to an unsplit copy of
            it, and the gradients of parameters held whole to each other over tp; a difference is refused naming the
            block or parameter (``docs/self_checks.md``). ``False`` skips it.
        **kwargs: the other options of :class:`HybridShardStrategy` / :class:`MeshStrategy`.
    """

    strategy_name = "tp"
    _applies_tp_plan = True

    def __init__(
        self,
        *,
        tp: Union[int, Literal["auto"]] = "auto",
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        loss_parallel: bool = False,
        dp_replicate: Union[int, Literal["auto"]] = "auto",
        dp_shard: Union[int, Literal["auto"]] = "auto",
        zero_stage: Literal[1, 2, 3] = 3,
        plan: Union[str, Mapping[str, Any], None] = None,
        **kwargs: Any,
    ) -> None:
        problems = []
        if plan is not None:  # the former name (the same option is `tp_plan` on every strategy)
            warnings.warn(
                f"TensorParallelStrategy(plan=...) is now `tp_plan=` (as on every strategy); `plan` is accepted"
                f" until lightning-dist 0.2. Write tp_plan={plan!r}.",
                DeprecationWarning,
                stacklevel=2,
            )
            if kwargs.get("tp_plan", "auto") != "auto":
                problems.append(
                    f"Pass either tp_plan={kwargs['tp_plan']!r} or its former name plan={plan!r}, not both."
                )
            kwargs["tp_plan"] = plan
        if tp != "auto" and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            problems.append(f'`tp={tp!r}` must be an integer >= 1 or "auto" (the devices of one node).')
        if not isinstance(sequence_parallel, bool):
            problems.append(f"`sequence_parallel={sequence_parallel!r}` must be True or False.")
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
            problems.append(f"`sequence_dim={sequence_dim!r}` must be an integer (the activation dim to split).")
        if not isinstance(loss_parallel, bool):
            problems.append(f"`loss_parallel={loss_parallel!r}` must be True or False.")
        self._defer_problems(problems)  # raised by MeshStrategy with the others
        super().__init__(
            tp=1 if tp == "auto" or problems else tp,
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            zero_stage=zero_stage,
            **kwargs,
        )
        self._tp_auto = tp == "auto"
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.loss_parallel = loss_parallel
        self.tp_entries: list[TPEntry] = []
        """The resolved plan (filled in when the model is parallelized)."""
        self.tp_probe_diff: Optional[float] = None
        """Relative output difference split vs unsplit on one sample (None: no sample could run)."""
        self.self_check_report: Optional[SelfCheckReport] = None
        """What the setup self-check measured (None: it did not run)."""
        self._self_check_pending = False
        self._checked: Optional[tuple[tuple[str, ...], ResolvedPlan]] = None
        """(module names, plan) resolved by ``validate_config`` when the model had parameters then: the plan
        ``parallelize`` applies if the model still has those modules."""

    @property
    def is_distributed(self) -> bool:
        # Lightning only syncs `self.log(..., sync_dist=True)` for strategies that say they are distributed
        return True

    @override
    def mesh_spec(self) -> MeshSpec:
        if self._tp_auto:
            self._sizes[TP] = self.num_processes  # "auto": one tp group per node
        return super().mesh_spec()

    @override
    def validate_config(self, spec: MeshSpec) -> None:
        super().validate_config(spec)
        tp, dp = spec.size(TP), spec.size("dp")
        if self.zero_stage == 1 and tp > 1 and dp > 1:
            raise ValueError(
                f"zero_stage=1 (all-reduce replication) does not compose with tp={tp}: torch's `replicate` does not"
                " take tensor-parallel DTensor parameters. Use zero_stage=2 or 3."
            )
        if self.sequence_parallel and tp > 1 and dp > 1 and TP_SEQUENCE_PARALLEL_WITH_DP_HANGS:
            import torch

            raise ValueError(
                f"sequence_parallel=True with data parallelism (dp={dp}) around tp={tp} deadlocks on torch"
                f" {torch.__version__} (a backward all-gather of sequence shards, fixed in torch 2.13). Upgrade to"
                " torch>=2.13, or pass sequence_parallel=False (tensor parallelism with data parallelism works here)."
            )
        module = self.lightning_module
        self._checked = None
        # check the plan now when the model already exists (else in `parallelize`): same on every rank. A model
        # parallelized by an earlier fit (a later `validate`/`test`) is set up as it is: no plan to check
        if module is not None and tp > 1 and any(True for _ in module.parameters()) and not self.already_parallelized():
            self._checked = (_module_names(module), self._resolve_plan(module, tp))

    def _resolve_plan(self, module: pl.LightningModule, tp: int) -> ResolvedPlan:
        """The plan matched against `module` and checked for `tp` ranks (raises ValueError, the same on every rank)."""
        resolved = resolve_tp_plan(module, self.tp_plan, tp=tp, sequence_parallel=self.sequence_parallel)
        if self.loss_parallel:
            head_entry(resolved.entries)  # the one vocabulary-split head, or a ValueError (before any collective)
        return resolved

    def _setup_plan(self, module: pl.LightningModule, tp: int) -> ResolvedPlan:
        """This setup's plan: the one ``validate_config`` resolved, unless the model's modules changed since
        (``LightningModule.setup`` and ``configure_model`` run in between and may add layers); else resolved now."""
        checked, self._checked = self._checked, None
        if checked is not None and checked[0] == _module_names(module):
            return checked[1]
        return self._resolve_plan(module, tp)

    @override
    def parallelize_config(self) -> ParallelizeConfig:
        """The options of :meth:`parallelize`, with the plan as given (``parallelize`` puts in the resolved one)."""
        tp = self.mesh.size(TP)
        return dataclasses.replace(
            super().parallelize_config(),
            tp_plan=self.tp_plan if tp > 1 else None,
            tp_options={
                "sequence_parallel": self.sequence_parallel,
                "sequence_dim": self.sequence_dim,
                "loss_parallel": self.loss_parallel and tp > 1,
            },
        )

    @override
    def parallelize(self, module: pl.LightningModule) -> None:
        tp = self.mesh.size(TP)
        config, probe = self.parallelize_config(), None
        if tp > 1:
            plan = self._setup_plan(module, tp)  # resolved once per setup; apply_tp applies this value as it is
            config = dataclasses.replace(config, tp_plan=plan)
            self.tp_entries = list(plan.entries)
            rank_zero_info(format_plan(self.tp_entries, tp=tp))
            # the unsplit model's output on one sample, to compare with the split one's
            probe = probe_output(module, self.root_device, self.tp_entries)
        parallelize_model(module, self.mesh, config)
        if probe is not None:
            self.tp_probe_diff = check_probe(*probe, describe=f"tensor-parallel plan (tp={tp})")
            self.reshard()  # a forward without backward leaves FSDP2 roots gathered: the optimizer must see shards
        self._self_check_pending = tp > 1 and self.self_check

    @override
    def check_split_model(self) -> None:
        """Each split block held to an unsplit copy of it, forward and backward, once per parallelization; under ep,
        the experts too."""
        self._check_experts()
        if not self._self_check_pending:
            return
        self._self_check_pending = False
        module, tp = self.lightning_module, self.mesh.size(TP)
        planned = {module.get_submodule(e.fqn) for e in self.tp_entries if e.active and e.style != "replicate"}
        blocks = [(n, b) for n, b in select_units(module) if any(m in planned for m in b.modules())]
        describe, errors = f"tensor-parallel plan (tp={tp})", []
        report = run_first_probe(
            module,
            lambda run: check_split_model(
                module, split_run(run), blocks, replica_group=self.mesh.group(TP), describe=describe
            ),
            errors=errors,
        )
        failed = [e.__cause__ for e in errors if isinstance(e, SplitRunError)]
        if report is None and failed and self.tp_probe_diff is not None:  # the split model ran the probe in eval
            raise split_failure(describe, failed[0]) from failed[0]
        if report is None:
            rank_zero_warn(
                "tensor-parallel self-check skipped: no probe sample runs through the model (set `example_input_array`"
                " on the LightningModule to have the split checked against one device at setup)."
            )
            return
        self.self_check_report = report
        self.reshard()
        rank_zero_info(
            f"tensor-parallel self-check: {report.blocks} block(s) and the parameters held whole on every tp rank,"
            f" forward and backward, match one device (worst relative difference {report.worst:.1e});"
            f" {report.seconds:.2f} s. self_check=False skips it."
        )

    def _loss_parallel(self, step: bool = True) -> Any:
        """torch's ``loss_parallel`` around a step (the logits' uses checked from the head on) or a backward."""
        if not (self.loss_parallel and self.tp_entries):
            return contextlib.nullcontext()
        fqn = head_entry(self.tp_entries).fqn
        return (
            loss_parallel_step(self.lightning_module.get_submodule(fqn), LogitsGuard(fqn))
            if step
            else loss_parallel_step(None, None)
        )

    @override
    def step_context(self) -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(self._loss_parallel())  # outside the base's (context parallelism)
        stack.enter_context(super().step_context())
        return stack

    @override
    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        with self._loss_parallel(step=False):  # torch: the backward of loss_parallel's cross-entropy runs inside it too
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def __repr__(self) -> str:
        return (
            f"{super().__repr__()[:-1]}, tp_plan={self.tp_plan if isinstance(self.tp_plan, str) else 'custom'},"
            f" sequence_parallel={self.sequence_parallel}, loss_parallel={self.loss_parallel})"
        )


def _module_names(module: pl.LightningModule) -> tuple[str, ...]:
    return tuple(name for name, _ in module.named_modules())


class SequenceParallelStrategy(TensorParallelStrategy):
    """:class:`TensorParallelStrategy` with sequence parallelism on (``strategy="tp_sp"``)."""

    strategy_name = "tp_sp"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("sequence_parallel", True)
        super().__init__(**kwargs)
