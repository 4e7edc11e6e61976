"""Pipeline stage splitting: a plan as data (stage -> blocks -> params -> cost) and the stage modules.

A pipelined network has one of three shapes:

* an ``nn.Sequential``: its children are the blocks;
* an unmodified HuggingFace causal LM: its ``config.base_model_pp_plan`` block list, the model itself
  running each stage with the parts it does not own taken out (see :mod:`.pipeline_hf`);
* a module with a **stem** (children registered before the block list), one ``nn.ModuleList`` of
  blocks (found by :func:`~lightning_dist.parallelize.units.find_block_lists`, a direct child) and a
  **head** (children registered after it). Its ``forward`` must equal applying the children in
  registration order (:func:`check_staged_forward` compares them on one micro-batch). A module used
  twice (weight sharing) runs twice; a parameter shared across stages is held by each (:func:`tied_stages`).

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
from typing import Any, Callable, Literal, Protocol, Union, runtime_checkable

import torch
from torch import nn

from lightning_dist.parallelize.units import find_block_lists

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
    hf: tuple | None = None
    """A HuggingFace causal LM: ``(base, block_list, stem, head)`` of :func:`~.pipeline_hf.hf_parts`; its stages
    are the model with the parts they do not own taken out (:func:`~.pipeline_hf.build_hf_stage`)."""

    def block_name(self, i: int) -> str:
        key = self.blocks[i]
        return key if self.block_list is None else f"{self.block_list}.{key}"


def network_layout(net: nn.Module) -> NetworkLayout:
    """Find stem / blocks / head of `net`; TypeError when it has none of the shapes (the message says why)."""
    from lightning_dist.parallelize.pipeline_hf import hf_parts, is_hf_causal_lm

    if is_hf_causal_lm(net):
        parts = hf_parts(net)
        _, block_list, stem, head = parts
        return NetworkLayout(stem=stem, block_list=block_list, blocks=tuple(net.get_submodule(block_list)._modules),
                             head=head, hf=parts)
    if isinstance(net, nn.Sequential):
        return NetworkLayout(stem=(), block_list=None, blocks=tuple(net._modules), head=())
    children = list(net.named_children())
    found = [(name, mod) for name, mod in find_block_lists(net) if "." not in name]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({[n for n, _ in found]})"
        raise TypeError(
            f"Cannot split {type(net).__name__} into pipeline stages: it has {what} direct nn.ModuleList of blocks."
            " Make it an nn.Sequential, or give it one nn.ModuleList of blocks (e.g. `self.blocks`) with the"
            " layers before it (stem) and after it (head) registered as children in execution order. (Tried: a"
            " HuggingFace causal LM's config.base_model_pp_plan - it is not one; nn.Sequential - it is not one.)"
        )
    name, blocks = found[0]
    if any(True for _ in net.parameters(recurse=False)):
        direct = [n for n, _ in net.named_parameters(recurse=False)]
        raise TypeError(
            f"{type(net).__name__} holds parameters directly ({direct}); a pipeline stage can only own whole"
            " child modules. Move them into a child module registered before or after the block list."
        )
    names = [n for n, _ in children]
    i = names.index(name)
    return NetworkLayout(stem=tuple(names[:i]), block_list=name, blocks=tuple(blocks._modules), head=tuple(names[i + 1:]))


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
            parts = (["stem"] if s.stem and self.layout.stem else []) + (
                [f"{self.layout.block_name(s.blocks[0])}..{self.layout.blocks[s.blocks[-1]]}"]
                if len(s.blocks) > 1 else [self.layout.block_name(s.blocks[0])]
            ) + (["head"] if s.head and self.layout.head else [])
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

        table = Table(title=f"Pipeline split ({self.method}, {self.num_stages} stages, imbalance {self.imbalance():.2f})")
        for col in ("stage", *(("rank",) if stage_ranks is not None else ()), "blocks", "params", f"cost ({self.cost_unit})"):
            table.add_column(col, justify="left" if col == "blocks" else "right")
        for row in self.rows():
            rank = (str(stage_ranks[row["stage"]]),) if stage_ranks is not None else ()
            cost = f"{row['cost']:.3f}" if self.cost_unit == "ms" else f"{int(row['cost']):,}"
            table.add_row(str(row["stage"]), *rank, row["blocks"], f"{row['params']:,}", cost)
        buf = io.StringIO()
        Console(file=buf, width=110, force_terminal=False).print(table)
        return buf.getvalue()


def partition(costs: Sequence[float], num_stages: int, *, first: float = 0.0, last: float = 0.0) -> list[int]:
    """Split points (start block of stages 1..S-1) of the contiguous split minimising the costliest stage.

    `first`/`last` are fixed costs of stage 0 (the stem) and the last stage (the head). Every stage gets at
    least one block. Exact dynamic programme over (stage, end block): O(S n^2), n is a few hundred at most.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"Cannot split {n} blocks into {num_stages} stages; need 1 <= stages <= blocks.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, i: int, j: int) -> float:  # blocks i..j-1 on stage s
        return prefix[j] - prefix[i] + (first if s == 0 else 0.0) + (last if s == num_stages - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: the smallest max-cost placing blocks 0..j-1 on stages 0..s; arg[s][j] the start of stage s
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    arg = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = stage_cost(0, 0, j)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], stage_cost(s, i, j))
                if value < best[s][j] - 1e-12:  # strict: ties keep the earliest split (deterministic)
                    best[s][j], arg[s][j] = value, i
    points, j = [], n
    for s in range(num_stages - 1, 0, -1):
        j = arg[s][j]
        points.append(j)
    return points[::-1]


