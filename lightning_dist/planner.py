"""Memory and communication planner: what each parallel layout costs per device, before launch.

Pure arithmetic, no process group: every rank (or a laptop) can plan, and every formula is unit-tested
in one process. ``lightning-dist plan`` (:mod:`lightning_dist.cli`) prints the candidate layouts.

Notation
--------
``P``  parameters the device's model replica holds (after the pipeline and tensor-parallel splits);
``W``  size of the group a collective runs over; ``S`` shard-group size (``dp_shard``);
``R``  replica groups (``dp_replicate``), ``S * R = dp``; ``t`` tensor-parallel size; ``p`` pipeline
stages; ``m`` micro-batches per step; ``v`` virtual stages per rank (interleaved pipelines).
Bytes per parameter come from :class:`StateBytes`: ``b_p`` (parameter storage), ``b_g`` (gradient),
``b_o`` (optimizer state, incl. an fp32 master copy where one is kept), ``b_gather`` (dtype of the
parameters all-gathered for compute) and ``b_reduce`` (dtype gradients are reduced in).

Model-state memory per device (:func:`model_state_bytes`)
---------------------------------------------------------
ZeRO stage ``z`` shards, over the ``S`` ranks of the shard group, the optimizer state (z >= 1), the
gradients (z >= 2) and the parameters (z = 3); what is not sharded is replicated::

    params    = P * b_p / (S if z >= 3 else 1)
    grads     = P * b_g / (S if z >= 2 else 1)
    optimizer = P * b_o / (S if z >= 1 else 1)

* DDP: ``z = 0`` -> ``P (b_p + b_g + b_o)``; with mixed-precision Adam (2 + 2 + 12) that is ``16 P``.
* ZeRO 1 / 2 / 3 over ``W`` ranks: ``S = W`` -> ``(b_p + b_g) P + b_o P / W``, ``b_p P + (b_g + b_o) P / W``,
  ``(b_p + b_g + b_o) P / W``. 1.5e9 parameters, 2 + 2 + 12, W = 8: 24.0, 8.25, 5.625, 3.0 GB (1 GB = 1e9 B).
* The ZeRO-2 row is DeepSpeed's (16-bit parameters resident and replicated). The pack's FSDP2
  ``zero_stage=2`` (``reshard_after_forward=False``) keeps only shards between steps, like stage 3, and
  holds the unsharded compute-dtype parameters from forward to backward: use :func:`fsdp2_state_bytes`
  for live bytes at rest.
* Hybrid sharding (HSDP): the same with ``S = dp_shard`` (replicated across the ``R`` replica groups).
* Tensor parallel: ``P = P_sharded / t + P_replicated`` (:func:`tp_local_params`), then the above over
  the data-parallel shard group.
* Pipeline: each stage holds its own ``P_s`` (an actual, possibly uneven split, :func:`split_stages`);
  the layout is sized by the largest stage, ``max_s``.
* Offload (:class:`OffloadTiers`): each of params / grads / optimizer sits on ``"device"``, ``"host"`` or
  ``"nvme"``; only ``"device"`` parts count toward the device total, the others are reported per tier.

FSDP2 shards every parameter along dim 0 (``torch.chunk`` semantics, chunks of ``ceil(d0 / S)`` rows,
trailing ranks may hold fewer or zero rows), so the exact per-rank count differs from ``P / S`` by the
rounding; :func:`per_parameter_shards` counts it exactly and :func:`fsdp2_state_bytes` turns it into bytes.
Its collectives move the padded shards (``S * ceil(d0 / S)`` rows per parameter): :func:`fsdp2_traffic`.

Communication per step, per device (:func:`data_parallel_traffic` and friends)
------------------------------------------------------------------------------
Each :class:`Collective` carries a *payload* (the full, unsharded tensor bytes moved per step, summed over
calls) and its ring-algorithm *wire* bytes (what one device sends, = what it receives)::

    all-reduce       wire = 2 (W - 1) / W * payload      (a reduce-scatter followed by an all-gather)
    all-gather       wire =   (W - 1) / W * payload      (payload = gathered output)
    reduce-scatter   wire =   (W - 1) / W * payload      (payload = full input)
    broadcast        wire =   (W - 1) / W * payload      (every rank broadcasts its 1/W partition)
    send/recv        wire = payload

* DDP: one gradient all-reduce over ``dp``: ``2 (W - 1) / W * P b_reduce``.
* ZeRO-1 as torch's ``ZeroRedundancyOptimizer`` does it: the DDP all-reduce plus a broadcast of the updated
  parameter partitions, ``(W - 1) / W * P b_p``.
* ZeRO-2 (FSDP2 ``reshard_after_forward=False``): one all-gather + one reduce-scatter on ``dp_shard``:
  ``2 (S - 1) / S`` model sizes (the same volume as DDP).
* ZeRO-3 / full sharding: two all-gathers (forward, backward) + one reduce-scatter: ``3 (S - 1) / S`` model
  sizes, 1.5x DDP. FSDP2 does not reshard the root module after forward, so parameters held directly by the
  root unit (``root_params``) are gathered once: gather payload ``(2 P - root_params) b_gather``.
* Hybrid sharding adds, on ``dp_replicate``, the all-reduce of each rank's ``1 / S`` gradient shard:
  ``2 (R - 1) / R * P b_reduce / S``.
* Tensor parallel (Megatron-style block: column-parallel then row-parallel linears, ``n_row`` row-parallel
  linears per block, 2 for attention + MLP): forward one all-reduce of the ``batch * seq * hidden``
  activation per row-parallel linear, backward one all-reduce of the same size per column-parallel input:
  payload ``2 n_row L * b s h * b_act`` on ``tp`` (:func:`tp_activation_traffic`). With sequence parallelism
  each all-reduce becomes an all-gather + a reduce-scatter of the same payload: same wire bytes. Only the
  blocks are counted (not a vocabulary-parallel embedding or loss-parallel head).
* Pipeline: per micro-batch, each stage boundary carries the activation forward and its gradient back;
  an interior stage sends ``2 m v A`` bytes per step (``A`` = activation bytes per micro-batch,
  :func:`pipeline_p2p_traffic`). Idle (bubble) fraction of a step with equal stage times:
  GPipe and 1F1B ``(p - 1) / (m + p - 1)``; interleaved 1F1B ``(p - 1) / (v m + p - 1)``.

"Per step" is one forward + backward + optimizer step; with ``k`` gradient-accumulation micro-steps FSDP
gathers ``k`` times while DDP under ``no_sync`` still all-reduces once.

Choosing a layout (:func:`candidate_layouts`, :func:`recommend`)
-----------------------------------------------------------------
Candidates: ddp, zero1, zero2, fsdp (zero3), hsdp for every shard size dividing the world size, tp x dp
(replicated or sharded dp), pp x dp, and two offload variants. The recommendation is the first that fits
in :data:`KIND_ORDER` (least parallelism first: ddp < zero1 < zero2 < hsdp < fsdp < tp < pp < offload),
ties broken by wire bytes per step, then by device memory. Memory counts model states only: activations,
communication buckets, the all-gathered unit and allocator fragmentation need headroom on top.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from lightning_dist.mesh import DP, DP_REPLICATE, DP_SHARD, PP, TP

if TYPE_CHECKING:
    from torch import nn

# Least parallelism first: the recommendation walks this order.
KIND_ORDER: tuple[str, ...] = ("ddp", "zero1", "zero2", "hsdp", "fsdp", "tp", "pp", "offload")
TIERS: tuple[str, ...] = ("device", "host", "nvme")
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b")

# Lightning precision flag -> (bytes of the stored parameters, bytes of the compute/all-gather dtype).
# "-mixed" keeps float32 parameters and computes in 16 bit (autocast / FSDP2 MixedPrecisionPolicy).
PRECISIONS: dict[str, tuple[int, int]] = {
    "64-true": (8, 8), "64": (8, 8),
    "32-true": (4, 4), "32": (4, 4),
    "bf16-mixed": (4, 2), "bf16": (4, 2), "16-mixed": (4, 2), "16": (4, 2),
    "bf16-true": (2, 2), "16-true": (2, 2),
}
# Optimizer -> state tensors per parameter (each in the parameter's dtype, as torch.optim keeps them).
OPTIMIZER_SLOTS: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}

_DECIMAL = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


# ---- bytes per parameter ------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Bytes per parameter element of each part of the model state, and of what collectives move."""

    param: float
    """Stored parameter (the tensor the module holds)."""
    grad: float
    """Gradient."""
    optimizer: float
    """Optimizer state, including an fp32 master copy when one is kept."""
    gather: float
    """Element size of parameters all-gathered for compute (FSDP2 ``param_dtype``)."""
    reduce: float
    """Element size gradients are reduced in (DDP bucket dtype / FSDP2 ``reduce_dtype``)."""

    def __post_init__(self) -> None:
        bad = [f"{k}={v!r}" for k, v in asdict(self).items() if not isinstance(v, (int, float)) or v < 0]
        if bad:
            raise ValueError(f"StateBytes needs non-negative byte counts; got {', '.join(bad)}.")

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optimizer

    @classmethod
    def mixed_adam(cls) -> "StateBytes":
        """ZeRO's mixed-precision Adam: 16-bit params (2) + grads (2) + fp32 master, momentum, variance (12)."""
        return cls(param=2, grad=2, optimizer=12, gather=2, reduce=2)

    @classmethod
    def fp32_adam(cls) -> "StateBytes":
        """Full float32 Adam: 4 + 4 + 8 (two moments)."""
        return cls(param=4, grad=4, optimizer=8, gather=4, reduce=4)

    @classmethod
    def fp64_adam(cls) -> "StateBytes":
        """Float64 Adam: 8 + 8 + 16."""
        return cls(param=8, grad=8, optimizer=16, gather=8, reduce=8)


