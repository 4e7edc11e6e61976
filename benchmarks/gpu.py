"""One-GPU benchmark of issue 15: the pack's strategies next to plain torch and the anchors a user would pick.

    python benchmarks/gpu.py [--json FILE] [--runs NAME,NAME] [--steps 30] [--warmup 10]
                             [--layers 12] [--width 768] [--heads 12] [--vocab 50304] [--seq 1024] [--batch 16]
    python benchmarks/gpu.py --smoke [--json FILE]     # every registered strategy, a few steps of a tiny GPT

The model is a user-style GPT (by default 163M parameters: 12 layers, width 768, vocab 50304, sequence 1024,
untied head), batch 16, bf16 autocast / ``precision="bf16-mixed"``, AdamW. Every run is its own process (peak
memory and CUDA state are per process), timed per step with a CUDA synchronize, median after ``--warmup`` steps:

* table 1, the pack: plain torch loop, Lightning ``strategy="auto"``, ``hsdp`` / ``fsdp2`` / ``tp`` /
  ``pipeline_1f1b`` on one device, compile on and off, the offload tiers ``offload`` (DeepSpeed ZeRO-3, CPU
  optimizer), ``offload_zero2`` and ``offload_fsdp2``;
* table 2, the anchors: DeepSpeed's own ZeRO-Offload (ZeRO-2, optimizer on CPU, ``DeepSpeedCPUAdam``, bf16),
  FSDP2 ``fully_shard`` per block + ``CPUOffloadPolicy(pin_memory=True)`` by hand, and the plain torch loop
  with ``torch.compile(model)``.

Also ``syncbn``: forward+backward ms of synchronized BatchNorm on the issue's 64x256x56x56 bf16 input, torch's
SyncBatchNorm function (what ``DataParallelBatchNorm`` now runs on CUDA) next to the hand-written CPU/gloo path.

Printed per run: step ms, tokens/s, MFU and peak GiB (``torch.cuda.max_memory_allocated``). MFU counts
``6 N + 12 L d T`` FLOPs per token (N parameters, L layers, width d, sequence T) over the chip's dense bf16
peak (known chips by name, else ``--peak-tflops``). Goals from the issue are checked in the JSON
(``goals``): offload_zero2 <= 1.05x DeepSpeed's ZeRO-Offload, offload_fsdp2 <= 1.05x (step) and <= 1.02x (peak)
the FSDP2-by-hand anchor, hsdp with compile <= the compiled plain loop.

Runs only where CUDA exists; elsewhere it exits with a message saying so (status 2).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PACK_RUNS = [
    "torch",
    "lightning_auto",
    "hsdp",
    "fsdp2",
    "tp",
    "pipeline_1f1b",
    "hsdp_compile",
    "fsdp2_compile",
    "tp_compile",
    "offload",
    "offload_zero2",
    "offload_fsdp2",
    "offload_fsdp2_compile",
]
ANCHOR_RUNS = ["anchor_deepspeed_zero_offload", "anchor_fsdp2_offload_by_hand", "anchor_torch_compile"]
EXTRA_RUNS = ["syncbn"]  # the synchronized BatchNorm of the issue: the pack's path on CUDA vs torch's function
# dense bf16 peak FLOP/s by device-name fragment (NVIDIA data sheets, SXM parts)
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12}
NO_CUDA = (
    "benchmarks/gpu.py measures the pack on a CUDA GPU, and torch.cuda.is_available() is False here"
    " (torch {version}). Run it on a machine with an NVIDIA GPU (see benchmarks/gpu_smoke.sh);"
    " on CPU use benchmarks/offload.py, hsdp.py, pipeline.py or tensor_parallel.py."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--json", help="write every result to this file")
    p.add_argument("--runs", default=",".join(PACK_RUNS + ANCHOR_RUNS + EXTRA_RUNS), help="comma-separated run names")
    p.add_argument("--smoke", action="store_true", help="every registered strategy, a few steps of a tiny GPT")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--peak-tflops", type=float, help="the chip's dense bf16 peak (TFLOP/s), if not known by name")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    # a dry run of the script's own logic on CPU (tiny sizes; figures meaningless); not a benchmark
    p.add_argument("--dry-run-cpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one configuration in this process
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def require_cuda(args: argparse.Namespace | None = None) -> None:
    """Exit with status 2 and a clear message when no CUDA device is available."""
    import torch

    if args is not None and args.dry_run_cpu:
        return
    if not torch.cuda.is_available():
        print(NO_CUDA.format(version=torch.__version__), file=sys.stderr)
        raise SystemExit(2)


def flops_per_token(n_params: int, *, layers: int, width: int, seq: int) -> float:
    """Training FLOPs per token: 6 N (forward + backward of the weights) + 12 L d T (attention scores)."""
    return 6 * n_params + 12 * layers * width * seq


def peak_flops(device_name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    return next((v for k, v in PEAK_BF16.items() if k in device_name), None)


# ---- one configuration, in its own process -------------------------------------------------------------
def _gpt(args: argparse.Namespace):
    from lightning_dist.models import GPT

    return GPT(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
        bias=True,
        tie_weights=False,
    )


def _batches(args: argparse.Namespace, n: int, device: str = "cpu"):
    import torch

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, args.vocab, (n, args.batch, args.seq + 1), generator=g)
    return [(d[:, :-1].to(device), d[:, 1:].to(device)) for d in data]


def _loss(logits, target):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(0, 1))


def _device(args: argparse.Namespace) -> str:
    return "cpu" if args.dry_run_cpu else "cuda"


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _manual_loop(args: argparse.Namespace, model, optimizer, *, autocast: bool = True, engine=None) -> list[float]:
    """Step times (s) of a hand-written training loop (``engine``: DeepSpeed's, which owns backward/step)."""
    import torch

    times, device = [], _device(args)
    for x, y in _batches(args, args.steps, device):
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = _loss((engine or model)(x), y)
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _single_process_group(device: str) -> None:
    """A one-rank process group for the anchors that need one (DeepSpeed, FSDP2 by hand)."""
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if not dist.is_initialized():
        if device == "cuda":
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        else:
            dist.init_process_group("gloo", rank=0, world_size=1)


def _strategy(name: str):
    from lightning_dist.strategies import (
        FSDP2OffloadStrategy,
        FullyShardStrategy,
        HybridShardStrategy,
        OffloadStrategy,
        PipelineStrategy,
        TensorParallelStrategy,
    )

    compile_ = name.endswith("_compile")
    base = name.removesuffix("_compile")
    if base == "lightning_auto":
        return "auto"
    if base == "hsdp":
        return HybridShardStrategy(compile=compile_)
    if base == "fsdp2":
        return FullyShardStrategy(compile=compile_)
    if base == "tp":
        return TensorParallelStrategy(tp=1, compile=compile_)
    if base == "pipeline_1f1b":
        return PipelineStrategy(schedule="1f1b", split="params", n_microbatches=2, compile=compile_)
    if base == "offload":
        return OffloadStrategy(report=False)  # ZeRO-3, optimizer state in host memory, DeepSpeedCPUAdam
    if base == "offload_zero2":
        return OffloadStrategy(zero_stage=2, report=False)
    if base == "offload_fsdp2":
        return FSDP2OffloadStrategy(report=False, compile=compile_)
    raise ValueError(f"unknown run {name!r}")


def _lightning_run(args: argparse.Namespace, name: str, strategy=None) -> list[float]:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dist.models import CharGPT

    class BenchGPT(CharGPT):
        def training_step(self, batch, batch_idx):  # no logging: nothing but the step is timed
            idx, target = batch
            return self.pipeline_loss(self(idx), target)

        def train_dataloader(self):
            # a batch size Lightning's DeepSpeed strategy can read off the loader (its config needs one)
            x, y = (torch.cat(t) for t in zip(*_batches(args, args.steps)))
            return DataLoader(TensorDataset(x, y), batch_size=args.batch)

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *_):
            _sync(device)
            self._start = time.perf_counter()

        def on_train_batch_end(self, *_):
            _sync(device)
            self.times.append(time.perf_counter() - self._start)

    device = _device(args)
    module = BenchGPT(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width, lr=3e-4
    )
    timer = Timer()
    trainer = pl.Trainer(
        accelerator=device,
        devices=1,
        strategy=strategy or _strategy(name),
        precision="bf16-mixed",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        num_sanity_val_steps=0,
    )
    trainer.fit(module)
    return timer.times


