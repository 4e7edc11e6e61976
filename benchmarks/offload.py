"""Offload benchmark: peak memory, bytes on disk and step time, 2 CPU processes, one invocation.

    python benchmarks/offload.py [--json FILE] [--steps 6] [--width 2048] [--depth 12]

Side by side on the same >= 50M-parameter MLP under DeepSpeed ZeRO-3 (OffloadStrategy):
no offload, optimizer -> NVMe, optimizer + parameters -> NVMe. Each configuration runs in its own
torchrun job (peak RSS is a per-process high-water mark). Reports per rank: peak RSS over the whole run and
during training (the high-water mark is reset when training starts), bytes in the swap folder, mean step time (first
step excluded), and the ratios to the in-memory run. Goal: with
optimizer+parameters on NVMe, peak RSS lower by >= 70% of the optimizer-state bytes.

Most of each peak (~2 GiB here) is neither model state nor offload buffers: ~0.7 GiB of imports, and ~0.8-1 GiB
that glibc's allocator keeps resident after the tensors in it were freed (free chunks of its main heap: after the
first large free it serves tensors up to 32 MiB from that heap and returns only its top). That part varies by
~100 MiB from run to run and rank to rank, in every configuration; `MALLOC_MMAP_THRESHOLD_=1048576` removes it
(large tensors then go back to the system when freed), at a cost in step time, to see the live memory alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "no offload": {"optimizer": None, "parameters": None},
    "optimizer->nvme": {"optimizer": "nvme", "parameters": None},
    "optimizer+parameters->nvme": {"optimizer": "nvme", "parameters": "nvme"},
}


def worker(args: argparse.Namespace) -> None:
    """One configuration on this rank (started by torchrun)."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dist.parallelize.offload import folder_bytes
    from lightning_dist.strategies import OffloadStrategy

    torch.set_num_threads(1)

    class Model(pl.LightningModule):
        def configure_model(self) -> None:
            # built inside DeepSpeed's zero.Init (ZeRO-3): each rank materializes only its partitions
            torch.manual_seed(0)
            layers = []
            for _ in range(args.depth):
                layers += [nn.Linear(args.width, args.width), nn.GELU()]
            self.net = nn.Sequential(*layers)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            x = torch.randn(args.batch * (args.steps + 1), args.width)
            return DataLoader(TensorDataset(x), batch_size=args.batch)

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.times, self.disk = [], 0

        def on_train_start(self, *_):
            # the set-up peak first: the reset below also resets getrusage's ru_maxrss (the same counter)
            self.setup_peak = _vm_hwm()
            # training-phase peak: reset the kernel's RSS high-water mark after set-up (Linux: clear_refs 5)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

        def on_train_end(self, *_):
            self.train_peak = _vm_hwm()

        def on_train_batch_start(self, *_):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *_):
            self.times.append(time.perf_counter() - self.t0)
            self.disk = max(self.disk, folder_bytes(nvme))

    config = CONFIGS[args.worker]
    nvme = os.path.join(args.nvme_root, args.worker.replace("+", "_").replace("->", "_to_").replace(" ", "_"))
    uses_nvme = "nvme" in config.values()
    if uses_nvme:
        os.makedirs(nvme, exist_ok=True)
    strategy = OffloadStrategy(
        # the NVMe swap buffers of the parameters are the strategy's default: sized to the largest partition
        **config,
        zero_stage=3,
        nvme_path=nvme if uses_nvme else None,
        sub_group_size=args.sub_group,
        report=False,
        # Lightning's 200M-element communication buckets would dominate the RSS of a 50M-parameter model
        reduce_bucket_size=args.bucket,
        allgather_bucket_size=args.bucket,
    )
    timer = Timer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision="32-true",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    model = Model()
    trainer.fit(model)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    # whole run: the set-up peak (before the reset) or the high-water mark since (ru_maxrss, Linux reports KiB)
    peak = max(timer.setup_peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    row = {
        "config": args.worker,
        "rank": trainer.global_rank,
        "params": n_params,
        "peak_rss_all": peak,
        "peak_rss": timer.train_peak,
        "disk": timer.disk,
        "step_s": sum(timer.times[1:]) / max(1, len(timer.times) - 1),
        "optimizer_state_bytes": -(-n_params // trainer.world_size) * 12,  # fp32 master + 2 Adam moments
    }
    with open(f"{args.out}.rank{trainer.global_rank}", "w") as f:
        json.dump(row, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sub-group", type=int, default=2_000_000, help="elements per optimizer sub-group")
    parser.add_argument("--bucket", type=int, default=5_000_000, help="reduce/allgather bucket elements")
    parser.add_argument("--nvme-root", default=None, help="folder for the swap files (default: a temp dir)")
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    n_params = args.depth * (args.width * args.width + args.width)
    if n_params < 50_000_000:
        print(f"note: {n_params / 1e6:.1f}M parameters, below the 50M the benchmark is meant for", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.nvme_root) as tmp:
        for name in CONFIGS:
            out = os.path.join(tmp, "result")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=2",
                "--master-addr=127.0.0.1",
                f"--master-port={_free_port()}",
                __file__,
                "--worker",
                name,
                "--out",
                out,
                "--nvme-root",
                tmp,
                "--steps",
                str(args.steps),
                "--width",
                str(args.width),
                "--depth",
                str(args.depth),
                "--batch",
                str(args.batch),
                "--sub-group",
                str(args.sub_group),
                "--bucket",
                str(args.bucket),
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
            print(f"running {name} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{name} failed:\n{proc.stderr[-4000:]}")
            for r in range(2):
                with open(f"{out}.rank{r}") as f:
                    rows.append(json.load(f))
    _report(rows, args.json)


def _report(rows: list[dict], json_path: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    base = {r["rank"]: r for r in rows if r["config"] == "no offload"}
    table = Table(title="Offload benchmark (DeepSpeed ZeRO-3, 2 CPU processes, float32)")
    for col in (
        "config",
        "rank",
        "params",
        "peak RSS (whole run)",
        "peak RSS (training)",
        "training RSS saved / optimizer state",
        "on disk (both ranks)",
        "step",
        "step ratio",
    ):
        table.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        b = base[r["rank"]]
        r["rss_saved_fraction_of_optimizer_state"] = (b["peak_rss"] - r["peak_rss"]) / r["optimizer_state_bytes"]
        r["step_ratio"] = r["step_s"] / b["step_s"]
        table.add_row(
            r["config"],
            str(r["rank"]),
            f"{r['params'] / 1e6:.1f}M",
            f"{r['peak_rss_all'] / 2**20:.0f} MiB",
            f"{r['peak_rss'] / 2**20:.0f} MiB",
            f"{r['rss_saved_fraction_of_optimizer_state']:.0%}",
            f"{r['disk'] / 2**20:.0f} MiB",
            f"{r['step_s']:.2f} s",
            f"{r['step_ratio']:.2f}x",
        )
    Console(width=150).print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)


def _vm_hwm() -> int:
    """Peak resident bytes since the last reset (VmHWM in /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
