"""Plain pipeline stages: a :class:`StageModule` holds the stem, block and head children some stages run, under
their original names, and applies them in registration order. Notes: docs/internals.md."""

from __future__ import annotations

import functools
import inspect
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from lightning_dist.parallelize.cp_probe import evaluating
from lightning_dist.parallelize.self_check import gradient_problem


class PipelinedModule(nn.Module):
    """A module made of what some pipeline stages run: ``run_local`` is the stages' forward; once the strategy sets
    ``runner``, calling the module runs the whole pipeline schedule instead."""

    runner: Callable | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if self.runner is not None:
            return self.runner(*args, **kwargs)
        return self.run_local(*args, **kwargs)

    def run_local(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def stage_blocks(self) -> list[nn.Module]:
        """The blocks this module holds."""
        raise NotImplementedError

    def fsdp_units(self) -> list[nn.Module]:
        """FSDP2's ``"auto"`` units: the blocks it holds."""
        return self.stage_blocks()


class StageModule(PipelinedModule):
    """The parts of a network that some pipeline stages run, under their original names, in execution order: stem
    parts, the block list (an ``nn.ModuleDict`` keyed by the original indices, or the Sequential's own keys), head
    parts. `network`: the split network, named in the refusal of an attribute only it has."""

    def __init__(
        self,
        parts: Sequence[tuple[str, nn.Module]],
        block_list: str | None,
        blocks: Sequence[tuple[str, nn.Module]],
        network: nn.Module | tuple[str, frozenset[str]] = ("", frozenset()),
    ) -> None:
        super().__init__()
        self._block_list = block_list
        if isinstance(network, nn.Module):
            names = frozenset(n for n in dir(network) if not n.startswith("_")) - frozenset(dir(StageModule))
            network = (type(network).__name__, names)
        self._network = network  # (class name, attribute names): strings only, so a stage still pickles
        for name, module in parts:
            self.add_module(name, nn.ModuleDict(dict(blocks)) if name == block_list else module)
        if block_list is None:
            for key, module in blocks:
                self.add_module(key, module)

    def run_local(self, x, **kwargs):
        """Apply this module's parts in order (what a PipelineStage runs). Keyword inputs (context parallelism's
        ``position_ids``) go to each part whose forward names them, as the network's forward passes them."""
        # `_modules`, not `children()`: children() yields a module used twice (weight sharing) only once
        for child in self._modules.values():
            for part in child.values() if isinstance(child, nn.ModuleDict) else (child,):
                x = part(x, **_taken(part, kwargs)) if kwargs else part(x)
        return x

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            cls, names = self.__dict__.get("_network", ("", frozenset()))
            if name not in names:
                raise
        held = ", ".join(
            ", ".join(f"{n}.{k}" for k in c._modules) if isinstance(c, nn.ModuleDict) else n
            for n, c in self._modules.items()
        )
        raise AttributeError(
            f"{cls}.{name} is not available under PipelineStrategy: it replaced the {cls} with the parts this rank's"
            f" pipeline stages run ({held}), one micro-batch at a time, and `{name}` belongs to the whole model."
            " PipelineStrategy answers, inside training_step, a router load-balancing loss method marked with"
            " lightning_dist.parallelize.moe.router_loss (MoEGPT.aux_loss); any other value over every layer and the"
            " whole batch has no pipelined form: leave it out of the step under a pipeline, or train with a strategy"
            " that keeps the whole model on each rank (hsdp, fsdp2, tp)."
        )

    def stage_blocks(self) -> list[nn.Module]:
        """The blocks this stage holds: its block list's entries, or (a split ``nn.Sequential``) its children."""
        units = self.fsdp_units()
        return units if units or self._block_list is not None else list(self.children())

    def fsdp_units(self) -> list[nn.Module]:
        """FSDP2's ``"auto"`` units: its block list's entries (a split ``nn.Sequential``: none, the root unit)."""
        return [b for child in self._modules.values() if isinstance(child, nn.ModuleDict) for b in child.values()]


@functools.cache
def _class_keywords(cls: type) -> frozenset[str]:
    params = inspect.signature(cls.forward).parameters.values()
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def keyword_inputs(module: nn.Module) -> frozenset[str]:
    """The keyword inputs `module`'s forward names (its class's: FSDP2 and activation checkpointing keep it)."""
    return _class_keywords(type(module))


def _taken(module: nn.Module, kwargs: dict) -> dict:
    names = keyword_inputs(module)
    return {k: v for k, v in kwargs.items() if k in names}


def plain_call_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict, None]:
    """(first stage's input, inputs every stage takes, labels) of a call of a pipelined network: one tensor."""
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
        raise TypeError("A pipelined network takes exactly one tensor argument (the batch of inputs).")
    return args[0], {}, None


def plain_call_output(shown: torch.Tensor, loss: Any, labels: Any, aux: Any = None, coef: float = 0.0) -> torch.Tensor:
    """What the pipelined network's call returns: what the step sees of the output."""
    return shown


def is_pipelined_module(net: object) -> bool:
    """A stage module built by ``split.build_stage_module`` (of either kind)."""
    return isinstance(net, PipelinedModule)


def stage_blocks(stage: PipelinedModule) -> list[nn.Module]:
    """The blocks a stage module holds (its block list's entries; a split ``nn.Sequential``: its children)."""
    return stage.stage_blocks()


def build_plain_stage(net: nn.Module, layout: Any, block_ids: Sequence[int], *, first: bool, last: bool) -> StageModule:
    """A :class:`StageModule` with blocks `block_ids` of `layout` (a ``NetworkLayout``), the stem when `first` and
    the head when `last` (the same module objects): once the caller drops `net`, the rest is freed."""
    blocks = [(layout.blocks[i], layout.block(net, i)) for i in block_ids]
    names = [
        *(layout.stem if first else ()),
        *([layout.block_list] if layout.block_list else ()),
        *(layout.head if last else ()),
    ]
    return StageModule([(n, getattr(net, n)) for n in names], layout.block_list, blocks, network=net)


