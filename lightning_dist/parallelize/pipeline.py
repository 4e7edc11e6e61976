"""Pipeline stage splitting: a plan as data (stage -> blocks -> params -> cost) and the stage modules.

A pipelined network has one of four shapes (:func:`network_layout` tries them in this order):

* an unmodified HuggingFace causal LM: its ``config.base_model_pp_plan`` block list, the model itself
  running each stage with the parts it does not own taken out (see :mod:`.pipeline_hf`);
* an ``nn.Sequential``: its children are the blocks;
* a module with a **stem** (children registered before the block list), one ``nn.ModuleList`` of
  blocks (found by :func:`~lightning_dist.parallelize.units.find_block_lists`, a direct child) and a
  **head** (children registered after it). Its ``forward`` must equal applying the children in
  registration order (:func:`check_staged_forward` compares them on one micro-batch). A module used
  twice (weight sharing) runs twice; a parameter shared across stages is held by each (:func:`tied_stages`);
* any other model whose one block list sits inside a direct child and whose forward takes one input
  (litgpt's ``GPT``: ``transformer.h``): like a HF model, a stage is the model with the blocks it does not own
  taken out, the boundary activation passed in place of its input (see :mod:`.pipeline_pruned`).

:func:`plan_split` returns a :class:`PipelineSplit` (pure data, printable with rich, unit-testable in
one process): contiguous runs of blocks per stage, the stem on stage 0 and the head on the last stage.
``split="balanced"`` balances measured forward+backward time per block, ``"params"`` parameter counts,
and a list of ``num_stages - 1`` block indices gives manual split points (where stages 1.. start).
:func:`build_stage_module` keeps only the parts of the stages a rank runs, under their original
names, so ``model.blocks.5.fc.weight`` is the same key whatever the pipeline layout.
"""

from __future__ import annotations

import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch
from torch import nn

from lightning_dist.parallelize.units import find_block_lists
from lightning_dist.rules import partition

Split = Union[Literal["balanced", "params"], Sequence[int]]


@dataclass(frozen=True, kw_only=True)
class NetworkLayout:
    """Where a network's stem, blocks and head are, by child name."""

    stem: tuple[str, ...]
    """Children run before the blocks (on stage 0)."""
    block_list: str | None
    """Name of the ``nn.ModuleList`` of blocks; None for an ``nn.Sequential`` (its children are the blocks)."""
    blocks: tuple[str, ...]
    """Block keys, in order (``"0"``, ``"1"``, ...)."""
    head: tuple[str, ...]
    """Children run after the blocks (on the last stage)."""
    pruned: tuple | None = None
    """``(child, block_list, stem, head)`` (qualified names) when the block list sits inside a child: the stages are
    the model with the parts they do not own taken out (:mod:`.pipeline_pruned`); None for the other shapes."""
    hf: tuple | None = None
    """A HuggingFace causal LM: the same parts (:func:`~.pipeline_hf.hf_parts`), its stages taking hidden states as
    ``inputs_embeds`` and returning ``.logits``; None for any other model."""

    @property
    def convention(self) -> type:
        """The stage class of a pruned layout: HF's ``inputs_embeds`` or the forward's first input."""
        if self.hf is not None:
            from lightning_dist.parallelize.pipeline_hf import HFStageMixin

            return HFStageMixin
        from lightning_dist.parallelize.pipeline_pruned import ForwardStage

        return ForwardStage

    def block_name(self, i: int) -> str:
        key = self.blocks[i]
        return key if self.block_list is None else f"{self.block_list}.{key}"


