"""Pipeline stages cut out of an unmodified model: a stage is the model with the parts it does not own taken out,
so the model's own ``forward`` runs each stage, as torchtitan builds its stages. Notes: docs/internals.md."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from lightning_dist.parallelize.cp_probe import evaluating
from lightning_dist.parallelize.pipeline.stages import PipelinedModule, plain_call_inputs
from lightning_dist.parallelize.self_check import gradient_problem
from lightning_dist.parallelize.units import find_block_lists

MODEL_INPUT = "model_input"
"""The keyword under which every :class:`ForwardStage` gets the model's own input (the micro-batch's ids)."""


class Handover:
    """One stage's boundary while it runs: the activation it received (None on the first stage), whether its first
    block took it, and its last block's output (what a stage without the head hands on). The forward's own code gets
    zeros in the activation's place (`stand_in`, `zeros`), which it may change in place (CTRL scales its input
    embeddings with ``*=``): only the first block takes the activation."""

    def __init__(self) -> None:
        self.active, self.received, self.taken, self.output, self._stand_in = False, None, False, None, None

    def start(self, received: Any) -> None:
        self.active, self.received, self.taken, self.output = True, received, False, None

    def finish(self) -> tuple[bool, Any]:
        taken, output = self.taken, self.output
        self.active, self.received, self.taken, self.output, self._stand_in = False, None, False, None, None
        return taken, output

    @property
    def stand_in(self) -> Any:
        """Zeros shaped like the received activation (made once per run)."""
        if self._stand_in is None and isinstance(self.received, torch.Tensor):
            self._stand_in = torch.zeros_like(self.received)
        return self._stand_in

    def zeros(self, shape: Sequence[int]) -> torch.Tensor:
        """Zeros of `shape`, in the received activation's dtype and device (what an embedding would have given)."""
        return self.received.new_zeros(tuple(shape))


class Absent(nn.Module):
    """A part another stage owns. A stem part (`head` False) returns zeros of the shape the part would give (an
    embedding, a linear projection; else the received activation's), so shape arithmetic before the blocks runs as on
    one device; a head part passes its input on (the stage hands on its last block's output). The forward may read
    the part's plain attributes and its parameters' shapes and dtypes (meta tensors: Zaya casts to
    ``self.norm.weight.dtype``). Called outside the stage's run (a method of the model), it refuses."""

    def __init__(self, handover: Handover, name: str, part: nn.Module, head: bool = False) -> None:
        super().__init__()
        self.handover, self.name, self.head = handover, name, head
        self.width = part.embedding_dim if isinstance(part, nn.Embedding) else getattr(part, "out_features", None)
        self.keeps_dims = isinstance(part, nn.Embedding)  # ids [..., n] -> [..., n, width]; a Linear: [..., width]
        params = {
            n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in part.named_parameters(recurse=False)
        }
        self.shadows = {**_plain_attrs(part), **params}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            shadows = self.__dict__.get("shadows", {})
            if name not in shadows:
                raise
            if not self.handover.active:  # AttributeError, as before the split: hasattr() stays False
                raise AttributeError(self._elsewhere(f"`{self.name}.{name}`")) from None
            return shadows[name]

    def _elsewhere(self, what: str) -> str:
        return (
            f"{what}: `{self.name}` is on the {'last' if self.head else 'first'} pipeline stage, not on this one:"
            " PipelineStrategy replaced the network with the parts this rank's stages run, and only the stage's"
            " own forward may use the parts another stage owns. Compute a value over the whole model inside its"
            " forward, or train with a strategy that keeps the whole model on each rank (hsdp, fsdp2, tp)."
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else next((v for v in kwargs.values() if v is not None), None)  # ModernBERT: keywords
        h = self.handover
        if not h.active:
            raise RuntimeError(self._elsewhere(f"`{self.name}(...)`"))
        if self.head:
            return x
        if self.width is not None and isinstance(x, torch.Tensor):
            return h.zeros((*(x.shape if self.keeps_dims else x.shape[:-1]), self.width))
        return h.stand_in


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


class _Skipped:
    """A block another stage owns, as the forward sees it. What it returns is not used: before the stage's first
    block, the stand-in of the activation the stage received; after its last block, that block's output (a tuple
    where blocks return one, so `block(...)[0]` keeps its shape); else its input. Its plain attributes
    (``attention_type``, a layer index) answer as the block's would (the forward may pick a mask by them)."""

    def __init__(self, attrs: dict[str, Any], handover: Handover) -> None:
        self.__dict__.update(attrs)
        self._handover = handover

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        h = self._handover
        if h.output is not None:
            return h.output
        return h.stand_in if h.received is not None and not h.taken else x


def _plain_attrs(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, (str, int, float, bool))}


