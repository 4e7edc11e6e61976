"""Pipeline stages cut out of an unmodified model: a stage is the model with the parts it does not own taken
out, so the model's own ``forward`` runs each stage (rotary tables, masks, whatever it builds), as torchtitan
builds its stages. Where the parts are (:func:`nested_parts`, or :func:`~.hf.hf_parts` for HF):

* the **block list**: an ``nn.ModuleList`` inside a direct child (``transformer.h`` of litgpt's ``GPT``, a
  HF base model's ``layers``); a stage keeps its slice under the original indices (``transformer.h.5`` stays
  ``transformer.h.5``);
* the **stem** (first stage): that child's children registered before the block list (the token embedding).
  A later stage gets the boundary activation in place of the model's input: a stem part it does not own is
  :class:`Absent`, which passes hidden states through (``self.transformer.wte(x)`` returns ``x``);
* the **head** (last stage): that child's children after the block list (the final norm) and the model's
  other children (``lm_head``); a stage that does not own them has ``nn.Identity`` there, so its output is
  its hidden states.

Two input conventions, one class each (:class:`PrunedStage` subclasses): :class:`ForwardStage` passes the
activation as the forward's first input and returns its output (litgpt); HF's passes ``inputs_embeds`` and
returns ``.logits`` (:class:`~.hf.HFStageMixin`). :func:`check_pruned_stages` runs the stages one
after the other on one micro-batch against the whole model before anything is split: a forward that does not
tolerate this (an embedding scaled after the lookup, a logit soft-cap) is refused, never mis-trained.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_dist.parallelize.units import find_block_lists


class Absent(nn.Module):
    """A stem part a later stage does not own: adds nothing to an embedding sum, passes hidden states through."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x  # e.g. the token embedding or the embedding dropout: the first stage applied it
        return torch.zeros((), dtype=torch.get_default_dtype())  # e.g. wpe(position_ids): x + 0 is x exactly


def _shallow(module: nn.Module, cls: type | None = None) -> nn.Module:
    """A new module object sharing `module`'s parameters, buffers, children and attributes, with its own
    hook and child dicts (FSDP2 and PipelineStage register hooks on a stage: they must not reach the others)."""
    out = (cls or type(module)).__new__(cls or type(module))
    nn.Module.__init__(out)
    fresh = set(out.__dict__)
    out.__dict__.update({k: v for k, v in module.__dict__.items() if k not in fresh})
    out._parameters = dict(module._parameters)
    out._buffers = dict(module._buffers)
    out._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    out._modules = dict(module._modules)
    out.training = module.training
    return out


