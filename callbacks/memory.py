"""MemoryReport: per-rank model-state bytes from the live tensors and peak memory, next to the planner."""

from __future__ import annotations

import io
import resource
import sys
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_dist.callbacks import _planned
from lightning_dist.measure import (
    cuda_memory,
    local_bytes,
    model_state_bytes,
    model_state_places,
    placement_mismatches,
)
from lightning_dist.parallelize.ac import offloaded_bytes

_PARTS = ("params", "grads", "optimizer", "total")


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes, what): CUDA max allocated on a GPU; this process's resident-set high-water mark on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in kilobytes on Linux, in bytes on macOS
    return int(rss if sys.platform == "darwin" else rss * 1024), "process max RSS"


def _expert_state_bytes(module: torch.nn.Module, optimizers: list[Any]) -> dict[str, int]:
    """The part of :func:`~lightning_dist.measure.model_state_bytes` held by the routed experts expert parallelism
    split (their local shards, gradients and optimizer state)."""
    ids = _planned.expert_param_ids(module)
    params = [p for p in module.parameters() if id(p) in ids]
    states = [getattr(o, "_optimizer", o).state.get(p, {}) for o in optimizers for p in params]
    out = {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            local_bytes(v) for st in states for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0
        ),
    }
    return {**out, "total": sum(out.values())}