def worker(args: argparse.Namespace) -> dict:
    """Run configuration ``args.worker`` in this process; returns its raw figures."""
    import torch

    name, device = args.worker, _device(args)
    torch.manual_seed(0)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats()
    n_params = sum(p.numel() for p in _gpt(args).parameters())  # on CPU, before anything is on the GPU
    if name in ("torch", "anchor_torch_compile"):
        model = _gpt(args).to(device)
        if name == "anchor_torch_compile":
            model = torch.compile(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        times = _manual_loop(args, model, optimizer)
    elif name == "anchor_fsdp2_offload_by_hand":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        _single_process_group(device)
        model = _gpt(args).to(device)
        kw = dict(
            offload_policy=CPUOffloadPolicy(pin_memory=device == "cuda"),
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        times = _manual_loop(args, model, optimizer, autocast=False)
    elif name == "anchor_deepspeed_zero_offload":
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        _single_process_group(device)
        model = _gpt(args)
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "overlap_comm": True,
                "contiguous_gradients": True,
            },
        }
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=3e-4, adamw_mode=True)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False
        )
        times = _manual_loop(args, model, None, autocast=False, engine=engine)
    else:
        times = _lightning_run(args, name)
    steady = times[args.warmup :] or times
    step = statistics.median(steady)
    tokens = args.batch * args.seq / step
    chip = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)"
    peak = peak_flops(chip, args.peak_tflops)
    fpt = flops_per_token(n_params, layers=args.layers, width=args.width, seq=args.seq)
    return {
        "run": name,
        "step_ms": step * 1e3,
        "tokens_per_s": tokens,
        "mfu": tokens * fpt / peak if peak else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
        "params": n_params,
        "flops_per_token": fpt,
        "steps_timed": len(steady),
        "device": chip,
        "torch": torch.__version__,
    }