def join_plain(layout: Any, pieces: Sequence[nn.Module]) -> StageModule:
    """The whole network from plain copies of every stage: stem, blocks and head in the layout's order."""
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
    order = [*layout.stem, *([layout.block_list] if layout.block_list is not None else []), *layout.head]
    network = pieces[0].__dict__.get("_network", ("", frozenset()))
    return StageModule(
        [(n, parts.get(n)) for n in order], layout.block_list, [(k, blocks[k]) for k in layout.blocks], network
    )


def part_costs(layout: Any, times: Sequence[float]) -> tuple[float, list[float], float]:
    """(stem, each block, head) from one time per stem part, block and head part, in that order."""
    n_stem, n_head = len(layout.stem), len(layout.head)
    return sum(times[:n_stem]), list(times[n_stem : len(times) - n_head]), sum(times[len(times) - n_head :])


def profile_plain(
    net: nn.Module, layout: Any, sample: torch.Tensor, *, repeats: int = 5
) -> tuple[float, list[float], float]:
    """Forward+backward milliseconds of (stem, each block, head), each part run on the previous one's output."""
    parts = (
        [net.get_submodule(n) for n in layout.stem]
        + [layout.block(net, i) for i in range(len(layout.blocks))]
        + [net.get_submodule(n) for n in layout.head]
    )
    times: list[float] = []
    x = sample
    for part in parts:
        runs = []
        for i in range(repeats + 1):  # the first run (allocations, lazy kernels set-up) is not timed
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            part(inp).float().sum().backward()
            if i:
                runs.append((time.perf_counter() - start) * 1e3)
        times.append(min(runs))  # interference from other processes only ever adds time
        with torch.no_grad():
            x = part(x)
    net.zero_grad(set_to_none=True)
    return part_costs(layout, times)


def plain_forward_problem(net: nn.Module, layout: Any, sample: torch.Tensor) -> str | None:
    """Why the children of `net` applied in registration order (what :class:`StageModule` runs) would not compute
    ``net(sample)``, or None when they do, gradients included."""
    staged = build_plain_stage(net, layout, range(len(layout.blocks)), first=True, last=True)
    registered = [*layout.stem, layout.block_list or "children", *layout.head]
    with evaluating(net), torch.no_grad():  # eval: dropout & co. would draw different masks in the two runs
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
    if (
        crash is None
        and isinstance(expected, torch.Tensor)
        and expected.shape == got.shape
        and torch.allclose(expected, got, rtol=1e-5, atol=1e-6)
    ):
        with evaluating(net):  # the same output can come with other gradients
            return gradient_problem(dict(net.named_parameters()), lambda: net(sample), lambda: staged.run_local(sample))
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


def chain_problem(net: nn.Module, layout: Any) -> str | None:
    """Why `net`'s forward is not provably its stem, block and head children in registration order, each on the
    previous one's output (None: it is), from a ``torch.fx`` trace with them as leaves (works on meta)."""
    names = [*layout.stem, *(layout.block_name(i) for i in range(len(layout.blocks))), *layout.head]
    leaves = {id(net.get_submodule(n)) for n in names}

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return id(m) in leaves or super().is_leaf_module(m, qualname)

    try:
        params = inspect.signature(net.forward).parameters.values()
        concrete = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        graph = Tracer().trace(net, concrete_args=concrete or None)
    except Exception as err:  # data-dependent control flow, a proxy unpacked (`b, t = idx.size()`), ...
        return f"its forward cannot be traced with the parts as leaves ({type(err).__name__})"
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    work = [
        n
        for n in graph.nodes
        if n.op not in ("placeholder", "output") and getattr(n.target, "__name__", "") != "_assert_is_none"
    ]
    called = [str(n.target) for n in work if n.op == "call_module"]
    if called != names:
        return f"its forward calls {' -> '.join(called) or 'none of them'}, not {' -> '.join(names)}"
    previous = inputs[0] if inputs else None
    for node in work:
        if node.op != "call_module" or node.args != (previous,) or node.kwargs:
            return f"{node.target} is not applied to the previous part's output alone"
        previous = node
    output = next(n for n in graph.nodes if n.op == "output")
    return None if output.args == (previous,) else "it returns something else than the last part's output"


def _record_call_order(net: nn.Module, layout: Any) -> tuple[list[str], list]:
    """(the stem, block-list and head children in the order `net`'s forward first calls them, filled as it runs;
    the hooks to remove). Nothing for an nn.Sequential, which runs its children in order by definition."""
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


def _work_outside_children(net: nn.Module) -> list[str]:
    """Operations `net.forward` applies itself, outside its child modules (from torch.fx; [] when not traceable)."""
    try:
        graph = torch.fx.symbolic_trace(net).graph
    except Exception:  # data-dependent control flow etc.: the numeric comparison still decides
        return []
    ops = Counter(
        str(getattr(n.target, "__name__", n.target)) for n in graph.nodes if n.op in ("call_function", "call_method")
    )
    return [f"{count} x {op}" if count > 1 else op for op, count in ops.items()]


__all__ = [
    "StageModule",
    "build_plain_stage",
    "chain_problem",
    "is_pipelined_module",
    "keyword_inputs",
    "join_plain",
    "part_costs",
    "PipelinedModule",
    "plain_call_inputs",
    "plain_call_output",
    "plain_forward_problem",
    "profile_plain",
    "stage_blocks",
]
