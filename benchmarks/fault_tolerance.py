"""Benchmark: the step-time cost of fault tolerance, side by side with plain hsdp (CPU, 2 processes).

    python benchmarks/fault_tolerance.py [--json out.json] [--shapes tiny realistic] [--repeats 3] [--steps N]
    python benchmarks/fault_tolerance.py --shapes tiny --repeats 1 --profile   # where a step's time goes

Plain hsdp ``dp_replicate=2, dp_shard=1`` (one job of 2 processes) against 2 torchft replica groups of 1 rank
(two jobs, the embedded lighthouse in group 0), interleaved A B A B per shape. A step is timed from the end of
one training step to the end of the next (Lightning's whole loop: the batch's read, where the fault-tolerant side
asks its quorum, forward, backward, the optimizer step and its commit vote, the figures' logging); the median
after warm-up, max over ranks (groups). Each run's ratio is fault-tolerant / plain of that run; the table gives
every run's and their mean (issue 42's goal: <= 1.05 without failures).

Shapes: ``tiny`` is the residual MLP (width 512, depth 8, 64 samples per rank: tens of ms a step), ``realistic``
the pack's GPT at a shape users train, scaled to this CPU (4 blocks, width 192, vocabulary 6,144 = 32 x width,
4 x 64 tokens per rank: a few hundred ms a step), ``larger`` the same GPT twice as wide and deep enough for steps of
about a second here (6 blocks, width 384, vocabulary 12,288, 4 x 128 tokens; opt in). ``--profile``: each rank
times, per step, where the time goes (wall clock: the quorum, forward, backward and the all-reduce in it, the commit
vote, the optimizer, the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIGHTHOUSE_PORT = 29645
SHAPES = {
    "tiny": {"model": "mlp", "width": 512, "depth": 8, "batch": 64, "steps": 30},
    "realistic": {"model": "gpt", "width": 192, "depth": 4, "vocab": 6144, "batch": 4, "seq": 64, "steps": 16},
    "larger": {"model": "gpt", "width": 384, "depth": 6, "vocab": 12288, "batch": 4, "seq": 128, "steps": 12},
}
WARMUP = 5
# what --profile times, per step (wall clock, inclusive: a row contains the rows it calls): (label, module, owner, name)
FT = "lightning_dist.strategies.fault_tolerance"
PROFILED = [
    ("batch read (Lightning's fetcher)", "lightning.pytorch.loops.fetchers", "_PrefetchDataFetcher", "__next__"),
    ("  quorum (Manager.start_quorum)", "torchft.manager", "Manager", "start_quorum"),
    ("training_step (forward)", "lightning.pytorch.strategies.strategy", "Strategy", "training_step"),
    ("backward (with the gradient all-reduce)", "lightning.pytorch.strategies.strategy", "Strategy", "backward"),
    ("  torchft all-reduce: launch", "torchft.manager", "Manager", "allreduce"),
    ("  torchft all-reduce: wait", "torchft.manager", "_ManagedWork", "wait"),
    (
        "optimizer_step (closure included)",
        "lightning_dist.strategies.fault_tolerance",
        "ReplicaGroupsMixin",
        "optimizer_step",
    ),
    ("  commit vote (Manager.should_commit)", "torchft.manager", "Manager", "should_commit"),
    ("  AdamW.step", "torch.optim", "AdamW", "step"),
    ("  figures (_record)", FT, "ReplicaGroupsMixin", "_record"),
    ("    log_dict", "lightning.pytorch.core.module", "LightningModule", "log_dict"),
]


class _Timers:
    """Wall-clock time per call of the PROFILED functions, summed while `on`."""

    def __init__(self) -> None:
        self.on, self.total = False, {}

    def install(self) -> None:
        import functools
        import importlib

        for label, module, owner, name in PROFILED:
            try:
                cls = getattr(importlib.import_module(module), owner)
            except (ImportError, AttributeError):
                continue
            fn = cls.__dict__.get(name)
            if fn is None:
                continue

            def timed(fn=fn, label=label):
                @functools.wraps(fn)
                def wrapper(*a, **k):
                    if not self.on:
                        return fn(*a, **k)
                    t = time.perf_counter()
                    try:
                        return fn(*a, **k)
                    finally:
                        self.total[label] = self.total.get(label, 0.0) + time.perf_counter() - t

                return wrapper

            setattr(cls, name, timed())

    def rows(self, steps: int) -> dict[str, float]:
        """ms per step."""
        return {label: self.total[label] * 1e3 / steps for label, *_ in PROFILED if label in self.total}


def child(args: argparse.Namespace) -> None:
    """One job: plain hsdp over 2 processes, or replica group `args.group` of 2 (1 process)."""
    sys.path.insert(0, str(HERE))
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from _common import ResidualMLP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import lightning_dist  # noqa: F401
    from lightning_dist.strategies import FaultTolerance, HybridShardStrategy

    torch.set_num_threads(1)
    timers = _Timers()
    if args.profile:
        timers.install()
    shape = SHAPES[args.shape]
    steps = args.steps or shape["steps"]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            if shape["model"] == "mlp":
                self.model = ResidualMLP(shape["width"], shape["depth"])
            else:
                from lightning_dist.models.gpt import GPT

                self.model = GPT(
                    vocab_size=shape["vocab"],
                    block_size=shape["seq"],
                    n_layer=shape["depth"],
                    n_head=4,
                    n_embd=shape["width"],
                )

        def training_step(self, batch, i):
            x, y = batch
            out = self.model(x)
            return F.cross_entropy(out.flatten(0, -2), y.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            n = shape["batch"] * 2 * steps
            if shape["model"] == "mlp":
                data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
            else:
                ids = torch.randint(0, shape["vocab"], (n, shape["seq"] + 1), generator=g)
                data = TensorDataset(ids[:, :-1], ids[:, 1:])
            sampler = DistributedSampler(data, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
            return DataLoader(data, batch_size=shape["batch"], sampler=sampler)

    class Timer(pl.Callback):
        """Each step from the previous step's end (the batch's read and its quorum included)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.last: float | None = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            if batch_idx >= WARMUP and self.last is not None:
                self.times.append(now - self.last)
            timers.on = batch_idx >= WARMUP - 1 and batch_idx < trainer.max_steps - 1
            self.last = time.perf_counter()

    if args.group is None:
        strategy, devices = HybridShardStrategy(dp_replicate=2, dp_shard=1), 2
    else:
        ft = FaultTolerance(replica_group=args.group, min_replicas=2, lighthouse_port=LIGHTHOUSE_PORT)
        strategy, devices = HybridShardStrategy(dp_replicate=2, dp_shard=1, fault_tolerance=ft), 1
    timer = Timer()
    pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[timer],
    ).fit(Module())
    t = torch.tensor(statistics.median(timer.times), dtype=torch.float64)
    if dist.is_initialized() and strategy.replica_groups == 1:  # plain: the slower rank; groups: max taken below
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    profile = timers.rows(len(timer.times)) if args.profile else None
    if profile is not None:
        profile["whole step (median)"] = statistics.median(timer.times) * 1e3
    if strategy.global_rank == 0 or profile is not None:
        line = "BENCH " + json.dumps({"seconds": t.item(), "profile": profile}) + "\n"
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), line.encode())  # one write: the ranks of one job share the pipe