class MemoryReport(Callback):
    """Per rank: model-state bytes of the live tensors vs the planner, and peak memory.

    Model state = local shards of parameters, gradients and optimizer state (scalar ``step`` counters
    excluded), measured with :func:`lightning_dist.measure.model_state_bytes` after each optimizer step
    (gradients still present) and kept from the last step. Planned = :func:`lightning_dist.planner.fsdp2_state_bytes`
    for the actual parameter shapes (tensor-parallel local shapes), mesh, ZeRO stage, precision and optimizer
    (Adam/AdamW/SGD); "-" when the strategy or optimizer is one the planner cannot place. Under expert parallelism
    the routed experts' part is shown too, measured and planned (:func:`lightning_dist.planner.ep_state_bytes_exact`).
    Peak memory is CUDA's max allocated on a GPU, the process's max RSS on CPU (it includes the Python runtime, so it
    is no model-state figure). Logs ``memory/model_state_bytes``, ``memory/planned_bytes`` and ``memory/peak_bytes``
    per step and prints a rank-0 table at the end of fit.

    Placement is measured too: the bytes of each state by where its tensors live (``tensor.device``: the
    device or host memory), next to where the strategy plans them (an offload plan or FSDP2's
    ``CPUOffloadPolicy``: host memory; otherwise the device), and on CUDA the allocator's allocated and peak
    bytes. A state that mostly lives elsewhere than planned is a warning naming it (not on a CPU device,
    where device and host memory are the same RAM). With DeepSpeed the strategy's offload report is the
    complete account (it reads DeepSpeed's own partitions and swap files).

    Activations: each row names the strategy's ``activation_checkpointing`` mode and, with
    ``offload_activations=True``, the bytes the blocks moved to host memory in the last step's forward
    (measured by the offload hooks; logged as ``memory/offloaded_activation_bytes``). The planner's
    activation bytes per mode are :func:`lightning_dist.planner.activation_bytes` (``checkpointed=``), checked
    against torch's ``MemTracker`` by ``lightning-dist dry-run``.

    Step peak (``track_step=N``): torch's ``MemTracker`` around training step ``N`` (0: the first; the
    ``training_step`` and ``backward``, up to the optimizer step), the same tracker as ``lightning-dist dry-run``
    puts around its simulated step: its peak bytes per category (parameters, gradients, optimizer state,
    activations, temporaries) on this rank, comparable with the dry run's figures for the same layout
    (``peak_total_bytes``, ``peak_activation_bytes``). It counts tensors (the dry run's fake ones have no
    allocator), not the allocator's caching or the Python runtime. The tracker's hooks slow that step; the
    others run untracked.

    Args:
        log: log the figures through ``pl_module.log``.
        print_table: print the rank-0 table at the end of fit.
        track_step: the training step (``trainer.global_step``) to measure under ``MemTracker``; None: none.
    """

    def __init__(self, *, log: bool = True, print_table: bool = True, track_step: int | None = None) -> None:
        if track_step is not None and (not isinstance(track_step, int) or track_step < 0):
            raise ValueError(f"MemoryReport(track_step={track_step!r}): give a step index >= 0, or None.")
        # not `self.log`: Lightning sets every callback's `log` attribute to `pl_module.log` at fit start
        self.log_figures, self.print_table, self.track_step = log, print_table, track_step
        self.step_peak: dict[str, Any] | None = None
        """MemTracker's peak figures of step ``track_step`` on this rank (``peak_total_bytes``,
        ``peak_activation_bytes``, ``peak_breakdown``); None until that step ran."""
        self._tracker: Any = None
        self.measured: dict[str, int] | None = None
        """This rank's live model-state bytes after the last step."""
        self.planned: dict[str, float] | None = None
        """The planner's prediction for this rank (None when it has none)."""
        self.peak: tuple[int, str] | None = None
        """(bytes, what) peak memory of this rank."""
        self.rows: list[dict[str, Any]] = []
        """Every rank's row, gathered at the end of fit (on every rank)."""
        self.places: dict[str, dict[str, int]] | None = None
        """This rank's bytes of each state by where they live (``{"params": {"device": .., "host": ..}, ...}``)."""
        self.offloaded: int | None = None
        """Activation bytes this rank's blocks moved to host memory in the last forward (None: no offload)."""
        self.measured_experts: dict[str, int] | None = None
        """Under expert parallelism: the routed experts' part of :attr:`measured` (None without ep)."""
        self.planned_experts: dict[str, float] | None = None
        """Under expert parallelism: the routed experts' part of :attr:`planned`."""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.measured = self.planned = self.peak = self.places = self.offloaded = self.step_peak = None
        self.measured_experts = self.planned_experts = None
        self.rows = []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.track_step is None or self._tracker is not None or self.step_peak is not None:
            return
        if trainer.global_step != self.track_step:
            return
        from lightning_dist._integrations.torch_memtracker import step_tracker

        # the optimizer state and the parameters that exist before the step count as theirs, not as the step's
        self._tracker = step_tracker()
        self._tracker.track_external(pl_module, *(getattr(o, "_optimizer", o) for o in trainer.optimizers))
        self._tracker.__enter__()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._tracker is None:
            return
        from lightning_dist._integrations.torch_memtracker import peak_figures

        self.step_peak = peak_figures(self._tracker)
        self._stop_tracking()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_tracking()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_tracking()  # a step that never reached its optimizer step (manual optimization without one)

    def _stop_tracking(self) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.measured = model_state_bytes(pl_module, trainer.optimizers)
        self.places = model_state_places(pl_module, trainer.optimizers)
        self.peak = peak_memory_bytes(trainer.strategy.root_device)
        self.offloaded = offloaded_bytes(pl_module)
        if _planned.ep_degree(trainer.strategy) > 1:
            self.measured_experts = _expert_state_bytes(pl_module, trainer.optimizers)
        if self.planned is None:
            planned = _planned.planned_memory(trainer, pl_module)
            if planned is not None:
                self.planned = planned[0].to_dict()
                self.planned_experts = planned[1].to_dict() if planned[1] is not None else None
        if self.log_figures:
            pl_module.log("memory/model_state_bytes", float(self.measured["total"]), on_step=True, on_epoch=False)
            pl_module.log("memory/peak_bytes", float(self.peak[0]), on_step=True, on_epoch=False)
            if self.planned is not None:
                pl_module.log("memory/planned_bytes", float(self.planned["total"]), on_step=True, on_epoch=False)
            if self.offloaded is not None:
                pl_module.log("memory/offloaded_activation_bytes", float(self.offloaded), on_step=True, on_epoch=False)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.measured is None:
            return
        initialized = dist.is_available() and dist.is_initialized()
        row = {
            "rank": dist.get_rank() if initialized else 0,
            "measured": self.measured,
            "planned": self.planned,
            "peak_bytes": self.peak[0],
            "peak_what": self.peak[1],
            "ratio": (self.measured["total"] / self.planned["total"])
            if self.planned and self.planned["total"]
            else None,
            "activation_checkpointing": getattr(trainer.strategy, "activation_checkpointing", False),
            "offloaded_activation_bytes": self.offloaded,
            "step_peak": self.step_peak,
            "experts": None
            if self.measured_experts is None
            else {
                "measured": self.measured_experts,
                "planned": self.planned_experts,
                "ratio": self.measured_experts["total"] / self.planned_experts["total"]
                if self.planned_experts and self.planned_experts["total"]
                else None,
            },
        }
        device = trainer.strategy.root_device
        planned_places = _planned.planned_places(trainer.strategy)
        row.update(
            places=self.places,
            planned_places=planned_places,
            cuda=cuda_memory(device),
            mismatches=placement_mismatches(self.places or {}, planned_places, device_type=device.type),
        )
        # async_checkpoint=True: the host copy of this rank's shards that background saves stage (kept for reuse)
        writer = trainer.strategy.checkpoint_writer() if hasattr(trainer.strategy, "checkpoint_writer") else None
        row["checkpoint_staging_bytes"] = writer.staging_bytes if writer is not None else 0
        # planned: what a checkpoint holds of this rank's model states (its parameter and optimizer shards)
        row["planned_checkpoint_staging_bytes"] = (
            self.planned["params"] + self.planned["optimizer"] if writer is not None and self.planned else None
        )
        if initialized:
            rows: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(rows, row)
        else:
            rows = [row]
        self.rows = rows
        wrong = [f"rank {r['rank']}: {line}" for r in rows for line in r["mismatches"]]
        if wrong:
            rank_zero_warn("MemoryReport: model states not where the strategy plans them:\n  - " + "\n  - ".join(wrong))
        if self.print_table and row["rank"] == 0:
            print(
                format_memory(rows, title=f"Model-state bytes per rank ({type(trainer.strategy).__name__})"), flush=True
            )