class PrunedStage(nn.Module):
    """A stage made of the model itself (a class made per model: ``(the convention, the model's class)``)."""

    _ld_model: type = nn.Module
    """The model's own class (the stage class is made at run time)."""
    _ld_first: bool = True
    _ld_block_list: str | None = None
    runner: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if self.runner is not None:  # the LightningModule's copy: the call runs the whole schedule
            return self.runner(*args, **kwargs)
        return self.run_local(*args, **kwargs)

    def run_local(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def stage_blocks(self) -> list[nn.Module]:
        """The blocks this stage holds: its slice of the model's block list."""
        return list(self.get_submodule(self._ld_block_list).children())

    def fsdp_units(self) -> list[nn.Module]:
        """FSDP2's ``"auto"`` units: the blocks it holds."""
        return self.stage_blocks()

    @staticmethod
    def whole_output(net: nn.Module, sample: Any) -> torch.Tensor:
        """The unsplit model's output on a sample micro-batch (what the stages must give)."""
        raise NotImplementedError

    @staticmethod
    def split_sample(sample: Any) -> tuple[Any, dict[str, Any]]:
        """(the first stage's input, the keyword inputs every stage takes) of a sample micro-batch."""
        raise NotImplementedError


class ForwardStage(PrunedStage):
    """The activation as the forward's first input (the first stage: the model's own input), its output out."""

    def run_local(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return self._ld_model.forward(self, x, *args, **kwargs)

    @staticmethod
    def whole_output(net: nn.Module, sample: Any) -> torch.Tensor:
        return net(sample)

    @staticmethod
    def split_sample(sample: Any) -> tuple[Any, dict[str, Any]]:
        return sample, {}


def model_class(stage: nn.Module) -> type:
    """The model's own class of a pruned stage (the class itself for any other module)."""
    return stage._ld_model if isinstance(stage, PrunedStage) else type(stage)


def nested_parts(net: nn.Module) -> tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]] | None, str]:
    """``((child, block_list, stem, head), "")`` for a model whose one block list sits inside a direct child
    (litgpt's ``transformer.h``), as qualified names; ``(None, why not)`` otherwise (pure, works on meta)."""
    lists = [n for n, _ in find_block_lists(net)]
    if not lists:
        return None, "it has no nn.ModuleList of blocks"
    try:
        params = list(inspect.signature(net.forward).parameters.values())
    except (TypeError, ValueError):  # no readable signature: the staged-forward check on one micro-batch decides
        params = []
    required = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(lists) > 1:
        two = f" and its forward takes {len(required)} inputs ({', '.join(required)})" if len(required) > 1 else ""
        return None, (
            f"it has {len(lists)} block lists ({', '.join(map(repr, lists))}){two}: an encoder-decoder's"
            " decoder blocks need the encoder's output and a second input beside the activation a stage"
            " hands to the next, which a pipeline of one activation cannot carry"
        )
    name = lists[0]
    if name.count(".") != 1:
        return None, f"its block list {name!r} is not inside a direct child (only `child.blocks` is cut out)"
    if getattr(type(net), "forward", None) is nn.Module.forward:
        return None, f"{type(net).__name__} defines no forward"
    if len(required) > 1 or (params and not required):
        return None, (
            f"its forward takes {len(required)} required inputs ({', '.join(required) or 'none'}); a later"
            " stage gets the boundary activation in place of one input"
        )
    direct = [n for n, _ in net.named_parameters(recurse=False)]
    if direct:
        return None, f"it holds parameters directly ({direct}), which every stage would hold"
    prefix, list_name = name.split(".")
    child = net.get_submodule(prefix)
    names = [n for n, m in child._modules.items() if m is not None]
    i = names.index(list_name)
    stem = tuple(f"{prefix}.{n}" for n in names[:i])
    head = tuple(f"{prefix}.{n}" for n in names[i + 1 :])
    head += tuple(n for n, m in net.named_children() if n != prefix)
    return (prefix, name, stem, head), ""


def build_pruned_stage(
    net: nn.Module,
    parts: tuple,
    blocks: Sequence[str],
    *,
    first: bool,
    last: bool,
    convention: type[PrunedStage] = ForwardStage,
) -> nn.Module:
    """`net` with only `blocks` of its block list, its stem when `first` and its head when `last` (shared modules)."""
    prefix, block_list, stem, head = parts
    cls = type(f"{type(net).__name__}Stage", (convention, type(net)), {"_ld_model": type(net)})
    lm = _shallow(net, cls)
    lm._ld_first = first
    lm._ld_block_list = block_list
    base = _shallow(net.get_submodule(prefix))
    lm._modules[prefix] = base
    full = net.get_submodule(block_list)
    kept = nn.ModuleList()
    kept._modules = {k: full._modules[k] for k in blocks}  # original indices: the single-device names
    base._modules[block_list.split(".", 1)[1]] = kept
    for name in stem if not first else ():
        base._modules[name.split(".", 1)[1]] = Absent()
    for name in head if not last else ():
        owner, _, child = name.rpartition(".")
        (base if owner == prefix else lm)._modules[child] = nn.Identity()
    if hasattr(lm, "_tied_weights_keys"):  # the pruned copy never re-ties (the tie lives in the parameters)
        lm.__dict__["_tied_weights_keys"] = None
    return lm


def join_pruned(parts: tuple, blocks_order: Sequence[str], pieces: Sequence[nn.Module]) -> nn.Module:
    """The whole model of the model's own class from plain copies of every stage (the parts put back into the
    first stage's copy, under their single-device names)."""
    prefix, block_list, stem, head = parts
    first = next(p for p in pieces if not isinstance(p.get_submodule(stem[0]), Absent)) if stem else pieces[0]
    whole = _shallow(first, model_class(first))
    base = _shallow(first.get_submodule(prefix))
    whole._modules[prefix] = base
    blocks = {k: m for p in pieces for k, m in p.get_submodule(block_list)._modules.items()}
    joined = nn.ModuleList()
    joined._modules = {k: blocks[k] for k in blocks_order}
    base._modules[block_list.split(".", 1)[1]] = joined
    last = next(p for p in pieces if not isinstance(p.get_submodule(head[-1]), nn.Identity)) if head else pieces[-1]
    for name in head:
        owner, _, child = name.rpartition(".")
        (base if owner == prefix else whole)._modules[child] = last.get_submodule(name)
    return whole


