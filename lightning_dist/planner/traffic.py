"""Communication per step, per device: each collective's payload and ring wire bytes.

Notes: docs/internals.md, "lightning_dist/planner/traffic.py"."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_dist import rules
from lightning_dist.mesh import CP, DP, DP_CP, DP_REPLICATE, DP_SHARD, DP_SHARD_CP, PP, TP
from lightning_dist.planner._checks import check_count, check_size, check_zero_stage
from lightning_dist.planner.memory import StateBytes
from lightning_dist.planner.shards import fsdp2_local_numel

# The schedules PipelineStrategy(schedule=...) runs (lightning_dist.rules.SCHEDULES), spelled the same way.
SCHEDULES: tuple[str, ...] = tuple(rules.SCHEDULES)
# a hyphen for the underscore is accepted too: "interleaved-1f1b" is "interleaved_1f1b"
_SCHEDULE_ALIASES = {"interleaved-1f1b": "interleaved_1f1b"}

_WIRE_FACTOR = {
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "all_gather": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "broadcast": lambda w: (w - 1) / w,
    "send_recv": lambda w: 1.0,
    "send": lambda w: 1.0,  # one-way point to point (the pipeline's loss scalar)
    "recv": lambda w: 1.0,
    "all_to_all": lambda w: (w - 1) / w,  # every rank keeps its own 1/W of the input and sends the rest
}


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One kind of communication per training step on one mesh dim."""

    op: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``, ``send_recv`` (a rank sends the payload and
    receives as much), ``send`` / ``recv`` (one way) or ``all_to_all``."""
    dim: str
    """Mesh dim (``dp``, ``dp_shard``, ``dp_replicate``, ``cp``, ``tp``, ``pp``; under cp FSDP2's dim is
    ``dp_shard_cp`` and the flattened data-parallel one ``dp_cp``: :func:`with_cp_dims`)."""
    group_size: int
    """Ranks in the group."""
    payload_bytes: float
    """Full (unsharded) tensor bytes per step, summed over calls (all-gather: output; reduce-scatter: input)."""
    what: str = ""
    """What is moved (gradients, parameters, activations)."""

    def __post_init__(self) -> None:
        if self.op not in _WIRE_FACTOR:
            raise ValueError(f"Unknown collective op {self.op!r}; use one of {sorted(_WIRE_FACTOR)}.")

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per step with ring algorithms (see the module docstring)."""
        return _WIRE_FACTOR[self.op](self.group_size) * self.payload_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "wire_bytes": self.wire_bytes}


def ring_all_reduce_bytes(size_bytes: float, world_size: int) -> float:
    """``2 (W - 1) / W * size``: bytes each rank sends in a ring all-reduce."""
    check_size("world_size", world_size)
    return 2 * (world_size - 1) / world_size * size_bytes


def ring_all_gather_bytes(size_bytes: float, world_size: int) -> float:
    """``(W - 1) / W * size`` (size = gathered output): bytes each rank sends; also reduce-scatter of an input."""
    check_size("world_size", world_size)
    return (world_size - 1) / world_size * size_bytes


def data_parallel_traffic(
    num_params: float,
    *,
    state: StateBytes,
    zero_stage: int,
    shard_size: int,
    replicate_size: int = 1,
    root_params: float = 0,
) -> list[Collective]:
    """Data-parallel collectives per step for ``num_params`` on this device (see the module docstring).

    ``zero_stage`` 0 and 1 run over the flattened ``dp`` (``shard_size * replicate_size`` ranks);
    stages 2 and 3 gather / reduce-scatter on ``dp_shard`` and all-reduce the ``1 / S`` shard on
    ``dp_replicate``. ``root_params``: parameters of the FSDP2 root unit, gathered once (stage 3).
    """
    check_count("num_params", num_params)
    check_zero_stage(zero_stage)
    check_size("shard_size", shard_size)
    check_size("replicate_size", replicate_size)
    check_count("root_params", root_params)
    dp = shard_size * replicate_size
    grads = num_params * state.reduce
    if zero_stage <= 1:
        out = [Collective(op="all_reduce", dim=DP, group_size=dp, payload_bytes=grads, what="gradients")]
        if zero_stage == 1:  # ZeroRedundancyOptimizer: each rank broadcasts its updated partition
            out.append(
                Collective(
                    op="broadcast",
                    dim=DP,
                    group_size=dp,
                    payload_bytes=num_params * state.param,
                    what="updated parameters",
                )
            )
        return out
    gathers = 2 * num_params - min(root_params, num_params) if zero_stage == 3 else num_params
    out = [
        Collective(
            op="all_gather",
            dim=DP_SHARD,
            group_size=shard_size,
            payload_bytes=gathers * state.gather,
            what="parameters",
        ),
        Collective(op="reduce_scatter", dim=DP_SHARD, group_size=shard_size, payload_bytes=grads, what="gradients"),
    ]
    if replicate_size > 1:
        out.append(
            Collective(
                op="all_reduce",
                dim=DP_REPLICATE,
                group_size=replicate_size,
                payload_bytes=grads / shard_size,
                what="gradient shards",
            )
        )
    return out


