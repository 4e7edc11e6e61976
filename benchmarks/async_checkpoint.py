"""Benchmark: blocking vs background (``async_checkpoint=True``) sharded saves, side by side in one run.

    python benchmarks/async_checkpoint.py [--json out.json] [--width 1024] [--depth 8] [--rounds 2]

fsdp2 over 2 CPU processes, AdamW, float32; each fit trains 12 steps and saves at steps 4 and 8 through
``trainer.save_checkpoint`` (what ModelCheckpoint calls). Blocking and async fits alternate (B A B A) so
machine noise hits both alike. Per save it measures:

* the save call: how long after the save the next step starts (blocking: the whole write; async: starting
  the staging copy, which is made in the background where torch can, plus ``meta.pt``). Goal: async <= 10%
  of the blocking save;
* the staging wait: how long the next optimizer step waited for that copy (the time training stood still
  on top of the save call; 0 when the copy is made inside the save call). The blocked time is the two added;
* the step right after the save (async: the copy and the write run in the background meanwhile) relative
  to the median of the other steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ResidualMLP, print_table  # noqa: E402

from lightning_dist.checkpoint_async import BackgroundWriter  # noqa: E402
from lightning_dist.strategies import FullyShardStrategy  # noqa: E402

WORLD, STEPS, SAVE_AT = 2, 12, (4, 8)


class Net(pl.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.model = ResidualMLP(width, depth)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32 * STEPS, 64, generator=g), torch.randint(0, 10, (32 * STEPS,), generator=g))
        return DataLoader(data, batch_size=32 // WORLD)


class SaveTimer(pl.Callback):
    """Saves at SAVE_AT; records each save call's duration and every step's wall time."""

    def __init__(self, out: Path) -> None:
        self.out, self.save_s, self.steps, self._t0 = out, [], {}, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[trainer.global_step] = time.perf_counter() - self._t0
        if trainer.global_step in SAVE_AT:
            t0 = time.perf_counter()
            trainer.save_checkpoint(self.out / f"step{trainer.global_step}.ckpt")
            self.save_s.append(time.perf_counter() - t0)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


class StagingWaits:
    """The time each BackgroundWriter.wait_staged blocked (the strategy calls it before an optimizer step)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._real = BackgroundWriter.wait_staged

    def __enter__(self):
        real, seconds = self._real, self.seconds

        def timed(writer):
            t0 = time.perf_counter()
            busy = writer.staging
            real(writer)
            if busy:
                seconds.append(time.perf_counter() - t0)

        BackgroundWriter.wait_staged = timed
        return self

    def __exit__(self, *exc):
        BackgroundWriter.wait_staged = self._real


def run(async_checkpoint: bool, out: Path, width: int, depth: int) -> dict:
    timer = SaveTimer(out)
    strategy = FullyShardStrategy(async_checkpoint=async_checkpoint)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        precision="32-true",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    with StagingWaits() as waits:
        trainer.fit(Net(width, depth))
    after = [timer.steps[s + 1] for s in SAVE_AT]  # the step right after each save
    others = [t for s, t in timer.steps.items() if s > 1 and s - 1 not in SAVE_AT]
    writer = trainer.strategy.checkpoint_writer()
    return {
        "save_s": [_max_over_ranks(s) for s in timer.save_s],
        # one entry per save (0: the copy was made before the step needed it)
        "wait_s": _max_over_ranks(sum(waits.seconds)) / len(SAVE_AT),
        "after_s": [_max_over_ranks(s) for s in after],
        "step_s": _max_over_ranks(statistics.median(others)),
        "staged_mib": (writer.staging_bytes / 2**20) if writer is not None else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    args = parser.parse_args()
    pl.seed_everything(0)
    # one folder on every rank (Lightning's launcher re-runs this script per rank; rank 0 names the path anyway)
    base = Path(args.dir or Path(tempfile.gettempdir()) / "lightning_dist_async_checkpoint_bench")
    results = {False: [], True: []}
    for r in range(args.rounds):
        for mode in (False, True):
            out = base / f"{'async' if mode else 'blocking'}{r}"
            results[mode].append(run(mode, out, args.width, args.depth))
    summary = {}
    for mode, runs in results.items():
        summary["async" if mode else "blocking"] = {
            "save_s": statistics.median(s for x in runs for s in x["save_s"]),
            "after_s": statistics.median(s for x in runs for s in x["after_s"]),
            "step_s": statistics.median(x["step_s"] for x in runs),
            "wait_s": statistics.median(x["wait_s"] for x in runs),
            "staged_mib": runs[-1]["staged_mib"],
        }
    b, a = summary["blocking"], summary["async"]
    ratio = a["save_s"] / b["save_s"]
    blocked = (a["save_s"] + a["wait_s"]) / b["save_s"]
    rows = [
        [
            name,
            m["save_s"] * 1e3,
            m["wait_s"] * 1e3,
            m["after_s"] * 1e3,
            m["step_s"] * 1e3,
            m["after_s"] / m["step_s"],
            m["staged_mib"],
        ]
        for name, m in summary.items()
    ]
    rows.append(["async / blocking save", ratio, "", "", "", "", "goal <= 0.10"])
    rows.append(["async (save + wait) / blocking", blocked, "", "", "", "", ""])
    print_table(
        f"Sharded save, fsdp2 x{WORLD}, width {args.width} depth {args.depth} (median of"
        f" {args.rounds * len(SAVE_AT)} saves each)",
        ["mode", "save call ms", "staging wait ms", "step after ms", "other ms", "after / other", "staged MiB/rank"],
        rows,
        args.json,
        {
            "summary": summary,
            "runs": {k: results[k == "async"] for k in ("blocking", "async")},
            "async_over_blocking_save": ratio,
            "async_blocked_over_blocking_save": blocked,
        },
    )


if __name__ == "__main__":
    main()