def network_layout(net: nn.Module) -> NetworkLayout:
    """Find stem / blocks / head of `net`; TypeError when no route can split it (the message gives each route's reason).

    Routes, in order: a HuggingFace causal LM (its ``config.base_model_pp_plan`` block list), an
    ``nn.Sequential``, a direct ``nn.ModuleList`` of blocks between stem and head children, a block list inside
    a direct child (litgpt's ``transformer.h``: the stages are the model with the blocks they do not own taken out).
    """
    from lightning_dist.parallelize.pipeline_hf import hf_parts, is_hf_causal_lm
    from lightning_dist.parallelize.pipeline_pruned import nested_parts

    if is_hf_causal_lm(net):
        parts = hf_parts(net)
        _, block_list, stem, head = parts
        return NetworkLayout(
            stem=stem,
            block_list=block_list,
            blocks=tuple(net.get_submodule(block_list)._modules),
            head=head,
            pruned=parts,
            hf=parts,
        )
    if isinstance(net, nn.Sequential):
        return NetworkLayout(stem=(), block_list=None, blocks=tuple(net._modules), head=())
    children = list(net.named_children())
    found = [(name, mod) for name, mod in find_block_lists(net) if "." not in name]
    if len(found) == 1:
        name, blocks = found[0]
        if any(True for _ in net.parameters(recurse=False)):
            direct = [n for n, _ in net.named_parameters(recurse=False)]
            raise TypeError(
                f"{type(net).__name__} holds parameters directly ({direct}); a pipeline stage can only own whole"
                " child modules. Move them into a child module registered before or after the block list."
            )
        names = [n for n, _ in children]
        i = names.index(name)
        return NetworkLayout(
            stem=tuple(names[:i]), block_list=name, blocks=tuple(blocks._modules), head=tuple(names[i + 1 :])
        )
    parts, nested_why = nested_parts(net) if not found else (None, "it has several direct block lists")
    if parts is not None:
        _, block_list, stem, head = parts
        return NetworkLayout(
            stem=stem,
            block_list=block_list,
            blocks=tuple(net.get_submodule(block_list)._modules),
            head=head,
            pruned=parts,
        )
    what = "none" if not found else f"{len(found)} ({[n for n, _ in found]})"
    tried = [
        "a HuggingFace causal LM (config.base_model_pp_plan): it is not one",
        "an nn.Sequential (its children are the blocks): it is not one",
        f"one direct nn.ModuleList of blocks between stem and head children: it has {what}",
        f"the model with the blocks a stage does not own taken out of the child holding them: {nested_why}",
    ]
    raise TypeError(
        f"Cannot split {type(net).__name__} into pipeline stages; routes tried:\n  - "
        + "\n  - ".join(tried)
        + "\nMake it an nn.Sequential, or give it one nn.ModuleList of blocks (e.g. `self.blocks`) with the layers"
        " before it (stem) and after it (head) registered as children in execution order, its forward taking one input."
    )


def _block(net: nn.Module, layout: NetworkLayout, i: int) -> nn.Module:
    container = net if layout.block_list is None else net.get_submodule(layout.block_list)
    return container._modules[layout.blocks[i]]


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def part_params(net: nn.Module, layout: NetworkLayout) -> tuple[list[int], int, int]:
    """Parameters of (each block, the stem, the head) of `net` as its stages hold them (pure; the planner uses
    it too). A weight shared by the stem and the head counts on both: each of the two stages holds a copy."""
    blocks = [_num_params(_block(net, layout, i)) for i in range(len(layout.blocks))]
    stem = sum(_num_params(net.get_submodule(m)) for m in layout.stem)
    head = sum(_num_params(net.get_submodule(m)) for m in layout.head)
    return blocks, stem, head


# ---- the plan as data --------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage: which blocks it runs, whether it holds the stem/head, its size and cost."""

    index: int
    blocks: tuple[int, ...]
    stem: bool
    head: bool
    params: int
    cost: float


