"""What a pipeline needs from the LightningModule, checked and planned before the split (no strategy state).
Notes: docs/internals.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_dist.mesh import DP_CP, TP
from lightning_dist.parallelize.ac import split_backward_problems
from lightning_dist.parallelize.pipeline.checks import check_splittable, staged_forward_problem
from lightning_dist.parallelize.pipeline.split import (
    NetworkLayout,
    PipelineSplit,
    layout_kind,
    plan_split,
)
from lightning_dist.parallelize.pipeline.stages import is_pipelined_module
from lightning_dist.parallelize.pipeline.tied import tied_gradient_groups, tied_problems


def option_problems(*, schedule: Any, options: Mapping[str, Any]) -> list[str]:
    """The constructor options that cannot work with a pipeline (beyond ``ModelOptions``' own checks)."""
    problems = []
    compile, ac = options.get("compile", False), options.get("activation_checkpointing", False)
    if isinstance(schedule, str) and "zero_bubble" in schedule:
        if compile is not False:
            problems.append(
                f"`compile` with schedule={schedule!r} is not supported: the zero-bubble split backward"
                " needs each block's autograd graph; use schedule='1f1b' or 'interleaved_1f1b'."
            )
        problems += split_backward_problems(ac, schedule)
    if options.get("save_distributed_checkpoint") is False:
        problems.append(
            "PipelineStrategy writes sharded checkpoints (save_distributed_checkpoint=True): each"
            " stage saves its own parameters. For one file, convert the directory with `lightning-dist"
            " consolidate` (torch's `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` gives"
            " the weights under 'state_dict' too, but a weight tied across stages under one name only)."
        )
    return problems


def module_problems(module: Any, network: str, net: Any) -> list[str]:
    """What keeps `module.<network>` from being pipelined (pure): not a module, split already, no loss."""
    problems = []
    if is_pipelined_module(net):
        problems.append(
            f"{type(module).__name__}.{network} was already split by another PipelineStrategy;"
            " build a fresh module (or load a checkpoint into one) for a new Trainer."
        )
    elif not isinstance(net, nn.Module):
        problems.append(
            f"{type(module).__name__}.{network} must be the network to pipeline (an nn.Module);"
            f" got {type(net).__name__}. Set `network=` to the attribute that holds it."
        )
    if not callable(getattr(module, "pipeline_loss", None)) and layout_kind(net).needs_pipeline_loss:
        problems.append(
            f"{type(module).__name__} has no `pipeline_loss(output, target)` method: the pipeline"
            " schedule computes the loss of each micro-batch on the last stage with it."
        )
    return problems


def _on_meta(net: Any) -> bool:
    first = next(iter(net.parameters()), None) if isinstance(net, nn.Module) else None
    return first is not None and first.is_meta


def _has_sample(module: Any, net: Any) -> bool:
    """A sample micro-batch can run: ``example_input_array``, or a HF model's config; on parameters with values (the
    dry run's are on the meta device: nothing to time)."""
    sample = getattr(module, "example_input_array", None) is not None or layout_kind(net).config_sample
    return sample and not _on_meta(net)


def check_balanced_sample(module: Any, net: nn.Module, mode: Any) -> None:
    """``split="balanced"`` measures the blocks on a sample micro-batch."""
    if mode == "balanced" and _on_meta(net):
        raise ValueError(
            'split="balanced" times each block on a sample micro-batch, and the network\'s parameters are on the meta'
            ' device (a dry run, or not materialized yet): nothing can be timed. Pass split="params" (or'
            ' split="auto", which splits by parameters then).'
        )
    if mode == "balanced" and not _has_sample(module, net):
        raise ValueError(
            f'split="balanced" profiles each block on a sample micro-batch: set'
            f" `{type(module).__name__}.example_input_array` to one micro-batch of inputs,"
            ' or pass split="params".'
        )


def resolve_split_mode(split_option: Any, module: Any, network: str) -> Any:
    """The split that will be used: `split_option` with ``"auto"`` resolved for the attached module."""
    if isinstance(split_option, str) and split_option == "auto":
        return "balanced" if _has_sample(module, getattr(module, network, None)) else "params"
    return split_option


@dataclass(frozen=True)
class PipelinePlan:
    """What ``validate_config`` planned and checked, for ``parallelize`` to use as is (made once per setup)."""

    mode: Any  # "balanced", "params" or manual split points
    split: PipelineSplit  # by parameters when `mode` is "balanced": the measured one is made in `parallelize`
    sample: Any  # the sample micro-batch the staged forward was checked on (None: none, or on meta)

    @property
    def layout(self) -> NetworkLayout:
        return self.split.layout


def plan_pipeline(module: Any, net: nn.Module, num_stages: int, mode: Any, *, allow_batchnorm: bool) -> PipelinePlan:
    """The split, BatchNorm, the balanced split's sample and the staged forward on it, checked once (TypeError for
    a network of another shape, ValueError naming a problem); the plan ``parallelize`` uses."""
    split = plan_split(net, num_stages, split="params" if mode == "balanced" else mode)
    check_splittable(net, split, allow_batchnorm=allow_batchnorm)
    check_balanced_sample(module, net, mode)
    # the layout's sample micro-batch (`example_input_array`, or a HF model's config ids); none on meta
    first = next(iter(net.parameters()), None)
    sample = None
    if first is not None and not first.is_meta:
        sample = split.layout.sample(net, getattr(module, "example_input_array", None))
    if sample is not None:  # the stages must compute the model's own forward (else: the first batch)
        problem = staged_forward_problem(net, sample)
        if problem:
            raise ValueError(problem)
    return PipelinePlan(mode=mode, split=split, sample=sample)


def tied_groups(
    tied: Sequence[tuple[tuple[str, ...], tuple[int, ...]]], stage_ranks: Sequence[int], *, mesh: Any, rank: int
) -> list[tuple[tuple[str, ...], Any, bool]]:
    """Tied parameters across stages (`tied`: :func:`~.checks.tied_stages`) refused on every rank, else grouped
    (``new_group``: collective when there are any)."""
    # FSDP2 shards each stage over dp x cp (context peers average gradients too)
    problems = tied_problems(tied, stage_ranks, dp_size=mesh.size(DP_CP), tp_size=mesh.size(TP))
    if problems:
        raise ValueError("Cannot pipeline tied parameters:\n  - " + "\n  - ".join(problems))
    if tied:
        rank_zero_info(f"pipeline: tied parameters {[list(n) for n, _ in tied]}: gradients summed over their stages")
    return tied_gradient_groups(tied, stage_ranks, spec=mesh.spec, rank=rank) if tied else []


def first_batch_problem(unsplit: nn.Module, sample: Tensor, device: Any) -> Optional[str]:
    """The staged forward against the unsplit copy on the first micro-batch: any rank's problem, on every rank."""
    dtype = next((p.dtype for p in unsplit.parameters() if p.is_floating_point()), None)
    sample = sample.detach().cpu()
    problem = staged_forward_problem(unsplit, sample.to(dtype) if dtype and sample.is_floating_point() else sample)
    flag = torch.tensor(float(problem is not None), device=device)
    if torch.distributed.is_initialized():  # data-parallel ranks see different batches: one verdict for all
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if flag.item():
        return problem or (
            "The pipeline stages compute a different network than the model's forward on"
            " another rank's first micro-batch: its forward does work outside the child modules."
        )
    return None


__all__ = [
    "PipelinePlan",
    "check_balanced_sample",
    "option_problems",
    "first_batch_problem",
    "module_problems",
    "plan_pipeline",
    "resolve_split_mode",
    "tied_groups",
]