def model_class_copy(module: nn.Module) -> nn.Module:
    """`module` with every pruned stage in it (itself included) turned back into the model's own class (shared
    parts): the stage classes are made per model at run time, so a stage cannot be pickled (e.g. gathered
    with ``all_gather_object``) as it is."""

    def plain(m: nn.Module) -> nn.Module:
        return _shallow(m, model_class(m)) if isinstance(m, PrunedStage) else m

    module = plain(module)
    for m in [module, *module.modules()]:
        for name, child in list(m._modules.items()):
            if isinstance(child, PrunedStage):
                m._modules[name] = plain(child)
    return module


def check_pruned_stages(net: nn.Module, stages: Sequence[nn.Module], sample: Any) -> str | None:
    """Why running `stages` one after the other does not give the model's output on `sample` (None when it does)."""
    if not stages or not isinstance(stages[0], PrunedStage):
        return "the stages are not pruned copies of the model"
    convention = type(stages[0])
    was = net.training
    net.eval()
    for s in stages:
        s.eval()
    try:
        with torch.no_grad():
            expected = convention.whole_output(net, sample)
            x, kw = convention.split_sample(sample)
            for stage in stages:
                x = stage.run_local(x, **kw)
    except Exception as err:  # a forward that cannot run without the parts a stage does not own
        return f"its forward fails on a stage without the parts it does not own ({type(err).__name__}: {err})"
    finally:
        net.train(was)
        for s in stages:
            s.train(was)
    if not isinstance(expected, torch.Tensor) or not isinstance(x, torch.Tensor):
        return f"its forward returns {type(expected).__name__}, not one tensor a stage can hand on"
    if x.shape != expected.shape:
        return f"the stages return {tuple(x.shape)}, the model {tuple(expected.shape)}"
    if not torch.allclose(x, expected, rtol=1e-5, atol=1e-6):
        gap = (x - expected).abs().max().item()
        return f"the stages compute another function (max abs difference {gap:.3g} on one micro-batch)"
    return _pruned_gradient_problem(net, stages, sample, convention)


def _pruned_gradient_problem(net: nn.Module, stages: Sequence[nn.Module], sample: Any, convention: Any) -> str | None:
    """The stages' gradients against the model's on `sample` (what the optimizer will use; eval mode)."""
    from lightning_dist.parallelize.self_check import gradient_problem

    def staged() -> Any:
        x, kw = convention.split_sample(sample)
        for stage in stages:
            x = stage.run_local(x, **kw)
        return x

    modules = [net, *stages]
    was = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        return gradient_problem(dict(net.named_parameters()), lambda: convention.whole_output(net, sample), staged)
    finally:
        for m, w in zip(modules, was):
            m.train(w)


def profile_pruned(
    net: nn.Module, layout: Any, sample: Any, *, convention: type[PrunedStage], repeats: int = 5
) -> tuple[float, list[float], float]:
    """Milliseconds of (stem, each block, head) in forward, inside the model's own forward (best of `repeats`).

    Blocks need the model's extra inputs (mask, rotary tables), so they are timed by hooks during the model's
    forward; the backward is taken as proportional to the forward (the split only needs ratios).
    """
    import time

    names = [*layout.stem, *(f"{layout.block_list}.{k}" for k in layout.blocks), *layout.head]
    best = [float("inf")] * len(names)
    starts: dict[int, float] = {}
    handles = []
    for i, name in enumerate(names):
        module = net.get_submodule(name)
        handles.append(module.register_forward_pre_hook(lambda m, a, i=i: starts.__setitem__(i, time.perf_counter())))
        handles.append(
            module.register_forward_hook(
                lambda m, a, o, i=i: best.__setitem__(i, min(best[i], (time.perf_counter() - starts[i]) * 1e3))
            )
        )
    try:
        with torch.no_grad():
            for _ in range(repeats + 1):
                convention.whole_output(net, sample)
    finally:
        for h in handles:
            h.remove()
    n_stem, n_head = len(layout.stem), len(layout.head)
    best = [0.0 if b == float("inf") else b for b in best]  # a part the forward never calls costs nothing
    return sum(best[:n_stem]), best[n_stem : len(best) - n_head], sum(best[len(best) - n_head :])


__all__ = [
    "Absent",
    "ForwardStage",
    "PrunedStage",
    "build_pruned_stage",
    "check_pruned_stages",
    "join_pruned",
    "model_class",
    "model_class_copy",
    "nested_parts",
    "profile_pruned",
]
