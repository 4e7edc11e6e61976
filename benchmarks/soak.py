"""Soak: a long hsdp run with frequent checkpoints must not leak memory, descriptors or processes.

    python benchmarks/soak.py [--steps 500] [--every 50] [--warmup 100] [--json out.json]

Lightning's launcher starts 4 CPU processes (hsdp 2x2, float64). Run 1 trains `--steps` steps with a
sharded checkpoint every `--every` steps (ModelCheckpoint keeps the last 2, so old ones are deleted as
in a real job); run 2 trains the same steps without checkpoints. Printed per rank:

* resident memory (RSS) after `--warmup` steps and at the end, and the growth (goal: <= 5%);
* open file descriptors and child processes at the warm-up point and at the end (goal: no growth);
* the largest parameter difference between the two runs (goal: 0, checkpointing changes nothing).
The process exits 1 if a goal is missed.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import psutil
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scenarios"))
from _common import Classifier, full_params, trainer  # noqa: E402  (the scenarios' model and Trainer helper)

from lightning_dist.strategies import HybridShardStrategy  # noqa: E402


def _print_table(*args, **kwargs):
    # benchmarks/_common.py shares its module name with tests/scenarios/_common.py: load it by path
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_common", Path(__file__).resolve().parent / "_common.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.print_table(*args, **kwargs)


class Probe(pl.Callback):
    """Samples RSS, open descriptors and child processes of this rank at the warm-up step and at the end."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.samples, self.proc = warmup, {}, psutil.Process()

    def _sample(self, name: str) -> None:
        gc.collect()
        self.samples[name] = {
            "rss": self.proc.memory_info().rss,
            "fds": self.proc.num_fds(),
            "children": len(self.proc.children(recursive=True)),
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.warmup:
            self._sample("warm")

    def on_train_end(self, trainer, pl_module):
        self._sample("end")


def run(args, out: Path | None):
    module = Classifier(n=96, width=64, depth=4, schedule=False)
    probe = Probe(args.warmup)
    callbacks = [probe]
    if out is not None:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=out, every_n_train_steps=args.every, save_top_k=2, monitor="step", mode="max", filename="{step}"
            )
        )
    strategy = HybridShardStrategy(dp_replicate=2, shard_size=2, timeout=timedelta(seconds=120))
    t = trainer(strategy, devices=4, steps=args.steps, enable_checkpointing=out is not None, callbacks=callbacks)
    start = time.perf_counter()
    t.fit(module)
    return full_params(module), probe.samples, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    out = Path(os.environ.setdefault("SOAK_DIR", tempfile.mkdtemp(prefix="soak-")))
    with_ckpt, samples, t_ckpt = run(args, out)
    without, _, t_plain = run(args, None)
    diff = max((with_ckpt[k] - without[k]).abs().max().item() for k in with_ckpt)
    mine = {
        "rank": dist.get_rank(),
        "rss_warm_mb": samples["warm"]["rss"] / 2**20,
        "rss_end_mb": samples["end"]["rss"] / 2**20,
        "growth_pct": 100 * (samples["end"]["rss"] / samples["warm"]["rss"] - 1),
        "fds": [samples["warm"]["fds"], samples["end"]["fds"]],
        "children": [samples["warm"]["children"], samples["end"]["children"]],
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    checkpoints = sorted(p.name for p in out.iterdir()) if dist.get_rank() == 0 else []
    ok = (
        all(
            r["growth_pct"] <= 5 and r["fds"][1] <= r["fds"][0] and r["children"][1] <= r["children"][0]
            for r in everyone
        )
        and diff == 0.0
    )
    rows = [
        [
            r["rank"],
            f"{r['rss_warm_mb']:.1f}",
            f"{r['rss_end_mb']:.1f}",
            f"{r['growth_pct']:+.2f}%",
            f"{r['fds'][0]} -> {r['fds'][1]}",
            f"{r['children'][0]} -> {r['children'][1]}",
        ]
        for r in everyone
    ]
    _print_table(
        f"Soak: hsdp 2x2, {args.steps} steps, checkpoint every {args.every} (warm-up {args.warmup});"
        f" max |param diff| vs no checkpoints = {diff:.3g}; {t_ckpt:.0f} s with / {t_plain:.0f} s without;"
        f" left on disk: {checkpoints}; {'PASS' if ok else 'FAIL'}",
        ["rank", "RSS warm MB", "RSS end MB", "growth", "fds", "child procs"],
        rows,
        args.json,
        {"ranks": everyone, "param_diff": diff, "seconds": [t_ckpt, t_plain], "ok": ok, "checkpoints": checkpoints},
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