def fsdp2_traffic(
    unit_shapes: Iterable[Sequence[int]],
    *,
    root_shapes: Iterable[Sequence[int]] = (),
    shard_size: int,
    replicate_size: int = 1,
    state: StateBytes,
    zero_stage: int = 3,
    frozen_shapes: Iterable[Sequence[int]] = (),
) -> list[Collective]:
    """Exact FSDP2 collectives per step (one forward + backward), padding included.

    ``frozen_shapes``: those of the parameters (among the units' and the root's) that do not require grad: gathered,
    but they have no gradient to reduce-scatter.

    FSDP2 gathers and reduce-scatters the *padded* shards: a parameter of dim 0 ``d0`` moves
    ``S * ceil(d0 / S) * rest`` elements (``S * padded`` of :func:`fsdp2_local_numel`), which for small or
    odd-sized models exceeds the closed form of :func:`data_parallel_traffic` noticeably.
    ``unit_shapes``: parameters of the non-root ``fully_shard`` units (gathered in forward and again in
    backward at ``zero_stage`` 3); ``root_shapes``: parameters held directly by the root unit, which FSDP2
    does not reshard after forward (gathered once). ``zero_stage`` 2 (``reshard_after_forward=False``)
    gathers every unit once. HSDP all-reduces each rank's padded gradient shard on ``dp_replicate``.
    """
    if zero_stage not in (2, 3):
        raise ValueError(f"`zero_stage={zero_stage!r}`: FSDP2 traffic is defined for stages 2 and 3.")
    check_size("shard_size", shard_size)
    check_size("replicate_size", replicate_size)

    def padded(shapes: Iterable[Sequence[int]]) -> int:
        return sum(shard_size * fsdp2_local_numel(tuple(s), shard_size, 0, padded=True) for s in shapes)

    units, root = padded(unit_shapes), padded(root_shapes)
    reduced = units + root - padded(frozen_shapes)
    gathered = (2 if zero_stage == 3 else 1) * units + root
    out = [
        Collective(
            op="all_gather",
            dim=DP_SHARD,
            group_size=shard_size,
            payload_bytes=gathered * state.gather,
            what="parameters (padded shards)",
        ),
        Collective(
            op="reduce_scatter",
            dim=DP_SHARD,
            group_size=shard_size,
            payload_bytes=reduced * state.reduce,
            what="gradients (padded)",
        ),
    ]
    if replicate_size > 1:
        out.append(
            Collective(
                op="all_reduce",
                dim=DP_REPLICATE,
                group_size=replicate_size,
                payload_bytes=reduced / shard_size * state.reduce,
                what="gradient shards",
            )
        )
    return out


