"""`make demo`: hybrid-sharded training of a small BatchNorm CNN on 4 CPU processes through Lightning's launcher.

Notes: docs/internals.md, "lightning_dist/demo.py"."""

from __future__ import annotations

import argparse
import math
import os
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger

import lightning_dist
from lightning_dist.callbacks import ExactEvaluation, GradientParityCheck, MeshSyncBatchNorm
from lightning_dist.measure import model_state_bytes
from lightning_dist.models.data import ShapesDataModule
from lightning_dist.models.vision import ShapesClassifier, ShapesCNN
from lightning_dist.strategies import HybridShardStrategy

BATCH_SIZE = 32  # per process


class DemoReport(pl.Callback):
    """Measures each rank's model-state bytes before every optimizer step (gradients and optimizer state both
    exist there; after the step the strategy frees the gradients) and gathers them at the end of training."""

    def __init__(self, parity: GradientParityCheck) -> None:
        self.start = time.monotonic()
        self.parity = parity
        self.state: dict[str, int] = {}
        self.rows: list[dict[str, int]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        # gradients reduced and sharded, AdamW moments from the previous steps: what the step works on
        self.state = model_state_bytes(pl_module, trainer.optimizers)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a collective on every rank; printed by `print_report` once fit has returned and the bar is gone
        self.rows = [None] * trainer.world_size
        dist.all_gather_object(self.rows, self.state) if dist.is_initialized() else self.rows.__setitem__(0, self.state)

    def print_report(self, trainer: pl.Trainer) -> None:
        from rich.console import Console
        from rich.table import Table

        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        strategy = trainer.strategy
        shape = " x ".join(f"{n}={s}" for n, s in zip(lightning_dist.DIM_NAMES, strategy.mesh.spec.shape) if s > 1)
        console = Console()
        console.print(
            f"\n[bold]lightning-dist demo[/bold]: strategy={type(strategy).__name__}"
            f" (zero_stage={getattr(strategy, 'zero_stage', '-')}), mesh {shape},"
            f" {trainer.world_size} CPU processes, {trainer.global_step} steps, {time.monotonic() - self.start:.0f} s",
            soft_wrap=True,
        )
        console.print(
            f"final train_loss {metrics.get('train_loss', float('nan')):.4f}   "
            f"val_loss {metrics.get('val_loss', float('nan')):.4f}   "
            f"val_acc {metrics.get('val_acc', float('nan')):.3f}   (chance 0.333; every one of"
            f" {int(metrics.get('val_samples', 0))} validation images scored once: ExactEvaluation)",
            soft_wrap=True,
        )
        for r in self.parity.results:
            console.print(
                f"step {r['step']}: distributed gradient vs one device on the whole batch of {r['global_batch']}"
                f" images: relative difference {r['rel_diff']:.1e} ({trainer.precision} precision,"
                f" tolerance {r['tolerance']:.0e}; BatchNorm statistics pooled over the ranks: MeshSyncBatchNorm)",
                soft_wrap=True,
            )
        table = Table(title="model-state bytes per rank (local shards, measured before the last optimizer step)")
        for col in ("rank", "params", "grads", "optimizer", "total"):
            table.add_column(col, justify="right")
        for r, row in enumerate(self.rows):
            table.add_row(str(r), *(f"{row[k]:,}" for k in ("params", "grads", "optimizer", "total")))
        n_params = sum(p.numel() for p in trainer.lightning_module.parameters())
        element = torch.finfo(trainer.lightning_module.dtype).bits // 8
        console.print(table)
        console.print(
            f"unsharded: {n_params:,} parameters = {n_params * element * 4:,} bytes of params+grads+AdamW state"
            " on every rank under plain DDP",
            soft_wrap=True,
        )
        console.print(f"logs: {Path(trainer.logger.log_dir).resolve()}/metrics.csv", soft_wrap=True)


def _steps(n_train: int, devices: int, epochs: int) -> int:
    """Optimizer steps of the run: each rank's share of the images (the sampler pads) in batches, per epoch."""
    return math.ceil(math.ceil(n_train / devices) / BATCH_SIZE) * epochs


def _strategy(name: str, devices: int) -> pl.strategies.Strategy | str:
    """ "hsdp" as 2 replicas of ``devices / 2`` shards (a two-node layout on one machine); other names as given."""
    if name != "hsdp" or devices < 2 or devices % 2:
        return name
    return HybridShardStrategy(shard_size=devices // 2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--strategy", default="hsdp", help="hsdp: 2 replicas x devices/2 shards; or any name")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--n-train", type=int, default=1536)
    parser.add_argument("--precision", default="64-true", help="float64: the differences are rounding only")
    parser.add_argument("--log-dir", default="lightning_logs", help="a new version_N folder under <this>/demo")
    args = parser.parse_args(argv)
    # Lightning 2.6 builds torch's deprecated LeafSpec on every step under torch >= 2.13: noise, not the demo's
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 4 processes on a few cores: no oversubscription
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    data = ShapesDataModule(n_train=args.n_train, n_val=256, batch_size=BATCH_SIZE)
    module = ShapesClassifier(model=ShapesCNN(width=16, n_blocks=2), lr=3e-3)
    last = _steps(args.n_train, args.devices, args.epochs) - 1
    parity = GradientParityCheck(steps=(0, last))  # raises if a distributed step is not the single-device one
    report = DemoReport(parity)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=_strategy(args.strategy, args.devices),
        max_epochs=args.epochs,
        precision=args.precision,
        logger=CSVLogger(args.log_dir, name="demo"),
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[MeshSyncBatchNorm(), ExactEvaluation(), parity, report],
        log_every_n_steps=5,
    )
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:  # after fit: the progress bar has drawn its last frame, the report ends the output
        report.print_report(trainer)


if __name__ == "__main__":
    main()