def launch(args: argparse.Namespace, shape: str, group: int | None, port: int) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--child", f"--shape={shape}", f"--steps={args.steps or 0}"]
    if group is not None:
        cmd.append(f"--group={group}")
    if args.profile:
        cmd.append("--profile")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def measured(procs: list[subprocess.Popen]) -> tuple[float, list[dict]]:
    times, profiles = [], []
    for p in procs:
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"a benchmark job failed ({p.returncode}):\n{err[-4000:]}")
        for line in out.splitlines():
            if line.startswith("BENCH "):
                result = json.loads(line[6:])
                times.append(result["seconds"])
                if result["profile"] is not None:
                    profiles.append(result["profile"])
    return max(times), profiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["tiny", "realistic"])
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: per shape)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="tiny", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.steps = args.steps or None
        return child(args)
    sys.path.insert(0, str(HERE))
    from _common import print_table

    rows, payload = [], {}
    for shape in args.shapes:
        plain, ft, ratios, profiles = [], [], [], {"plain": [], "fault_tolerant": []}
        for _ in range(args.repeats):  # interleaved: A B A B
            a, prof_a = measured([launch(args, shape, None, 29670)])
            b, prof_b = measured([launch(args, shape, g, 29671 + g) for g in (0, 1)])
            plain.append(a)
            ft.append(b)
            ratios.append(b / a)
            profiles["plain"] += prof_a
            profiles["fault_tolerant"] += prof_b
        mean = statistics.mean(ratios)
        payload[shape] = {"shape": SHAPES[shape], "plain_s": plain, "fault_tolerant_s": ft, "ratios": ratios}
        rows.append(
            [
                shape,
                ", ".join(f"{x * 1e3:.1f}" for x in plain),
                ", ".join(f"{x * 1e3:.1f}" for x in ft),
                ", ".join(f"{r:.3f}" for r in ratios),
                mean,
                statistics.median(ratios),
                "yes" if mean <= 1.05 else "no",
            ]
        )
        if args.profile:
            payload[shape]["profile"] = profiles
            _print_profile(shape, profiles)
    print_table(
        f"step time (ms per run, median after warm-up; {args.repeats} runs, interleaved)",
        ["shape", "plain hsdp 2x1", "2 torchft groups x 1", "ratio per run", "mean", "median", "mean <= 1.05"],
        rows,
        args.json,
        payload,
    )


def _print_profile(shape: str, profiles: dict[str, list[dict]]) -> None:
    labels = dict.fromkeys(label for side in profiles.values() for p in side for label in p)
    print(f"\nprofile, {shape}: ms per step (wall clock, inclusive; mean over runs and ranks)")
    for label in labels:
        cells = []
        for side in ("plain", "fault_tolerant"):
            values = [p[label] for p in profiles[side] if label in p]
            cells.append(f"{statistics.mean(values):8.2f}" if values else "       -")
        print(f"  {label:40s} plain {cells[0]}   fault-tolerant {cells[1]}")


if __name__ == "__main__":
    main()
