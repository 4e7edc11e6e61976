"""Expert parallelism: each rank of an ``ep`` group holds ``E / ep`` experts and the tokens travel to them.

Notes: docs/internals.md, "lightning_dist/parallelize/ep.py"."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import types
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ContextManager, Protocol

import torch
from torch import Tensor, nn

from lightning_dist.parallelize.moe import all_rows, all_to_all, own_rows
from lightning_dist.rules import ep_spans_tp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

GLOBAL_EXPERTS_KEY = "_ep_global_experts"
"""``module.__dict__`` key: the number of experts of the whole model (``num_experts`` is the local count under ep)."""


def expert_count(module: nn.Module) -> int | None:
    """The number of experts of an experts module (the leading size shared by all its own parameters), or None when
    `module` is not one: its own parameters do not all have the expert first (one leading size; 3-D weights, at least
    one, and 2-D per-expert biases ``[E, out]``, as gpt-oss's experts hold), or its forward does not take
    ``(hidden, top_k_index, top_k_weights)``. One "expert" is no mixture (XLNet's base model holds a ``[1, 1, d]``
    mask embedding)."""
    import inspect

    params = list(module.parameters(recurse=False))
    if not params or any(p.dim() not in (2, 3) for p in params) or len({p.shape[0] for p in params}) != 1:
        return None
    if params[0].shape[0] < 2:
        return None
    if not any(p.dim() == 3 for p in params):  # [E, C] alone: an embedding or a router's weight, not experts
        return None
    try:
        names = [p.name for p in inspect.signature(module.forward).parameters.values()]
    except (TypeError, ValueError):
        return None
    if len(names) < 3:
        return None
    return int(params[0].shape[0])


def expert_params(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(owner, name) of every parameter of an experts module held per expert: its own, and its descendants' whose
    leading size is the expert count (Ergo's per-expert norm scales ``[E, d]``, indexed by the expert id)."""
    n = expert_count(module)
    own = [(module, name) for name, p in module._parameters.items() if p is not None]
    return own + [
        (m, name)
        for child in module.children()
        for m in child.modules()
        for name, p in m._parameters.items()
        if p is not None and p.dim() >= 1 and p.shape[0] == n
    ]


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every experts module of `model` (see :func:`expert_count`), outermost first."""
    return [(n, m) for n, m in model.named_modules() if expert_count(m) is not None]


def ep_problems(model: nn.Module, *, ep: int, dp_shard: int, cp: int = 1, tp: int = 1) -> list[str]:
    """Why `model` cannot run with `ep` (one process, no collective): the same answer on every rank."""
    if ep == 1:
        return []
    problems = []
    spans_tp = ep_spans_tp(ep, tp)
    if (dp_shard * cp) % (ep // tp if spans_tp else ep):
        n = dp_shard * cp
        ranks = f"dp_shard={dp_shard}" if cp == 1 else f"dp_shard x cp = {dp_shard} x {cp} = {n}"
        problems.append(
            f"ep={ep} with tp={tp} and {ranks}: an ep group either takes every tp rank (ep a multiple of tp, and ep /"
            f" tp dividing {n}) or lies inside the {n} sharding ranks at each tp coordinate (ep dividing {n})."
            " Choose such an ep."
            if tp > 1
            else f"ep={ep} must divide {ranks}: the expert-parallel groups are formed inside the sharding ranks"
            " (each group holds every expert once). Choose an ep that divides it."
        )
    experts = find_experts(model)
    if not experts:
        problems.append(
            f"ep={ep} but {type(model).__name__} has no experts module (3-D parameters with the expert first,"
            " per-expert biases [E, out] allowed, and a forward (hidden, top_k_index, top_k_weights), as"
            " transformers' mixtures of experts and the pack's MoEGPT have); drop ep, or write the experts that way."
        )
    for name, module in experts:
        n = expert_count(module)
        if n % ep:
            problems.append(f"{name} holds {n} experts, not divisible by ep={ep}; choose an ep that divides {n}.")
    return problems


class RoutingStandIn(Protocol):
    """The routing assumed where the router's choices hold no values (the dry run's fake tensors,
    :mod:`lightning_dist.dryrun`): the dispatch sizes its exchanges from it instead of from the choices."""

    def rows_per_expert(self, rows: int, experts: int) -> list[int]:
        """How many of one rank's `rows` (token, choice) pairs each of the `experts` receives (alike on every rank)."""
        ...

    def concrete(self) -> ContextManager[None]:
        """A block where index tensors made from those counts hold values (the experts' own forward reads them)."""
        ...