def syncbn(args: argparse.Namespace) -> dict:
    """Forward+backward ms of synchronized BatchNorm on the issue's 64x256x56x56 input (bf16), one rank.

    Both paths of ``DataParallelBatchNorm``: on CUDA inputs it now calls torch's SyncBatchNorm function
    (``uses_torch_kernels``, unit-tested), on CPU/gloo the hand-written function (what CUDA ran before, 2.05x
    torch in the issue). Each runs through the same one-rank NCCL group, so its collectives run (over one
    rank); with one GPU the module itself would take plain BatchNorm (nothing to sync with).
    """
    import torch
    import torch.distributed as dist

    from lightning_dist._compat import torch_sync_batchnorm_function
    from lightning_dist.callbacks.sync_batchnorm import DataParallelBatchNorm, _SyncBatchNormFn, uses_torch_kernels

    device = _device(args)
    _single_process_group(device)
    shape = (8, 16, 8, 8) if args.dry_run_cpu else (64, 256, 56, 56)
    x = torch.randn(
        shape, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32, requires_grad=True
    )
    dy = torch.randn_like(x)
    bn = DataParallelBatchNorm(shape[1], process_group=dist.group.WORLD, device=device)
    fns = {"hand-written (CPU/gloo path)": _SyncBatchNormFn}
    if uses_torch_kernels(x.device):
        fns["torch SyncBatchNorm function (CUDA path)"] = torch_sync_batchnorm_function()
    out = {}
    for name, fn in fns.items():
        times = []
        for _ in range(args.warmup + args.steps):
            x.grad = None
            _sync(device)
            start = time.perf_counter()
            y = fn.apply(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps, 0.1, dist.group.WORLD, 1)
            y.backward(dy)
            _sync(device)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times[args.warmup :]) * 1e3
    return {"run": "syncbn", "shape": list(shape), "ms": out, "dispatch_on_this_device": uses_torch_kernels(x.device)}


def smoke(args: argparse.Namespace) -> dict:
    """Every registered strategy name, 3 steps of a tiny GPT on one CUDA device: ok or the error."""
    import torch

    import lightning_dist  # noqa: F401  (registers the strategies)
    from lightning_dist.strategies import REGISTERED

    tiny = argparse.Namespace(
        **{
            **vars(args),
            "layers": 2,
            "width": 64,
            "heads": 4,
            "vocab": 128,
            "seq": 32,
            "batch": 4,
            "steps": 3,
            "warmup": 0,
        }
    )
    out = {}
    for name in REGISTERED:
        if name == "offload_nvme" and not os.path.isdir("/local_nvme"):
            out[name] = "skipped: no /local_nvme folder"
            continue
        try:
            from lightning.pytorch.strategies import StrategyRegistry

            times = _lightning_run(tiny, name, strategy=StrategyRegistry.get(name))
            out[name] = f"ok ({len(times)} steps, last {times[-1] * 1e3:.1f} ms)"
        except Exception as err:  # a smoke run reports every strategy, whatever one of them raises
            out[name] = f"error: {type(err).__name__}: {str(err)[:300]}"
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


