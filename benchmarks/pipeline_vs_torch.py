"""PipelineStrategy vs torch's pipelining driven by hand, side by side in one run on 2 CPU processes (gloo, float32).

One invocation (it starts torchrun itself)::

    python benchmarks/pipeline_vs_torch.py [--steps 12] [--vocabs 4096 256] [--schedules 1f1b interleaved_1f1b]
                                           [--profile] [--json FILE]

The same model (the pack's :class:`~lightning_dist.models.gpt.GPT`: width 128, 4 blocks, sequence 64, batch 16,
4 micro-batches), the same split (1F1B: embeddings + 2 blocks | 2 blocks + norm + head; interleaved: one block
per stage, stages 0, 2 on rank 0) and the same SGD, trained:

* by hand, as torchtitan does: a ``PipelineStage`` per stage module, ``Schedule1F1B`` /
  ``ScheduleInterleaved1F1B`` with the loss on the last stage, ``optimizer.step()`` around it;
* by Lightning with ``PipelineStrategy(pp=2, n_microbatches=4, schedule=...)`` and the unchanged
  :class:`~lightning_dist.models.gpt.CharGPT` ``training_step`` (``self.pipeline_loss(self(idx), target)``,
  ``self.log(..., sync_dist=True)``).

Per (vocabulary, schedule) it prints the median step time of each side (steps after warm-up, the slower
rank), their ratio pack / hand, and the bytes per op of one step on rank 0 from the pack's
``CommunicationLedger`` and from the same recorder around one hand step. The rounds alternate (hand,
pack, pack, hand, ...) so a slow moment of the machine hits both. ``--profile`` prints the cProfile top of one
step of each side on rank 0.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

WIDTH, BLOCKS, SEQ, BATCH, MICRO, HEADS = 128, 4, 64, 16, 4, 4


def _launch(argv: list[str]) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={29500 + os.getpid() % 1000}",
        __file__,
        *argv,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.call(cmd, env=env)


def _model(vocab: int):
    import torch

    from lightning_dist.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=vocab, block_size=SEQ, n_layer=BLOCKS, n_head=HEADS, n_embd=WIDTH)
    return model


def _data(vocab: int, n: int):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, SEQ + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _stages(schedule: str) -> tuple[list[list[int]], list[int]]:
    """Blocks of each stage and the rank of each stage (the pack's layout for the same split points)."""
    if schedule == "1f1b":
        return [[0, 1], [2, 3]], [0, 1]
    return [[0], [1], [2], [3]], [0, 1, 0, 1]


def _stage_module(model, blocks: list[int], first: bool, last: bool):
    import copy

    from torch import nn

    stage = copy.deepcopy(model)
    if not first:
        stage.tok_emb = stage.pos_emb = None
    if not last:
        stage.norm = stage.lm_head = None
    stage.blocks = nn.ModuleList(b if i in blocks else None for i, b in enumerate(stage.blocks))
    return stage


def _loss(out, target):
    import torch.nn.functional as F

    return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))


class _Hand:
    """torch's pipelining driven by hand (torchtitan's way): stages, schedule, loss on the last stage, SGD."""

    def __init__(self, vocab: int, schedule: str) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed import pipelining

        rank = dist.get_rank()
        model = _model(vocab)
        blocks, ranks = _stages(schedule)
        n = len(blocks)
        self.mods = [_stage_module(model, blocks[s], s == 0, s == n - 1) for s in range(n) if ranks[s] == rank]
        local = [s for s in range(n) if ranks[s] == rank]
        stages = [pipelining.PipelineStage(m, s, n, torch.device("cpu")) for m, s in zip(self.mods, local)]
        cls = pipelining.Schedule1F1B if schedule == "1f1b" else pipelining.ScheduleInterleaved1F1B
        self.sched = cls(stages[0] if schedule == "1f1b" else stages, n_microbatches=MICRO, loss_fn=_loss)
        self.first, self.last = 0 in local, n - 1 in local
        self.opt = torch.optim.SGD([p for m in self.mods for p in m.parameters()], lr=1e-3)
        self.x, self.y = _data(vocab, BATCH)

    def step(self) -> None:
        self.opt.zero_grad()
        losses: list = []
        kw = {"target": self.y, "losses": losses} if self.last else {}
        self.sched.step(*((self.x,) if self.first else ()), **kw)
        self.opt.step()


def _hand_times(vocab: int, schedule: str, steps: int, warmup: int, profile: bool) -> tuple[list[float], dict, str]:
    from lightning_dist.callbacks.ledger import CollectiveRecorder

    hand = _Hand(vocab, schedule)
    times = []
    for _ in range(warmup):
        hand.step()
    for _ in range(steps):
        t0 = time.perf_counter()
        hand.step()
        times.append(time.perf_counter() - t0)
    with CollectiveRecorder() as rec:
        hand.step()
    ops: dict[str, int] = {}
    for op, _, nbytes in rec.calls:
        ops[op] = ops.get(op, 0) + nbytes
    return times, ops, _profiled(hand.step) if profile else ""


