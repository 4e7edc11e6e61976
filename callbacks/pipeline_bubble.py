"""PipelineBubble: the measured pipeline bubble of each training step, next to the theory, and a Gantt chart.

Notes: docs/internals.md, "callbacks/pipeline_bubble.py"."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dist._compat import matplotlib_available
from lightning_dist.parallelize.pipeline.split import pipeline_view
from lightning_dist.rules import bubble_theory

COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"}


def bubble_stats(records: list[dict], pp: int) -> dict[str, Any]:
    """Idle fractions, theory and peak held micro-batches of one step from the per-rank records (pure)."""
    start = min(r["start"] for r in records)
    span = max(r["end"] for r in records) - start
    m = records[0]["n_microbatches"]
    idle = {}
    for r in records:
        busy = sum(ev[4] - ev[3] for ev in r["events"])
        idle[r["rank"]] = 1.0 - busy / span if span > 0 else 0.0
    peak: dict[int, int] = {}
    for r in records:
        for stage, held in r["peak_held"].items():
            peak[int(stage)] = max(peak.get(int(stage), 0), held)
    theory = bubble_theory(pp, m)  # the GPipe/1F1B reference, whatever the schedule (the one formula)
    mean_idle = sum(idle.values()) / len(idle)
    return {
        "idle_fraction": mean_idle,
        "idle_by_rank": idle,
        "idle_theory": theory,
        "idle_replay": replay_idle(records),
        "ratio": mean_idle / theory if theory > 0 else float("nan"),
        "span_s": span,
        "peak_held": dict(sorted(peak.items())),
        "n_microbatches": m,
        "pp": pp,
    }


def _cost(event: tuple, cpu: bool) -> float:
    return event[5] if cpu and len(event) > 5 else event[4] - event[3]


def replay_idle(records: list[dict], *, cpu: bool = True) -> float:
    """Idle fraction of the same step replayed with its measured action costs and free, instant communication.

    `cpu`: cost = the thread CPU time of each action (what the computation needs, whatever else runs on the
    machine); False: its wall time.

    Each rank runs its recorded actions in their recorded order, each as soon as its inputs exist
    (F after the previous stage's F; B/I after this stage's F and the next stage's B/I; W after this
    stage's I). What remains idle is the bubble the schedule itself leaves given the real per-action costs,
    without message latency, wake-ups and preemption (which dominate on an oversubscribed machine).
    """
    last = max(ev[0] for r in records for ev in r["events"])
    queues = {r["rank"]: sorted(r["events"], key=lambda ev: ev[3]) for r in records}
    done: dict[tuple[int, str, int], float] = {}
    free = {rank: 0.0 for rank in queues}
    pos = {rank: 0 for rank in queues}

    def deps(stage: int, kind: str, mb: int) -> list[tuple[int, str, int]]:
        if kind == "F":
            return [(stage - 1, "F", mb)] if stage > 0 else []
        if kind in ("B", "I"):
            nxt = [] if stage == last else [(stage + 1, "B", mb), (stage + 1, "I", mb)]
            return [(stage, "F", mb), *nxt]
        return [(stage, "I", mb)]

    remaining = sum(len(q) for q in queues.values())
    while remaining:
        progressed = False
        for rank, queue in queues.items():
            while pos[rank] < len(queue):
                stage, kind, mb, t0, t1 = queue[pos[rank]][:5]
                cost = _cost(queue[pos[rank]], cpu)
                need = deps(stage, kind, mb)
                if kind in ("B", "I") and stage != last:  # the next stage's backward is either a B or an I
                    ready = [done.get(need[0])] + [min((done[d] for d in need[1:] if d in done), default=None)]
                else:
                    ready = [done.get(d) for d in need]
                if any(t is None for t in ready):
                    break
                start = max([free[rank], *ready])
                free[rank] = done[(stage, kind, mb)] = start + cost
                pos[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("The recorded actions do not form a runnable schedule.")
    span = max(free.values())
    busy = {r["rank"]: sum(_cost(ev, cpu) for ev in r["events"]) for r in records}
    return sum(1.0 - b / span for b in busy.values()) / len(busy) if span > 0 else 0.0


def save_gantt(records: list[dict], path: Union[str, Path], *, title: str = "") -> Path:
    """A PNG Gantt chart of one step: a row per stage, one box per action (F/B/I/W) labelled by micro-batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    start = min(r["start"] for r in records)
    stage_rank = {ev[0]: r["rank"] for r in records for ev in r["events"]}
    stages = sorted(stage_rank)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(stages) + 1.5))
    for r in records:
        for stage, kind, mb, t0, t1, *_ in r["events"]:
            y = stages.index(stage)
            ax.broken_barh(
                [((t0 - start) * 1e3, (t1 - t0) * 1e3)],
                (y - 0.4, 0.8),
                facecolors=COLORS.get(kind, "grey"),
                edgecolor="black",
                linewidth=0.4,
            )
            ax.text((t0 + t1 - 2 * start) / 2 * 1e3, y, str(mb), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(stages)), [f"stage {s} (rank {stage_rank[s]})" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time in step (ms)")
    ax.set_title(title or "pipeline timeline")
    kinds = sorted({ev[1] for r in records for ev in r["events"]})
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], loc="upper right", fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class PipelineBubble(Callback):
    """Log the measured pipeline bubble per training step and save the last step's timeline as a PNG.

    Args:
        gantt_path: where global rank 0 writes the Gantt chart of the last recorded step (None: no chart).
        log: log ``pipeline/idle_fraction``, ``pipeline/idle_theory``, ``pipeline/peak_held_stage0``.
        warmup_steps: steps left out of :attr:`steps` (the first includes the schedule's set-up).

    After fitting, :attr:`steps` holds the statistics of each recorded step, :attr:`last_records` the
    gathered per-rank action records of the last one, and :meth:`summary` their means.
    """

    def __init__(
        self, *, gantt_path: Optional[Union[str, Path]] = None, log: bool = True, warmup_steps: int = 1
    ) -> None:
        if gantt_path is not None and not matplotlib_available():
            # checked here, on every rank, so a missing extra never surfaces after a step's collectives
            raise ModuleNotFoundError(
                f"PipelineBubble(gantt_path={str(gantt_path)!r}) draws the chart with matplotlib,"
                " which is not installed: pip install 'lightning-dist[plot]', or pass"
                " gantt_path=None."
            )
        self.gantt_path = gantt_path
        self.log_figures = log  # not `self.log`: Lightning overwrites that attribute with pl_module.log
        self.warmup_steps = warmup_steps
        self.steps: list[dict] = []
        self.last_records: Optional[list[dict]] = None
        self._seen = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        view = pipeline_view(trainer.strategy)
        if view is None:
            raise TypeError(
                f"PipelineBubble needs Trainer(strategy=PipelineStrategy(...)); got {type(trainer.strategy).__name__}."
            )
        view.record_timeline = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        view = pipeline_view(strategy)
        mine = view.pop_timelines() if view is not None else []
        pp = strategy.mesh.size("pp")  # type: ignore[attr-defined]
        for record in mine:
            gathered: list[Any] = [None] * pp
            if pp > 1:
                dist.all_gather_object(gathered, record, group=strategy.mesh.group("pp"))  # type: ignore[attr-defined]
            else:
                gathered = [record]
            self._seen += 1
            stats = bubble_stats(gathered, pp)
            self.last_records = gathered
            if self._seen > self.warmup_steps:
                self.steps.append(stats)
            if self.log_figures:
                pl_module.log("pipeline/idle_fraction", stats["idle_fraction"], on_step=True, prog_bar=False)
                pl_module.log("pipeline/idle_theory", stats["idle_theory"], on_step=True)
                pl_module.log("pipeline/peak_held_stage0", float(stats["peak_held"].get(0, 0)), on_step=True)
                pl_module.log("pipeline/idle_replay", stats["idle_replay"], on_step=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.gantt_path is not None and self.last_records and trainer.is_global_zero:
            stats = bubble_stats(self.last_records, len(self.last_records))  # one record per pp rank
            save_gantt(
                self.last_records,
                self.gantt_path,
                title=f"{type(trainer.strategy).__name__} {getattr(trainer.strategy, 'schedule', '')}:"
                f" p={stats['pp']}, m={stats['n_microbatches']}, idle {stats['idle_fraction']:.3f}"
                f" (theory {stats['idle_theory']:.3f})",
            )

    def summary(self) -> dict[str, Any]:
        """Means over the recorded steps (after warm-up)."""
        if not self.steps:
            return {}
        n = len(self.steps)
        peak: dict[int, int] = {}
        for s in self.steps:
            for k, v in s["peak_held"].items():
                peak[k] = max(peak.get(k, 0), v)
        idles = sorted(s["idle_fraction"] for s in self.steps)
        idle, best = sum(idles) / n, idles[0]
        theory = self.steps[0]["idle_theory"]
        # the step with the least idle (as timeit reports its minimum) and the median: shared machines are noisy
        replay = sorted(s["idle_replay"] for s in self.steps)[n // 2]
        return {
            "idle_fraction": idle,
            "idle_median": idles[n // 2],
            "idle_best": best,
            "idle_theory": theory,
            "idle_replay": replay,
            "ratio_replay": replay / theory if theory else float("nan"),
            "ratio": idle / theory if theory else float("nan"),
            "ratio_best": best / theory if theory else float("nan"),
            "span_s": sum(s["span_s"] for s in self.steps) / n,
            "peak_held": peak,
            "steps": n,
        }


__all__ = ["PipelineBubble", "bubble_stats", "replay_idle", "save_gantt"]