class StageBlocks(nn.ModuleList):
    """A :class:`ForwardStage`'s slice of the block list (original keys). While the stage runs, the forward sees the
    whole list (`every` key): blocks it does not own pass their input through, its first and last are
    :class:`_Boundary`. Outside a run it is the stage's own blocks, indexed by position."""

    handover: Handover | None = None
    every: tuple[str, ...] = ()
    skipped: dict[str, _Skipped] = {}  # the blocks other stages own, as the forward sees them

    def _running(self) -> bool:
        return self.handover is not None and self.handover.active

    def _seen(self, key: str) -> Any:
        own = list(self._modules)
        if key not in self._modules:
            return self.skipped[key]
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
        if not self._running():  # this stage's own blocks, by position (their keys are the single-device indices)
            return list(self._modules.values())[idx]
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


class PrunedStage(PipelinedModule):
    """A stage made of the model itself (a class made per model: ``(the convention, the model's class)``). While it
    runs the model's forward, a later stage's first block takes the activation it received and a stage without the
    head hands on its last block's output, so the forward's own arithmetic around the blocks (positions, masks, an
    embedding sum or scale, a final norm or logit scale) runs where it runs on one device."""

    _ld_model: type = nn.Module
    """The model's own class (the stage class is made at run time)."""
    _ld_first: bool = True
    _ld_last: bool = True
    _ld_block_list: str | None = None
    _ld_handover: Handover | None = None

    def stage_blocks(self) -> list[nn.Module]:
        """The blocks this stage holds: its slice of the model's block list."""
        return list(self.get_submodule(self._ld_block_list).children())

    def _run_forward(self, received: Any, forward: Callable[[], Any]) -> Any:
        """`forward()` (the model's forward, run as this stage) and what the stage hands on: its output on the last
        stage, else its last block's output."""
        h = self._ld_handover
        h.start(None if self._ld_first else received)
        try:
            out = forward()
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
        return last[0] if isinstance(last, (tuple, list)) else last  # a block returning (hidden states, ...)

    @staticmethod
    def whole_output(net: nn.Module, sample: Any) -> torch.Tensor:
        """The unsplit model's output on a sample micro-batch (what the stages must give)."""
        raise NotImplementedError

    @staticmethod
    def split_sample(sample: Any) -> tuple[Any, dict[str, Any]]:
        """(the first stage's input, the keyword inputs every stage takes) of a sample micro-batch."""
        raise NotImplementedError


class ForwardStage(PrunedStage):
    """Every stage runs the model's forward on the model's own input (keyword :data:`MODEL_INPUT`)."""

    def run_local(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        inputs = kwargs.pop(MODEL_INPUT, x)
        return self._run_forward(x, lambda: self._ld_model.forward(self, inputs, *args, **kwargs))

    @staticmethod
    def whole_output(net: nn.Module, sample: Any) -> torch.Tensor:
        return net(sample)

    @staticmethod
    def split_sample(sample: Any) -> tuple[Any, dict[str, Any]]:
        return sample, {MODEL_INPUT: sample}


def model_input_call(args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict, None]:
    """:func:`~.stages.plain_call_inputs` for pruned stages, each of which runs the model's forward on its input."""
    x, _, _ = plain_call_inputs(args, kwargs)
    return x, {MODEL_INPUT: x}, None


def model_class(stage: nn.Module) -> type:
    """The model's own class of a pruned stage (the class itself for any other module)."""
    return stage._ld_model if isinstance(stage, PrunedStage) else type(stage)


def pruned_parts(
    net: nn.Module, block_list: str | None = None
) -> tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]] | None, str]:
    """``((owner, block_list, stem, head), "")`` as qualified names for a model with one block list and a forward
    taking one input (``owner`` holds the list; ``""``: the model); ``(None, why not)`` otherwise (pure)."""
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
    """Give `root` its own shallow copies of the modules down to `owner`; returns the copy of `owner`."""
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
    handover = Handover()
    kept = StageBlocks()
    kept._modules = {k: full._modules[k] for k in blocks}  # original indices: the single-device names
    kept.handover = lm._ld_handover = handover
    kept.every = tuple(full._modules)
    kept.skipped = {k: _Skipped(_plain_attrs(m), handover) for k, m in full._modules.items() if k not in kept._modules}
    holder._modules[block_list.rpartition(".")[2]] = kept
    for name in stem if not first else ():
        _set(lm, name, Absent(handover, name, net.get_submodule(name)))
    for name in head if not last else ():
        _set(lm, name, Absent(handover, name, net.get_submodule(name), head=True))
    if hasattr(lm, "_tied_weights_keys"):  # the pruned copy never re-ties (the tie lives in the parameters)
        lm.__dict__["_tied_weights_keys"] = None
    return lm