# ---- the driver -----------------------------------------------------------------------------------------
def _run_one(args: argparse.Namespace, name: str, argv: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", name, "--out", out]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
        if proc.returncode == 0 and os.path.getsize(out):
            with open(out) as fh:
                return json.load(fh)
        return {"run": name, "error": (proc.stderr or proc.stdout)[-2000:]}
    except subprocess.TimeoutExpired:
        return {"run": name, "error": f"timed out after {time.perf_counter() - start:.0f} s"}
    finally:
        os.unlink(out)


def goals(rows: dict[str, dict]) -> dict[str, dict]:
    """The issue's targets, from the measured rows (None where a run is missing or failed)."""

    def ratio(a: str, b: str, key: str) -> float | None:
        ra, rb = rows.get(a, {}), rows.get(b, {})
        return ra[key] / rb[key] if ra.get(key) and rb.get(key) else None

    checks = {
        "offload_zero2 step / DeepSpeed ZeRO-Offload step <= 1.05": ratio(
            "offload_zero2", "anchor_deepspeed_zero_offload", "step_ms"
        ),
        "offload_fsdp2 step / FSDP2-offload-by-hand step <= 1.05": ratio(
            "offload_fsdp2", "anchor_fsdp2_offload_by_hand", "step_ms"
        ),
        "offload_fsdp2 peak / FSDP2-offload-by-hand peak <= 1.02": ratio(
            "offload_fsdp2", "anchor_fsdp2_offload_by_hand", "peak_gib"
        ),
        "hsdp_compile step / compiled plain loop step <= 1.00": ratio(
            "hsdp_compile", "anchor_torch_compile", "step_ms"
        ),
    }
    limits = [1.05, 1.05, 1.02, 1.00]
    return {k: {"ratio": v, "met": None if v is None else v <= limit} for (k, v), limit in zip(checks.items(), limits)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    require_cuda(args)
    if args.worker:
        result = {"smoke": smoke, "syncbn": syncbn}.get(args.worker, worker)(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0
    # the worker processes get the sizes, not the driver's own options
    passthrough = [
        f"--{k}={getattr(args, k.replace('-', '_'))}"
        for k in ("steps", "warmup", "layers", "width", "heads", "vocab", "seq", "batch")
    ]
    if args.peak_tflops:
        passthrough.append(f"--peak-tflops={args.peak_tflops}")
    if args.dry_run_cpu:
        passthrough.append("--dry-run-cpu")
    from rich.console import Console
    from rich.table import Table

    if args.smoke:
        result = _run_one(args, "smoke", passthrough)
        table = Table(title="CUDA smoke of every registered strategy (tiny GPT, 3 steps, bf16-mixed)")
        table.add_column("strategy")
        table.add_column("result")
        for name, status in result.items() if "error" not in result else [("all", result["error"])]:
            table.add_row(name, status)
        Console().print(table)
        payload = {"smoke": result}
    else:
        names = [n for n in args.runs.split(",") if n]
        rows = {}
        for name in names:
            rows[name] = _run_one(args, name, passthrough)
            print(json.dumps(rows[name]), flush=True)
            if args.json:  # after every run: a job stopped half-way still leaves what it measured
                with open(args.json, "w") as f:
                    json.dump({"rows": rows, "goals": goals(rows)}, f, indent=2)
        for title, group in (
            ("The pack on one GPU", [n for n in names if not n.startswith("anchor_") and n not in EXTRA_RUNS]),
            ("Anchors: the same model without the pack", [n for n in names if n.startswith("anchor_")]),
        ):
            table = Table(
                title=f"{title} ({args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch})"
            )
            for col in ("run", "step ms", "tokens/s", "MFU", "peak GiB"):
                table.add_column(col, justify="right")
            for name in group:
                r = rows[name]
                if "error" in r:
                    table.add_row(name, "error", r["error"].strip().splitlines()[-1][:60] if r["error"] else "", "", "")
                else:
                    table.add_row(
                        name,
                        f"{r['step_ms']:.1f}",
                        f"{r['tokens_per_s']:,.0f}",
                        "-" if r["mfu"] is None else f"{r['mfu']:.3f}",
                        f"{r['peak_gib']:.2f}",
                    )
            Console().print(table)
        if "syncbn" in rows:
            r = rows["syncbn"]
            print(
                "synchronized BatchNorm, forward+backward ms:",
                r.get("error", "").strip().splitlines()[-1:] or json.dumps(r["ms"]),
            )
        payload = {"rows": rows, "goals": goals(rows)}
        for goal, v in payload["goals"].items():
            figure = "-" if v["ratio"] is None else f"{v['ratio']:.3f}"
            verdict = "" if v["met"] is None else ("met" if v["met"] else "NOT met")
            print(f"{goal}: {figure} {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
