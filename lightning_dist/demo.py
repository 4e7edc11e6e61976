"""`make demo`: hybrid-sharded training of a small CNN on 4 CPU processes through Lightning's launcher.

The data are synthetic shape images generated in-process (no download). At the end rank 0 prints a short
report: final loss and accuracy, the mesh that ran, and the model-state bytes each rank holds.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger

import lightning_dist  # noqa: F401  (registers "hsdp" and friends)
from lightning_dist.measure import model_state_bytes
from lightning_dist.models.data import ShapesDataModule
from lightning_dist.models.vision import ShapesClassifier, ShapesCNN


class DemoReport(pl.Callback):
    """Collects every rank's model-state bytes at the end of fit and prints one table on rank 0."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mine = model_state_bytes(pl_module, trainer.optimizers)
        rows = [None] * trainer.world_size
        dist.all_gather_object(rows, mine) if dist.is_initialized() else rows.__setitem__(0, mine)
        if trainer.is_global_zero:
            self._print(trainer, rows)

    def _print(self, trainer: pl.Trainer, rows: list) -> None:
        from rich.console import Console
        from rich.table import Table

        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        strategy = trainer.strategy
        shape = " x ".join(f"{n}={s}" for n, s in zip(lightning_dist.DIM_NAMES, strategy.mesh.spec.shape))
        console = Console()
        console.print(f"\n[bold]lightning-dist demo[/bold]: strategy={type(strategy).__name__}"
                      f" (zero_stage={getattr(strategy, 'zero_stage', '-')}), mesh {shape},"
                      f" {trainer.world_size} processes, {time.monotonic() - self.start:.0f} s")
        console.print(f"final train_loss {metrics.get('train_loss', float('nan')):.4f}   "
                      f"val_loss {metrics.get('val_loss', float('nan')):.4f}   "
                      f"val_acc {metrics.get('val_acc', float('nan')):.3f}   (chance 0.333)")
        table = Table(title="model-state bytes per rank (local shards)")
        for col in ("rank", "params", "grads", "optimizer", "total"):
            table.add_column(col, justify="right")
        for r, row in enumerate(rows):
            table.add_row(str(r), *(f"{row[k]:,}" for k in ("params", "grads", "optimizer", "total")))
        n_params = sum(p.numel() for p in trainer.lightning_module.parameters())
        console.print(table)
        console.print(f"unsharded: {n_params:,} parameters = {n_params * 4 * 4:,} bytes of params+grads+AdamW state"
                      " on every rank under plain DDP")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--strategy", default="hsdp")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--n-train", type=int, default=1536)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 4 processes on a few cores: no oversubscription
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    data = ShapesDataModule(n_train=args.n_train, n_val=256, batch_size=32)
    module = ShapesClassifier(model=ShapesCNN(width=16, n_blocks=2), lr=3e-3)
    log_dir = os.path.join(tempfile.gettempdir(), "lightning_dist_demo")
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=args.strategy, max_epochs=args.epochs,
        logger=CSVLogger(log_dir), enable_checkpointing=False, enable_model_summary=False,
        callbacks=[DemoReport()], log_every_n_steps=5,
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
