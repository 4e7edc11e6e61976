"""The pack's only uses of ``torch.distributed.pipelining`` internals (private schedule IR, ``PipelineStage`` hooks),
each refusing a torch outside :data:`~lightning_dist._compat.TORCH_PIPELINING_TESTED` with the release and the fix."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch.distributed.pipelining import PipelineStage

from lightning_dist._compat import PIPELINE_INIT_P2P_TO_SELF, check_torch_pipelining, torch_pipelining_exchanges_meta


def install_forward_only_program(schedule: Any, stage_ranks: Sequence[int], n_microbatches: int) -> None:
    """Give a multi-stage schedule a forward-only program: each rank runs its stages in order, all micro-batches.

    Reason: torch's multi-stage schedules have no forward-only (eval) mode and their validator insists on
    backward actions (upstream: the eval() API proposed in pytorch/pytorch#157795, not merged); the F-only
    program is lowered with torch's own passes (``_add_unshard_reshard``, ``_add_send_recv``) and installed
    as ``pipeline_order_with_comms``.
    """
    check_torch_pipelining("install_forward_only_program")
    from torch.distributed.pipelining import schedules as S

    order: dict[int, list] = {r: [] for r in sorted(set(stage_ranks))}
    for stage, rank in enumerate(stage_ranks):
        order[rank] += [S._Action(stage, S._ComputationType.FORWARD, mb) for mb in range(n_microbatches)]
    schedule.pipeline_order_with_comms = S._add_send_recv(
        {r: S._add_unshard_reshard(a) for r, a in order.items()},
        stage_to_rank=lambda s: stage_ranks[s],
        num_stages=len(stage_ranks),
    )


def drop_p2p_to_self(ops: list, group_rank: int) -> list:
    """The warm-up p2p ops of a stage without those addressed to its own rank.

    Reason: before torch 2.13 the first-step warm-up exchange with neighbour stages (added by
    pytorch/pytorch#160210) includes a send to self when the neighbour stage is on the same rank, which gloo
    cannot pair; stages of one rank hand tensors over in memory, so the exchange is not needed.
    """
    return [op for op in ops if op.group_peer != group_rank]


class TimedStage(PipelineStage):
    """A PipelineStage that records its F/B/I/W actions when a timeline list is attached, and asks `peer` (a
    :class:`~lightning_dist.parallelize.pipeline.schedule.PipelinePeer`) for what other ranks' stages would send.

    Reason: torch's schedules have no per-action callback (upstream: no issue found), so the ``*_one_chunk`` methods
    are wrapped and ``fwd_cache`` is read; a fake process group cannot carry the metadata torch exchanges in the
    private ``_recv_meta`` / ``_send_meta`` in a schedule's first step.
    """

    timeline: Optional[list] = None
    peak_held: int = 0

    def __init__(self, *args: Any, peer: Any = None, **kwargs: Any) -> None:
        check_torch_pipelining("TimedStage")
        super().__init__(*args, **kwargs)
        self.peer = peer

    def _clock(self) -> tuple[float, float]:
        # the thread CPU clock only while recording: a system call per action (~1 ms each measured on a busy CPU host)
        return (time.perf_counter(), time.thread_time()) if self.timeline is not None else (0.0, 0.0)

    def _record(self, kind: str, mb: int, start: float, cpu_start: float) -> None:
        if self.timeline is not None:  # (stage, kind, micro-batch, wall start, wall end, thread CPU seconds)
            self.timeline.append(
                (self.stage_index, kind, mb, start, time.perf_counter(), time.thread_time() - cpu_start)
            )

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        start, cpu = self._clock()
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._record("F", fwd_chunk_id, start, cpu)
        self.peak_held = max(self.peak_held, len(self.fwd_cache))  # micro-batches whose activations are held
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        start, cpu = self._clock()
        out = super().backward_one_chunk(
            bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
        )
        self._record("B" if full_backward else "I", bwd_chunk_id, start, cpu)
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        start, cpu = self._clock()
        out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self._record("W", bwd_chunk_id, start, cpu)
        return out

    def _recv_meta(self, src_stage: int) -> Any:
        if self.peer is None:
            return super()._recv_meta(src_stage)
        from torch.distributed.pipelining._utils import (
            _derive_grad_metas,
            _StageBackwardMeta,
            _StageForwardMeta,
            extract_tensor_metas,
        )

        if src_stage < self.stage_index:  # the previous stage's output: this stage's input
            shape, dtype = self.peer.stage_input(self.stage_index)
            x = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
            return _StageForwardMeta(forward_metas=extract_tensor_metas((x,)))
        # the next stage's input gradient: the shapes of this stage's outputs
        return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))

    def _send_meta(self, meta: Any, dst_stage: int) -> None:
        if self.peer is None:  # with a peer, the receiving stage asks its own
            super()._send_meta(meta, dst_stage)

    if PIPELINE_INIT_P2P_TO_SELF:

        def _get_init_p2p_neighbors_ops(self):
            return drop_p2p_to_self(super()._get_init_p2p_neighbors_ops(), self.group_rank)


@functools.lru_cache(maxsize=None)
def peer_answered(schedule_class: type) -> type:
    """`schedule_class` whose first step sets its stages' shape mode from this rank's stages' own votes instead of
    every stage's (stages with a peer, :class:`TimedStage`).

    Reason: the vote travels as tensors between the ranks and is read with ``.item()`` in the private
    ``_PipelineSchedule._warmup_p2p``, which a process group that delivers no values (fake tensors) cannot answer.
    """
    check_torch_pipelining("peer_answered")
    if not torch_pipelining_exchanges_meta():  # no vote to answer: this torch infers shapes by running the stages
        return schedule_class
    from torch.distributed.pipelining._utils import InferenceMode

    class PeerAnswered(schedule_class):  # type: ignore[misc, valid-type]
        def _warmup_p2p(self, stages: list, has_backward: bool, p2p_done: bool) -> None:
            dynamic = any(InferenceMode.needs_dynamic(st._user_meta, has_backward) for st in stages)
            for st in stages:
                st._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    return PeerAnswered


__all__ = ["TimedStage", "drop_p2p_to_self", "install_forward_only_program", "peer_answered"]
