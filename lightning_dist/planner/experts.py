"""Expert parallelism's model states per rank and all-to-all bytes per step (formulas: docs/planner.md, "Mixtures of
experts")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from lightning_dist.mesh import DP_REPLICATE, DP_SHARD, EP, EP_OUTER, TP
from lightning_dist.planner._checks import check_count, check_divides, check_size, divisors
from lightning_dist.planner.memory import MemoryBreakdown, StateBytes, model_state_bytes, tp_local_params
from lightning_dist.planner.shards import fsdp2_state_bytes
from lightning_dist.planner.traffic import Collective, data_parallel_traffic
from lightning_dist.rules import ep_spans_tp

COUNT_BYTES = 8
"""Bytes of one per-expert token count exchanged before the tokens (int64, as ``torch.bincount`` gives them)."""

UNIFORM_ROUTING = (
    "uniform routing: each expert receives the same share of the (token, choice) rows, so each rank keeps 1/ep of"
    " its tokens x top_k rows of width hidden and sends (ep-1)/ep of them, and receives as many"
)


@dataclass(frozen=True, kw_only=True)
class MoEShape:
    """What expert parallelism's plan needs to know of a mixture of experts."""

    experts: int
    """Routed experts of each MoE layer ``E``."""
    top_k: int
    """Experts each token is sent to ``k``."""
    hidden: int
    """Width of the rows exchanged (the model's hidden size) ``C``."""
    layers: int
    """MoE layers ``L`` (each with its own experts module)."""
    expert_params: int
    """Routed-expert parameters of all layers together ``P_e`` (shared experts, routers: dense)."""
    expert_shapes: tuple[tuple[int, ...], ...] = ()
    """Each routed-expert parameter's shape, the expert first (exact FSDP2 shards); empty: the closed form only."""

    def __post_init__(self) -> None:
        for name in ("experts", "top_k", "hidden", "layers"):
            check_size(name, getattr(self, name))
        check_count("expert_params", self.expert_params)
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} must be at most experts={self.experts}.")
        bad = [s for s in self.expert_shapes if not s or s[0] != self.experts]
        if bad:
            raise ValueError(f"expert_shapes {bad} must each start with the number of experts {self.experts}.")


