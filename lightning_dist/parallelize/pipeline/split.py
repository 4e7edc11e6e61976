"""How a network is pipelined (:class:`NetworkLayout`: an ``nn.Sequential``, a model pruned per stage, or HF, chosen
once by :func:`network_layout`) and its split into stages as data (:func:`plan_split`). Which models take which route:
docs/strategies/pipeline.md."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, Protocol, Union, runtime_checkable

import torch
from torch import Tensor, nn

from lightning_dist.parallelize.pipeline.hf import (
    HFStageMixin,
    hf_call_inputs,
    hf_call_output,
    hf_example_inputs,
    hf_parts,
    is_hf_causal_lm,
    pipeline_loss_function,
)
from lightning_dist.parallelize.pipeline.pruned import (
    ForwardStage,
    build_pruned_stage,
    call_order,
    check_pruned_stages,
    join_pruned,
    model_input_call,
    pruned_parts,
)
from lightning_dist.parallelize.pipeline.stages import (
    build_sequential_stage,
    is_sequential,
    join_sequential,
    plain_call_inputs,
    plain_call_output,
    profile_parts,
)
from lightning_dist.parallelize.units import find_block_lists
from lightning_dist.rules import partition

Split = Union[Literal["balanced", "params"], Sequence[int]]

Costs = tuple[float, list[float], float]
"""Forward+backward milliseconds of (the stem, each block, the head)."""


# ---- how a network is staged -------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class NetworkLayout:
    """Where a network's stem, blocks and head are, by qualified name, and how its stages are made: this class is an
    ``nn.Sequential``'s layout (its children are the blocks; a :class:`~.stages.StageModule` runs some in order)."""

    stem: tuple[str, ...]
    """Children run before the blocks (on stage 0)."""
    block_list: str | None
    """Name of the ``nn.ModuleList`` of blocks; None for an ``nn.Sequential`` (its children are the blocks)."""
    blocks: tuple[str, ...]
    """Block keys, in order (``"0"``, ``"1"``, ...)."""
    head: tuple[str, ...]
    """Children run after the blocks (on the last stage)."""

    needs_pipeline_loss: ClassVar[bool] = True
    """The LightningModule must define ``pipeline_loss(output, target)`` (HF: the ``labels`` convention instead)."""
    config_sample: ClassVar[bool] = False
    """A sample micro-batch comes from the network's config when the module has no ``example_input_array``."""

    def block_name(self, i: int) -> str:
        key = self.blocks[i]
        return key if self.block_list is None else f"{self.block_list}.{key}"

    def block(self, net: nn.Module, i: int) -> nn.Module:
        """Block `i` of `net`."""
        container = net if self.block_list is None else net.get_submodule(self.block_list)
        return container._modules[self.blocks[i]]

    # ---- stages
    def build_stage(self, net: nn.Module, block_ids: Sequence[int], *, first: bool, last: bool) -> nn.Module:
        """The stage module of blocks `block_ids`, the stem when `first`, the head when `last` (`net`'s modules)."""
        return build_sequential_stage(net, [self.blocks[i] for i in block_ids])

    def profile(self, net: nn.Module, sample: Any, *, repeats: int = 5) -> Costs:
        """Milliseconds of (stem, each block, head) on one sample micro-batch (best of `repeats`)."""
        return profile_parts(net, self, lambda: net(sample), repeats=repeats)

    def forward_problem(self, net: nn.Module, sample: Any) -> str | None:
        """Why the stages would not compute ``net(sample)``, or None when they do (a Sequential's children in order
        are its forward)."""
        return None

    def join(self, pieces: Sequence[nn.Module]) -> nn.Module:
        """The whole single-device network from plain copies of every stage module (pure)."""
        return join_sequential(self.blocks, pieces)

    # ---- the network call
    def sample(self, net: nn.Module, example: Any) -> Any:
        """The sample micro-batch (`example`: ``example_input_array``, its first row: a later stage's forward that
        unpacks a block's tuple from the activation's stand-in fails on one row, where two unpack by chance) placed
        on `net`; None without one."""
        if example is None:
            return None
        example = torch.as_tensor(example)
        return self.place_sample(example[:1] if example.dim() else example, net)

    def place_sample(self, sample: Any, net: nn.Module) -> Any:
        """`sample` on `net`'s device (and floating dtype: the precision plugin may have converted `net`)."""
        sample = torch.as_tensor(sample).to(next(net.parameters()).device)
        dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), None)
        return sample.to(dtype) if dtype is not None and sample.is_floating_point() else sample

    call_inputs: ClassVar[Callable[[tuple, dict], tuple[Tensor, dict, Tensor | None]]] = staticmethod(plain_call_inputs)
    """(first stage's input, inputs every stage takes, labels) of a call of the pipelined network."""
    call_output: ClassVar[Callable[..., Any]] = staticmethod(plain_call_output)
    """What the pipelined network's call returns, from what the step sees of the output and the loss."""


