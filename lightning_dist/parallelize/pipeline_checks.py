"""What a pipeline split cannot run as is: parameters shared across stages, BatchNorm, work outside the
children, a forward that is not the children in order (checked on one micro-batch). Pure checks on the plan
of :mod:`.pipeline`, run before anything is split."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dist.parallelize.pipeline import PipelineSplit, StagePlan, network_layout, plan_split
from lightning_dist.parallelize.pipeline_stages import build_stage_module


# ---- what cannot be split ----------------------------------------------------------------------
def _part_names(split: PipelineSplit, stage: StagePlan) -> list[str]:
    lay = split.layout
    return (
        (list(lay.stem) if stage.stem else [])
        + [lay.block_name(i) for i in stage.blocks]
        + (list(lay.head) if stage.head else [])
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
        raise ValueError(
            f"BatchNorm layers {bn} would normalize each micro-batch with its own statistics, unlike"
            " single-device training. Use LayerNorm/GroupNorm, or pass allow_batchnorm=True."
        )
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
    ops = Counter(
        str(getattr(n.target, "__name__", n.target)) for n in graph.nodes if n.op in ("call_function", "call_method")
    )
    return [f"{count} x {op}" if count > 1 else op for op, count in ops.items()]


def staged_forward_problem(
    net: nn.Module, sample: torch.Tensor, *, rtol: float = 1e-5, atol: float = 1e-6
) -> str | None:
    """Why the pipeline stages would not compute ``net(sample)``, or None when they do.

    The stages run only the network's children (stem, blocks, head) one after the other (what
    :class:`StageModule` runs); a ``forward`` that adds residuals around blocks, calls a child twice or
    in another order, or transforms tensors between children computes something else.
    """
    layout = network_layout(net)
    if layout.pruned is not None:  # every block boundary is a stage boundary: each hand-over is checked
        from lightning_dist.parallelize.pipeline_pruned import check_pruned_stages

        one_each = plan_split(net, len(layout.blocks), split=list(range(1, len(layout.blocks))))
        problem = check_pruned_stages(
            net, [build_stage_module(net, one_each, [s]) for s in range(one_each.num_stages)], sample
        )
        if problem is None:
            return None
        given = (
            "as `inputs_embeds` (HF's config.base_model_pp_plan layout)"
            if layout.hf is not None
            else "in place of its input"
        )
        return (
            f"Cannot split {type(net).__name__} into pipeline stages: {problem}. Tried: a stage = the model"
            f" with the blocks of {layout.block_list} it does not own taken out, hidden states passed {given}."
        )
    staged = build_stage_module(net, plan_split(net, 1, split="params"), [0])
    registered = [*layout.stem, layout.block_list or "children", *layout.head]
    was_training = net.training
    net.eval()  # dropout & co. would draw different masks in the two runs
    try:
        with torch.no_grad():
            called, hooks = _record_call_order(net, layout)
            try:
                expected = net(sample)
            finally:
                for h in hooks:
                    h.remove()
            try:
                got, crash = staged.run_local(sample), None
            except (RuntimeError, ValueError, TypeError, IndexError) as err:  # e.g. a head run before the blocks
                got, crash = None, err
    finally:
        net.train(was_training)
    if (
        crash is None
        and isinstance(expected, torch.Tensor)
        and expected.shape == got.shape
        and torch.allclose(expected, got, rtol=rtol, atol=atol)
    ):
        return None
    order = " -> ".join(registered)
    if called and called != registered and set(called) == set(registered):
        moved = [n for n in registered if called.index(n) != registered.index(n)]
        return (
            f"{type(net).__name__} registers its children in the order {order}, but its forward runs them as"
            f" {' -> '.join(called)}: the pipeline stages run the children in registration order (stem, block"
            f" list, head), so they would run {moved} at the wrong place"
            + (f" (the staged forward failed: {str(crash).splitlines()[0]})" if crash is not None else "")
            + f". Register the children in execution order: in {type(net).__name__}.__init__ assign"
            f" {' then '.join(called)}."
        )
    if crash is not None:
        what = f"the stages fail on one micro-batch: {type(crash).__name__}: {str(crash).splitlines()[0]}"
    elif isinstance(expected, torch.Tensor) and expected.shape == got.shape:
        what = f"max abs difference {(expected - got).abs().max().item():.4g} on one micro-batch"
    else:
        what = f"output {tuple(getattr(expected, 'shape', ()))} vs the stages' {tuple(got.shape)}"
    ops = _work_outside_children(net)
    outside = (
        f" It applies {', '.join(ops)} itself, outside the child modules (e.g. residual adds around blocks)."
        if ops
        else ""
    )
    return (
        f"{type(net).__name__}.forward is not its children applied in registration order ({order}): the pipeline"
        f" stages would compute a different network ({what}).{outside} Move that work into a child module (e.g. a"
        " block whose own forward adds its residual), register the layers in execution order, or express the"
        " network as an nn.Sequential."
    )


def _record_call_order(net: nn.Module, layout) -> tuple[list[str], list]:
    """Hooks recording the stem, block-list and head children of `net` in the order its forward first calls
    them: (that list, filled as it runs; the hook handles to remove). Nothing for an nn.Sequential, which runs
    its children in registration order by definition."""
    order: list[str] = []
    if layout.block_list is None:
        return order, []
    hooks = []
    for name in [*layout.stem, layout.block_list, *layout.head]:
        child = net.get_submodule(name)
        for t in list(child.children()) if name == layout.block_list else [child]:  # a ModuleList is never called
            hooks.append(
                t.register_forward_pre_hook(lambda m, args, name=name: None if name in order else order.append(name))
            )
    return order, hooks


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