def ep_degrees(experts: int, dp_shard: int, tp: int = 1) -> list[int]:
    """The ep degrees a ``dp_shard`` (x ``tp``) can run: ``ep > 1`` dividing the experts and, for ``ep`` a multiple of
    ``tp > 1`` (the ep groups take every tp rank: :func:`lightning_dist.rules.ep_spans_tp`), ``ep / tp`` dividing
    ``dp_shard``, else ``ep`` dividing ``dp_shard`` (the groups inside ``dp_shard`` at each tp coordinate)."""
    check_size("experts", experts)
    check_size("dp_shard", dp_shard)
    check_size("tp", tp)
    return [d for d in divisors(experts) if d > 1 and dp_shard % (d // tp if ep_spans_tp(d, tp) else d) == 0]


def ep_fsdp_size(shard_size: int, ep: int, tp: int = 1) -> int:
    """Ranks of the experts' FSDP2 mesh (``dp_shard_mod_ep``): ``S t / ep`` when the ep groups span tp, else
    ``S / ep`` (``S``: ``dp_shard`` x ``cp``)."""
    check_size("tp", tp)
    if ep_spans_tp(ep, tp):
        check_divides("ep / tp", ep // tp, shard_size, "dp_shard")
        return shard_size * tp // ep
    check_divides("ep", ep, shard_size, "dp_shard")
    return shard_size // ep


def ep_local_shape(shape: Sequence[int], ep: int) -> tuple[int, ...]:
    """An experts parameter's shape on one ep rank: ``E / ep`` experts (``Shard(0)`` on the ep mesh)."""
    check_divides("ep", ep, shape[0], "experts")
    return (shape[0] // ep, *shape[1:])


def ep_state_bytes(
    dense_params: float, expert_params: float, *, shard_size: int, ep: int, state: StateBytes, tp: int = 1
) -> tuple[MemoryBreakdown, MemoryBreakdown]:
    """(dense, experts) model-state bytes per rank, closed form: the dense ``P_d`` FSDP2-sharded over ``dp_shard``
    (``P_d / S``), the experts ``P_e / ep`` per ep rank, FSDP2-sharded over the ranks left (:func:`ep_fsdp_size`:
    ``S / ep``, or ``S tp / ep`` when the ep groups span ``tp``)."""
    size = ep_fsdp_size(shard_size, ep, tp)
    dense = model_state_bytes(dense_params, state=state, zero_stage=3, shard_size=shard_size)
    experts = model_state_bytes(expert_params / ep, state=state, zero_stage=3, shard_size=size)
    return dense, experts


def ep_state_bytes_exact(
    dense_shapes: Iterable[Sequence[int]],
    expert_shapes: Iterable[Sequence[int]],
    *,
    shard_size: int,
    ep: int,
    shard_rank: int,
    state: StateBytes,
    tp: int = 1,
    tp_rank: int = 0,
) -> tuple[MemoryBreakdown, MemoryBreakdown]:
    """(dense, experts) live bytes on rank `shard_rank` of ``dp_shard``, FSDP2's uneven dim-0 shards counted: the dense
    shapes over ``S`` ranks, each experts shape's ``E / ep`` rows (:func:`ep_local_shape`) over the ranks of the
    experts' FSDP2 mesh (:func:`ep_fsdp_size`), where this rank is number ``i // ep`` of the block the ep groups are cut
    from (each ep group: ``ep`` consecutive ranks of it): ``i = shard_rank``, or ``shard_rank tp + tp_rank`` when the
    groups span ``tp`` (tp the fastest dim)."""
    size = ep_fsdp_size(shard_size, ep, tp)
    dense = fsdp2_state_bytes(dense_shapes, shard_size=shard_size, rank=shard_rank, state=state)
    local = [ep_local_shape(s, ep) for s in expert_shapes]
    at = shard_rank * tp + tp_rank if ep_spans_tp(ep, tp) else shard_rank
    experts = fsdp2_state_bytes(local, shard_size=size, rank=at // ep, state=state)
    return dense, experts


def ep_all_to_all(
    *,
    rows: float,
    hidden: int,
    bytes_per_element: float,
    experts: int,
    ep: int,
    layers: int = 1,
    received: float | None = None,
) -> list[Collective]:
    """The all-to-alls of expert parallelism per step on one rank, on ``ep`` (payload: each call's input).

    ``rows``: this rank's (token, choice) pairs per MoE layer and step, ``N k`` (``N k / tp`` when the ep groups span
    ``tp``: each tp rank dispatches its share of the tokens, :func:`ep_rows`); ``received``: the rows its experts
    received (None: uniform routing, ``N k``). Per MoE layer, forward: the per-expert counts (``8 E`` bytes), the rows
    to the experts (dispatch, ``N k C a``) and the experts' outputs back (combine, ``R C a``); backward: the combine's
    gradient (``N k C a``) and the dispatch's (``R C a``). Empty for ``ep == 1``.
    """
    check_size("ep", ep)
    check_size("experts", experts)
    check_size("hidden", hidden)
    check_count("rows", rows)
    check_count("layers", layers)
    check_count("bytes_per_element", bytes_per_element)
    if ep == 1:
        return []
    recv = rows if received is None else received
    check_count("received", recv)
    row = hidden * bytes_per_element

    def a2a(payload: float, what: str) -> Collective:
        return Collective(op="all_to_all", dim=EP, group_size=ep, payload_bytes=layers * payload, what=what)

    return [
        a2a(COUNT_BYTES * experts, "per-expert token counts"),
        a2a(rows * row, "dispatch: tokens to their experts"),
        a2a(recv * row, "combine: expert outputs back"),
        a2a((rows + recv) * row, "backward: combine and dispatch gradients"),
    ]


def ep_rows(tokens: int, top_k: int, *, ep: int, tp: int = 1, tp_rank: int = 0) -> int:
    """(token, choice) rows tp rank `tp_rank` dispatches per MoE layer: ``N k``, or its ``torch.tensor_split`` share
    ``(N // tp + (tp_rank < N mod tp)) k`` when the ep groups span ``tp`` (rank 0 the most loaded)."""
    check_count("tokens", tokens)
    check_size("top_k", top_k)
    if not ep_spans_tp(ep, tp):
        return tokens * top_k
    return (tokens // tp + (tp_rank < tokens % tp)) * top_k


def ep_tp_gathers(
    *,
    tokens: int,
    hidden: int,
    top_k: int,
    tp: int,
    bytes_per_element: float,
    weight_bytes: float | None = None,
    layers: int = 1,
) -> list[Collective]:
    """The all-gathers over ``tp`` of expert parallelism per step when its groups span ``tp`` (payload: the gathered
    output, as for every all-gather; empty for ``tp == 1``). The ``N`` tokens a tp group holds alike are split over
    its ranks (``torch.tensor_split``), each dispatches its share; per MoE layer the combined rows are gathered back in
    forward (``[ceil(N/tp), C]`` per rank, activation dtype), and in backward the hidden input's gradient (as wide) and
    the routing weights' (``[ceil(N/tp), k]``, their dtype: ``weight_bytes``, default the activations'): each
    ``tp ceil(N/tp)`` rows."""
    check_size("tp", tp)
    check_size("hidden", hidden)
    check_size("top_k", top_k)
    check_count("tokens", tokens)
    check_count("layers", layers)
    check_count("bytes_per_element", bytes_per_element)
    if tp == 1:
        return []
    w = bytes_per_element if weight_bytes is None else weight_bytes
    check_count("weight_bytes", w)
    rows = tp * -(-tokens // tp)  # each rank's share padded to the largest

    def gather(width: float, what: str) -> Collective:
        return Collective(op="all_gather", dim=TP, group_size=tp, payload_bytes=layers * rows * width, what=what)

    return [
        gather(hidden * bytes_per_element, "ep: combined expert outputs to every tp rank"),
        gather(hidden * bytes_per_element, "ep backward: hidden-input gradient shares"),
        gather(top_k * w, "ep backward: routing-weight gradient shares"),
    ]


def ep_fsdp_traffic(
    dense_params: float,
    expert_params: float,
    *,
    state: StateBytes,
    shard_size: int,
    replicate_size: int,
    ep: int,
    root_params: float = 0,
    tp: int = 1,
) -> list[Collective]:
    """FSDP2's collectives under ep, closed form (ZeRO-3): the dense parameters over ``dp_shard`` as without ep; each
    rank's ``P_e / ep`` experts gathered and reduce-scattered over the ranks of ``dp_shard_mod_ep`` (``S / ep``, or
    ``S tp / ep`` when the ep groups span ``tp``: :func:`ep_fsdp_size`; none when that is one rank) and their gradient
    shards all-reduced over ``dp_replicate``."""
    size = ep_fsdp_size(shard_size, ep, tp)
    out = data_parallel_traffic(
        dense_params,
        state=state,
        zero_stage=3,
        shard_size=shard_size,
        replicate_size=replicate_size,
        root_params=root_params,
    )
    experts = data_parallel_traffic(
        expert_params / ep, state=state, zero_stage=3, shard_size=size, replicate_size=replicate_size
    )
    out += [replace(c, dim=EP_OUTER) if c.dim == DP_SHARD else c for c in experts if c.group_size > 1]
    return out


@dataclass(frozen=True, kw_only=True)
class EPLayout:
    """One expert-parallel layout (FSDP2 / HSDP with ``ep``): states per rank and traffic per step."""

    name: str
    """``fsdp-ep2``, ``hsdp-4-ep2`` (shard size 4), ``tp2-fsdp-ep2`` (tensor parallel x2)."""
    dp_replicate: int
    dp_shard: int
    ep: int
    tp: int = 1
    """Tensor-parallel degree: the dense parts split over ``tp`` ranks. ``ep`` a multiple of ``tp``: the ep groups
    span tp (``E / ep`` experts per rank, each tp rank dispatching ``1/tp`` of the tokens); else the experts whole on
    each tp rank, every tp rank dispatching all its tokens."""
    experts_per_rank: int
    """``E / ep`` experts of each layer on a rank."""
    dense: MemoryBreakdown
    """Dense model states per rank (attention, routers, shared experts, embeddings)."""
    experts: MemoryBreakdown
    """Routed-expert model states per rank."""
    all_to_all: tuple[Collective, ...]
    """The ep exchange per step (empty when the tokens per rank were not given)."""
    fsdp: tuple[Collective, ...]
    """FSDP2's gathers, reduce-scatters and all-reduces per step."""
    per_layer: tuple[Collective, ...] = ()
    """The ep exchange of one MoE layer per step (the rows of :attr:`all_to_all` for ``layers=1``)."""
    fits: bool | None = None
    """Model states within the device memory (None: none given)."""
    tp_gathers: tuple[Collective, ...] = ()
    """The all-gathers over ``tp`` per step when the ep groups span tp (:func:`ep_tp_gathers`; empty otherwise or when
    the tokens per rank were not given)."""

    @property
    def total(self) -> float:
        return self.dense.total + self.experts.total

    @property
    def wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in (*self.all_to_all, *self.tp_gathers, *self.fsdp))

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "mesh": {DP_REPLICATE: self.dp_replicate, DP_SHARD: self.dp_shard, TP: self.tp, EP: self.ep},
            "experts_per_rank": self.experts_per_rank,
            "dense": self.dense.to_dict(),
            "experts": self.experts.to_dict(),
            "total": self.total,
            "all_to_all": [c.to_dict() for c in self.all_to_all],
            "all_to_all_per_layer": [c.to_dict() for c in self.per_layer],
            "tp_all_gather": [c.to_dict() for c in self.tp_gathers],
            "fsdp": [c.to_dict() for c in self.fsdp],
            "wire_bytes": self.wire_bytes,
            "fits": self.fits,
        }


def ep_layouts(
    total_params: float,
    moe: MoEShape,
    *,
    world_size: int,
    state: StateBytes,
    tokens: int | None = None,
    bytes_per_element: float = 2,
    device_memory: float | None = None,
    tp_sharded_params: float | None = None,
    tp_sharded_expert_params: float | None = None,
    devices_per_node: int | None = None,
) -> list[EPLayout]:
    """Every FSDP2 / HSDP layout of ``world_size`` ranks with expert parallelism: each shard size ``S > 1`` dividing
    the data-parallel ranks (``R = W / (t S)`` replicas) and each ``ep > 1`` of :func:`ep_degrees`; with
    ``tp_sharded_params`` (what tensor parallelism splits, ``ParamCounts.tp_sharded_params``) also under each
    ``tp = t > 1`` dividing the node (``devices_per_node``, default the world), as ``TensorParallelStrategy(ep=...)``
    runs it: the dense parameters ``P_s / t + P_r`` per tp rank. ``ep`` a multiple of ``t`` (``ep / t`` dividing
    ``S``): the ep groups span tp (torchtitan's layout), ``E / ep`` experts per rank FSDP2-sharded over ``S t / ep``
    ranks, each tp rank dispatching its ``ceil(N / t)`` share of the tokens (:func:`ep_rows`) and the tp all-gathers
    of :func:`ep_tp_gathers`; else (``ep`` dividing ``S``) the experts and their all-to-alls as without tp (every tp
    rank dispatches its data-parallel rank's tokens over its own ep group). The routed experts are not split by tp
    and count once, as experts: ``tp_sharded_expert_params`` of them are taken out of
    ``tp_sharded_params`` (``P_s``, experts held as ``nn.Linear`` modules, which ``count_params`` counts with the
    Linear weights), the rest out of the parameters tp does not split (``P_r``, fused 3-D experts). None: all of them
    when ``tp_sharded_params`` is the whole model (``ParamCounts(tp_sharded=None)``), else none (the fused experts
    ``inputs.moe_spec`` reads off a model). ``tokens``: tokens per data-parallel rank per step (batch x sequence), for
    the all-to-all bytes under uniform routing (None: not counted). States: the exact shards of ``moe.expert_shapes``
    when given (rank 0, the most loaded), else the closed form."""
    check_size("world_size", world_size)
    check_count("total_params", total_params)
    if moe.expert_params > total_params:
        raise ValueError(f"expert_params={moe.expert_params} exceeds the model's {total_params} parameters.")
    dense_params = total_params - moe.expert_params
    per_node = devices_per_node or world_size
    tps = [1]
    if tp_sharded_params is not None:
        check_count("tp_sharded_params", tp_sharded_params)
        if tp_sharded_params > total_params:
            raise ValueError(f"tp_sharded_params={tp_sharded_params} exceeds the model's {total_params} parameters.")
        if tp_sharded_expert_params is None:
            tp_sharded_expert_params = moe.expert_params if tp_sharded_params == total_params else 0
        check_count("tp_sharded_expert_params", tp_sharded_expert_params)
        if tp_sharded_expert_params > min(moe.expert_params, tp_sharded_params):
            raise ValueError(
                f"tp_sharded_expert_params={tp_sharded_expert_params} exceeds expert_params={moe.expert_params} or"
                f" tp_sharded_params={tp_sharded_params}."
            )
        # the dense parameters tp does not split: the whole model less what tp splits less the experts not in it
        replicated = total_params - tp_sharded_params - (moe.expert_params - tp_sharded_expert_params)
        if replicated < 0:
            raise ValueError(
                f"The {moe.expert_params - tp_sharded_expert_params} routed-expert parameters not counted in"
                f" tp_sharded_params={tp_sharded_params} exceed the {total_params - tp_sharded_params} parameters tp"
                " does not split: pass tp_sharded_expert_params, the expert parameters counted in tp_sharded_params"
                " (experts held as nn.Linear modules)."
            )
        tps += [t for t in divisors(world_size)[1:] if t <= per_node and per_node % t == 0]
    elif tp_sharded_expert_params is not None:
        raise ValueError("tp_sharded_expert_params goes with tp_sharded_params.")
    out = []
    for t in tps:
        dense_local = dense_params
        if t > 1:
            dense_local = tp_local_params(
                tp_sharded_params=tp_sharded_params - tp_sharded_expert_params, replicated_params=replicated, tp=t
            )
        for shard in divisors(world_size // t)[1:]:
            rep = world_size // (t * shard)
            for ep in ep_degrees(moe.experts, shard, t):
                out.append(
                    _ep_layout(
                        dense_local,
                        moe,
                        t=t,
                        rep=rep,
                        shard=shard,
                        ep=ep,
                        state=state,
                        tokens=tokens,
                        bytes_per_element=bytes_per_element,
                    )
                )
    if device_memory is not None:
        out = [replace(layout, fits=layout.total <= device_memory) for layout in out]
    return out


def _ep_layout(
    dense_params: float,
    moe: MoEShape,
    *,
    t: int,
    rep: int,
    shard: int,
    ep: int,
    state: StateBytes,
    tokens: int | None,
    bytes_per_element: float,
) -> EPLayout:
    """One row of :func:`ep_layouts` (rank 0): `dense_params` per tp rank, the mesh ``rep x shard x t``, ``ep`` over
    shard, or over shard x t when it spans tp."""
    dense, experts = ep_state_bytes(dense_params, moe.expert_params, shard_size=shard, ep=ep, state=state, tp=t)
    if moe.expert_shapes:
        _, experts = ep_state_bytes_exact(
            (), moe.expert_shapes, shard_size=shard, ep=ep, shard_rank=0, state=state, tp=t
        )
    a2a: list[Collective] = []
    per_layer: list[Collective] = []
    gathers: list[Collective] = []
    if tokens is not None:
        common = dict(hidden=moe.hidden, bytes_per_element=bytes_per_element, experts=moe.experts, ep=ep)
        rows = ep_rows(tokens, moe.top_k, ep=ep, tp=t)
        # uniform routing: the ep group's tokens (ep / t tp groups of N when it spans tp) spread evenly over its ranks
        received = tokens * moe.top_k / t if ep_spans_tp(ep, t) else None
        a2a = ep_all_to_all(rows=rows, received=received, layers=moe.layers, **common)
        per_layer = ep_all_to_all(rows=rows, received=received, **common)
        if ep_spans_tp(ep, t):
            gathers = ep_tp_gathers(
                tokens=tokens,
                hidden=moe.hidden,
                top_k=moe.top_k,
                tp=t,
                bytes_per_element=bytes_per_element,
                layers=moe.layers,
            )
    kind = "fsdp" if rep == 1 else f"hsdp-{shard}"
    return EPLayout(
        name=f"{f'tp{t}-' if t > 1 else ''}{kind}-ep{ep}",
        dp_replicate=rep,
        dp_shard=shard,
        ep=ep,
        tp=t,
        experts_per_rank=moe.experts // ep,
        dense=dense,
        experts=experts,
        all_to_all=tuple(a2a),
        per_layer=tuple(per_layer),
        tp_gathers=tuple(gathers),
        fsdp=tuple(
            ep_fsdp_traffic(
                dense_params, moe.expert_params, state=state, shard_size=shard, replicate_size=rep, ep=ep, tp=t
            )
        ),
    )