def state_bytes(
    *,
    precision: str = "32-true",
    optimizer: str = "adamw",
    master_weights: bool = False,
    optimizer_state_bytes: float | None = None,
) -> StateBytes:
    """Bytes per parameter for a Lightning precision flag and an optimizer.

    Without ``master_weights`` this is what Lightning + torch hold: ``*-mixed`` keeps float32 parameters and
    gradients (autocast / FSDP2 ``MixedPrecisionPolicy`` only cast the compute copy), and each optimizer
    state tensor has the parameter's dtype: Adam 2 slots, SGD with momentum 1, plain SGD 0.
    ``bf16-mixed`` + Adam is therefore 4 + 4 + 8 (all-gathers in 2 bytes, gradient reduction in 4).
    ``master_weights=True`` is ZeRO/DeepSpeed's convention for 16-bit training: 16-bit parameters and
    gradients plus an fp32 master copy and fp32 states, i.e. Adam 2 + 2 + 12.
    ``optimizer_state_bytes`` replaces the optimizer's bytes per parameter outright.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; use one of {sorted(PRECISIONS)}.")
    if optimizer not in OPTIMIZER_SLOTS:
        raise ValueError(f"Unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_SLOTS)},"
                         " or pass optimizer_state_bytes for another optimizer.")
    if optimizer_state_bytes is not None and optimizer_state_bytes < 0:
        raise ValueError(f"optimizer_state_bytes={optimizer_state_bytes!r} must be >= 0.")
    stored, compute = PRECISIONS[precision]
    slots = OPTIMIZER_SLOTS[optimizer]
    if master_weights:
        if compute >= 4:
            raise ValueError(f"master_weights=True needs a 16-bit precision (bf16-mixed, 16-mixed, bf16-true,"
                             f" 16-true); {precision!r} already trains in {compute * 8}-bit.")
        # 16-bit working params/grads; the optimizer keeps fp32 master weights + fp32 states.
        param = grad = reduce = compute
        opt = 4 + 4 * slots
    else:
        param = grad = reduce = stored
        opt = stored * slots
    if optimizer_state_bytes is not None:
        opt = optimizer_state_bytes
    return StateBytes(param=param, grad=grad, optimizer=opt, gather=compute, reduce=reduce)


# ---- memory ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class OffloadTiers:
    """Where each part of the model state lives: ``"device"``, ``"host"`` (CPU RAM) or ``"nvme"``."""

    params: str = "device"
    """Tier of the (sharded) parameters."""
    grads: str = "device"
    """Tier of the (sharded) gradients."""
    optimizer: str = "device"
    """Tier of the optimizer state."""

    def __post_init__(self) -> None:
        bad = [f"{k}={v!r}" for k, v in asdict(self).items() if v not in TIERS]
        if bad:
            raise ValueError(f"Unknown offload tier {', '.join(bad)}; each must be one of {TIERS}.")

    @property
    def any(self) -> bool:
        return any(v != "device" for v in asdict(self).values())


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Model-state bytes per device: the device-resident parts, and what was offloaded per tier."""

    params: float
    """Parameter bytes on the device."""
    grads: float
    """Gradient bytes on the device."""
    optimizer: float
    """Optimizer-state bytes on the device."""
    host: float = 0.0
    """Bytes this rank keeps in host memory (offloaded parts)."""
    nvme: float = 0.0
    """Bytes this rank keeps on NVMe (offloaded parts)."""

    @property
    def total(self) -> float:
        """Device bytes: params + grads + optimizer."""
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def _check_count(name: str, value: Any, *, minimum: float = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"`{name}={value!r}` must be a number >= {minimum}.")


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}={value!r}` must be an integer >= 1.")


def _check_zero_stage(zero_stage: Any) -> None:
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"`zero_stage={zero_stage!r}` must be 0 (replicate), 1, 2 or 3.")


def _check_divides(what: str, part: int, whole: int, whole_name: str = "world_size") -> None:
    if whole % part:
        divisors = [d for d in range(1, whole + 1) if whole % d == 0]
        raise ValueError(f"`{what}={part}` does not divide {whole_name}={whole}; pick one of {divisors}.")


def model_state_bytes(
    num_params: float,
    *,
    state: StateBytes,
    zero_stage: int = 0,
    shard_size: int = 1,
    offload: OffloadTiers | None = None,
) -> MemoryBreakdown:
    """Model-state bytes on one device holding ``num_params`` (after pp/tp splits), ZeRO stage over ``shard_size``.

    ``params = P b_p / S^[z>=3]``, ``grads = P b_g / S^[z>=2]``, ``optimizer = P b_o / S^[z>=1]``; parts
    placed on ``"host"`` / ``"nvme"`` by ``offload`` move from the device columns to those tiers.
    """
    _check_count("num_params", num_params)
    _check_zero_stage(zero_stage)
    _check_size("shard_size", shard_size)
    parts = {
        "params": num_params * state.param / (shard_size if zero_stage >= 3 else 1),
        "grads": num_params * state.grad / (shard_size if zero_stage >= 2 else 1),
        "optimizer": num_params * state.optimizer / (shard_size if zero_stage >= 1 else 1),
    }
    tiers = offload or OffloadTiers()
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "host": 0.0, "nvme": 0.0}
    for part, nbytes in parts.items():
        tier = getattr(tiers, part)
        out[part if tier == "device" else tier] += nbytes
    return MemoryBreakdown(**out)


def ddp_bytes(num_params: float, *, state: StateBytes) -> MemoryBreakdown:
    """DDP: everything replicated, ``P (b_p + b_g + b_o)`` per device."""
    return model_state_bytes(num_params, state=state, zero_stage=0)


def zero_bytes(
    num_params: float, *, stage: int, world_size: int, state: StateBytes, offload: OffloadTiers | None = None
) -> MemoryBreakdown:
    """ZeRO stage 1/2/3 partitioned over all ``world_size`` ranks (see :func:`model_state_bytes`)."""
    _check_size("world_size", world_size)
    return model_state_bytes(num_params, state=state, zero_stage=stage, shard_size=world_size, offload=offload)


def hsdp_bytes(
    num_params: float, *, shard_size: int, world_size: int, state: StateBytes, zero_stage: int = 3,
    offload: OffloadTiers | None = None,
) -> MemoryBreakdown:
    """Hybrid sharding: sharded over the ``shard_size`` ranks of a shard group, replicated across
    ``world_size / shard_size`` groups; the bytes depend on ``shard_size`` only."""
    _check_size("world_size", world_size)
    _check_size("shard_size", shard_size)
    _check_divides("shard_size", shard_size, world_size)
    return model_state_bytes(num_params, state=state, zero_stage=zero_stage, shard_size=shard_size, offload=offload)


def tp_local_params(*, tp_sharded_params: float, replicated_params: float, tp: int) -> float:
    """Parameters one tensor-parallel rank holds: ``P_sharded / t + P_replicated``."""
    _check_count("tp_sharded_params", tp_sharded_params)
    _check_count("replicated_params", replicated_params)
    _check_size("tp", tp)
    return tp_sharded_params / tp + replicated_params


def tp_bytes(
    *, tp_sharded_params: float, replicated_params: float, tp: int, state: StateBytes,
    zero_stage: int = 0, dp_shard: int = 1,
) -> MemoryBreakdown:
    """Tensor parallel over ``tp`` ranks, then ZeRO ``zero_stage`` over the ``dp_shard`` data-parallel ranks."""
    local = tp_local_params(tp_sharded_params=tp_sharded_params, replicated_params=replicated_params, tp=tp)
    return model_state_bytes(local, state=state, zero_stage=zero_stage, shard_size=dp_shard)


def split_stages(layer_params: Sequence[int], stages: int, *, pre_params: int = 0, post_params: int = 0) -> list[int]:
    """Parameters per pipeline stage for a contiguous split of the blocks.

    Blocks are split by count, as evenly as possible, the first ``len % stages`` stages taking one more;
    ``pre_params`` (embeddings, before the blocks) go to the first stage, ``post_params`` (final norm,
    head) to the last. Pass a real split's counts to :func:`pipeline_bytes` instead when you have one.
    """
    _check_size("stages", stages)
    if len(layer_params) < stages:
        raise ValueError(f"Cannot split {len(layer_params)} blocks into stages={stages}; use at most"
                         f" {len(layer_params)} stages.")
    for i, n in enumerate(layer_params):
        _check_count(f"layer_params[{i}]", n)
    _check_count("pre_params", pre_params)
    _check_count("post_params", post_params)
    base, extra = divmod(len(layer_params), stages)
    out, start = [], 0
    for s in range(stages):
        stop = start + base + (1 if s < extra else 0)
        out.append(sum(layer_params[start:stop]))
        start = stop
    out[0] += pre_params
    out[-1] += post_params
    return out


def pipeline_bytes(
    stage_params: Sequence[float], *, state: StateBytes, zero_stage: int = 0, dp_shard: int = 1
) -> list[MemoryBreakdown]:
    """Model-state bytes of each pipeline stage (uneven allowed); size a layout by the largest, ``max(...)``."""
    if not stage_params:
        raise ValueError("stage_params is empty; give the parameter count of every pipeline stage.")
    return [model_state_bytes(n, state=state, zero_stage=zero_stage, shard_size=dp_shard) for n in stage_params]


# ---- exact FSDP2 / ZeroRedundancyOptimizer partitions -----------------------------------------------------
def fsdp2_local_numel(shape: Sequence[int], world_size: int, rank: int, *, padded: bool = False) -> int:
    """Elements rank ``rank`` holds of a parameter of ``shape`` under FSDP2's dim-0 sharding.

    FSDP2 splits dim 0 with ``torch.chunk`` into chunks of ``c = ceil(d0 / W)`` rows (trailing ranks get
    fewer or none): rank ``r`` holds ``clamp(d0 - r c, 0, c)`` rows. ``padded=True`` gives the padded
    storage FSDP2 allocates for the all-gather (``c`` rows on every rank).
    """
    _check_size("world_size", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside world_size={world_size}.")
    if len(shape) == 0:
        raise ValueError("FSDP2 shards along dim 0 and rejects 0-dim (scalar) parameters; reshape it to (1,).")
    d0, rest = shape[0], math.prod(shape[1:])
    chunk = -(-d0 // world_size)
    rows = chunk if padded else min(chunk, max(0, d0 - rank * chunk))
    return rows * rest


def per_parameter_shards(shapes: Iterable[Sequence[int]], world_size: int, *, padded: bool = False) -> list[int]:
    """Local parameter elements on each of ``world_size`` ranks when every parameter is FSDP2-sharded on dim 0.

    Returns one count per rank (rank 0 first, which always holds the most); ``sum`` of the unpadded counts is
    the model size. Multiply by :class:`StateBytes` parts for bytes (see :func:`fsdp2_state_bytes`).
    """
    shapes = [tuple(s) for s in shapes]
    return [sum(fsdp2_local_numel(s, world_size, r, padded=padded) for s in shapes) for r in range(world_size)]


def zero_redundancy_owners(numels: Sequence[int], world_size: int) -> list[int]:
    """Rank that owns each parameter's optimizer state under torch's ``ZeroRedundancyOptimizer``.

    Mirrors its greedy partition (one parameter group): parameters sorted by size, largest first (a stable
    sort), each to the rank with the smallest total so far (the lowest such rank on ties).
    """
    _check_size("world_size", world_size)
    sizes, owners = [0] * world_size, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):
        rank = sizes.index(min(sizes))
        owners[i] = rank
        sizes[rank] += int(numels[i])
    return owners


def zero_redundancy_partition(numels: Sequence[int], world_size: int) -> list[int]:
    """Parameter elements whose optimizer state each rank owns under ``ZeroRedundancyOptimizer``."""
    sizes = [0] * world_size
    for n, rank in zip(numels, zero_redundancy_owners(numels, world_size)):
        sizes[rank] += int(n)
    return sizes


def fsdp2_state_bytes(
    shapes: Iterable[Sequence[int]], *, shard_size: int, rank: int = 0, state: StateBytes,
    zero_stage: int = 3, padded: bool = False, step_bytes: float = 0,
) -> MemoryBreakdown:
    """Live model-state bytes on ``rank`` of a shard group, as the pack's FSDP2 strategies hold them at rest.

    * ``zero_stage`` 3 and 2: FSDP2 keeps only the dim-0 shards between steps (stage 2 differs from 3 by
      keeping the unsharded parameters from forward to backward, which is transient), so params, grads and
      optimizer state are all :func:`fsdp2_local_numel` elements.
    * ``zero_stage`` 1: parameters and gradients replicated, optimizer state partitioned whole-parameter by
      :func:`zero_redundancy_partition` over ``shard_size`` ranks (ZeroRedundancyOptimizer).
    * ``zero_stage`` 0: everything replicated.
    ``step_bytes``: per-parameter-tensor scalar optimizer state, added to the optimizer part (torch's Adam
    keeps a float32 ``step`` per parameter: 4; FSDP2 ranks hold one per parameter, even with zero rows).
    Differs from the closed form :func:`model_state_bytes` only by the rounding of uneven shards.
    """
    _check_zero_stage(zero_stage)
    _check_count("step_bytes", step_bytes)
    shapes = [tuple(s) for s in shapes]
    total = sum(math.prod(s) for s in shapes)
    steps = len(shapes) * step_bytes
    if zero_stage >= 2:
        local = sum(fsdp2_local_numel(s, shard_size, rank, padded=padded) for s in shapes)
        return MemoryBreakdown(params=local * state.param, grads=local * state.grad,
                               optimizer=local * state.optimizer + steps)
    opt = total
    if zero_stage == 1:
        _check_size("shard_size", shard_size)
        if not 0 <= rank < shard_size:
            raise ValueError(f"rank={rank} is outside shard_size={shard_size}.")
        numels = [math.prod(s) for s in shapes]
        owners = zero_redundancy_owners(numels, shard_size)
        opt = sum(n for n, r in zip(numels, owners) if r == rank)
        steps = sum(1 for r in owners if r == rank) * step_bytes
    return MemoryBreakdown(params=total * state.param, grads=total * state.grad,
                           optimizer=opt * state.optimizer + steps)


# ---- communication --------------------------------------------------------------------------------------
_WIRE_FACTOR = {
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "all_gather": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "broadcast": lambda w: (w - 1) / w,
    "send_recv": lambda w: 1.0,
}


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One kind of communication per training step on one mesh dim."""

    op: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast`` or ``send_recv``."""
    dim: str
    """Mesh dim (``dp``, ``dp_shard``, ``dp_replicate``, ``tp``, ``pp``)."""
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
    _check_size("world_size", world_size)
    return 2 * (world_size - 1) / world_size * size_bytes


def ring_all_gather_bytes(size_bytes: float, world_size: int) -> float:
    """``(W - 1) / W * size`` (size = gathered output): bytes each rank sends; also reduce-scatter of an input."""
    _check_size("world_size", world_size)
    return (world_size - 1) / world_size * size_bytes


def data_parallel_traffic(
    num_params: float, *, state: StateBytes, zero_stage: int, shard_size: int, replicate_size: int = 1,
    root_params: float = 0,
) -> list[Collective]:
    """Data-parallel collectives per step for ``num_params`` on this device (see the module docstring).

    ``zero_stage`` 0 and 1 run over the flattened ``dp`` (``shard_size * replicate_size`` ranks);
    stages 2 and 3 gather / reduce-scatter on ``dp_shard`` and all-reduce the ``1 / S`` shard on
    ``dp_replicate``. ``root_params``: parameters of the FSDP2 root unit, gathered once (stage 3).
    """
    _check_count("num_params", num_params)
    _check_zero_stage(zero_stage)
    _check_size("shard_size", shard_size)
    _check_size("replicate_size", replicate_size)
    _check_count("root_params", root_params)
    dp = shard_size * replicate_size
    grads = num_params * state.reduce
    if zero_stage <= 1:
        out = [Collective(op="all_reduce", dim=DP, group_size=dp, payload_bytes=grads, what="gradients")]
        if zero_stage == 1:  # ZeroRedundancyOptimizer: each rank broadcasts its updated partition
            out.append(Collective(op="broadcast", dim=DP, group_size=dp, payload_bytes=num_params * state.param,
                                  what="updated parameters"))
        return out
    gathers = 2 * num_params - min(root_params, num_params) if zero_stage == 3 else num_params
    out = [
        Collective(op="all_gather", dim=DP_SHARD, group_size=shard_size, payload_bytes=gathers * state.gather,
                   what="parameters"),
        Collective(op="reduce_scatter", dim=DP_SHARD, group_size=shard_size, payload_bytes=grads, what="gradients"),
    ]
    if replicate_size > 1:
        out.append(Collective(op="all_reduce", dim=DP_REPLICATE, group_size=replicate_size,
                              payload_bytes=grads / shard_size, what="gradient shards"))
    return out


def fsdp2_traffic(
    unit_shapes: Iterable[Sequence[int]], *, root_shapes: Iterable[Sequence[int]] = (), shard_size: int,
    replicate_size: int = 1, state: StateBytes, zero_stage: int = 3,
) -> list[Collective]:
    """Exact FSDP2 collectives per step (one forward + backward), padding included.

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
    _check_size("shard_size", shard_size)
    _check_size("replicate_size", replicate_size)

    def padded(shapes: Iterable[Sequence[int]]) -> int:
        return sum(shard_size * fsdp2_local_numel(tuple(s), shard_size, 0, padded=True) for s in shapes)

    units, root = padded(unit_shapes), padded(root_shapes)
    gathered = (2 if zero_stage == 3 else 1) * units + root
    out = [
        Collective(op="all_gather", dim=DP_SHARD, group_size=shard_size, payload_bytes=gathered * state.gather,
                   what="parameters (padded shards)"),
        Collective(op="reduce_scatter", dim=DP_SHARD, group_size=shard_size,
                   payload_bytes=(units + root) * state.reduce, what="gradients (padded)"),
    ]
    if replicate_size > 1:
        out.append(Collective(op="all_reduce", dim=DP_REPLICATE, group_size=replicate_size,
                              payload_bytes=(units + root) / shard_size * state.reduce, what="gradient shards"))
    return out


def tp_activation_traffic(
    *, batch: int, seq: int, hidden: int, blocks: int, tp: int, bytes_per_element: float,
    row_parallel_per_block: int = 2, sequence_parallel: bool = False,
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
    for name, value in (("batch", batch), ("seq", seq), ("hidden", hidden), ("blocks", blocks), ("tp", tp),
                        ("row_parallel_per_block", row_parallel_per_block)):
        _check_size(name, value)
    _check_count("bytes_per_element", bytes_per_element)
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


def _check_schedule(schedule: str, virtual_stages: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown pipeline schedule {schedule!r}; use one of {SCHEDULES}.")
    _check_size("virtual_stages", virtual_stages)
    if schedule != "interleaved-1f1b" and virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule='interleaved-1f1b' ({schedule!r} runs"
                         " one stage per rank).")


def pipeline_idle_fraction(
    *, stages: int, micro_batches: int, schedule: str = "1f1b", virtual_stages: int = 1
) -> float:
    """Bubble share of a step with equal stage times: ``(p-1)/(m+p-1)`` for GPipe and 1F1B (1F1B reorders
    the work and cuts activation memory, not the bubble); ``(p-1)/(v m + p-1)`` for interleaved 1F1B."""
    _check_size("stages", stages)
    _check_size("micro_batches", micro_batches)
    _check_schedule(schedule, virtual_stages)
    return (stages - 1) / (virtual_stages * micro_batches + stages - 1)


def pipeline_p2p_traffic(
    *, activation_bytes: float, micro_batches: int, stages: int, virtual_stages: int = 1
) -> list[Collective]:
    """Stage-boundary traffic per step for an interior rank: each micro-batch's activation
    (``activation_bytes``) goes forward and its gradient back at each of the rank's ``v`` stages:
    ``2 m v A`` bytes sent (and the same received). Empty for a single stage."""
    _check_count("activation_bytes", activation_bytes)
    _check_size("micro_batches", micro_batches)
    _check_size("stages", stages)
    _check_size("virtual_stages", virtual_stages)
    if stages == 1:
        return []
    payload = 2 * micro_batches * virtual_stages * activation_bytes
    return [Collective(op="send_recv", dim=PP, group_size=stages, payload_bytes=payload,
                       what="activations + their gradients")]


# ---- model description ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ParamCounts:
    """What the planner needs to know of a model (:func:`count_params` fills it from a module)."""

    total: int
    """Trainable and frozen parameters, shared ones counted once."""
    tp_sharded: int | None = None
    """Parameters tensor parallelism would shard (Linear / Embedding weights and biases); None: all."""
    shapes: tuple[tuple[int, ...], ...] = ()
    """Every parameter's shape (for the exact FSDP2 counts)."""
    layer_params: tuple[int, ...] = ()
    """Parameters of each block of the model's block list, in order (for pipeline splits)."""
    pre_params: int = 0
    """Parameters registered before the block list (first pipeline stage)."""
    post_params: int = 0
    """Parameters registered after the block list (last pipeline stage)."""

    def __post_init__(self) -> None:
        _check_count("total", self.total)
        if self.tp_sharded is not None and not 0 <= self.tp_sharded <= self.total:
            raise ValueError(f"tp_sharded={self.tp_sharded} must lie in [0, total={self.total}].")

    @property
    def tp_sharded_params(self) -> float:
        return self.total if self.tp_sharded is None else self.tp_sharded

    def stage_params(self, stages: int) -> list[int]:
        """Per-stage parameters: a split of the block list when known, else an even split of the total."""
        if self.layer_params:
            return split_stages(self.layer_params, stages, pre_params=self.pre_params, post_params=self.post_params)
        _check_size("stages", stages)
        base, extra = divmod(int(self.total), stages)
        return [base + (1 if s < extra else 0) for s in range(stages)]


def _block_list(model: "nn.Module") -> tuple[str, Any] | None:
    """The ModuleList / Sequential of repeated blocks holding the most parameters (name, module), or None."""
    from torch import nn

    best, best_n = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = (name, mod), n
    return best


def count_params(model: "nn.Module") -> ParamCounts:
    """Count a module's parameters (works on the meta device; shared parameters counted once)."""
    from torch import nn

    params = dict(model.named_parameters())  # named_parameters() already drops duplicates (tied weights)
    tp_ids = {id(p) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding)) for p in m.parameters()}
    layer_params: tuple[int, ...] = ()
    pre = post = 0
    found = _block_list(model)
    if found is not None:
        _, blocks = found
        layer_params = tuple(sum(p.numel() for p in b.parameters()) for b in blocks)
        block_ids = {id(p) for p in blocks.parameters()}
        seen_block = False
        for p in params.values():
            if id(p) in block_ids:
                seen_block = True
            elif seen_block:
                post += p.numel()
            else:
                pre += p.numel()
    return ParamCounts(
        total=sum(p.numel() for p in params.values()),
        tp_sharded=sum(p.numel() for p in params.values() if id(p) in tp_ids),
        shapes=tuple(tuple(p.shape) for p in params.values()),
        layer_params=layer_params,
        pre_params=pre,
        post_params=post,
    )


def import_class(class_path: str) -> type:
    """Import ``package.module.Class``; ValueError naming the path when it cannot be found."""
    module_name, _, attr = class_path.rpartition(".")
    if not module_name:
        raise ValueError(f"Model class path {class_path!r} must be dotted, e.g. 'my_pkg.models.GPT'.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"Cannot import module {module_name!r} of {class_path!r}: {err}") from err
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"{class_path!r}: module {module_name!r} has no class {attr!r}.")
    return cls


def _instantiate(spec: Any) -> Any:
    # LightningCLI's nested {class_path, init_args} specs, instantiated recursively; a few lines instead
    # of a full jsonargparse parser, which would need the model's type hints to resolve them.
    if isinstance(spec, Mapping) and "class_path" in spec:
        cls = import_class(spec["class_path"])
        kwargs = {k: _instantiate(v) for k, v in (spec.get("init_args") or {}).items()}
        return cls(**kwargs)
    if isinstance(spec, list):
        return [_instantiate(v) for v in spec]
    return spec


def build_meta_model(class_path: str, init_args: Mapping[str, Any] | str | None = None) -> "nn.Module":
    """Build ``class_path(**init_args)`` on the meta device (no memory is allocated).

    ``init_args`` is a mapping or a JSON object string; nested ``{"class_path", "init_args"}`` values are
    instantiated too. A LightningModule's ``configure_model`` hook runs as well, since models of the pack
    create their layers there.
    """
    import torch
    from torch import nn

    if isinstance(init_args, str):
        try:
            init_args = json.loads(init_args)
        except json.JSONDecodeError as err:
            raise ValueError(f"init args are not valid JSON ({err}): {init_args!r}") from err
    if init_args is not None and not isinstance(init_args, Mapping):
        raise ValueError(f"init args must be a JSON object of keyword arguments; got {init_args!r}.")
    cls = import_class(class_path)
    if not issubclass(cls, nn.Module):
        raise TypeError(f"{class_path!r} is not a torch.nn.Module subclass; the planner counts module parameters.")
    with torch.device("meta"):
        model = _instantiate({"class_path": class_path, "init_args": dict(init_args or {})})
        hook = getattr(model, "configure_model", None)
        if callable(hook):
            hook()
    return model


def model_spec_from_config(path: str) -> tuple[str, dict[str, Any]]:
    """(class path, init args) of ``model:`` in a LightningCLI YAML config (``class_path`` / ``init_args``)."""
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    model = config.get("model") if isinstance(config, Mapping) else None
    if not isinstance(model, Mapping) or "class_path" not in model:
        raise ValueError(f"{path}: expected a `model:` section with `class_path:` (and optional `init_args:`),"
                         " as LightningCLI writes it; or pass --model CLASS_PATH.")
    return str(model["class_path"]), dict(model.get("init_args") or {})


# ---- parsing ----------------------------------------------------------------------------------------------
def parse_bytes(text: str | int | float) -> int:
    """``"80GB"`` (1e9), ``"24GiB"`` (2**30), ``"512MiB"``, ``"1.5TB"`` or a plain byte count -> bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if match is None or (unit and unit not in _DECIMAL and unit not in _BINARY):
            raise ValueError(f"Cannot parse memory size {text!r}; write e.g. 80GB (1e9 bytes), 24GiB (2**30 bytes),"
                             " 512MiB or a number of bytes.")
        value = float(match.group(1)) * ({**_DECIMAL, **_BINARY}.get(unit, 1))
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"Memory size {text!r} must be a positive number of bytes.")
    return int(value)


def parse_count(text: str | int | float) -> int:
    """``"1.5B"``, ``"125M"``, ``"7e9"`` or ``1500000000`` -> a parameter count (K/M/B/T are powers of 1000)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]?)\s*", str(text))
        if match is None or match.group(2).lower() not in _COUNT_SUFFIX:
            raise ValueError(f"Cannot parse parameter count {text!r}; write e.g. 1500000000, 1.5e9, 1.5B or 125M.")
        value = float(match.group(1)) * _COUNT_SUFFIX[match.group(2).lower()]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"Parameter count {text!r} must be >= 0.")
    return int(round(value))


# ---- layouts ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ActivationShape:
    """Activation size, for tensor- and pipeline-parallel traffic (optional)."""

    batch: int
    """Samples per data-parallel rank per step (all micro-batches together)."""
    seq: int
    """Sequence length (1 for non-sequence models)."""
    hidden: int
    """Hidden size of the activation between blocks."""
    bytes_per_element: float = 2
    """Activation dtype size."""

    def __post_init__(self) -> None:
        for name in ("batch", "seq", "hidden"):
            _check_size(name, getattr(self, name))
        _check_count("bytes_per_element", self.bytes_per_element)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One candidate parallel layout with its per-device memory and per-step traffic."""

    name: str
    """Short label, e.g. ``hsdp-4`` (shard size 4) or ``tp2-fsdp4``."""
    kind: str
    """One of :data:`KIND_ORDER`."""
    mesh: dict[str, int]
    """Sizes of ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``."""
    zero_stage: int
    """ZeRO stage on the data-parallel dims."""
    memory: MemoryBreakdown
    """Model-state bytes of the most loaded device."""
    traffic: tuple[Collective, ...]
    """Collectives per step (activation traffic only when an :class:`ActivationShape` was given)."""
    offload: OffloadTiers = field(default_factory=OffloadTiers)
    """Where params / grads / optimizer state live."""
    idle_fraction: float = 0.0
    """Pipeline bubble share of a step."""
    fits: bool | None = None
    """Device total within the device memory (None when no memory was given)."""
    activations_counted: bool = True
    """False for tp / pp layouts planned without an :class:`ActivationShape`: their traffic lacks activations."""
    note: str = ""
    """What the layout is, in words."""

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per step, all dims together."""
        return sum(c.wire_bytes for c in self.traffic)

    def wire_bytes_by_dim(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.traffic:
            out[c.dim] = out.get(c.dim, 0.0) + c.wire_bytes
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "mesh": dict(self.mesh), "zero_stage": self.zero_stage,
            "offload": asdict(self.offload), "memory": self.memory.to_dict(),
            "traffic": [c.to_dict() for c in self.traffic], "wire_bytes": self.wire_bytes,
            "wire_bytes_by_dim": self.wire_bytes_by_dim(), "idle_fraction": self.idle_fraction,
            "fits": self.fits, "activations_counted": self.activations_counted, "note": self.note,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mesh(pp: int = 1, rep: int = 1, shard: int = 1, tp: int = 1) -> dict[str, int]:
    return {PP: pp, DP_REPLICATE: rep, DP_SHARD: shard, TP: tp}


def candidate_layouts(
    params: ParamCounts | int,
    *,
    world_size: int,
    devices_per_node: int,
    state: StateBytes,
    device_memory: float | None = None,
    activation: ActivationShape | None = None,
    micro_batches: int = 8,
    schedule: str = "1f1b",
) -> list[Layout]:
    """Every candidate layout for ``world_size`` ranks, ``devices_per_node`` per node, with memory and traffic.

    ddp; zero1, zero2, fsdp (zero3) over all ranks; hsdp for each shard size ``1 < S < W`` dividing ``W``;
    ``tp x dp`` for each ``1 < t <= devices_per_node`` dividing both (dp replicated, and dp fully sharded);
    ``pp x dp`` (dp replicated) for each ``1 < p`` dividing ``W`` with at least ``p`` blocks, sized by the
    largest stage, with ``max(micro_batches, p)`` micro-batches; zero-offload (ZeRO-2, optimizer state and
    gradients on host) and fsdp-offload (ZeRO-3, everything on host). ``fits`` compares the device total with
    ``device_memory`` (bytes). ``params``: a :class:`ParamCounts` or a plain count.
    """
    counts = params if isinstance(params, ParamCounts) else ParamCounts(total=params)
    _check_size("world_size", world_size)
    _check_size("devices_per_node", devices_per_node)
    _check_size("micro_batches", micro_batches)
    _check_schedule(schedule, 1)
    if world_size > devices_per_node and world_size % devices_per_node:
        raise ValueError(f"world_size={world_size} is not divisible by devices_per_node={devices_per_node}:"
                         " nodes must be full; pick a world size that is a multiple of the devices per node.")
    if device_memory is not None:
        _check_count("device_memory", device_memory, minimum=1)
    P, W = counts.total, world_size
    per_node = min(devices_per_node, W)
    out: list[Layout] = []

    def dp_layout(name, kind, stage, shard, rep, note, offload=None):
        mem = model_state_bytes(P, state=state, zero_stage=stage, shard_size=shard if stage >= 2 else shard * rep,
                                offload=offload)
        traffic = data_parallel_traffic(P, state=state, zero_stage=stage, shard_size=shard, replicate_size=rep)
        out.append(Layout(name=name, kind=kind, mesh=_mesh(rep=rep, shard=shard), zero_stage=stage, memory=mem,
                          traffic=tuple(traffic), offload=offload or OffloadTiers(), note=note))

    dp_layout("ddp", "ddp", 0, 1, W, "replicate everything, all-reduce gradients")
    if W > 1:
        dp_layout("zero1", "zero1", 1, W, 1, "shard optimizer state over all ranks")
        dp_layout("zero2", "zero2", 2, W, 1, "shard optimizer state and gradients")
        for s in _divisors(W)[1:-1]:
            dp_layout(f"hsdp-{s}", "hsdp", 3, s, W // s,
                      f"shard over groups of {s}, replicate x{W // s}" + (" (one node)" if s == per_node else ""))
        dp_layout("fsdp", "fsdp", 3, W, 1, "shard everything over all ranks (ZeRO-3)")

    # tensor parallel x data parallel
    for t in (d for d in _divisors(W)[1:] if d <= per_node and per_node % d == 0):
        dp = W // t
        local = tp_local_params(tp_sharded_params=counts.tp_sharded_params,
                                replicated_params=P - counts.tp_sharded_params, tp=t)
        act = []
        if activation is not None and counts.layer_params:
            act = tp_activation_traffic(batch=activation.batch, seq=activation.seq, hidden=activation.hidden,
                                        blocks=len(counts.layer_params), tp=t,
                                        bytes_per_element=activation.bytes_per_element)
        for stage, label in ((0, "ddp"), (3, "fsdp")):
            if stage == 3 and dp == 1:
                continue
            mem = model_state_bytes(local, state=state, zero_stage=stage, shard_size=dp)
            traffic = [*act]
            if dp > 1:
                traffic += data_parallel_traffic(local, state=state, zero_stage=stage,
                                                 shard_size=dp if stage else 1, replicate_size=1 if stage else dp)
            out.append(Layout(name=f"tp{t}-{label}{dp}" if dp > 1 else f"tp{t}", kind="tp",
                              mesh=_mesh(shard=dp if stage else 1, rep=1 if stage else dp, tp=t), zero_stage=stage,
                              memory=mem, traffic=tuple(traffic), activations_counted=bool(act),
                              note=f"tensor parallel x{t} in a node, dp x{dp} "
                                   + ("sharded" if stage else "replicated")))

    # pipeline x data parallel
    max_stages = len(counts.layer_params) if counts.layer_params else W
    for p in (d for d in _divisors(W)[1:] if d <= max_stages):
        dp, m = W // p, max(micro_batches, p)
        stages = counts.stage_params(p)
        mem = max(pipeline_bytes(stages, state=state), key=lambda b: b.total)
        traffic = data_parallel_traffic(max(stages), state=state, zero_stage=0, shard_size=1, replicate_size=dp) \
            if dp > 1 else []
        if activation is not None:
            a_bytes = activation.batch / m * activation.seq * activation.hidden * activation.bytes_per_element
            traffic += pipeline_p2p_traffic(activation_bytes=a_bytes, micro_batches=m, stages=p)
        out.append(Layout(name=f"pp{p}-ddp{dp}" if dp > 1 else f"pp{p}", kind="pp", mesh=_mesh(pp=p, rep=dp),
                          zero_stage=0, memory=mem, traffic=tuple(traffic), activations_counted=activation is not None,
                          idle_fraction=pipeline_idle_fraction(stages=p, micro_batches=m, schedule=schedule),
                          note=f"{p} pipeline stages ({schedule}, {m} micro-batches), dp x{dp} replicated"))

    if W > 1:
        dp_layout("zero-offload", "offload", 2, W, 1, "ZeRO-2, optimizer state and gradients on host",
                  offload=OffloadTiers(grads="host", optimizer="host"))
        dp_layout("fsdp-offload", "offload", 3, W, 1, "ZeRO-3, params, grads and optimizer state on host",
                  offload=OffloadTiers(params="host", grads="host", optimizer="host"))
    else:
        dp_layout("offload", "offload", 0, 1, 1, "single device, optimizer state on host",
                  offload=OffloadTiers(optimizer="host"))

    if device_memory is not None:
        out = [replace(layout, fits=layout.memory.total <= device_memory) for layout in out]
    return out


def recommend(layouts: Sequence[Layout]) -> Layout | None:
    """The least parallelism that fits: first by :data:`KIND_ORDER`, then fewer wire bytes, then less memory.

    Layouts with ``fits=None`` (no device memory given) count as fitting. None when nothing fits.
    """
    fitting = [layout for layout in layouts if layout.fits is not False]
    if not fitting:
        return None
    return min(fitting, key=lambda l: (KIND_ORDER.index(l.kind), l.wire_bytes, l.memory.total))


# ---- activations ----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class BlockShape:
    """Sizes of a pre-norm transformer block (the pack's GPT family) for :func:`activation_bytes`."""

    hidden: int
    """Model width ``C``."""
    heads: int
    """Attention heads ``h``."""
    mlp_hidden: int
    """MLP inner width ``H``."""
    vocab: int | None = None
    """Vocabulary size ``V`` of the output head (None: no head term)."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: ``heads``."""

    @property
    def params(self) -> float:
        """Weights of one block: q and proj ``C^2`` each, k and v ``C C_kv`` each, fc1 and fc2 ``C H`` each."""
        C = self.hidden
        kv = C * (self.kv_heads or self.heads) / self.heads
        return 2 * C * C + 2 * C * kv + 2 * C * self.mlp_hidden


def activation_bytes(
    block: BlockShape, *, tokens: int, blocks: int, tp: int = 1, bytes_per_element: float = 2,
    residual_bytes: float | None = None, micro_batches_held: int = 1, stem: bool = True, head: bool = True,
    head_gathered: bool = False, checkpointed: bool = False, autocast: bool = False,
) -> float:
    """Peak activation bytes of one training step on one device (saved for backward + the backward's start).

    ``N = tokens`` per micro-batch on this device (batch x sequence), ``a`` = ``bytes_per_element`` (compute
    dtype), ``f`` = ``residual_bytes`` (the residual stream's dtype; default ``a``), ``t`` = ``tp``.
    Per pre-norm block (``norm1 -> q, k, v -> attention -> proj``, ``norm2 -> fc1 -> GELU -> fc2``), the
    tensors autograd keeps for backward, per token::

        norm inputs             2 f C              (norm1, norm2; + 2 x 8 B of mean / rstd)
        norm outputs            2 a C              (the q/k/v input and the fc1 input: replicated over tp)
        q, k, v, attention out  4 a C / t          (the attention kernel's saved inputs and output)
        proj input              a C / t
        GELU and fc2 inputs     2 a H / t
        log-sum-exp             4 h / t

    ``autocast`` (Lightning's ``*-mixed`` precision without FSDP2's cast of the parameters): each linear casts
    its input and its weight to the compute dtype itself and keeps both, so the q, k, v and fc1 inputs are
    four copies (``4 a C`` instead of ``2 a C``) and each block (and the head) keeps a compute-dtype copy of
    its tensor-parallel local weights per micro-batch (``a x params / t``, not per token).
    ``checkpointed``: a block keeps only its input ``f C`` and one block's full set is live again while it is
    recomputed. The stem (``stem``) adds the embedding output ``a C`` (and the int64 token ids);
    the head (``head``) the final norm's input and output ``(f + a) C`` and, when backward starts, the
    cross-entropy's saved log-probabilities, their gradient and the logits' gradient in the loss dtype
    (``3 f V``; the loss runs in the residual dtype, float32 under autocast) plus the logits' gradient in
    the compute dtype (``a V`` when the head is ``colwise_gather`` across ``tp``, ``head_gathered``, else
    ``a V / t``); the logits themselves are not kept (no backward needs them). A pipeline stage holds
    ``micro_batches_held`` micro-batches at its peak (1F1B: ``p - s``); the head runs on one at a time.
    """
    for name, value in (("tokens", tokens), ("tp", tp), ("micro_batches_held", micro_batches_held)):
        _check_size(name, value)
    _check_count("blocks", blocks)
    a = bytes_per_element
    f = a if residual_bytes is None else residual_bytes
    C, H, h, t = block.hidden, block.mlp_hidden, block.heads, tp
    copies = 4 if autocast else 2  # compute-dtype inputs of q, k, v and fc1 (one shared norm output without autocast)
    full = 2 * f * C + 16 + copies * a * C + 4 * a * C / t + a * C / t + 2 * a * H / t + 4 * h / t
    per_block = f * C if checkpointed else full
    saved = blocks * per_block + (full if checkpointed and blocks else 0)
    if stem:
        saved += a * C + 8
    weights = (blocks * block.params / t) * a if autocast else 0.0  # per micro-batch, not per token
    total = micro_batches_held * (saved * tokens + weights)
    if head and block.vocab:
        V = block.vocab
        per_token = (f + a) * C + 16 + 3 * f * V + (a * V if head_gathered else a * V / t)
        total += per_token * tokens + (a * C * V / t if autocast else 0.0)
    return total


# ---- choosing a runnable layout (strategy="auto_parallel") ---------------------------------------------
# Layout kinds the pack's strategies run as auto_parallel choices, least parallelism first: DDP-style
# replication (hsdp with shard groups of one), hybrid sharding, full sharding, tensor x data, pipeline x data,
# FSDP2 with everything in host memory. (The planner's zero1/zero2 rows are DeepSpeed's conventions and its
# zero-offload row DeepSpeed's ZeRO-2 offload, which the FSDP2-based choices do not run.)
AUTO_KINDS: tuple[str, ...] = ("ddp", "hsdp", "fsdp", "tp", "pp", "offload")


def rank_layouts(
    layouts: Sequence[Layout], *, global_batch: int | None = None, prefer: Sequence[str] | str = (),
) -> list[Layout]:
    """The runnable layouts that fit, best first: what ``strategy="auto_parallel"`` picks from.

    Kept: kinds in :data:`AUTO_KINDS` (and the FSDP2 ``fsdp-offload`` row among the offload ones) that fit
    (``fits`` is not False) and, with ``global_batch``, whose data-parallel size divides it (every
    data-parallel rank needs the same whole number of samples). Order: the kinds named in ``prefer`` first
    (in that order), then least parallelism: :data:`AUTO_KINDS` order, then the smaller ``pp x tp``, then the
    smaller shard group, then fewer wire bytes. ``[0]`` is the choice, ``[1]`` the runner-up.
    """
    prefer = (prefer,) if isinstance(prefer, str) else tuple(prefer)
    unknown = [p for p in prefer if p not in AUTO_KINDS]
    if unknown:
        raise ValueError(f"prefer={list(prefer)!r}: {unknown} are not layout kinds; use some of {AUTO_KINDS}.")
    if global_batch is not None:
        _check_size("global_batch", global_batch)
    out = []
    for layout in layouts:
        if layout.kind not in AUTO_KINDS or layout.fits is False:
            continue
        if layout.kind == "offload" and layout.name not in ("fsdp-offload", "offload"):
            continue
        dp = layout.mesh[DP_REPLICATE] * layout.mesh[DP_SHARD]
        if global_batch is not None and global_batch % dp:
            continue
        out.append(layout)

    def key(layout: Layout) -> tuple:
        m = layout.mesh
        first = prefer.index(layout.kind) if layout.kind in prefer else len(prefer)
        return (first, AUTO_KINDS.index(layout.kind), m[PP] * m[TP], m[DP_SHARD], layout.wire_bytes)

    return sorted(out, key=key)