def profile_costs(
    net: nn.Module, layout: NetworkLayout, sample: torch.Tensor, *, repeats: int = 5
) -> tuple[float, list[float], float]:
    """Measured forward+backward milliseconds of (stem, each block, head) on one sample micro-batch (best of `repeats`).

    The parts are assumed to compose to ``net`` (check that first with :func:`check_staged_forward`).
    A HuggingFace causal LM is measured inside its own forward (`sample`: its keyword inputs).
    """
    if layout.hf is not None:
        from lightning_dist.parallelize.pipeline_hf import profile_hf

        return profile_hf(net, layout, sample, repeats=repeats)
    parts = [net.get_submodule(n) for n in layout.stem] + [_block(net, layout, i) for i in range(len(layout.blocks))] + [
        net.get_submodule(n) for n in layout.head
    ]
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
    return sum(times[:n_stem]), times[n_stem:len(times) - n_head], sum(times[len(times) - n_head:])


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
        stages.append(StagePlan(
            index=s, blocks=idx, stem=is_first, head=is_last,
            params=sum(params[i] for i in idx) + (stem_p if is_first else 0) + (head_p if is_last else 0),
            cost=sum(block_costs[i] for i in idx) + (first if is_first else 0.0) + (last if is_last else 0.0),
        ))
    return PipelineSplit(layout=layout, stages=tuple(stages), method=method, cost_unit=unit)


# ---- what cannot be split ----------------------------------------------------------------------
def _part_names(split: PipelineSplit, stage: StagePlan) -> list[str]:
    lay = split.layout
    return (list(lay.stem) if stage.stem else []) + [lay.block_name(i) for i in stage.blocks] + (
        list(lay.head) if stage.head else []
    )


def shared_across_stages(net: nn.Module, split: PipelineSplit) -> list[tuple[str, ...]]:
    """Parameters reachable from two or more stages (tied weights): the qualified names of each, per parameter."""
    owners: dict[int, list[tuple[int, str]]] = {}
    for stage in split.stages:
        for part in _part_names(split, stage):
            module = net.get_submodule(part)
            for pname, p in module.named_parameters(remove_duplicate=False):
                owners.setdefault(id(p), []).append((stage.index, f"{part}.{pname}"))
    return [tuple(n for _, n in uses) for uses in owners.values() if len({s for s, _ in uses}) > 1]


