"""Shared pieces of the benchmarks: a residual MLP, a step timer and table/JSON output."""

from __future__ import annotations

import json
import statistics
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn


class ResidualMLP(nn.Module):
    """stem -> `depth` residual Linear+GELU blocks (the FSDP2 units) -> a 10-way head; 64 input features."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.stem = nn.Linear(64, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


class StepTimer(pl.Callback):
    """Wall time of each training step after `warmup` steps; `result()` is the median, max over ranks."""

    def __init__(self, warmup: int = 3) -> None:
        self.warmup, self.times, self._t0 = warmup, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._t0)

    def result(self) -> float:
        t = torch.tensor(statistics.median(self.times), dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()


def print_table(title: str, columns: list[str], rows: list[list], json_path: str | None, payload: dict) -> None:
    """Rank 0 prints a rich table and optionally writes `payload` as JSON."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r))
    Console().print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=2)
