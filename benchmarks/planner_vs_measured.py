"""Benchmark: the planner's memory and traffic predictions against the live run, for the example models.

    python benchmarks/planner_vs_measured.py [--json out.json] [--steps 4] [--models cnn,vit,gpt]

Four CPU processes (Lightning's launcher), float32 AdamW. For ShapesCNN, ViT and the char-level GPT of
``lightning_dist.models`` under hsdp 2x2, fsdp2 1x4 and replicate 4x1 (``shard_size=1``: DDP's bucketed
all-reduce), :class:`~lightning_dist.callbacks.MemoryReport` measures each rank's model-state bytes from
the live shards and :class:`~lightning_dist.callbacks.CommunicationLedger` records every collective of a
step; rank 0 prints two tables side by side:

* memory: rank 0's measured and planned bytes and the worst measured / planned over the ranks;
* communication: mean payload bytes per step for each (op, dim) on rank 0, planned, and the ratio
  (payload convention of ``lightning_dist.planner``: all-gather = output, reduce-scatter = input,
  all-reduce / broadcast = tensor). Rows without a plan are traffic the planner does not model
  (e.g. DDP broadcasting BatchNorm buffers every forward, or rebuilding its buckets once).
"""

from __future__ import annotations

import argparse
import json
import os

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.callbacks import CommunicationLedger, MemoryReport
from lightning_dist.models import GPT, ShapesCNN, ViT
from lightning_dist.strategies import FullyShardStrategy, HybridShardStrategy

WORLD = 4
MODELS = {
    "cnn": ("ShapesCNN", lambda: ShapesCNN(in_channels=1, width=16, n_blocks=2, num_classes=3)),
    "vit": ("ViT", lambda: ViT(image_size=16, patch_size=4, dim=32, depth=2, n_heads=4, num_classes=3)),
    "gpt": ("GPT", lambda: GPT(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32)),
}
LAYOUTS = {
    "hsdp 2x2": lambda: HybridShardStrategy(dp_replicate=2, shard_size=2),
    "fsdp2 1x4": lambda: FullyShardStrategy(),
    "replicate 4x1": lambda: HybridShardStrategy(shard_size=1),
}


class Task(pl.LightningModule):
    """Cross-entropy on random data of the model's kind (images for the CNN / ViT, tokens for the GPT)."""

    def __init__(self, kind: str, steps: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.steps = kind, steps
        self.model = MODELS[kind][1]()

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.model(x)
        return F.cross_entropy(out.flatten(0, 1) if out.dim() == 3 else out, y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g, n = torch.Generator().manual_seed(1), 8 * WORLD * self.steps
        if self.kind == "gpt":
            ds = TensorDataset(torch.randint(0, 40, (n, 16), generator=g), torch.randint(0, 40, (n, 16), generator=g))
        else:
            ds = TensorDataset(torch.randn(n, 1, 16, 16, generator=g), torch.randint(0, 3, (n,), generator=g))
        return DataLoader(ds, batch_size=8)


def measure(kind: str, layout: str, steps: int) -> tuple[list[dict], list[dict], int]:
    ledger, memory = CommunicationLedger(print_table=False, log=False), MemoryReport(print_table=False, log=False)
    task = Task(kind, steps)
    n_params = sum(p.numel() for p in task.parameters())
    pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=LAYOUTS[layout](),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ledger, memory],
    ).fit(task)
    return memory.rows, ledger.summary, n_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write every figure (all ranks) to this file")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--models", default="cnn,vit,gpt")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    kinds = args.models.split(",")
    unknown = sorted(set(kinds) - set(MODELS))
    if unknown:
        raise ValueError(f"Unknown model(s) {unknown}; pick from {sorted(MODELS)}.")

    payload, mem_rows, comm_rows = [], [], []
    for kind in kinds:
        for layout in LAYOUTS:
            memory, comm, n_params = measure(kind, layout, args.steps)
            # every rank's comm rows: the worst ratio over ranks goes in the table
            all_comm: list = [None] * dist.get_world_size()
            dist.all_gather_object(all_comm, comm)
            payload.append(
                {"model": MODELS[kind][0], "layout": layout, "params": n_params, "memory": memory, "comm": all_comm}
            )
            ratios = [r["ratio"] for r in memory if r["ratio"] is not None]
            worst = max(ratios, key=lambda v: abs(v - 1)) if ratios else None
            r0 = memory[0]
            mem_rows.append(
                [
                    MODELS[kind][0],
                    layout,
                    f"{r0['measured']['total']:,}",
                    "-" if r0["planned"] is None else f"{r0['planned']['total']:,.0f}",
                    "-" if worst is None else f"{worst:.3f}",
                ]
            )
            for row in comm:
                worst_c = [
                    c["ratio"]
                    for rank_rows in all_comm
                    for c in rank_rows
                    if (c["op"], c["dim"]) == (row["op"], row["dim"]) and c["ratio"] is not None
                ]
                comm_rows.append(
                    [
                        MODELS[kind][0],
                        layout,
                        f"{row['op']} / {row['dim']}",
                        f"{row['count']:.0f}",
                        f"{row['bytes']:,.0f}",
                        "-" if row["planned_bytes"] is None else f"{row['planned_bytes']:,.0f}",
                        "-" if not worst_c else f"{max(worst_c, key=lambda v: abs(v - 1)):.3f}",
                    ]
                )

    if dist.get_rank() != 0:
        return
    from rich.columns import Columns
    from rich.console import Console
    from rich.table import Table

    mem = Table(title="Model-state bytes per rank (rank 0; ratio: worst over ranks)")
    for col in ("model", "layout", "measured", "planned", "meas/plan"):
        mem.add_column(col, justify="left" if col in ("model", "layout") else "right")
    for r in mem_rows:
        mem.add_row(*r)
    comm = Table(title=f"Payload bytes per step (rank 0, mean of steps 2..{args.steps}; ratio: worst over ranks)")
    for col in ("model", "layout", "op / dim", "calls", "measured", "planned", "meas/plan"):
        comm.add_column(col, justify="left" if col in ("model", "layout", "op / dim") else "right")
    for r in comm_rows:
        comm.add_row(*r)
    Console(width=200).print(Columns([mem, comm]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
