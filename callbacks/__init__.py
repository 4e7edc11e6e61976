"""Lightning callbacks that fix silent distributed-training pitfalls (installed as ``lightning_dist.callbacks``).

Notes: docs/internals.md, "callbacks/__init__.py"."""

from lightning_dist.callbacks.exact_eval import ExactBatchSampler, ExactEvaluation, ExactMetric, exact_eval_mask
from lightning_dist.callbacks.gradient_parity import GradientParityCheck, GradientParityError, default_tolerance
from lightning_dist.callbacks.guards import FiniteLossGuard, TrainDataGuard
from lightning_dist.callbacks.hf_weights import HFPretrained
from lightning_dist.callbacks.ledger import CollectiveRecorder, CommunicationLedger
from lightning_dist.callbacks.memory import MemoryReport
from lightning_dist.callbacks.pipeline_bubble import PipelineBubble, bubble_stats, replay_idle, save_gantt
from lightning_dist.callbacks.resume_rng import ResumeRNG
from lightning_dist.callbacks.sampler_epoch import (
    SamplerEpoch,
    check_sampler_seeds,
    find_epoch_holders,
    set_epoch_everywhere,
)
from lightning_dist.callbacks.sync_batchnorm import (
    DataParallelBatchNorm,
    MeshSyncBatchNorm,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)
from lightning_dist.callbacks.throughput import ThroughputSummary, format_summary

__all__ = [
    "HFPretrained",
    "CollectiveRecorder",
    "CommunicationLedger",
    "MemoryReport",
    "PipelineBubble",
    "bubble_stats",
    "replay_idle",
    "save_gantt",
    "DataParallelBatchNorm",
    "ExactBatchSampler",
    "ExactEvaluation",
    "ExactMetric",
    "GradientParityCheck",
    "GradientParityError",
    "MeshSyncBatchNorm",
    "SamplerEpoch",
    "check_sampler_seeds",
    "convert_sync_batchnorm",
    "default_tolerance",
    "exact_eval_mask",
    "find_epoch_holders",
    "revert_sync_batchnorm",
    "set_epoch_everywhere",
    "ThroughputSummary",
    "format_summary",
    "FiniteLossGuard",
    "TrainDataGuard",
    "ResumeRNG",
]
