"""Benchmark: the step-time cost of fault tolerance, side by side with plain hsdp (CPU, 2 processes).

    python benchmarks/fault_tolerance.py [--json out.json] [--steps 30] [--width 512] [--depth 8] [--repeats 2]

Plain hsdp ``dp_replicate=2, dp_shard=1`` (one job of 2 processes) against 2 torchft replica groups of 1 rank
(two jobs, the embedded lighthouse in group 0), interleaved A B A B; the median step time after warm-up, max over
ranks (groups), best of the repeats; the ratio fault-tolerant / plain (issue 42's goal: <= 1.05 without failures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIGHTHOUSE_PORT = 29645


def child(args: argparse.Namespace) -> None:
    """One job: plain hsdp over 2 processes, or replica group `args.group` of 2 (1 process)."""
    sys.path.insert(0, str(HERE))
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from _common import ResidualMLP, StepTimer
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import lightning_dist  # noqa: F401
    from lightning_dist.strategies import FaultTolerance, HybridShardStrategy

    torch.set_num_threads(1)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = ResidualMLP(args.width, args.depth)

        def training_step(self, batch, i):
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            n = 64 * 2 * args.steps
            data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
            sampler = DistributedSampler(data, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
            return DataLoader(data, batch_size=64, sampler=sampler)

    if args.group is None:
        strategy, devices = HybridShardStrategy(dp_replicate=2, dp_shard=1), 2
    else:
        ft = FaultTolerance(replica_group=args.group, min_replicas=2, lighthouse_port=LIGHTHOUSE_PORT)
        strategy, devices = HybridShardStrategy(dp_replicate=2, dp_shard=1, fault_tolerance=ft), 1
    timer = StepTimer(warmup=5)
    pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[timer],
    ).fit(Module())
    seconds = timer.result()
    if strategy.global_rank == 0:
        print("BENCH " + json.dumps({"seconds": seconds}), flush=True)


def launch(args: argparse.Namespace, group: int | None, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        f"--steps={args.steps}",
        f"--width={args.width}",
        f"--depth={args.depth}",
    ]
    if group is not None:
        cmd.append(f"--group={group}")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def measured(procs: list[subprocess.Popen]) -> float:
    times = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"a benchmark job failed ({p.returncode}):\n{err[-4000:]}")
        times += [json.loads(line[6:])["seconds"] for line in out.splitlines() if line.startswith("BENCH ")]
    return max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    sys.path.insert(0, str(HERE))
    from _common import print_table

    plain, ft = [], []
    for _ in range(args.repeats):  # interleaved: A B A B
        plain.append(measured([launch(args, None, 29670)]))
        ft.append(measured([launch(args, g, 29671 + g) for g in (0, 1)]))
    a, b = min(ft), min(plain)
    payload = {"plain_s": b, "fault_tolerant_s": a, "ratio": a / b, "runs": {"plain": plain, "fault_tolerant": ft}}
    print_table(
        f"step time (ms; width {args.width}, depth {args.depth}, 64 samples per rank; best of {args.repeats})",
        ["layout", "plain hsdp 2x1", "2 torchft groups x 1", "ratio", "<= 1.05"],
        [["dp_replicate=2", b * 1e3, a * 1e3, a / b, "yes" if a / b <= 1.05 else "no"]],
        args.json,
        payload,
    )


if __name__ == "__main__":
    main()