def tp_activation_traffic(
    *,
    batch: int,
    seq: int,
    hidden: int,
    blocks: int,
    tp: int,
    bytes_per_element: float,
    row_parallel_per_block: int = 2,
    sequence_parallel: bool = False,
    gathered: Sequence[tuple[float, float]] = (),
) -> list[Collective]:
    """Tensor-parallel activation collectives per step (Megatron-style blocks, see the module docstring).

    ``A = batch * seq * hidden * bytes_per_element`` (``batch``: samples per data-parallel rank per step).
    Without sequence parallelism: all-reduce payload ``2 * row_parallel_per_block * blocks * A`` (forward
    output of each row-parallel linear + backward input-gradient of each column-parallel one). With it:
    an all-gather and a reduce-scatter, each of that payload. ``gathered``: ``(input bytes, output bytes)``
    of each ``colwise_gather`` layer (an output head): its output all-gathered in the forward, its input
    gradient all-reduced in the backward.
    """
    for name, value in (
        ("batch", batch),
        ("seq", seq),
        ("hidden", hidden),
        ("blocks", blocks),
        ("tp", tp),
        ("row_parallel_per_block", row_parallel_per_block),
    ):
        check_size(name, value)
    check_count("bytes_per_element", bytes_per_element)
    payload = 2 * row_parallel_per_block * blocks * batch * seq * hidden * bytes_per_element
    head_in, head_out = sum(float(i) for i, _ in gathered), sum(float(o) for _, o in gathered)
    if not sequence_parallel:
        out = [Collective(op="all_reduce", dim=TP, group_size=tp, payload_bytes=payload + head_in, what="activations")]
        if head_out:
            out.append(Collective(op="all_gather", dim=TP, group_size=tp, payload_bytes=head_out, what="head output"))
        return out
    out = [
        Collective(op="all_gather", dim=TP, group_size=tp, payload_bytes=payload + head_out, what="activations"),
        Collective(op="reduce_scatter", dim=TP, group_size=tp, payload_bytes=payload, what="activations"),
    ]
    if head_in:
        out.append(Collective(op="all_reduce", dim=TP, group_size=tp, payload_bytes=head_in, what="head input grad"))
    return out