def format_memory(rows: list[dict[str, Any]], *, title: str = "Model-state bytes per rank") -> str:
    """Rich table: per rank, measured params / grads / optimizer / total, planned total, ratio, peak memory."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    with_experts = any(r.get("experts") for r in rows)  # expert parallelism: the routed experts' part, and its plan
    for col in (
        "rank",
        "params B",
        "grads B",
        "optimizer B",
        "total B",
        "planned B",
        "measured/planned",
        *(("experts B (planned, ratio)",) if with_experts else ()),
        "host B (planned places)",
        "AC / offloaded act. B",
        "peak B",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        m, p = r["measured"], r["planned"]
        places, planned_places = r.get("places") or {}, r.get("planned_places") or {}
        host = sum(v.get("host", 0) for v in places.values())
        where = "/".join(f"{k}:{planned_places[k]}" for k in ("params", "grads", "optimizer") if k in planned_places)
        peak = f"{r['peak_bytes']:,} ({r['peak_what']})"
        if r.get("cuda"):
            peak += f"; allocated {r['cuda']['allocated']:,}"
        if r.get("step_peak"):
            step = r["step_peak"]
            peak += f"; step MemTracker {step['peak_total_bytes']:,} (act. {step['peak_activation_bytes']:,})"
        ac, off = r.get("activation_checkpointing") or "none", r.get("offloaded_activation_bytes")
        ex = r.get("experts")
        experts = "-"
        if ex is not None:
            experts = f"{ex['measured']['total']:,}"
            experts += "" if ex["planned"] is None else f" ({ex['planned']['total']:,.0f}, {ex['ratio']:.3f})"
        table.add_row(
            str(r["rank"]),
            *(f"{m[k]:,}" for k in _PARTS),
            "-" if p is None else f"{p['total']:,.0f}",
            "-" if r["ratio"] is None else f"{r['ratio']:.3f}",
            *((experts,) if with_experts else ()),
            f"{host:,} ({where})" + (" MISMATCH" if r.get("mismatches") else ""),
            f"{ac} / {'-' if off is None else f'{off:,}'}",
            peak,
        )
    buf = io.StringIO()
    Console(file=buf, width=170, force_terminal=False).print(table)
    return buf.getvalue()
