"""Lightning callbacks that fix silent distributed-training pitfalls (installed as ``lightning_dist.callbacks``).

* :class:`SamplerEpoch`: every sampler, batch sampler, wrapper and iterable dataset gets the epoch.
* :class:`ExactEvaluation`: validation/test/predict score every sample exactly once, in unchanged user code
  (:class:`ExactMetric` for its mask mode).
* :class:`MeshSyncBatchNorm`: BatchNorm statistics pooled over the data-parallel group (CPU and GPU).
* :class:`GradientParityCheck`: the distributed gradient equals the single-device one, checked in the run.
* :class:`CommunicationLedger`, :class:`MemoryReport`: measured traffic and model-state bytes next to the planner's.
* :class:`PipelineBubble`: measured pipeline idle fraction against (p-1)/(m+p-1), and a Gantt chart.
* :class:`HFPretrained`: start from a HuggingFace safetensors folder under any strategy, export back to one.
* :class:`ThroughputSummary`: global samples/s through Lightning's loggers and a rank-0 summary table of the fit.
* :class:`TrainDataGuard`, :class:`FiniteLossGuard`: refuse empty / too-small datasets and non-finite losses on every
  rank.
* :class:`ResumeRNG`: every rank's RNG states in checkpoints, for an exact mid-epoch resume.
"""

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