_STAND_IN: contextvars.ContextVar[RoutingStandIn | None] = contextvars.ContextVar(
    "lightning_dist_ep_routing", default=None
)


@contextlib.contextmanager
def assume_routing(stand_in: RoutingStandIn, model: nn.Module | None = None) -> Iterator[None]:
    """Inside the block, every ep dispatch routes as `stand_in` says (the choices' values are not read), and so do
    the experts modules of `model` that run their own forward (no ep): they receive the stand-in's choices in place
    of the router's and run inside its ``concrete()`` block."""
    token = _STAND_IN.set(stand_in)
    own = [m for _, m in find_experts(model)] if model is not None else []
    handles = [h for m in own if GLOBAL_EXPERTS_KEY not in m.__dict__ for h in _stand_in_choices(m, stand_in)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        _STAND_IN.reset(token)


@contextlib.contextmanager
def dropless(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Inside the block the ep dispatch of these experts modules sends every (token, choice) pair, whatever their
    capacity factor (the self-check holds them to whole copies, which drop nothing). A flag on each module, not a
    context variable: a checkpointed block's recompute may run on autograd's device threads."""
    states = [m.__dict__[GLOBAL_EXPERTS_KEY] for m in modules if GLOBAL_EXPERTS_KEY in m.__dict__]
    for state in states:
        state["dropless"] = True
    try:
        yield
    finally:
        for state in states:
            state["dropless"] = False


def expert_capacity(factor: float, pairs: int, experts: int) -> int:
    """The most (token, choice) pairs one expert takes from one rank: ``ceil(factor * pairs / experts)``, as GShard."""
    return math.ceil(factor * pairs / experts)


def capacity_keep(sorted_experts: Tensor, counts: Tensor, capacity: int) -> Tensor:
    """Which pairs (sorted by expert, stably: token order within an expert) fit: each expert keeps its first
    `capacity`."""
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(sorted_experts.numel(), device=sorted_experts.device) - starts[sorted_experts]
    return position < capacity


def stand_in_choices(stand_in: RoutingStandIn, n_tokens: int, k: int, experts: int) -> Tensor:
    """``[n_tokens, k]`` expert ids with the stand-in's rows per expert: the rows in expert order, dealt to the
    tokens one choice at a time (a token's choices are distinct while no expert gets more than `n_tokens` rows)."""
    counts = torch.tensor(stand_in.rows_per_expert(n_tokens * k, experts))
    return torch.repeat_interleave(torch.arange(experts), counts).view(k, n_tokens).t()


def _stand_in_choices(module: nn.Module, stand_in: RoutingStandIn) -> list[Any]:
    """Forward hooks giving `module` (an experts module running its own forward) the stand-in's choices."""
    import inspect

    index_name = list(inspect.signature(module.forward).parameters)[1]
    blocks: list[ContextManager[None]] = []

    def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        index = args[1] if len(args) > 1 else kwargs[index_name]
        with stand_in.concrete():
            choices = stand_in_choices(stand_in, index.shape[0], index.shape[1], expert_count(mod)).to(index.dtype)
        block = stand_in.concrete()
        block.__enter__()  # left by `after`, which runs even when the forward raises
        blocks.append(block)
        if len(args) > 1:
            return (args[0], choices, *args[2:]), kwargs
        return args, {**kwargs, index_name: choices}

    def after(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        blocks.pop().__exit__(None, None, None)

    return [
        module.register_forward_pre_hook(before, with_kwargs=True),
        module.register_forward_hook(after, with_kwargs=True, always_call=True),
    ]


def _dispatch_forward(self: nn.Module, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The forward of an experts module under expert parallelism (bound to the module: see :func:`apply_ep`)."""
    state = self.__dict__[GLOBAL_EXPERTS_KEY]
    group, ranks, n_global, tp_group = state["group"], state["ranks"], state["experts"], state["tp_group"]
    n_all = hidden.shape[0]
    if tp_group is not None:  # the ep group spans the tp ranks, which hold the same tokens: each sends its share
        hidden, top_k_index, top_k_weights = (own_rows(t, tp_group) for t in (hidden, top_k_index, top_k_weights))
    n_local = n_global // ranks
    n_tokens, k = top_k_index.shape
    # the (token, choice) pairs in expert order (stable: a token's choices keep their order within an expert)
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)
    tokens = torch.arange(n_tokens, device=hidden.device).repeat_interleave(k)[order]
    stand_in = _STAND_IN.get()
    values = contextlib.nullcontext if stand_in is None else stand_in.concrete  # where routing tensors hold values
    if stand_in is None:
        counts = torch.bincount(experts, minlength=n_global)
        factor = state["capacity_factor"]
        if factor is not None and not state["dropless"]:  # token dropping, asked for explicitly (changes the result)
            capacity = expert_capacity(factor, experts.numel(), n_global)
            keep = capacity_keep(experts[order], counts, capacity)
            order, tokens = order[keep], tokens[keep]
            state["dropped"], state["capacity"] = experts.numel() - order.numel(), capacity
            counts = counts.clamp(max=capacity)
    else:
        assumed = stand_in.rows_per_expert(experts.numel(), n_global)
        counts = torch.tensor(assumed, device=hidden.device)
    # how many rows each rank sends to each other rank: counts first, in one exchange
    received = torch.empty_like(counts)
    torch.distributed.all_to_all_single(received, counts, group=group)
    with values():
        if stand_in is None:
            send = counts.view(ranks, n_local).sum(1).tolist()
            per_source = received.view(ranks, n_local)
        else:  # every rank routes alike: each sends this rank's experts the counts it assumes for them
            me = torch.distributed.get_rank(group)
            send = [sum(assumed[r * n_local : (r + 1) * n_local]) for r in range(ranks)]
            per_source = torch.tensor(assumed[me * n_local : (me + 1) * n_local] * ranks).view(ranks, n_local)
        recv = per_source.sum(1).tolist()
        # each arrived row goes to its local expert with weight 1: the module's own per-expert code runs unchanged
        local_ids = torch.repeat_interleave(
            torch.arange(n_local, device=hidden.device).repeat(ranks), per_source.reshape(-1)
        ).unsqueeze(1)
        ones = torch.ones(local_ids.shape, dtype=top_k_weights.dtype, device=hidden.device)
    state["arrived"] = sum(recv)  # rows this rank's experts ran in the last forward (0: none of them was chosen)
    state["sent"] = sum(send)  # rows this rank dispatched (its share of the tp group's tokens when ep spans tp)
    x = hidden[tokens]
    arrived = all_to_all(x, recv, send, group)
    with _LocalParams(self), values():
        out = state["forward"](arrived, local_ids, ones)
        if not len(arrived):
            # none of this rank's experts was chosen: keep the exchanges and the experts in the backward all the
            # same (the peers' backward all-to-alls wait for this rank; FSDP2 reduces every rank's expert gradients)
            touched = [p for o, n in state["params"] if (p := o._parameters[n]) is not None and p.requires_grad]
            out = out + 0 * arrived.sum() + sum(0 * p.sum() for p in touched)
    back = all_to_all(out, send, recv, group)
    weights = top_k_weights.reshape(-1)[order].unsqueeze(1)
    combined = torch.zeros_like(hidden).index_add(0, tokens, (back * weights).to(hidden.dtype))
    return combined if tp_group is None else all_rows(combined, n_all, tp_group)


class _LocalParams:
    """The module's DTensor parameters as their local parts (its forward indexes them by local expert), and
    ``num_experts`` the local count, for the length of the block."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        m = self.module
        state = m.__dict__[GLOBAL_EXPERTS_KEY]
        self.saved = [(owner, name, owner._parameters[name]) for owner, name in state["params"]]
        for owner, name, p in self.saved:
            if p is not None and hasattr(p, "to_local"):
                local = p.to_local()
                if local.requires_grad:
                    # these experts ran on the tokens of every ep peer: their gradient sums the losses of the `scale`
                    # data-parallel ranks among them (ep / tp when the group spans tp, whose ranks share their
                    # tokens), where a dense parameter's holds this rank's only (data parallelism then averages both)
                    local.register_hook(lambda g, n=state["scale"]: g / n)
                owner._parameters[name] = local
        self.had = "num_experts" in m.__dict__
        self.count = m.__dict__.get("num_experts")
        if self.had:
            m.__dict__["num_experts"] = state["experts"] // state["ranks"]

    def __exit__(self, *exc: Any) -> None:
        for owner, name, p in self.saved:
            owner._parameters[name] = p
        if self.had:
            self.module.__dict__["num_experts"] = self.count


def apply_ep(
    model: nn.Module, ep_mesh: "DeviceMesh", tp_group: Any = None, capacity_factor: float | None = None
) -> list[str]:
    """Split every experts module of `model` over the 1-D `ep_mesh` (each rank its ``E / ep`` experts, contiguous) and
    route tokens to them (module docstring). `tp_group`: the tp ranks inside each ep group (``rules.ep_spans_tp``),
    which hold the same tokens and each dispatch a share. `capacity_factor`: None sends every pair (dropless); a
    number drops the pairs past each expert's :func:`expert_capacity` of a rank's tokens. Before FSDP (which then
    shards the local experts); returns their names."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ranks = ep_mesh.size()
    names = []
    for name, module in find_experts(model):
        n, params = expert_count(module), expert_params(module)
        for owner, pname in params:
            # every rank holds the whole value (broadcast from rank 0 at set-up): each keeps its own experts
            p = owner._parameters[pname]
            shard = distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            owner.register_parameter(pname, nn.Parameter(shard, requires_grad=p.requires_grad))
        module.__dict__[GLOBAL_EXPERTS_KEY] = {
            "group": ep_mesh.get_group(),
            "ranks": ranks,
            "scale": ranks // (1 if tp_group is None else torch.distributed.get_world_size(tp_group)),
            "tp_group": tp_group,
            "experts": n,
            "params": params,  # (owner, name) of the per-expert parameters
            "capacity_factor": capacity_factor,
            "dropped": 0,  # pairs the last forward dropped (capacity_factor only)
            "dropless": False,  # set by `dropless`
            "forward": module.forward,
        }
        module.forward = types.MethodType(_dispatch_forward, module)
        names.append(name)
    log.info("expert parallelism: %d experts module(s) split over ep=%d", len(names), ranks)
    if capacity_factor is not None and names and torch.distributed.get_rank() == 0:
        log.warning(
            "ep_capacity_factor=%s: each expert takes at most ceil(%s x a rank's routed pairs / experts) of them and"
            " the rest are dropped, so training differs from one device's (None drops nothing)",
            capacity_factor,
            capacity_factor,
        )
    return names


__all__ = [
    "GLOBAL_EXPERTS_KEY",
    "RoutingStandIn",
    "apply_ep",
    "assume_routing",
    "capacity_keep",
    "dropless",
    "ep_problems",
    "expert_capacity",
    "expert_count",
    "expert_params",
    "find_experts",
    "stand_in_choices",
]
