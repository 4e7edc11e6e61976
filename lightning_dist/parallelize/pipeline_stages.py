"""Stage modules of a pipeline split (the parts a rank runs, under their original names), FSDP2 per stage,
the :class:`PipelineView` protocol callbacks read, and the whole network joined back from its stages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Protocol, runtime_checkable

from torch import nn

from lightning_dist.parallelize.pipeline import PipelineSplit, _block


# ---- stage modules -----------------------------------------------------------------------------
class StageModule(nn.Module):
    """The parts of a network that some pipeline stages run, under their original names.

    Children are kept in execution order: stem parts, the block list (an ``nn.ModuleDict`` keyed by the
    original block indices, or the Sequential's own keys), head parts. ``forward`` applies them in order.
    """

    def __init__(
        self, parts: Sequence[tuple[str, nn.Module]], block_list: str | None, blocks: Sequence[tuple[str, nn.Module]]
    ) -> None:
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
    from lightning_dist.parallelize.pipeline_pruned import PrunedStage

    return isinstance(net, (StageModule, PrunedStage))


def build_stage_module(net: nn.Module, split: PipelineSplit, stage_indices: Sequence[int]) -> StageModule:
    """A :class:`StageModule` with only the stem/blocks/head of `stage_indices` (the same module objects).

    The rest of `net` is not referenced: once the caller drops `net`, those parameters are freed.
    """
    lay = split.layout
    chosen = [split.stages[i] for i in sorted(stage_indices)]
    block_ids = [b for s in chosen for b in s.blocks]
    if lay.pruned is not None:
        from lightning_dist.parallelize.pipeline_pruned import build_pruned_stage

        return build_pruned_stage(
            net,
            lay.pruned,
            [lay.blocks[i] for i in block_ids],
            first=any(s.stem for s in chosen),
            last=any(s.head for s in chosen),
            convention=lay.convention,
        )
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
    pruned_list = getattr(stage, "_ld_block_list", None)
    if pruned_list is not None:  # a pruned copy of the model (HF, litgpt): its slice of the block list
        return list(stage.get_submodule(pruned_list).children())
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
    """The strategy's :class:`PipelineView` (``strategy.pipeline_view()``), or None (no pipeline, or not a mesh
    strategy)."""
    get = getattr(strategy, "pipeline_view", None)
    return get() if callable(get) else None


def join_stages(split: PipelineSplit, pieces: Sequence[nn.Module]) -> nn.Module:
    """The whole single-device network from plain copies of every pipeline rank's stage module (pure).

    Stem, blocks and head are put back in the split's order under their single-device names. A pruned
    stage (HF, litgpt) is the model with the parts it does not own taken out: the parts are put back into the first
    stage's copy.
    """
    layout = split.layout
    if layout.pruned is not None:
        from lightning_dist.parallelize.pipeline_pruned import join_pruned

        return join_pruned(layout.pruned, layout.blocks, pieces)
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
