"""Benchmark: hybrid sharding against Lightning's own strategies, side by side in one run (4 CPU processes).

    python benchmarks/hsdp.py [--json out.json] [--steps 20] [--width 512] [--depth 8]

1. Step time of `hsdp` with shard_size=1 vs Lightning's DDPStrategy, and of full sharding (`fsdp2`) vs
   Lightning's ModelParallelStrategy with the same `fully_shard` applied by hand (goal: ratio <= 1.05).
   The pairs run interleaved (A B A B) so machine noise hits both alike.
2. Model-state bytes per rank measured from the live shards after a step (parameters, gradients, AdamW
   state) vs the closed form for that stage and world size (goal: within 1%). The closed form is the
   planner's: FSDP2 chunks each parameter along dim 0 into ceil(rows / S) rows per rank, so each rank
   holds its chunk of parameters, gradients and both Adam moments; ZeRO-1 holds full parameters and
   gradients and the Adam moments of the parameters it owns.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ResidualMLP, StepTimer, print_table  # noqa: E402

import lightning_dist  # noqa: E402,F401
from lightning_dist import planner  # noqa: E402
from lightning_dist.measure import model_state_bytes  # noqa: E402
from lightning_dist.strategies import FullyShardStrategy, HybridShardStrategy  # noqa: E402

WORLD = 4


class Module(pl.LightningModule):
    def __init__(self, width: int, depth: int, steps: int, by_hand: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ResidualMLP(width, depth)
        self.steps, self.by_hand = steps, by_hand
        self.measured = None

    def configure_model(self):
        if not self.by_hand:
            return
        from torch.distributed.fsdp import fully_shard  # what a ModelParallelStrategy user writes

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def on_train_batch_end(self, outputs, batch, i):
        if i == self.steps - 1:  # after the last optimizer step: gradients and optimizer state are live
            self.measured = model_state_bytes(self, self.trainer.optimizers)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n = 64 * WORLD * self.steps
        ds = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
        return DataLoader(ds, batch_size=64)


def run(strategy, args, by_hand=False):
    module = Module(args.width, args.depth, args.steps, by_hand)
    timer = StepTimer(warmup=3)
    pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    ).fit(module)
    return timer.result(), module


def expected_bytes(module: Module, *, shard_size: int, zero_stage: int) -> int:
    """Closed form for this rank, from the planner (parameters, gradients, Adam moments; scalar `step`
    counters are left out on both sides)."""
    rank = dist.get_rank()
    shapes = [tuple(p.shape) for p in module.parameters()]  # DTensor .shape is the global shape
    state = planner.state_bytes(precision="32-true", optimizer="adamw")
    if zero_stage == 1:  # ZeroRedundancyOptimizer partitions whole parameters over all data-parallel ranks
        shard_size, zero_stage = WORLD, 1
    mb = planner.fsdp2_state_bytes(
        shapes, shard_size=shard_size, rank=rank % shard_size, state=state, zero_stage=zero_stage
    )
    return int(mb.total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    pairs = {
        "hsdp shard_size=1 / DDPStrategy": (lambda: HybridShardStrategy(shard_size=1), lambda: DDPStrategy(), False),
        "fsdp2 / ModelParallelStrategy+fully_shard": (
            lambda: FullyShardStrategy(),
            lambda: ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
            True,
        ),
    }
    timing_rows, payload = [], {"timing": {}, "memory": {}}
    for name, (ours, theirs, by_hand) in pairs.items():
        t_ours, t_theirs = [], []
        for _ in range(args.repeats):  # interleaved: A B A B
            t_ours.append(run(ours(), args)[0])
            t_theirs.append(run(theirs(), args, by_hand=by_hand)[0])
        a, b = min(t_ours), min(t_theirs)
        timing_rows.append([name, a * 1e3, b * 1e3, a / b, "yes" if a / b <= 1.05 else "no"])
        payload["timing"][name] = {"ours_s": a, "theirs_s": b, "ratio": a / b}
    print_table(
        "step time (ms, best of interleaved repeats, max over ranks)",
        ["pair", "ours", "Lightning", "ratio", "<= 1.05"],
        timing_rows,
        None,
        payload,
    )

    mem_rows = []
    for label, strategy, shard, stage in [
        ("hsdp 2x2 zero3", lambda: HybridShardStrategy(dp_replicate=2, shard_size=2), 2, 3),
        ("hsdp 2x2 zero2", lambda: HybridShardStrategy(dp_replicate=2, shard_size=2, zero_stage=2), 2, 2),
        ("fsdp2 1x4 zero3", lambda: FullyShardStrategy(), 4, 3),
        ("hsdp 4x1 (replicate)", lambda: HybridShardStrategy(shard_size=1), 1, 3),
        ("zero1 over 4", lambda: HybridShardStrategy(shard_size=1, zero_stage=1), 1, 1),
    ]:
        _, module = run(strategy(), args)
        measured = module.measured["total"]
        expected = expected_bytes(module, shard_size=shard, zero_stage=stage)
        both = torch.tensor([measured, expected], dtype=torch.float64)
        worst = torch.tensor([abs(measured / expected - 1)], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        mem_rows.append(
            [
                label,
                int(both[0]),
                int(both[1]),
                measured / expected,
                worst.item(),
                "yes" if worst.item() <= 0.01 else "no",
            ]
        )
        payload["memory"][label] = {
            "rank0_measured": int(both[0]),
            "rank0_expected": int(both[1]),
            "worst_rel_err": worst.item(),
        }
    print_table(
        "model-state bytes per rank: measured live shards vs closed form (rank 0 shown)",
        ["layout", "measured", "closed form", "ratio", "worst |ratio-1| over ranks", "<= 1%"],
        mem_rows,
        args.json,
        payload,
    )


if __name__ == "__main__":
    main()
