"""What the router loss costs a pipeline: ``PipelineStrategy(pp=2)`` steps of the pack's ``CharMoEGPT`` with
``aux_loss_coef=0.01`` (a forward-only counting pass before each schedule) against the same steps with
``aux_loss_coef=0`` (no counting pass after the first step), side by side in one run on 2 CPU processes (gloo,
float32). The two runs alternate in rounds, so a slow spell of the machine hits both alike.

One invocation (it starts torchrun itself)::

    python benchmarks/moe_pipeline_router.py [--steps 12] [--rounds 3] [--schedule 1f1b] [--json FILE]

Prints the median step time of each side per round (steps after warm-up, the slower rank) and their ratio
(with / without the router loss). Notes: docs/moe.md, "Pipelines".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

SIZES = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, n_experts=8, top_k=2, expert_hidden=128)


def _worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_dist  # noqa: F401  (registers the strategies)
    from lightning_dist.models.data import CHAR_VOCAB_SIZE
    from lightning_dist.models.moe import CharMoEGPT
    from lightning_dist.strategies import PipelineStrategy

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self.start)

    def run(coef: float) -> float:
        torch.manual_seed(0)
        n = (args.steps + 1) * 16
        data = TensorDataset(torch.randint(0, CHAR_VOCAB_SIZE, (n, 64)), torch.randint(0, CHAR_VOCAB_SIZE, (n, 64)))
        timer = Timer()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=PipelineStrategy(pp=2, schedule=args.schedule, n_microbatches=4),
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer],
        )
        trainer.fit(CharMoEGPT(aux_loss_coef=coef, **SIZES), DataLoader(data, batch_size=16))
        mine = torch.tensor(statistics.median(timer.times[2:]))
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return float(mine)

    rows = []
    for r in range(args.rounds):
        with_loss, without = run(0.01), run(0.0)
        rows.append({"round": r, "with_router_loss_s": with_loss, "without_s": without, "ratio": with_loss / without})
        if int(os.environ["RANK"]) == 0:
            print(
                f"round {r}: with the router loss {with_loss * 1e3:.1f} ms, without {without * 1e3:.1f} ms,"
                f" ratio {with_loss / without:.3f}",
                flush=True,
            )
    if int(os.environ["RANK"]) == 0:
        mean = statistics.mean(r["ratio"] for r in rows)
        print(
            f"pp2 {args.schedule}, CharMoEGPT {SIZES}: with / without the router loss,"
            f" mean of {args.rounds}: {mean:.3f}"
        )
        if args.json:
            Path(args.json).write_text(json.dumps({"sizes": SIZES, "schedule": args.schedule, "rounds": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if "RANK" in os.environ:
        _worker(args)
        return
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", __file__, *sys.argv[1:]]
    raise SystemExit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
