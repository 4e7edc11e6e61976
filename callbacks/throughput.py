"""ThroughputSummary: global samples/s through Lightning's loggers, and a rank-0 summary table at the end of fit."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

from lightning_dist.mesh import data_parallel_info

_OWN_PREFIXES = ("throughput/", "memory/", "comm/")


class ThroughputSummary(Callback):
    """Logs training throughput in global samples/s and prints a rank-0 summary of the fit.

    Samples are counted over the data-parallel group only: tensor- and pipeline-parallel peers train
    on the same samples and are counted once (:func:`lightning_dist.mesh.data_parallel_info`).
    Per step, over a sliding window of ``window_size`` steps (Lightning's
    :class:`~lightning.fabric.utilities.throughput.Throughput`, with the dp size as its world size), it logs
    ``throughput/samples_per_sec`` (global) and ``throughput/device_samples_per_sec`` (one dp rank)
    through ``pl_module.log``, so every Lightning logger (CSV, TensorBoard, ...) receives them.

    At the end of training it gathers every rank's counts once (no collective during steps) and logs
    ``throughput/fit_samples_per_sec`` (samples seen by all dp ranks after the first ``skip_steps`` steps,
    divided by the slowest rank's time) and ``throughput/fit_samples`` to ``trainer.loggers``. At the end
    of fit, rank 0 prints one table: throughput, the final scalar metrics (``trainer.callback_metrics``)
    and, when :class:`~lightning_dist.callbacks.MemoryReport` / :class:`~lightning_dist.callbacks.CommunicationLedger`
    are among ``trainer.callbacks``, their model-state bytes, peak memory and payload bytes per step.
    The figures are also kept in :attr:`summary` on every rank.

    Args:
        window_size: steps in the sliding window of the per-step figures (>= 2); nothing is logged per
            step until the window is full.
        skip_steps: first steps left out of the fit average (compilation, allocator warm-up).
        batch_size_fn: ``fn(batch) -> int`` samples in a batch on this rank; default: Lightning's
            ``extract_batch_size`` (dim 0 of the first tensor).
        log: log the figures through Lightning's loggers.
        print_table: print the rank-0 summary table at the end of fit.
    """

    def __init__(
        self,
        *,
        window_size: int = 10,
        skip_steps: int = 1,
        batch_size_fn: Callable[[Any], int] | None = None,
        log: bool = True,
        print_table: bool = True,
    ) -> None:
        problems = []
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 2:
            problems.append(f"`window_size={window_size!r}` must be an integer >= 2 (steps in the sliding window).")
        if isinstance(skip_steps, bool) or not isinstance(skip_steps, int) or skip_steps < 0:
            problems.append(f"`skip_steps={skip_steps!r}` must be an integer >= 0.")
        if batch_size_fn is not None and not callable(batch_size_fn):
            problems.append(f"`batch_size_fn={batch_size_fn!r}` must be callable (batch -> number of samples) or None.")
        if problems:
            raise ValueError("Invalid ThroughputSummary configuration:\n  - " + "\n  - ".join(problems))
        self.window_size, self.skip_steps, self.batch_size_fn = window_size, skip_steps, batch_size_fn
        # not `self.log`: Lightning overwrites a callback's `log` attribute with `pl_module.log` at fit start
        self.log_figures, self.print_table = log, print_table
        self.summary: dict[str, Any] = {}
        """Filled at the end of training on every rank: fit throughput, memory and communication figures."""
        self._throughput: Throughput | None = None
        self._t0: float | None = None
        self._batches = self._samples = 0
        self._skip_mark: tuple[float, int] | None = None  # (time, samples) when the skipped steps ended

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _, dp_size, _ = data_parallel_info(trainer.strategy)
        self._throughput = Throughput(world_size=dp_size, window_size=self.window_size)
        self._t0, self._batches, self._samples, self._skip_mark, self.summary = None, 0, 0, None, {}

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._t0 is None:  # time the steps, not the set-up before the first batch
            _synchronize(trainer.strategy.root_device)
            self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._throughput is None or self._t0 is None:
            return
        _synchronize(trainer.strategy.root_device)
        elapsed = time.perf_counter() - self._t0
        self._batches += 1
        self._samples += int(self.batch_size_fn(batch) if self.batch_size_fn else extract_batch_size(batch))
        if self._skip_mark is None and trainer.global_step >= self.skip_steps:
            self._skip_mark = (elapsed, self._samples) if self.skip_steps else (0.0, 0)
        self._throughput.update(time=elapsed, batches=self._batches, samples=self._samples)
        metrics = self._throughput.compute()
        if self.log_figures and "device/samples_per_sec" in metrics:
            per_device = metrics["device/samples_per_sec"]
            global_rate = metrics.get("samples_per_sec", per_device)  # dp size 1: no global entry
            pl_module.log("throughput/samples_per_sec", float(global_rate), on_step=True, on_epoch=False)
            pl_module.log("throughput/device_samples_per_sec", float(per_device), on_step=True, on_epoch=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._t0 is None:
            return
        elapsed = time.perf_counter() - self._t0
        _, dp_size, dp_rank = data_parallel_info(trainer.strategy)
        mark_time, mark_samples = self._skip_mark or (0.0, 0)
        row = {
            "rank": _rank(),
            "dp_rank": dp_rank,
            "samples": self._samples,
            "time": elapsed,
            "timed_samples": self._samples - mark_samples,
            "timed_time": elapsed - mark_time,
            "memory": _memory_figures(trainer),
            "comm": _comm_figures(trainer),
        }
        rows = _gather(row)
        by_dp = {r["dp_rank"]: r for r in rows}  # tp/pp peers of a dp rank saw the same samples: count them once
        samples = sum(r["samples"] for r in by_dp.values())
        timed = sum(r["timed_samples"] for r in by_dp.values())
        slowest = max(r["timed_time"] for r in rows)
        self.summary = {
            "strategy": type(trainer.strategy).__name__,
            "world_size": len(rows),
            "dp_size": dp_size,
            "steps": trainer.global_step,
            "samples": samples,
            "time_s": max(r["time"] for r in rows),
            "samples_per_sec": timed / slowest if slowest > 0 else float("nan"),
            "metrics": {
                k: float(v)
                for k, v in trainer.callback_metrics.items()
                if not k.startswith(_OWN_PREFIXES)  # the pack's figures have rows of their own
                and (isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1))
            },
            "ranks": rows,
        }
        if self.log_figures:
            for logger in trainer.loggers:  # loggers write on rank 0 only (rank_zero_only)
                logger.log_metrics(
                    {
                        "throughput/fit_samples_per_sec": self.summary["samples_per_sec"],
                        "throughput/fit_samples": float(samples),
                    },
                    step=trainer.global_step,
                )

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.print_table and self.summary and self.summary["ranks"][0]["rank"] == _rank():
            print(format_summary(self.summary), flush=True)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # kernels are asynchronous: time what ran, not what was queued
        torch.cuda.synchronize(device)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _gather(row: dict[str, Any]) -> list[dict[str, Any]]:
    if dist.is_available() and dist.is_initialized():
        rows: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        return rows
    return [row]


def _find(trainer: pl.Trainer, cls: type) -> Any:
    return next((cb for cb in trainer.callbacks if isinstance(cb, cls)), None)


def _memory_figures(trainer: pl.Trainer) -> dict[str, Any] | None:
    """This rank's last MemoryReport measurement (read directly: its own table may come later in on_fit_end)."""
    from lightning_dist.callbacks.memory import MemoryReport

    report = _find(trainer, MemoryReport)
    if report is None or report.measured is None:
        return None
    return {
        "model_state_bytes": report.measured["total"],
        "planned_bytes": None if report.planned is None else report.planned["total"],
        "peak_bytes": report.peak[0] if report.peak else None,
        "peak_what": report.peak[1] if report.peak else "",
    }


def _comm_figures(trainer: pl.Trainer) -> dict[str, float] | None:
    """This rank's CommunicationLedger mean payload bytes per step, by mesh dim."""
    from lightning_dist.callbacks.ledger import CommunicationLedger

    ledger = _find(trainer, CommunicationLedger)
    if ledger is None or not ledger.steps:
        return None
    out: dict[str, float] = {}
    for (_, dim), (_, nbytes) in ledger.per_step().items():
        out[dim] = out.get(dim, 0.0) + nbytes
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """Rich table of a :attr:`ThroughputSummary.summary`: throughput, final metrics, memory and communication."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Fit summary ({summary['strategy']}, {summary['world_size']} processes,"
        f" data-parallel size {summary['dp_size']})"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("optimizer steps", f"{summary['steps']:,}")
    table.add_row("samples (all dp ranks)", f"{summary['samples']:,}")
    table.add_row("training time (s)", f"{summary['time_s']:.2f}")
    table.add_row("throughput (global samples/s)", f"{summary['samples_per_sec']:,.1f}")
    for name, value in sorted(summary["metrics"].items()):
        table.add_row(name, f"{value:.4g}")
    rows = summary["ranks"]
    memory = [r["memory"] for r in rows if r["memory"] is not None]
    if memory:
        table.add_row("model-state bytes per rank (max)", f"{max(m['model_state_bytes'] for m in memory):,}")
        planned = [m["planned_bytes"] for m in memory if m["planned_bytes"] is not None]
        if planned:
            table.add_row("planned bytes per rank (max)", f"{max(planned):,.0f}")
        peaks = [m for m in memory if m["peak_bytes"] is not None]
        if peaks:
            top = max(peaks, key=lambda m: m["peak_bytes"])
            table.add_row(f"peak memory per rank (max, {top['peak_what']})", f"{top['peak_bytes']:,}")
    comm = [r["comm"] for r in rows if r["comm"] is not None]
    if comm:
        dims = sorted({d for c in comm for d in c})
        for dim in dims:
            table.add_row(f"payload bytes per step on {dim} (max rank)", f"{max(c.get(dim, 0.0) for c in comm):,.0f}")
    buf = io.StringIO()
    Console(file=buf, width=100, force_terminal=False).print(table)
    return buf.getvalue()