def batchnorm_modules(net: nn.Module) -> list[str]:
    """Qualified names of BatchNorm layers (their statistics would come from one micro-batch, not the batch)."""
    return [name for name, m in net.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def tied_stages(net: nn.Module, split: PipelineSplit) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """Parameters held by two or more stages (tied embeddings): ``(qualified names, stage indices)`` of each.

    Each holding stage keeps the parameter; the strategy sums its gradient over the holders' ranks every step
    (Megatron's embedding group), so every copy takes the same optimizer step.
    """
    owners: dict[int, list[tuple[int, str]]] = {}
    for stage in split.stages:
        for part in _part_names(split, stage):
            for pname, p in net.get_submodule(part).named_parameters(remove_duplicate=False):
                owners.setdefault(id(p), []).append((stage.index, f"{part}.{pname}"))
    out = []
    for uses in owners.values():
        stages = tuple(sorted({s for s, _ in uses}))
        if len(stages) > 1:
            out.append((tuple(dict.fromkeys(n for _, n in uses)), stages))
    return out


def check_splittable(net: nn.Module, split: PipelineSplit, *, allow_batchnorm: bool = False) -> None:
    """Refuse (unless allowed, then warn) BatchNorm layers, naming them. Tied weights across stages are
    trained as one parameter (see :func:`tied_stages`)."""
    bn = batchnorm_modules(net)
    if bn and not allow_batchnorm:
        raise ValueError(f"BatchNorm layers {bn} would normalize each micro-batch with its own statistics, unlike"
                         " single-device training. Use LayerNorm/GroupNorm, or pass allow_batchnorm=True.")
    if bn:
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(f"Pipelining BatchNorm layers {bn}: statistics come from micro-batches.")


def _work_outside_children(net: nn.Module) -> list[str]:
    """Operations `net.forward` applies itself, outside its child modules (from torch.fx; [] when not traceable)."""
    from collections import Counter

    try:
        graph = torch.fx.symbolic_trace(net).graph
    except Exception:  # data-dependent control flow etc.: the numeric comparison still decides
        return []
    ops = Counter(str(getattr(n.target, "__name__", n.target)) for n in graph.nodes if n.op in ("call_function", "call_method"))
    return [f"{count} x {op}" if count > 1 else op for op, count in ops.items()]


def staged_forward_problem(net: nn.Module, sample: torch.Tensor, *, rtol: float = 1e-5, atol: float = 1e-6) -> str | None:
    """Why the pipeline stages would not compute ``net(sample)``, or None when they do.

    The stages run only the network's children (stem, blocks, head) one after the other (what
    :class:`StageModule` runs); a ``forward`` that adds residuals around blocks, calls a child twice or
    in another order, or transforms tensors between children computes something else.
    """
    layout = network_layout(net)
    if layout.hf is not None:  # every block boundary is a stage boundary: each hand-over is checked
        from lightning_dist.parallelize.pipeline_hf import check_hf_stages

        one_each = plan_split(net, len(layout.blocks), split=list(range(1, len(layout.blocks))))
        problem = check_hf_stages(net, [build_stage_module(net, one_each, [s]) for s in range(one_each.num_stages)],
                                  sample)
        if problem is None:
            return None
        return (f"Cannot split {type(net).__name__} into pipeline stages: {problem}. Tried: a stage = the model"
                f" with the blocks of {layout.block_list} it does not own taken out, hidden states passed as"
                " `inputs_embeds` (HF's config.base_model_pp_plan layout).")
    staged = build_stage_module(net, plan_split(net, 1, split="params"), [0])
    was_training = net.training
    net.eval()  # dropout & co. would draw different masks in the two runs
    try:
        with torch.no_grad():
            expected, got = net(sample), staged.run_local(sample)
    finally:
        net.train(was_training)
    if isinstance(expected, torch.Tensor) and expected.shape == got.shape and torch.allclose(expected, got, rtol=rtol, atol=atol):
        return None
    if isinstance(expected, torch.Tensor) and expected.shape == got.shape:
        what = f"max abs difference {(expected - got).abs().max().item():.4g} on one micro-batch"
    else:
        what = f"output {tuple(getattr(expected, 'shape', ()))} vs the stages' {tuple(got.shape)}"
    ops = _work_outside_children(net)
    outside = f" It applies {', '.join(ops)} itself, outside the child modules (e.g. residual adds around blocks)." if ops else ""
    order = " -> ".join([*layout.stem, layout.block_list or "children", *layout.head])
    return (f"{type(net).__name__}.forward is not its children applied in registration order ({order}): the pipeline"
            f" stages would compute a different network ({what}).{outside} Move that work into a child module (e.g. a"
            " block whose own forward adds its residual), register the layers in execution order, or express the"
            " network as an nn.Sequential.")


def host_copy(net: nn.Module) -> nn.Module:
    """A copy of `net` with its tensors in host memory (never a second copy in device memory), to check later."""
    import copy

    memo: dict[int, object] = {}
    for p in net.parameters():
        memo[id(p)] = nn.Parameter(p.detach().cpu().clone(), requires_grad=p.requires_grad)
    for b in net.buffers():
        memo[id(b)] = b.detach().cpu().clone()
    return copy.deepcopy(net, memo)


def check_staged_forward(net: nn.Module, sample: torch.Tensor) -> None:
    """ValueError (see :func:`staged_forward_problem`) when the stages would not compute ``net(sample)``."""
    problem = staged_forward_problem(net, sample)
    if problem:
        raise ValueError(problem)


# ---- stage modules -----------------------------------------------------------------------------
class StageModule(nn.Module):
    """The parts of a network that some pipeline stages run, under their original names.

    Children are kept in execution order: stem parts, the block list (an ``nn.ModuleDict`` keyed by the
    original block indices, or the Sequential's own keys), head parts. ``forward`` applies them in order.
    """

    def __init__(self, parts: Sequence[tuple[str, nn.Module]], block_list: str | None,
                 blocks: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self._block_list = block_list
        for name, module in parts:
            if name == block_list:
                self.add_module(name, nn.ModuleDict(dict(blocks)))
            else:
                self.add_module(name, module)
        if block_list is None:
            for key, module in blocks:
                self.add_module(key, module)
        self.runner: Callable | None = None
        """Set by the strategy: the whole-network call on the pipelined model runs the schedule instead."""

    def run_local(self, x):
        """Apply this module's parts in order (what a PipelineStage runs)."""
        # `_modules`, not `children()`: children() yields a module used twice (weight sharing) only once
        for child in self._modules.values():
            if isinstance(child, nn.ModuleDict):
                for block in child.values():
                    x = block(x)
            else:
                x = child(x)
        return x

    def forward(self, *args, **kwargs):
        if self.runner is not None:
            return self.runner(*args, **kwargs)
        return self.run_local(*args, **kwargs)


def is_pipelined_module(net: object) -> bool:
    """A stage module built by :func:`build_stage_module` (of either kind)."""
    from lightning_dist.parallelize.pipeline_hf import HFStageMixin

    return isinstance(net, (StageModule, HFStageMixin))


def build_stage_module(net: nn.Module, split: PipelineSplit, stage_indices: Sequence[int]) -> StageModule:
    """A :class:`StageModule` with only the stem/blocks/head of `stage_indices` (the same module objects).

    The rest of `net` is not referenced: once the caller drops `net`, those parameters are freed.
    """
    lay = split.layout
    chosen = [split.stages[i] for i in sorted(stage_indices)]
    block_ids = [b for s in chosen for b in s.blocks]
    if lay.hf is not None:
        from lightning_dist.parallelize.pipeline_hf import build_hf_stage

        return build_hf_stage(net, lay.hf, [lay.blocks[i] for i in block_ids], first=any(s.stem for s in chosen),
                              last=any(s.head for s in chosen))
    blocks = [(lay.blocks[i], _block(net, lay, i)) for i in block_ids]
    parts: list[tuple[str, nn.Module]] = []
    if any(s.stem for s in chosen):
        parts += [(n, getattr(net, n)) for n in lay.stem]
    if lay.block_list is not None:
        parts.append((lay.block_list, getattr(net, lay.block_list)))
    if any(s.head for s in chosen):
        parts += [(n, getattr(net, n)) for n in lay.head]
    return StageModule(parts, lay.block_list, blocks)


def stage_blocks(stage: StageModule) -> list[nn.Module]:
    """The blocks a stage module holds: its block list's entries, or (a split ``nn.Sequential``) its children."""
    hf_list = getattr(stage, "_ld_block_list", None)
    if hf_list is not None:  # a HuggingFace stage: its slice of the block list
        return list(stage.get_submodule(hf_list).children())
    lists = [child for child in stage.children() if isinstance(child, nn.ModuleDict)]
    if lists:
        return [block for blocks in lists for block in blocks.values()]
    return list(stage.children())


def apply_fsdp_to_stage(
    stage: nn.Module,
    mesh: Any,
    *,
    units: Any = "auto",
    reshard_after_forward: bool = False,
    mp_policy: Any | None = None,
    offload_policy: Any | None = None,
) -> int:
    """FSDP2 on the data-parallel mesh for one stage module: its units first, then the stage module as root.

    The stage module must be its own FSDP root so ``PipelineStage`` can defer the gradient reduction to the
    last micro-batch (``apply_fsdp``'s roots are the LightningModule's children, which never run here).
    `units`: ``"auto"`` (the blocks of the stage's block list), class names or modules; of those, a block run
    twice or sharing a parameter with the rest of the stage stays in the root unit. Returns the unit count.
    """
    from lightning_dist._compat import fully_shard_api
    from lightning_dist.parallelize.units import select_units

    fully_shard = fully_shard_api()[0]
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    if isinstance(units, str) and units == "auto" and getattr(stage, "_ld_block_list", None) is not None:
        blocks = stage_blocks(stage)
    elif isinstance(units, str) and units == "auto":
        blocks = [b for child in stage._modules.values() if isinstance(child, nn.ModuleDict) for b in child.values()]
    else:
        blocks = [m for _, m in select_units(stage, units)]
    picked = _unshared(blocks, stage)
    for block in picked:
        fully_shard(block, **kwargs)
    fully_shard(stage, **kwargs)
    return len(picked) + 1


def _unshared(blocks: Sequence[nn.Module], stage: nn.Module) -> list[nn.Module]:
    """The blocks to shard as their own FSDP units: those run once per forward and sharing no parameter.

    A block used twice (or holding a parameter another part of the stage also uses) stays with the stage's
    root unit, which keeps it gathered for the whole forward and backward of the stage.
    """
    uses: dict[int, int] = {}
    for _, p in stage.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    out, seen = [], set()
    for block in blocks:
        if id(block) in seen:
            continue
        seen.add(id(block))
        own = {id(p): 0 for p in block.parameters()}
        for _, p in block.named_parameters(remove_duplicate=False):
            own[id(p)] += 1
        if sum(b is block for b in blocks) == 1 and all(uses[k] == n for k, n in own.items()):
            out.append(block)
    return out


@runtime_checkable
class PipelineView(Protocol):
    """What a strategy offers about its pipeline to callbacks and tools (``MeshStrategy.pipeline_view()``).

    Read-only except ``record_timeline``; a callback never needs the strategy's class or its internals.
    """

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
    """The strategy's :class:`PipelineView` (``strategy.pipeline_view()``), or None (no pipeline, or not a mesh strategy)."""
    get = getattr(strategy, "pipeline_view", None)
    return get() if callable(get) else None


def join_stages(split: PipelineSplit, pieces: Sequence[nn.Module]) -> nn.Module:
    """The whole single-device network from plain copies of every pipeline rank's stage module (pure).

    Stem, blocks and head are put back in the split's order under their single-device names. A HuggingFace
    stage is the model with the parts it does not own taken out: the parts are put back into the first
    stage's copy.
    """
    layout = split.layout
    if layout.hf is not None:
        from lightning_dist.parallelize.pipeline_hf import HFStageMixin, _shallow

        first = next(p for p in pieces if p.get_submodule(layout.stem[0]).__class__.__name__ != "Absent")
        # the model's own class (a stage's class is (the stage class, the mixin, it); a piece may be one already)
        whole = _shallow(first, type(first).__mro__[2] if isinstance(first, HFStageMixin) else type(first))
        assert not isinstance(whole, HFStageMixin)
        prefix = layout.hf[0]
        base = _shallow(first.get_submodule(prefix))
        whole._modules[prefix] = base
        blocks = {k: m for p in pieces for k, m in p.get_submodule(layout.block_list)._modules.items()}
        joined = nn.ModuleList()
        joined._modules = {k: blocks[k] for k in layout.blocks}
        base._modules[layout.block_list.split(".", 1)[1]] = joined
        last = next(p for p in pieces if not isinstance(p.get_submodule(layout.head[-1]), nn.Identity))
        for name in layout.head:
            owner, _, child = name.rpartition(".")
            (base if owner == prefix else whole)._modules[child] = last.get_submodule(name)
        return whole
    parts: dict[str, nn.Module] = {}
    blocks: dict[str, nn.Module] = {}
    for piece in pieces:
        for name, child in piece.named_children():
            if name == layout.block_list:
                blocks.update(child.items())
            elif layout.block_list is None:  # an nn.Sequential: its children are the blocks
                blocks[name] = child
            else:
                parts[name] = child
    order = list(layout.stem) + ([layout.block_list] if layout.block_list is not None else []) + list(layout.head)
    return StageModule([(n, parts.get(n)) for n in order], layout.block_list, [(k, blocks[k]) for k in layout.blocks])


def stage_ranks(num_stages: int, pp: int, style: Literal["loop", "v"] = "loop") -> list[int]:
    """Pipeline rank of each stage: ``loop`` (stage s on rank s % pp) or ``v`` (ZBV: 0..p-1 then p-1..0)."""
    if num_stages % pp:
        raise ValueError(f"{num_stages} stages do not divide over pp={pp} ranks.")
    if style == "loop":
        return [s % pp for s in range(num_stages)]
    out = []
    for s in range(num_stages):
        lap, pos = divmod(s, pp)
        out.append(pos if lap % 2 == 0 else pp - 1 - pos)
    return out


__all__ = [
    "NetworkLayout", "PipelineSplit", "PipelineView", "join_stages", "pipeline_view", "StagePlan", "StageModule", "apply_fsdp_to_stage", "batchnorm_modules",
    "stage_blocks",
    "check_splittable", "tied_stages", "is_pipelined_module",
    "build_stage_module", "check_staged_forward", "host_copy", "staged_forward_problem",
    "network_layout", "partition", "plan_split", "profile_costs", "shared_across_stages", "stage_ranks",
]