def cp_attention_traffic(
    *,
    batch: int,
    seq: int,
    heads: int,
    head_dim: int,
    attention_calls: int,
    cp: int,
    kv_heads: int | None = None,
    tp: int = 1,
    bytes_per_element: float,
    recomputed_calls: int = 0,
    style: str = "ulysses",
) -> list[Collective]:
    """Context parallelism's attention exchange per step on ``cp`` (``parallelize/cp.py``): Ulysses' all-to-alls, or
    (``style="ring"``) the ring's all-gathers and all-to-alls.

    Each attention call sends this rank's q, k, v ``[batch, heads / tp, seq / cp, head_dim]`` to head shards and the
    output back (4 all-to-alls), and its backward the 4 gradients the other way; a block that activation
    checkpointing recomputes repeats the forward 4 (``recomputed_calls``). Key/value heads per tp rank that do not
    divide by ``cp`` are repeated to one per query head before the exchange. ``seq`` is the whole sequence;
    ``batch`` the samples per data-parallel rank per step. Payload = each call's input (what the recorder counts).

    The ring (torch's ``_templated_ring_attention`` with its default all-gather rotation, as measured through the
    recorder): this rank's keys and values ``2 b (h_q / tp) (s / cp) d a`` (key/value heads repeated to the query
    heads, as :func:`~lightning_dist.parallelize.cp.ring_sdpa` does) are all-gathered once per forward (recomputed
    ones too) and once per backward (payload: the gathered output, ``cp`` times them), and their gradients go round in
    ``cp`` all-to-alls per backward (payload: the same ``2 b (h_q / tp) (s / cp) d a`` each).
    """
    if style not in ("ulysses", "ring"):
        raise ValueError(f"`style={style!r}` must be 'ulysses' or 'ring'.")
    for name, value in (
        ("batch", batch),
        ("seq", seq),
        ("heads", heads),
        ("head_dim", head_dim),
        ("cp", cp),
        ("tp", tp),
    ):
        check_size(name, value)
    check_count("attention_calls", attention_calls)
    check_count("recomputed_calls", recomputed_calls)
    check_count("bytes_per_element", bytes_per_element)
    if cp == 1:
        return []
    if style == "ring":
        kv_bytes = 2 * batch * (heads // tp) * (seq // cp) * head_dim * bytes_per_element
        return [
            Collective(
                op="all_gather",
                dim=CP,
                group_size=cp,
                payload_bytes=(2 * attention_calls + recomputed_calls) * cp * kv_bytes,
                what="ring attention keys and values, forward and backward",
            ),
            Collective(
                op="all_to_all",
                dim=CP,
                group_size=cp,
                payload_bytes=attention_calls * cp * kv_bytes,
                what="ring attention key and value gradients, backward",
            ),
        ]
    q = heads // tp
    kv = (kv_heads or heads) // tp
    kv = q if kv % cp else kv  # repeated to the query heads (ulysses_sdpa)
    per_head = batch * (seq // cp) * head_dim * bytes_per_element
    forward = (2 * q + 2 * kv) * per_head  # q, k, v out and the attention output back
    payload = (2 * attention_calls + recomputed_calls) * forward
    return [
        Collective(
            op="all_to_all",
            dim=CP,
            group_size=cp,
            payload_bytes=payload,
            what="attention q, k, v and output, forward and backward",
        )
    ]


def with_cp_dims(collectives: Iterable[Collective], cp: int) -> list[Collective]:
    """The data-parallel collectives of a cp run on the dims they run on: FSDP2 shards over ``dp_shard x cp``
    (``dp_shard`` -> ``dp_shard_cp``) and the flattened data-parallel dim includes cp (``dp`` -> ``dp_cp``)."""
    if cp == 1:
        return list(collectives)
    rename = {DP_SHARD: DP_SHARD_CP, DP: DP_CP}
    return [replace(c, dim=rename.get(c.dim, c.dim)) for c in collectives]


def check_schedule(schedule: str, virtual_stages: int) -> str:
    """The runtime's name of ``schedule``; ValueError for an unknown one or ``virtual_stages`` it cannot run."""
    schedule = _SCHEDULE_ALIASES.get(schedule, schedule)
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown pipeline schedule {schedule!r}; use one of {SCHEDULES}.")
    check_size("virtual_stages", virtual_stages)
    if rules.SCHEDULES[schedule][1] == 1 and virtual_stages != 1:  # a one-stage-per-rank schedule
        raise ValueError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved_1f1b' ({schedule!r} runs one stage per rank)."
        )
    return schedule


def pipeline_idle_fraction(
    *, stages: int, micro_batches: int, schedule: str = "1f1b", virtual_stages: int = 1
) -> float:
    """Bubble share of a step with equal stage times (:func:`lightning_dist.rules.bubble_theory`, which the
    runtime's PipelineBubble callback compares with): ``(p-1)/(m+p-1)`` for GPipe and 1F1B (1F1B reorders the
    work and cuts activation memory, not the bubble); ``(p-1)/(v m + p-1)`` for interleaved 1F1B with ``v``
    stages per rank."""
    check_size("stages", stages)
    check_size("micro_batches", micro_batches)
    check_schedule(schedule, virtual_stages)
    return rules.bubble_theory(stages, micro_batches, virtual_stages)


def pipeline_p2p_traffic(
    *, activation_bytes: float, micro_batches: int, stages: int, virtual_stages: int = 1
) -> list[Collective]:
    """Stage-boundary traffic per step for an interior rank: each micro-batch's activation
    (``activation_bytes``) goes forward and its gradient back at each of the rank's ``v`` stages:
    ``2 m v A`` bytes sent (and the same received); the output is not broadcast: the loss is computed on the
    last stage and every rank gets it as one scalar (:func:`pipeline_loss_transfer`: an interior rank receives it).
    Empty for a single stage."""
    check_count("activation_bytes", activation_bytes)
    check_size("micro_batches", micro_batches)
    check_size("stages", stages)
    check_size("virtual_stages", virtual_stages)
    if stages == 1:
        return []
    payload = 2 * micro_batches * virtual_stages * activation_bytes
    return [
        Collective(
            op="send_recv", dim=PP, group_size=stages, payload_bytes=payload, what="activations + their gradients"
        ),
        pipeline_loss_transfer(stages),
    ]


def pipeline_loss_transfer(pp: int, *, last_stage: bool = False, loss_bytes: int = 4) -> Collective:
    """The batch loss (a float32 scalar: `loss_bytes`) on every pp rank, once per training step: the last stage's
    rank sends it to each of the other ``pp - 1`` ranks, point to point, and each of those receives one copy
    (``PipelineRunner._loss_to_all``). `last_stage`: the figure of the rank holding the last stage."""
    check_size("pp", pp)
    if last_stage:
        return Collective(op="send", dim=PP, group_size=pp, payload_bytes=loss_bytes * (pp - 1), what="loss")
    return Collective(op="recv", dim=PP, group_size=pp, payload_bytes=loss_bytes, what="loss")