@dataclass(frozen=True, kw_only=True)
class PrunedLayout(NetworkLayout):
    """A model with one block list (the pack's GPT, nanoGPT, litgpt): a stage is the model with the parts it does not
    own taken out (:mod:`.pruned`), running its own forward."""

    parts: tuple[str, str, tuple[str, ...], tuple[str, ...]]
    """``(owner, block_list, stem, head)`` as qualified names (``owner``: the module holding the block list)."""

    convention: ClassVar[type] = ForwardStage
    handed_over: ClassVar[str] = "into its first block, the model's input given to every stage"
    fix: ClassVar[str] = (
        " A value the forward carries across blocks beside the activation (a residual add outside the blocks, a skip"
        " connection from the stem to the head) cannot be handed between stages: move such work into a child module"
        " (e.g. a block whose own forward adds its residual)."
    )
    own_class: ClassVar[bool] = True

    @classmethod
    def from_parts(cls, net: nn.Module, parts: tuple) -> PrunedLayout:
        """The layout of `net` whose ``(owner, block_list, stem, head)`` are `parts`."""
        _, block_list, stem, head = parts
        blocks = tuple(net.get_submodule(block_list)._modules)
        return cls(stem=stem, block_list=block_list, blocks=blocks, head=head, parts=parts)

    def build_stage(self, net: nn.Module, block_ids: Sequence[int], *, first: bool, last: bool) -> nn.Module:
        blocks = [self.blocks[i] for i in block_ids]
        return build_pruned_stage(net, self.parts, blocks, first=first, last=last, convention=self.convention)

    def profile(self, net: nn.Module, sample: Any, *, repeats: int = 5) -> Costs:
        return profile_parts(net, self, lambda: self.convention.whole_output(net, sample), repeats=repeats)

    def forward_problem(self, net: nn.Module, sample: Any) -> str | None:
        n = len(self.blocks)  # every block boundary is a stage boundary: each hand-over is checked
        problem = check_pruned_stages(
            net, [self.build_stage(net, [i], first=i == 0, last=i == n - 1) for i in range(n)], sample
        )
        if problem is None:
            return None
        cls = type(net).__name__
        registered = [*self.stem, self.block_list, *self.head]
        called = call_order(net, registered, lambda: self.convention.whole_output(net, sample))
        before = set(called[: called.index(self.block_list)]) if self.block_list in called else set(self.stem)
        if before != set(self.stem) and set(called) == set(registered):  # a part on the wrong side of the blocks
            short = [n.rpartition(".")[2] for n in called]
            hint = (
                f" Register the children in execution order: in {cls}.__init__ assign {' then '.join(short)}."
                if self.own_class
                else self.fix
            )
            return (
                f"{cls} registers its children in the order {' -> '.join(n.rpartition('.')[2] for n in registered)},"
                f" but its forward runs them as {' -> '.join(short)}: a pipeline stage takes the children registered"
                " before the block list as the stem (first stage) and those after it as the head (last stage), by"
                f" registration order.{hint}"
            )
        return (
            f"Cannot split {cls} into pipeline stages: {problem}. Tried: a stage = the model with the blocks of"
            f" {self.block_list} it does not own taken out, hidden states passed {self.handed_over}.{self.fix}"
        )

    def join(self, pieces: Sequence[nn.Module]) -> nn.Module:
        return join_pruned(self.parts, self.blocks, pieces)

    call_inputs = staticmethod(model_input_call)