def _profiled(fn) -> str:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    return buf.getvalue()


def _pack_times(
    vocab: int, schedule: str, steps: int, warmup: int, profile: bool, ledger: bool = False
) -> tuple[list[float], dict, str]:
    """The pack's step times; with `ledger`, the CommunicationLedger's bytes per op instead (its dispatch mode
    sees every op of the step: a separate fit, not timed)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dist.callbacks import CommunicationLedger
    from lightning_dist.models.gpt import CharGPT
    from lightning_dist.strategies import PipelineStrategy

    class Task(CharGPT):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Timer(pl.Callback):
        """Wall time from one step's start to the next's: the whole loop (data, hooks, step, optimizer)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.prof: cProfile.Profile | None = None
            self.t0 = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            now = time.perf_counter()
            if warmup < batch_idx <= warmup + steps:
                self.times.append(now - self.t0)
            if self.prof is not None:
                self.prof.disable()
            if profile and batch_idx == warmup + steps:
                self.prof = cProfile.Profile()
                self.prof.enable()
            self.t0 = now

    task = Task(vocab_size=vocab, block_size=SEQ, n_layer=BLOCKS, n_head=HEADS, n_embd=WIDTH)
    task.model.load_state_dict(_model(vocab).state_dict())
    x, y = _data(vocab, BATCH)
    total = warmup + steps + 2
    loader = DataLoader(TensorDataset(x.repeat(total, 1), y.repeat(total, 1)), batch_size=BATCH)
    split = [2] if schedule == "1f1b" else [1, 2, 3]
    timer = Timer()
    recorder = CommunicationLedger(skip_steps=warmup, planned=None, log=False, print_table=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        precision="32-true",
        max_steps=total,
        logger=False,
        strategy=PipelineStrategy(pp=2, n_microbatches=MICRO, schedule=schedule, split=split),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[recorder] if ledger else [timer],
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(task, loader)
    ops: dict[str, int] = {}
    for (op, dim), (_, nbytes) in recorder.per_step().items() if ledger else ():
        ops[f"{op}/{dim}"] = ops.get(f"{op}/{dim}", 0) + int(nbytes)
    text = ""
    if timer.prof is not None:
        buf = io.StringIO()
        pstats.Stats(timer.prof, stream=buf).sort_stats("tottime").print_stats(18)
        text = buf.getvalue()
    return timer.times, ops, text


def _slowest(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    for vocab in args.vocabs:
        for schedule in args.schedules:
            hand, pack, prof = [], [], {}
            for r in range(args.rounds):  # alternating (hand, pack, pack, hand, ...): a slow spell hits both sides
                last = args.profile and r == args.rounds - 1
                for side in ("hand", "pack") if r % 2 == 0 else ("pack", "hand"):
                    if side == "hand":
                        times, hand_ops, prof["hand"] = _hand_times(vocab, schedule, args.steps, args.warmup, last)
                        hand += times
                    else:
                        times, _, prof["pack"] = _pack_times(vocab, schedule, args.steps, args.warmup, last)
                        pack += times
            _, pack_ops, _ = _pack_times(vocab, schedule, 2, 1, False, ledger=True)
            h, p = _slowest(statistics.median(hand)), _slowest(statistics.median(pack))
            row = {
                "vocab": vocab,
                "vocab_per_width": vocab / WIDTH,
                "schedule": schedule,
                "hand_ms": 1e3 * h,
                "pack_ms": 1e3 * p,
                "ratio": p / h,
                "hand_bytes": hand_ops,
                "pack_bytes": pack_ops,
            }
            results.append(row)
            if rank == 0:
                print(
                    f"vocab {vocab} (vocab/width {vocab / WIDTH:g}) {schedule}: hand {1e3 * h:.1f} ms,"
                    f" pack {1e3 * p:.1f} ms, pack/hand {p / h:.3f}",
                    flush=True,
                )
                print(f"  bytes per step on rank 0: hand {hand_ops}; pack {pack_ops}", flush=True)
                if args.profile:
                    for side in ("hand", "pack"):
                        print(f"---- cProfile, one {side} step, rank 0 ({schedule}, vocab {vocab}) ----\n{prof[side]}")
    if rank == 0:
        print("\n| vocab | vocab/width | schedule | hand (ms) | pack (ms) | pack/hand |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in results:
            print(
                f"| {r['vocab']} | {r['vocab_per_width']:g} | {r['schedule']} | {r['hand_ms']:.1f} |"
                f" {r['pack_ms']:.1f} | {r['ratio']:.3f} |"
            )
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round and side")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="alternating hand/pack rounds")
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32 * WIDTH, 2 * WIDTH])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved_1f1b"])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        sys.exit(_launch(sys.argv[1:]))
    _worker(args)


if __name__ == "__main__":
    main()
