"""Pipeline stages cut out of an unmodified model: a stage is the model with the parts it does not own taken
out, so the model's own ``forward`` runs each stage (positions, rotary tables, masks, whatever it builds), as
torchtitan builds its stages. Where the parts are (:func:`pruned_parts`, or :func:`~.hf.hf_parts` for HF): the
**block list** (an ``nn.ModuleList``; a stage keeps its slice under the original indices), the **stem** (its
owner's children registered before it: first stage) and the **head** (its owner's later children and every
other child of the model: last stage). A stem part a stage does not own is :class:`Absent`, a head part
``nn.Identity``.

Notes: docs/internals.md, "lightning_dist/parallelize/pipeline/pruned.py"."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_dist.parallelize.units import find_block_lists

MODEL_INPUT = "model_input"
"""The keyword under which every :class:`ForwardStage` gets the model's own input (the micro-batch's ids)."""


class Handover:
    """One stage's boundary while it runs: the activation it received (None on the first stage), whether its first
    block took it, and its last block's output (what a stage without the head hands on)."""

    def __init__(self) -> None:
        self.active, self.received, self.taken, self.output = False, None, False, None

    def start(self, received: Any) -> None:
        self.active, self.received, self.taken, self.output = True, received, False, None

    def finish(self) -> tuple[bool, Any]:
        taken, output = self.taken, self.output
        self.active, self.received, self.taken, self.output = False, None, False, None
        return taken, output


class Absent(nn.Module):
    """A stem part a later stage does not own. With a :class:`Handover` (:class:`ForwardStage`): the activation the
    stage received, so shape arithmetic before the blocks runs as on one device (the value is not used: the first
    block takes the activation itself). Without (HF): adds nothing to an embedding sum, passes hidden states on."""

    def __init__(self, handover: Handover | None = None) -> None:
        super().__init__()
        self.handover = handover

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if self.handover is not None and self.handover.active and self.handover.received is not None:
            return self.handover.received
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x  # e.g. the token embedding or the embedding dropout: the first stage applied it
        return torch.zeros((), dtype=torch.get_default_dtype())  # e.g. wpe(position_ids): x + 0 is x exactly


class _Boundary:
    """A stage's first and/or last block as the model's forward sees it while the stage runs: the first takes the
    activation the stage received in place of its input; the last notes its output."""

    def __init__(self, block: nn.Module, handover: Handover, *, first: bool, last: bool) -> None:
        self.block, self.handover, self.first, self.last = block, handover, first, last

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        h = self.handover
        if self.first and h.received is not None and not h.taken:
            x, h.taken = h.received, True
        out = self.block(x, *args, **kwargs)
        if self.last:
            h.output = out
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.block, name)


def _pass_through(x: Any, *args: Any, **kwargs: Any) -> Any:
    return x


class StageBlocks(nn.ModuleList):
    """A :class:`ForwardStage`'s slice of the block list (the original keys). While the stage runs, the model's forward
    sees the whole list (iterated, indexed, ``len``): the blocks the stage does not own pass their input through, its
    first and last own blocks are seen through :class:`_Boundary`. Otherwise it is its slice."""

    handover: Handover | None = None
    every: tuple[str, ...] = ()
    """The keys of the whole block list."""

    def _running(self) -> bool:
        return self.handover is not None and self.handover.active

    def _seen(self, key: str) -> Any:
        own = list(self._modules)
        if key not in self._modules:
            return _pass_through
        block = self._modules[key]
        if key not in (own[0], own[-1]):
            return block
        return _Boundary(block, self.handover, first=key == own[0], last=key == own[-1])

    def __iter__(self) -> Any:
        if not self._running():
            return super().__iter__()
        return iter([self._seen(k) for k in self.every])

    def __len__(self) -> int:
        return len(self.every) if self._running() else super().__len__()

    def __getitem__(self, idx: Any) -> Any:
        if not self._running():
            return super().__getitem__(idx)
        if isinstance(idx, slice):
            return [self._seen(k) for k in self.every[idx]]
        return self._seen(self.every[idx])


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
    """Every stage runs the model's forward on the model's own input (keyword :data:`MODEL_INPUT`; the first stage's
    activation is that input): a later stage's first block takes the activation it received, a stage without the
    head hands on its last block's output. So the forward's own arithmetic on the input (``b, t = idx.size()``,
    ``arange(t)`` positions, masks, rotary tables) and between the parts (a learned position embedding added to the
    token embedding, an embedding scale, a logit soft-cap) runs as on one device."""

    _ld_last: bool = True
    _ld_handover: Handover | None = None

    def run_local(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        inputs = kwargs.pop(MODEL_INPUT, x)
        h = self._ld_handover
        h.start(None if self._ld_first else x)
        try:
            out = self._ld_model.forward(self, inputs, *args, **kwargs)
        finally:
            taken, last = h.finish()
        own = list(self.get_submodule(self._ld_block_list)._modules)
        if not self._ld_first and not taken:
            raise RuntimeError(
                f"{self._ld_model.__name__}.forward did not call the first block of this pipeline stage"
                f" ({self._ld_block_list}.{own[0]}), which takes the activation the previous stage handed on"
            )
        if self._ld_last:
            return out
        if last is None:
            raise RuntimeError(
                f"{self._ld_model.__name__}.forward did not call the last block of this pipeline stage"
                f" ({self._ld_block_list}.{own[-1]}), whose output the stage hands on"
            )
        return last

    @staticmethod
    def whole_output(net: nn.Module, sample: Any) -> torch.Tensor:
        return net(sample)

    @staticmethod
    def split_sample(sample: Any) -> tuple[Any, dict[str, Any]]:
        return sample, {MODEL_INPUT: sample}


def model_class(stage: nn.Module) -> type:
    """The model's own class of a pruned stage (the class itself for any other module)."""
    return stage._ld_model if isinstance(stage, PrunedStage) else type(stage)


def pruned_parts(
    net: nn.Module, block_list: str | None = None
) -> tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]] | None, str]:
    """``((owner, block_list, stem, head), "")`` for a model with one block list (`block_list`, else the one
    :func:`find_block_lists` finds) and a forward taking one input, as qualified names (``owner``: the module holding
    the list, ``""`` for the model itself); ``(None, why not)`` otherwise (pure, works on meta)."""
    lists = [block_list] if block_list is not None else [n for n, _ in find_block_lists(net)]
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
    if getattr(type(net), "forward", None) is nn.Module.forward:
        return None, f"{type(net).__name__} defines no forward"
    if len(required) > 1 or (params and not required):
        return None, (
            f"its forward takes {len(required)} required inputs ({', '.join(required) or 'none'}); every stage"
            " gets the model's one input beside the activation handed on"
        )
    direct = [n for n, _ in net.named_parameters(recurse=False)]
    if direct:
        return None, f"it holds parameters directly ({direct}), which every stage would hold"
    owner, _, list_name = name.rpartition(".")
    path = owner.split(".") if owner else []
    holder = net.get_submodule(owner)
    names = [n for n, m in holder._modules.items() if m is not None]
    i = names.index(list_name)
    q = (lambda n: f"{owner}.{n}") if owner else (lambda n: n)
    stem = tuple(q(n) for n in names[:i])
    head = tuple(q(n) for n in names[i + 1 :])
    for depth in range(len(path) - 1, -1, -1):  # every ancestor's other children: after the blocks (litgpt's lm_head)
        above = ".".join(path[:depth])
        module = net.get_submodule(above)
        head += tuple(
            f"{above}.{n}" if above else n for n, m in module._modules.items() if m is not None and n != path[depth]
        )
    return (owner, name, stem, head), ""


