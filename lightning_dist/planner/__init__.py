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

Modules
-------
:mod:`~lightning_dist.planner.memory`       bytes per parameter and model-state bytes per device (ZeRO, HSDP, tp, pp,
                                             offload tiers)
:mod:`~lightning_dist.planner.shards`       exact FSDP2 dim-0 shards and ZeroRedundancyOptimizer partitions
:mod:`~lightning_dist.planner.traffic`      collectives per step (payload and ring wire bytes), pipeline bubble
:mod:`~lightning_dist.planner.activations`  peak activation bytes of transformer blocks
:mod:`~lightning_dist.planner.experts`      expert parallelism: states per rank, all-to-all bytes, ep layouts
:mod:`~lightning_dist.planner.model`        what the planner knows of a model (:class:`ParamCounts`)
:mod:`~lightning_dist.planner.layouts`      candidate layouts, their activation memory, the recommendation,
                                             auto_parallel's ranking

The planner imports no runtime module (``parallelize/``, ``strategies/``, the dry run): the decisions it shares
with them live in :mod:`lightning_dist.rules`. A module's counts come from
:func:`lightning_dist.parallelize.counts.count_params` (the runtime's split of it); turning user input (``"80GB"``,
``"1.5B"``, class paths, LightningCLI YAML) into these arguments is :mod:`lightning_dist.inputs`' job.
"""

from __future__ import annotations

from lightning_dist.planner.activations import BlockShape, activation_bytes, check_checkpointed
from lightning_dist.planner.experts import (
    UNIFORM_ROUTING,
    EPLayout,
    MoEShape,
    ep_all_to_all,
    ep_degrees,
    ep_fsdp_traffic,
    ep_layouts,
    ep_local_shape,
    ep_state_bytes,
    ep_state_bytes_exact,
)
from lightning_dist.planner.layouts import (
    AUTO_KINDS,
    KIND_ORDER,
    ActivationShape,
    Layout,
    candidate_layouts,
    count_activations,
    rank_layouts,
    recommend,
)
from lightning_dist.planner.memory import (
    OPTIMIZER_SLOTS,
    PRECISIONS,
    TIERS,
    MemoryBreakdown,
    OffloadTiers,
    StateBytes,
    ddp_bytes,
    hsdp_bytes,
    model_state_bytes,
    pipeline_bytes,
    split_stages,
    state_bytes,
    tp_bytes,
    tp_local_params,
    zero_bytes,
)
from lightning_dist.planner.model import ParamCounts
from lightning_dist.planner.shards import (
    fsdp2_local_numel,
    fsdp2_state_bytes,
    per_parameter_shards,
    zero_redundancy_owners,
    zero_redundancy_partition,
)
from lightning_dist.planner.traffic import (
    SCHEDULES,
    Collective,
    cp_attention_traffic,
    data_parallel_traffic,
    fsdp2_traffic,
    pipeline_idle_fraction,
    pipeline_loss_transfer,
    pipeline_p2p_traffic,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    tp_activation_traffic,
    with_cp_dims,
)

__all__ = [
    "AUTO_KINDS",
    "KIND_ORDER",
    "OPTIMIZER_SLOTS",
    "PRECISIONS",
    "SCHEDULES",
    "TIERS",
    "UNIFORM_ROUTING",
    "ActivationShape",
    "BlockShape",
    "Collective",
    "EPLayout",
    "Layout",
    "MemoryBreakdown",
    "MoEShape",
    "OffloadTiers",
    "ParamCounts",
    "StateBytes",
    "activation_bytes",
    "check_checkpointed",
    "candidate_layouts",
    "count_activations",
    "cp_attention_traffic",
    "data_parallel_traffic",
    "ddp_bytes",
    "ep_all_to_all",
    "ep_degrees",
    "ep_fsdp_traffic",
    "ep_layouts",
    "ep_local_shape",
    "ep_state_bytes",
    "ep_state_bytes_exact",
    "fsdp2_local_numel",
    "fsdp2_state_bytes",
    "fsdp2_traffic",
    "hsdp_bytes",
    "model_state_bytes",
    "per_parameter_shards",
    "pipeline_bytes",
    "pipeline_idle_fraction",
    "pipeline_loss_transfer",
    "pipeline_p2p_traffic",
    "rank_layouts",
    "recommend",
    "ring_all_gather_bytes",
    "ring_all_reduce_bytes",
    "split_stages",
    "state_bytes",
    "tp_activation_traffic",
    "with_cp_dims",
    "tp_bytes",
    "tp_local_params",
    "zero_bytes",
    "zero_redundancy_owners",
    "zero_redundancy_partition",
]