def join_pruned(parts: tuple, blocks_order: Sequence[str], pieces: Sequence[nn.Module]) -> nn.Module:
    """The whole model, of its own class, from plain copies of every stage (the parts put back into the first's)."""
    owner, block_list, stem, head = parts
    first = next(p for p in pieces if not isinstance(p.get_submodule(stem[0]), Absent)) if stem else pieces[0]
    whole = _shallow(first, model_class(first))
    holder = _own_path(whole, owner)
    blocks = {k: m for p in pieces for k, m in p.get_submodule(block_list)._modules.items()}
    joined = nn.ModuleList()
    joined._modules = {k: blocks[k] for k in blocks_order}
    holder._modules[block_list.rpartition(".")[2]] = joined
    last = next(p for p in pieces if not isinstance(p.get_submodule(head[-1]), Absent)) if head else pieces[-1]
    for name in head:
        _set(whole, name, last.get_submodule(name))
    return whole


def model_class_copy(module: nn.Module) -> nn.Module:
    """`module` with every pruned stage in it (itself included) back in the model's own class (shared parts): a
    stage's class is made at run time, so a stage cannot be pickled as it is."""

    def plain(m: nn.Module) -> nn.Module:
        return _shallow(m, model_class(m)) if isinstance(m, PrunedStage) else m

    module = plain(module)
    for m in [module, *module.modules()]:
        for name, child in list(m._modules.items()):
            if isinstance(child, PrunedStage):
                m._modules[name] = plain(child)
    return module


def check_pruned_stages(net: nn.Module, stages: Sequence[nn.Module], sample: Any) -> str | None:
    """Why running `stages` one after the other does not give the model's output on `sample`, or its gradients (None
    when it does; eval mode)."""
    if not stages or not isinstance(stages[0], PrunedStage):
        return "the stages are not pruned copies of the model"
    convention = type(stages[0])

    def staged() -> Any:
        x, kw = convention.split_sample(sample)
        for stage in stages:
            x = stage.run_local(x, **kw)
        return x

    with evaluating(net, *stages):
        try:
            with torch.no_grad():
                expected, x = convention.whole_output(net, sample), staged()
        except Exception as err:  # a forward that cannot run without the parts a stage does not own
            return f"its forward fails on a stage without the parts it does not own ({type(err).__name__}: {err})"
        if not isinstance(expected, torch.Tensor) or not isinstance(x, torch.Tensor):
            return f"its forward returns {type(expected).__name__}, not one tensor a stage can hand on"
        if x.shape != expected.shape:
            return f"the stages return {tuple(x.shape)}, the model {tuple(expected.shape)}"
        if not torch.allclose(x, expected, rtol=1e-5, atol=1e-6):
            gap = (x - expected).abs().max().item()
            return f"the stages compute another function (max abs difference {gap:.3g} on one micro-batch)"
        return gradient_problem(dict(net.named_parameters()), lambda: convention.whole_output(net, sample), staged)


def call_order(net: nn.Module, names: Sequence[str], run: Callable[[], Any]) -> list[str]:
    """`names` (parts of `net`; a block list stands for its blocks) in the order ``run()`` first calls them (eval,
    no autograd)."""
    order: list[str] = []
    hooks = []
    for name in names:
        part = net.get_submodule(name)
        for m in part.children() if isinstance(part, nn.ModuleList) else [part]:  # a ModuleList is never called
            hooks.append(
                m.register_forward_pre_hook(lambda m, a, name=name: None if name in order else order.append(name))
            )
    try:
        with evaluating(net), torch.no_grad():
            run()
    except Exception:  # the order up to the failure is what the forward ran
        pass
    finally:
        for h in hooks:
            h.remove()
    return order


__all__ = [
    "MODEL_INPUT",
    "Absent",
    "ForwardStage",
    "PrunedStage",
    "build_pruned_stage",
    "call_order",
    "check_pruned_stages",
    "join_pruned",
    "model_class",
    "model_class_copy",
    "model_input_call",
    "pruned_parts",
]
