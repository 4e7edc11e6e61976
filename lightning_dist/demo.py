"""`make demo`: hybrid-sharded training of a small BatchNorm CNN on 4 CPU processes through Lightning's launcher.

The data are synthetic shape images generated in-process (no download). The pack's callbacks make the run
equal to one device on the whole batch: ``MeshSyncBatchNorm`` pools the BatchNorm statistics over the
data-parallel ranks, ``ExactEvaluation`` scores every validation image once (no padded duplicates), and
``GradientParityCheck`` compares the distributed gradient of step 0 with the one a single device computes on
the same global batch. At the end rank 0 prints a short report: final loss and accuracy, that measured
gradient difference, the mesh that ran, and the model-state bytes each rank held at its last optimizer step
(parameters, gradients and AdamW state all alive).
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
from lightning_dist.callbacks import ExactEvaluation, GradientParityCheck, MeshSyncBatchNorm
from lightning_dist.measure import model_state_bytes
from lightning_dist.models.data import ShapesDataModule
from lightning_dist.models.vision import ShapesClassifier, ShapesCNN


class DemoReport(pl.Callback):
    """Measures each rank's model-state bytes before every optimizer step (gradients and optimizer state both
    exist there; after the step the strategy frees the gradients) and prints one table on rank 0 at the end."""

    def __init__(self, parity: GradientParityCheck) -> None:
        self.start = time.monotonic()
        self.parity = parity
        self.state: dict[str, int] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        # gradients reduced and sharded, AdamW moments from the previous steps: what the step works on
        self.state = model_state_bytes(pl_module, trainer.optimizers)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rows = [None] * trainer.world_size
        dist.all_gather_object(rows, self.state) if dist.is_initialized() else rows.__setitem__(0, self.state)
        if trainer.is_global_zero:
            self._print(trainer, rows)

    def _print(self, trainer: pl.Trainer, rows: list) -> None:
        from rich.console import Console
        from rich.table import Table

        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        strategy = trainer.strategy
        shape = " x ".join(f"{n}={s}" for n, s in zip(lightning_dist.DIM_NAMES, strategy.mesh.spec.shape))
        console = Console()
        console.print(
            f"\n[bold]lightning-dist demo[/bold]: strategy={type(strategy).__name__}"
            f" (zero_stage={getattr(strategy, 'zero_stage', '-')}), mesh {shape},"
            f" {trainer.world_size} processes, {time.monotonic() - self.start:.0f} s",
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
                f"gradient at step {r['step']}, distributed vs one device on the same {r['global_batch']}"
                f" images: relative difference {r['rel_diff']:.1e} ({trainer.precision} precision,"
                f" tolerance {r['tolerance']:.0e};"
                " BatchNorm statistics pooled over the ranks: MeshSyncBatchNorm)",
                soft_wrap=True,
            )
        table = Table(title="model-state bytes per rank (local shards, measured before the last optimizer step)")
        for col in ("rank", "params", "grads", "optimizer", "total"):
            table.add_column(col, justify="right")
        for r, row in enumerate(rows):
            table.add_row(str(r), *(f"{row[k]:,}" for k in ("params", "grads", "optimizer", "total")))
        n_params = sum(p.numel() for p in trainer.lightning_module.parameters())
        console.print(table)
        console.print(
            f"unsharded: {n_params:,} parameters = {n_params * 4 * 4:,} bytes of params+grads+AdamW state"
            " on every rank under plain DDP",
            soft_wrap=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--strategy", default="hsdp")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--n-train", type=int, default=1536)
    parser.add_argument(
        "--precision", default="32-true", help="e.g. 64-true: the gradient difference drops to float64 rounding"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 4 processes on a few cores: no oversubscription
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    data = ShapesDataModule(n_train=args.n_train, n_val=256, batch_size=32)
    module = ShapesClassifier(model=ShapesCNN(width=16, n_blocks=2), lr=3e-3)
    log_dir = os.path.join(tempfile.gettempdir(), "lightning_dist_demo")
    parity = GradientParityCheck(steps=(0,))  # raises if the distributed step is not the single-device one
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.epochs,
        precision=args.precision,
        logger=CSVLogger(log_dir),
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[MeshSyncBatchNorm(), ExactEvaluation(), parity, DemoReport(parity)],
        log_every_n_steps=5,
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
