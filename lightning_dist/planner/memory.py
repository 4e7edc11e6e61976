"""Model-state bytes per device: bytes per parameter, ZeRO / HSDP / tp / pipeline splits.

Notes: docs/internals.md, "lightning_dist/planner/memory.py"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from lightning_dist import rules
from lightning_dist.measure import PLACES
from lightning_dist.planner._checks import check_count, check_divides, check_size, check_zero_stage
from lightning_dist.precision import PRECISION_DTYPES

TIERS: tuple[str, ...] = PLACES  # where each part lives: one vocabulary with the offload plan and report


# Lightning precision flag -> (bytes of the stored parameters, bytes of the compute/all-gather dtype).
# "-mixed" keeps float32 parameters and computes in 16 bit (autocast / FSDP2 MixedPrecisionPolicy).
PRECISIONS: dict[str, tuple[int, int]] = {
    flag: (dtypes.param_bytes, dtypes.compute_bytes) for flag, dtypes in PRECISION_DTYPES.items()
}
# Optimizer -> state tensors per parameter (each in the parameter's dtype, as torch.optim keeps them).
OPTIMIZER_SLOTS: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}


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
        raise ValueError(
            f"Unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_SLOTS)},"
            " or pass optimizer_state_bytes for another optimizer."
        )
    if optimizer_state_bytes is not None and optimizer_state_bytes < 0:
        raise ValueError(f"optimizer_state_bytes={optimizer_state_bytes!r} must be >= 0.")
    stored, compute = PRECISIONS[precision]
    slots = OPTIMIZER_SLOTS[optimizer]
    if master_weights:
        if compute >= 4:
            raise ValueError(
                f"master_weights=True needs a 16-bit precision (bf16-mixed, 16-mixed, bf16-true,"
                f" 16-true); {precision!r} already trains in {compute * 8}-bit."
            )
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
    check_count("num_params", num_params)
    check_zero_stage(zero_stage)
    check_size("shard_size", shard_size)
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
    check_size("world_size", world_size)
    return model_state_bytes(num_params, state=state, zero_stage=stage, shard_size=world_size, offload=offload)


def hsdp_bytes(
    num_params: float,
    *,
    shard_size: int,
    world_size: int,
    state: StateBytes,
    zero_stage: int = 3,
    offload: OffloadTiers | None = None,
) -> MemoryBreakdown:
    """Hybrid sharding: sharded over the ``shard_size`` ranks of a shard group, replicated across
    ``world_size / shard_size`` groups; the bytes depend on ``shard_size`` only."""
    check_size("world_size", world_size)
    check_size("shard_size", shard_size)
    check_divides("shard_size", shard_size, world_size)
    return model_state_bytes(num_params, state=state, zero_stage=zero_stage, shard_size=shard_size, offload=offload)


def tp_local_params(*, tp_sharded_params: float, replicated_params: float, tp: int) -> float:
    """Parameters one tensor-parallel rank holds: ``P_sharded / t + P_replicated``."""
    check_count("tp_sharded_params", tp_sharded_params)
    check_count("replicated_params", replicated_params)
    check_size("tp", tp)
    return tp_sharded_params / tp + replicated_params


def tp_bytes(
    *,
    tp_sharded_params: float,
    replicated_params: float,
    tp: int,
    state: StateBytes,
    zero_stage: int = 0,
    dp_shard: int = 1,
) -> MemoryBreakdown:
    """Tensor parallel over ``tp`` ranks, then ZeRO ``zero_stage`` over the ``dp_shard`` data-parallel ranks."""
    local = tp_local_params(tp_sharded_params=tp_sharded_params, replicated_params=replicated_params, tp=tp)
    return model_state_bytes(local, state=state, zero_stage=zero_stage, shard_size=dp_shard)


def split_stages(layer_params: Sequence[int], stages: int, *, pre_params: int = 0, post_params: int = 0) -> list[int]:
    """Parameters per pipeline stage, split as ``PipelineStrategy(split="params")`` splits the blocks.

    The split is the runtime's own (:func:`lightning_dist.rules.partition`): contiguous, every
    stage at least one block, minimising the largest stage; ``pre_params`` (embeddings, before the blocks)
    count on the first stage, ``post_params`` (final norm, head) on the last. Pass a measured split's counts
    to :func:`pipeline_bytes` instead when you have one.
    """
    check_size("stages", stages)
    if len(layer_params) < stages:
        raise ValueError(
            f"Cannot split {len(layer_params)} blocks into stages={stages}; use at most {len(layer_params)} stages."
        )
    for i, n in enumerate(layer_params):
        check_count(f"layer_params[{i}]", n)
    check_count("pre_params", pre_params)
    check_count("post_params", post_params)
    points = rules.partition([float(n) for n in layer_params], stages, first=float(pre_params), last=float(post_params))
    bounds = [0, *points, len(layer_params)]
    out = [sum(layer_params[a:b]) for a, b in zip(bounds, bounds[1:])]
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