@dataclass(frozen=True, kw_only=True)
class HFLayout(PrunedLayout):
    """An unmodified HuggingFace causal LM (:mod:`.hf`): pruned stages taking ``inputs_embeds``, giving ``.logits``."""

    convention: ClassVar[type] = HFStageMixin
    handed_over: ClassVar[str] = "as `inputs_embeds` (HF's config.base_model_pp_plan layout)"
    fix: ClassVar[str] = " transformers' class cannot be changed here: train this model with pp=1 (fsdp2, hsdp, tp)."
    own_class: ClassVar[bool] = False  # the model's class is not the user's to reorder
    needs_pipeline_loss: ClassVar[bool] = False
    config_sample: ClassVar[bool] = True

    def build_stage(self, net: nn.Module, block_ids: Sequence[int], *, first: bool, last: bool) -> nn.Module:
        stage = super().build_stage(net, block_ids, first=first, last=last)
        stage._ld_embed_width = getattr(net.get_input_embeddings(), "embedding_dim", None)  # the whole model's
        return stage

    def join(self, pieces: Sequence[nn.Module]) -> nn.Module:
        whole = super().join(pieces)
        whole.loss_function = pipeline_loss_function  # HF's property has a setter for this (per instance)
        return whole

    def sample(self, net: nn.Module, example: Any) -> Any:
        if example is None:
            return hf_example_inputs(net)
        sample = dict(example) if isinstance(example, Mapping) else {"input_ids": example}
        # one row, as hf_example_inputs gives
        rows = {k: v[:1] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in sample.items()}
        return self.place_sample(rows, net)

    def place_sample(self, sample: Any, net: nn.Module) -> Any:
        device = next(net.parameters()).device
        return {k: torch.as_tensor(v).to(device) for k, v in sample.items()}

    call_inputs = staticmethod(hf_call_inputs)
    call_output = staticmethod(hf_call_output)


def layout_kind(net: Any) -> type[NetworkLayout]:
    """:class:`HFLayout` or the plain layout class, before the parts are looked for (its class attributes answer)."""
    return HFLayout if isinstance(net, nn.Module) and is_hf_causal_lm(net) else NetworkLayout


def network_layout(net: nn.Module) -> NetworkLayout:
    """The layout of `net`; TypeError giving each route's reason when none can split it. Routes, in order: HF causal
    LM, ``nn.Sequential``, the model pruned per stage around its one block list."""
    if layout_kind(net) is HFLayout:
        return HFLayout.from_parts(net, hf_parts(net))
    if is_sequential(net):
        return NetworkLayout(stem=(), block_list=None, blocks=tuple(net._modules), head=())
    direct = [name for name, _ in find_block_lists(net) if "." not in name]  # one on the model itself goes first
    parts, why = pruned_parts(net, direct[0] if len(direct) == 1 else None)
    if parts is not None:
        return PrunedLayout.from_parts(net, parts)
    tried = [
        "a HuggingFace causal LM (config.base_model_pp_plan): it is not one",
        "an nn.Sequential (its children are the blocks): it is not one",
        f"the model with the blocks a stage does not own taken out of the child holding them: {why}",
    ]
    raise TypeError(
        f"Cannot split {type(net).__name__} into pipeline stages; routes tried:\n  - "
        + "\n  - ".join(tried)
        + "\nMake it an nn.Sequential, or give it one nn.ModuleList of blocks (e.g. `self.blocks`) with the layers"
        " before it (stem) and after it (head) registered as children, its forward taking one input."
    )


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def part_params(net: nn.Module, layout: NetworkLayout) -> tuple[list[int], int, int]:
    """Parameters of (each block, the stem, the head) as the stages hold them (a tied weight counts on both)."""
    blocks = [_num_params(layout.block(net, i)) for i in range(len(layout.blocks))]
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
        lay = self.layout
        for s in self.stages:
            blocks = lay.block_name(s.blocks[0]) + (f"..{lay.blocks[s.blocks[-1]]}" if len(s.blocks) > 1 else "")
            parts = [*(["stem"] if s.stem and lay.stem else []), blocks, *(["head"] if s.head and lay.head else [])]
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
        rank_column = ["rank"] if stage_ranks is not None else []
        for col in ["stage", *rank_column, "blocks", "params", f"cost ({self.cost_unit})"]:
            table.add_column(col, justify="left" if col == "blocks" else "right")
        for row in self.rows():
            rank = (str(stage_ranks[row["stage"]]),) if stage_ranks is not None else ()
            cost = f"{row['cost']:.3f}" if self.cost_unit == "ms" else f"{int(row['cost']):,}"
            table.add_row(str(row["stage"]), *rank, row["blocks"], f"{row['params']:,}", cost)
        buf = io.StringIO()
        Console(file=buf, width=110, force_terminal=False).print(table)
        return buf.getvalue()