def _own_path(root: nn.Module, owner: str) -> nn.Module:
    """Give `root` its own shallow copies of the modules down to `owner` (their child dicts are then the copy's
    alone); returns the copy of `owner`."""
    module = root
    for part in owner.split(".") if owner else []:
        module._modules[part] = _shallow(module._modules[part])
        module = module._modules[part]
    return module


def _set(root: nn.Module, name: str, module: nn.Module) -> None:
    owner, _, child = name.rpartition(".")
    root.get_submodule(owner)._modules[child] = module


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
    owner, block_list, stem, head = parts
    cls = type(f"{type(net).__name__}Stage", (convention, type(net)), {"_ld_model": type(net)})
    lm = _shallow(net, cls)
    lm._ld_first, lm._ld_last = first, last
    lm._ld_block_list = block_list
    holder = _own_path(lm, owner)
    full = net.get_submodule(block_list)
    handover = Handover() if issubclass(convention, ForwardStage) else None
    kept = StageBlocks() if handover is not None else nn.ModuleList()
    kept._modules = {k: full._modules[k] for k in blocks}  # original indices: the single-device names
    kept.handover = lm._ld_handover = handover
    kept.every = tuple(full._modules)
    holder._modules[block_list.rpartition(".")[2]] = kept
    for name in stem if not first else ():
        _set(lm, name, Absent(handover))
    for name in head if not last else ():
        _set(lm, name, nn.Identity())
    if hasattr(lm, "_tied_weights_keys"):  # the pruned copy never re-ties (the tie lives in the parameters)
        lm.__dict__["_tied_weights_keys"] = None
    return lm


def join_pruned(parts: tuple, blocks_order: Sequence[str], pieces: Sequence[nn.Module]) -> nn.Module:
    """The whole model of the model's own class from plain copies of every stage (the parts put back into the
    first stage's copy, under their single-device names)."""
    owner, block_list, stem, head = parts
    first = next(p for p in pieces if not isinstance(p.get_submodule(stem[0]), Absent)) if stem else pieces[0]
    whole = _shallow(first, model_class(first))
    holder = _own_path(whole, owner)
    blocks = {k: m for p in pieces for k, m in p.get_submodule(block_list)._modules.items()}
    joined = nn.ModuleList()
    joined._modules = {k: blocks[k] for k in blocks_order}
    holder._modules[block_list.rpartition(".")[2]] = joined
    last = next(p for p in pieces if not isinstance(p.get_submodule(head[-1]), nn.Identity)) if head else pieces[-1]
    for name in head:
        _set(whole, name, last.get_submodule(name))
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
    "MODEL_INPUT",
    "Absent",
    "ForwardStage",
    "Handover",
    "PrunedStage",
    "build_pruned_stage",
    "check_pruned_stages",
    "join_pruned",
    "model_class",
    "model_class_copy",
    "pruned_parts",
    "profile_pruned",
    "StageBlocks",
]