@dataclass(frozen=True, kw_only=True)
class PipelineSplit:
    """A split of a network into contiguous stages (pure data)."""

    layout: NetworkLayout
    stages: tuple[StagePlan, ...]
    method: str
    """``"balanced"`` (measured time), ``"params"`` or ``"manual"``."""
    cost_unit: str
    """``"ms"`` for measured forward+backward time, ``"params"`` for parameter counts."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_of_block(self, i: int) -> int:
        return next(s.index for s in self.stages if i in s.blocks)

    def rows(self) -> list[dict]:
        """One row per stage: ``{"stage", "blocks", "params", "cost"}`` with readable block names."""
        out = []
        for s in self.stages:
            parts = (
                (["stem"] if s.stem and self.layout.stem else [])
                + (
                    [f"{self.layout.block_name(s.blocks[0])}..{self.layout.blocks[s.blocks[-1]]}"]
                    if len(s.blocks) > 1
                    else [self.layout.block_name(s.blocks[0])]
                )
                + (["head"] if s.head and self.layout.head else [])
            )
            out.append({"stage": s.index, "blocks": " + ".join(parts), "params": s.params, "cost": s.cost})
        return out

    def imbalance(self) -> float:
        """max stage cost / mean stage cost (1.0 is perfectly balanced)."""
        costs = [s.cost for s in self.stages]
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean > 0 else 1.0

    def format(self, stage_ranks: Sequence[int] | None = None) -> str:
        """The stage -> blocks -> params -> cost table (rendered with rich)."""
        from rich.console import Console
        from rich.table import Table

        table = Table(
            title=f"Pipeline split ({self.method}, {self.num_stages} stages, imbalance {self.imbalance():.2f})"
        )
        for col in (
            "stage",
            *(("rank",) if stage_ranks is not None else ()),
            "blocks",
            "params",
            f"cost ({self.cost_unit})",
        ):
            table.add_column(col, justify="left" if col == "blocks" else "right")
        for row in self.rows():
            rank = (str(stage_ranks[row["stage"]]),) if stage_ranks is not None else ()
            cost = f"{row['cost']:.3f}" if self.cost_unit == "ms" else f"{int(row['cost']):,}"
            table.add_row(str(row["stage"]), *rank, row["blocks"], f"{row['params']:,}", cost)
        buf = io.StringIO()
        Console(file=buf, width=110, force_terminal=False).print(table)
        return buf.getvalue()


def profile_costs(
    net: nn.Module, layout: NetworkLayout, sample: torch.Tensor, *, repeats: int = 5
) -> tuple[float, list[float], float]:
    """Measured forward+backward milliseconds of (stem, each block, head) on one sample micro-batch (best of `repeats`).

    The parts are assumed to compose to ``net`` (check that first with :func:`check_staged_forward`).
    A model split into pruned copies (HF, litgpt) is measured inside its own forward (HF `sample`: its keyword inputs).
    """
    if layout.pruned is not None:  # measured inside the model's own forward (its blocks take extra inputs)
        from lightning_dist.parallelize.pipeline_pruned import profile_pruned

        return profile_pruned(net, layout, sample, convention=layout.convention, repeats=repeats)
    parts = (
        [net.get_submodule(n) for n in layout.stem]
        + [_block(net, layout, i) for i in range(len(layout.blocks))]
        + [net.get_submodule(n) for n in layout.head]
    )
    times: list[float] = []
    x = sample
    for part in parts:
        runs = []
        for i in range(repeats + 1):  # the first run (allocations, lazy kernels set-up) is not timed
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = part(inp)
            out.float().sum().backward()
            if i:
                runs.append((time.perf_counter() - start) * 1e3)
        times.append(min(runs))  # interference from other processes only ever adds time
        with torch.no_grad():
            x = part(x)
    net.zero_grad(set_to_none=True)
    n_stem, n_head = len(layout.stem), len(layout.head)
    return sum(times[:n_stem]), times[n_stem : len(times) - n_head], sum(times[len(times) - n_head :])


def plan_split(
    net: nn.Module,
    num_stages: int,
    *,
    split: Split = "params",
    sample: torch.Tensor | None = None,
    costs: tuple[float, list[float], float] | None = None,
) -> PipelineSplit:
    """Split `net` into `num_stages` contiguous stages.

    `split`: ``"balanced"`` (measured time; needs `sample` or precomputed `costs` from :func:`profile_costs`),
    ``"params"`` (parameter count) or a list of ``num_stages - 1`` increasing block indices where stages
    1, 2, ... start. Raises ValueError naming the numbers when the split is impossible.
    """
    layout = network_layout(net)
    n = len(layout.blocks)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be an integer >= 1.")
    if num_stages > n:
        raise ValueError(
            f"Cannot split {type(net).__name__} into {num_stages} pipeline stages: it has only {n} blocks"
            f" ({layout.block_list or 'nn.Sequential children'}). Use at most {n} stages (pp x stages_per_rank),"
            " or a deeper model."
        )
    params, stem_p, head_p = part_params(net, layout)
    if isinstance(split, str) and split == "balanced":
        if costs is None:
            if sample is None:
                raise ValueError(
                    'split="balanced" profiles each block on a sample micro-batch: set `example_input_array` on the'
                    ' LightningModule to one micro-batch of inputs, or use split="params".'
                )
            from lightning_dist.parallelize.pipeline_checks import check_staged_forward

            check_staged_forward(net, sample)
            costs = profile_costs(net, layout, sample)
        first, block_costs, last = costs
        method, unit = "balanced", "ms"
    elif isinstance(split, str) and split == "params":
        first, block_costs, last = float(stem_p), [float(p) for p in params], float(head_p)
        method, unit = "params", "params"
    elif not isinstance(split, str) and isinstance(split, Sequence):
        first, block_costs, last = float(stem_p), [float(p) for p in params], float(head_p)
        method, unit = "manual", "params"
    else:
        raise ValueError(f'split={split!r} must be "balanced", "params" or a list of {num_stages - 1} block indices.')
    if method == "manual":
        points = [int(p) for p in split]  # type: ignore[union-attr]
        bounds = [0, *points, n]
        if len(points) != num_stages - 1 or any(b >= e for b, e in zip(bounds, bounds[1:])):
            raise ValueError(
                f"Manual split points {list(split)} must be {num_stages - 1} strictly increasing block indices in"  # type: ignore[arg-type]
                f" 1..{n - 1} (where stages 1..{num_stages - 1} start), e.g. {partition(params, num_stages)}."
            )
    else:
        points = partition(block_costs, num_stages, first=first, last=last)
    bounds = [0, *points, n]
    stages = []
    for s in range(num_stages):
        idx = tuple(range(bounds[s], bounds[s + 1]))
        is_first, is_last = s == 0, s == num_stages - 1
        stages.append(
            StagePlan(
                index=s,
                blocks=idx,
                stem=is_first,
                head=is_last,
                params=sum(params[i] for i in idx) + (stem_p if is_first else 0) + (head_p if is_last else 0),
                cost=sum(block_costs[i] for i in idx) + (first if is_first else 0.0) + (last if is_last else 0.0),
            )
        )
    return PipelineSplit(layout=layout, stages=tuple(stages), method=method, cost_unit=unit)


# The checks and the stage modules live in their own modules (pipeline_checks, pipeline_stages), which import
# this one; they are still reachable here, as before, looked up on first use (PEP 562) so that neither module
# imports the other at load time.
_MOVED = {
    "pipeline_checks": (
        "_work_outside_children",
        "batchnorm_modules",
        "check_splittable",
        "check_staged_forward",
        "host_copy",
        "shared_across_stages",
        "staged_forward_problem",
        "tied_stages",
    ),
    "pipeline_stages": (
        "PipelineView",
        "StageModule",
        "_unshared",
        "apply_fsdp_to_stage",
        "build_stage_module",
        "is_pipelined_module",
        "join_stages",
        "pipeline_view",
        "stage_blocks",
    ),
}


def __getattr__(name: str) -> Any:
    import importlib

    for module, names in _MOVED.items():
        if name in names:
            return getattr(importlib.import_module(f"lightning_dist.parallelize.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "NetworkLayout",
    "PipelineSplit",
    "PipelineView",
    "join_stages",
    "pipeline_view",
    "StagePlan",
    "StageModule",
    "apply_fsdp_to_stage",
    "batchnorm_modules",
    "stage_blocks",
    "check_splittable",
    "tied_stages",
    "is_pipelined_module",
    "build_stage_module",
    "check_staged_forward",
    "host_copy",
    "staged_forward_problem",
    "network_layout",
    "plan_split",
    "profile_costs",
    "shared_across_stages",
]
