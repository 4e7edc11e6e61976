"""Running a pipeline split with torch's schedules: which schedule, its checks, the runner of one step.
Notes: docs/internals.md."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.rules import SCHEDULES

if TYPE_CHECKING:
    from lightning_dist._integrations.torch_pipelining import TimedStage


class PipelinePeer(Protocol):
    """What this rank's pipeline peers would send it, for a process group that delivers no values (the dry run's
    fake group): the runner and its stages ask it instead of receiving."""

    def stage_input(self, stage: int) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of one micro-batch's input of `stage` (the previous stage's output)."""

    def last_stage_meta(self, key: tuple) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of what the last stage's rank holds under `key` (``("out", ...)``, ``("loss", ...)``)."""


def schedule_problems(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int) -> list[str]:
    """What torch's schedule constructors would reject, checked up front with the numbers (pure)."""
    if schedule not in SCHEDULES:
        return [f"`schedule={schedule!r}` must be one of {sorted(SCHEDULES)}."]
    out = []
    if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) or n_microbatches < 1:
        return [f"`n_microbatches={n_microbatches!r}` must be an integer >= 1."]
    multi = SCHEDULES[schedule][1] > 1
    if not multi and stages_per_rank != 1:
        out.append(
            f"schedule={schedule!r} runs one stage per rank; got stages_per_rank={stages_per_rank}."
            " Use 'interleaved_1f1b' or 'zero_bubble' for several."
        )
    if schedule == "zero_bubble" and stages_per_rank != 2:
        out.append(f"schedule='zero_bubble' (ZBV) needs stages_per_rank=2; got {stages_per_rank}.")
    if schedule != "gpipe" and n_microbatches < pp:
        out.append(f"schedule={schedule!r} needs n_microbatches >= pp = {pp}; got n_microbatches={n_microbatches}.")
    if schedule == "zero_bubble" and n_microbatches < 2 * pp - 1:
        out.append(f"schedule='zero_bubble' (ZBV) needs n_microbatches >= 2*pp-1 = {2 * pp - 1}; got {n_microbatches}.")
    if multi and n_microbatches % max(1, n_microbatches // pp):
        rounds = max(1, n_microbatches // pp)
        out.append(
            f"schedule={schedule!r} needs n_microbatches to be a multiple of the rounds n_microbatches // pp"
            f" = {rounds}; got {n_microbatches} (use a multiple of pp={pp})."
        )
    return out


def build_schedule(
    views: Sequence[nn.Module],
    local_stages: Sequence[int],
    stage_ranks: Sequence[int],
    *,
    schedule: str,
    n_microbatches: int,
    device: torch.device,
    group: Optional[Any],
    loss_fn: Optional[Callable] = None,
    peer: Optional[PipelinePeer] = None,
) -> tuple[Any, list[TimedStage]]:
    """This rank's stages (one per module of `views`) and the schedule running them.

    ``scale_grads=False``: `loss_fn` returns each micro-batch's share of the batch loss (its mean / `n_microbatches`),
    so gradients average as they accumulate, not in one more pass at the step's end. ``loss_fn=None``: forward only.
    """
    from torch.distributed import pipelining  # loaded only by a pipeline, not with the package

    from lightning_dist._integrations.torch_pipelining import TimedStage, install_forward_only_program, peer_answered

    num_stages = len(stage_ranks)
    stages = [TimedStage(view, s, num_stages, device, group=group, peer=peer) for s, view in zip(local_stages, views)]
    train = loss_fn is not None
    name = SCHEDULES[schedule][0] if train or len(stages) > 1 else "ScheduleGPipe"
    single = name in ("ScheduleGPipe", "Schedule1F1B") and len(stages) == 1
    cls = getattr(pipelining, name) if peer is None else peer_answered(getattr(pipelining, name))
    sched = cls(stages[0] if single else stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if not train and not single:
        install_forward_only_program(sched, stage_ranks, n_microbatches)
    return sched, stages


_LOSS_TAG = 0x1055  # the tag of the batch loss's transfer to the pp ranks (torch's schedules send with tag 0)


class PipelineRunner:
    """This rank's pipeline stages and their schedules, one per (training?, input shape, dtype, m).

    ``step`` runs one schedule over a batch: the output stays on the last stage's rank, the batch loss goes to every
    pp rank, the gradients stay in ``.grad`` (averaged over micro-batches; a tied weight's, `tied`: (parameter,
    group of its holders), summed over its holders). `peer`: see :class:`PipelinePeer`.
    """

    def __init__(
        self,
        views: Sequence[nn.Module],
        local_stages: Sequence[int],
        stage_ranks: Sequence[int],
        *,
        schedule: str,
        device: torch.device,
        group: Optional[Any],
        tied: Sequence[tuple[torch.Tensor, Any]] = (),
        peer: Optional[PipelinePeer] = None,
    ) -> None:
        self.views, self.local_stages, self.stage_ranks = list(views), list(local_stages), list(stage_ranks)
        self.tied, self.peer = list(tied), peer
        self.params = list({id(p): p for view in self.views for p in view.parameters()}.values())
        self.schedule, self.device, self.group = schedule, device, group
        self._schedules: dict[tuple, tuple[Any, list[TimedStage]]] = {}
        self._meta: dict[tuple, Any] = {}
        # the running step's loss, which the cached schedules call (HF labels divide by each batch's token count)
        self._loss_fn: Optional[Callable] = None
        self._seen: list[tuple[tuple[int, ...], torch.dtype]] = []  # the running step's micro-batch output metas
        self._last, self._peers = None, []
        if group is not None:
            self._last = dist.get_global_rank(group, self.stage_ranks[-1])
            self._peers = [
                dist.get_global_rank(group, r) for r in range(dist.get_world_size(group)) if r != self.stage_ranks[-1]
            ]
        # gloo matches a receive by sender and tag, so the loss's receive can wait through the schedule; NCCL
        # ignores tags, so there it is posted after the schedule, behind the schedule's own transfers
        self.receive_loss_early = group is not None and dist.get_backend(group) == "gloo"

    def step(
        self,
        x: torch.Tensor,
        *,
        n_microbatches: int,
        loss_fn: Optional[Callable] = None,
        target: Any = None,
        timeline: Optional[list] = None,
        kwargs: Optional[dict] = None,
        keep_output: bool = True,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], dict]:
        """Run the schedule on `x` (read on the first stage's rank); returns (output, loss, record).

        output: the joined output on the last stage's rank, else None; with ``keep_output=False`` (training) a meta
        tensor of its shape (the schedule keeps no logits). `kwargs`: inputs every stage takes, split along dim 0
        like `x`. loss: the batch's mean `loss_fn` on every rank (None without one). record: wall start/end, peak
        micro-batches held per local stage; `timeline` receives every F/B/I/W action.
        """
        train, m = loss_fn is not None, n_microbatches
        kwargs = dict(kwargs or {})
        shapes = tuple((k, tuple(v.shape) if isinstance(v, torch.Tensor) else None) for k, v in sorted(kwargs.items()))
        key = (train, tuple(x.shape), x.dtype, m, shapes)
        if key not in self._schedules:
            # each micro-batch's share of the batch mean, its output's shape noted (for the meta output)
            def share(out: torch.Tensor, tgt: Any) -> torch.Tensor:
                self._seen.append((tuple(out.shape), out.dtype))
                return self._loss_fn(out, tgt) / m

            share = share if train else None
            self._schedules[key] = build_schedule(
                self.views,
                self.local_stages,
                self.stage_ranks,
                schedule=self.schedule,
                n_microbatches=m,
                device=self.device,
                group=self.group,
                loss_fn=share,
                peer=self.peer,
            )
        sched, stages = self._schedules[key]
        has_last = len(self.stage_ranks) - 1 in self.local_stages
        losses: list[torch.Tensor] = []
        kw = {"target": target, "losses": losses} if train and has_last else {}
        for st in stages:
            st.timeline, st.peak_held = timeline, 0
        self._loss_fn, self._seen = loss_fn, []
        keep = keep_output or not train
        meta = self._meta.get(("loss",))  # the loss's dtype, known from the first step on
        early = train and not has_last and meta is not None and self.receive_loss_early
        posted = self._post_loss_receive(meta[1]) if early else None
        try:
            start = time.perf_counter()
            out = sched.step(*((x,) if 0 in self.local_stages else ()), **kw, **kwargs, return_outputs=keep)
            end = time.perf_counter()
        finally:  # nothing of this step stays with the runner
            self._loss_fn = None
            for st in stages:
                st.timeline = None
        record = {"start": start, "end": end, "peak_held": {st.stage_index: st.peak_held for st in stages}}
        out = out if has_last else None
        if has_last and not keep:  # the joined output's shape: the micro-batches' along dim 0 (torch's default merge)
            # the last m calls (a schedule's first step also calls the loss once to infer the backward's metadata)
            seen = self._seen[-m:]
            assert len(seen) == m, f"{len(seen)} micro-batch losses for {m} micro-batches"
            (first, dtype), rows = seen[0], sum(shape[0] for shape, _ in seen)
            out = torch.empty((rows, *first[1:]), dtype=dtype, device="meta")
        self._seen = []
        loss = None
        if train:
            value = torch.stack([micro_loss.detach() for micro_loss in losses]).sum() if losses else None
            loss = self._loss_to_all(value, posted)
            if self.tied:
                self._sum_tied_gradients()
        return out, loss, record

    def _sum_tied_gradients(self) -> None:
        """Each tied parameter's gradient summed over its holders (FSDP2: the same shard on each), as Megatron does."""
        from torch.distributed.tensor import DTensor

        for p, group in self.tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=group)

    def _post_loss_receive(self, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
        buf = torch.empty((), dtype=dtype, device=self.device)
        return dist.irecv(buf, src=self._last, group=self.group, tag=_LOSS_TAG), buf

    def _loss_to_all(self, value: Optional[torch.Tensor], posted: Optional[tuple[Any, torch.Tensor]]) -> torch.Tensor:
        """The batch loss (`value`, held by the last stage's rank) on every pp rank, sent point to point: a
        broadcast's rendezvous costs the first stage's rank a round trip on the step's critical path. Under gloo the
        others posted their receive before their schedule (`posted`)."""
        if self.group is None:
            assert value is not None
            return value
        _, dtype = self.output_meta(value, ("loss",))
        if value is not None:
            for work in [dist.isend(value, dst=peer, group=self.group, tag=_LOSS_TAG) for peer in self._peers]:
                work.wait()
            return value
        work, buf = posted if posted is not None else self._post_loss_receive(dtype)
        work.wait()
        return buf

    def output_meta(self, value: Optional[torch.Tensor], key: tuple) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of a tensor held by the last stage's rank, on every pp rank (broadcast once per `key`)."""
        if self.group is None or (value is not None and self.peer is not None):
            assert value is not None
            return tuple(value.shape), value.dtype
        if self.peer is not None:
            return self.peer.last_stage_meta(key)
        if key not in self._meta:
            meta = [(tuple(value.shape), value.dtype) if value is not None else None]
            dist.broadcast_object_list(meta, src=self._last, group=self.group, device=self.device)
            self._meta[key] = meta[0]
        return self._meta[key]

    def from_last_stage(self, value: Optional[torch.Tensor], key: tuple) -> torch.Tensor:
        """Broadcast a tensor held by the last stage's rank to the whole pp group (shapes cached per `key`)."""
        if self.group is None:
            assert value is not None
            return value.detach()
        shape, dtype = self.output_meta(value, key)
        buf = value.detach().contiguous() if value is not None else torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(buf, src=self._last, group=self.group)
        return buf

    def clear(self) -> None:
        self._schedules.clear()
        self._meta.clear()


__all__ = [
    "PipelinePeer",
    "PipelineRunner",
    "build_schedule",
    "schedule_problems",
]