def profile_costs(net: nn.Module, layout: NetworkLayout, sample: Any, *, repeats: int = 5) -> Costs:
    """Measured milliseconds of (stem, each block, head) on one sample micro-batch (best of `repeats`); the parts
    must compose to ``net`` (see :meth:`NetworkLayout.forward_problem`)."""
    return layout.profile(net, sample, repeats=repeats)


def plan_split(
    net: nn.Module,
    num_stages: int,
    *,
    split: Split = "params",
    sample: torch.Tensor | None = None,
    costs: Costs | None = None,
    layout: NetworkLayout | None = None,
) -> PipelineSplit:
    """Split `net` into `num_stages` contiguous stages.

    `split`: ``"balanced"`` (measured time; needs `sample` or precomputed `costs` from :func:`profile_costs`),
    ``"params"`` (parameter count) or a list of ``num_stages - 1`` increasing block indices where stages
    1, 2, ... start. `layout`: `net`'s :func:`network_layout`, when the caller has it. Raises ValueError naming
    the numbers when the split is impossible.
    """
    layout = network_layout(net) if layout is None else layout
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
            problem = layout.forward_problem(net, sample)
            if problem:
                raise ValueError(problem)
            costs = layout.profile(net, sample)
        first, block_costs, last = costs
        method, unit = "balanced", "ms"
    elif split == "params" if isinstance(split, str) else isinstance(split, Sequence):
        first, block_costs, last = float(stem_p), [float(p) for p in params], float(head_p)
        method, unit = "params" if isinstance(split, str) else "manual", "params"
    else:
        raise ValueError(f'split={split!r} must be "balanced", "params" or a list of {num_stages - 1} block indices.')
    if method == "manual":
        points = [int(p) for p in split]  # type: ignore[union-attr]
    else:
        points = partition(block_costs, num_stages, first=first, last=last)
    bounds = [0, *points, n]
    if method == "manual" and (len(points) != num_stages - 1 or any(b >= e for b, e in zip(bounds, bounds[1:]))):
        raise ValueError(
            f"Manual split points {list(split)} must be {num_stages - 1} strictly increasing block indices in"  # type: ignore[arg-type]
            f" 1..{n - 1} (where stages 1..{num_stages - 1} start), e.g. {partition(params, num_stages)}."
        )
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


def build_stage_module(net: nn.Module, split: PipelineSplit, stage_indices: Sequence[int]) -> nn.Module:
    """The stage module with the parts of `stage_indices` (`net`'s modules: the rest is freed with `net`)."""
    chosen = [split.stages[i] for i in sorted(stage_indices)]
    return split.layout.build_stage(
        net,
        [b for s in chosen for b in s.blocks],
        first=any(s.stem for s in chosen),
        last=any(s.head for s in chosen),
    )


def join_stages(split: PipelineSplit, pieces: Sequence[nn.Module]) -> nn.Module:
    """The whole single-device network from plain copies of every pipeline rank's stage module (pure)."""
    return split.layout.join(pieces)


@runtime_checkable
class PipelineView(Protocol):
    """What a strategy offers about its pipeline to callbacks and tools (read-only except ``record_timeline``)."""

    split: PipelineSplit | None
    """The stage plan (blocks per stage, the network's layout); None until the model is split."""
    network: str
    """Attribute of the LightningModule holding the pipelined network."""
    record_timeline: bool
    """Set True to record each step's F/B/I/W actions (read back with :meth:`pop_timelines`)."""

    @property
    def local_stages(self) -> list[int]:
        """Indices of the stages this rank runs."""

    @property
    def stage_modules(self) -> list[nn.Module]:
        """This rank's stage modules, as the schedule runs them (after TP/FSDP), one per local stage."""

    def pop_timelines(self) -> list[dict]:
        """The timelines recorded since the last call (one per training step), removed from the strategy."""


def pipeline_view(strategy: Any) -> PipelineView | None:
    """The strategy's :class:`PipelineView`, or None (no pipeline, or not a mesh strategy)."""
    get = getattr(strategy, "pipeline_view", None)
    return get() if callable(get) else None


__all__ = [
    "Costs",
    "HFLayout",
    "NetworkLayout",
    "PipelineSplit",
    "PipelineView",
    "PrunedLayout",
    "Split",
    "StagePlan",
    "build_stage_module",
    "join_stages",
    "layout_kind",
    "network_layout",
    "part_params",
    "pipeline_view",
    "plan_split",
    "profile_costs",
]
