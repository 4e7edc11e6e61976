"""PipelineStrategy vs torch's pipelining driven by hand, side by side in one run on 2 CPU processes (gloo, float32).

One invocation (it starts torchrun itself)::

    python benchmarks/pipeline_vs_torch.py [--steps 12] [--vocabs 4096 256] [--schedules 1f1b interleaved_1f1b]
                                           [--no-lightning-hand] [--breakdown] [--profile] [--json FILE]

The same model (the pack's :class:`~lightning_dist.models.gpt.GPT`: width 128, 4 blocks, sequence 64, batch 16,
4 micro-batches), the same split (1F1B: embeddings + 2 blocks | 2 blocks + norm + head; interleaved: one block
per stage, stages 0, 2 on rank 0) and the same SGD, trained:

* by hand, as torchtitan does: a ``PipelineStage`` per stage module, ``Schedule1F1B`` /
  ``ScheduleInterleaved1F1B`` with the loss on the last stage (each micro-batch's loss / m with
  ``scale_grads=False``: the mean accumulates, no pass over every gradient at the end; ``return_outputs=False``: no
  logits kept or joined), each step's batch read from a ``DataLoader`` (torchtitan's ``next(data_iterator)``),
  ``optimizer.step()`` around it;
* by Lightning with ``PipelineStrategy(pp=2, n_microbatches=4, schedule=...)`` and the unchanged
  :class:`~lightning_dist.models.gpt.CharGPT` ``training_step`` (``self.pipeline_loss(self(idx), target)``,
  ``self.log(..., sync_dist=True)``);
* by Lightning with the same hand-driven schedule in ``training_step`` ("Lightning-hand", see
  :func:`_lightning_hand`; ``--no-lightning-hand`` skips it): what a Lightning user writes without the pack. Against
  the bare hand loop it measures Lightning's own loop; against it the pack's own cost.

Per (vocabulary, schedule) it prints the median step time of each side (steps after warm-up, the slower
rank), their ratios (pack / hand; Lightning-hand / hand and pack / Lightning-hand, each Lightning side against the
hand steps run beside it), and the bytes per op of one step on rank 0 from the pack's
``CommunicationLedger`` and from the same recorder around one hand step. The two sides run paired in one
process per rank: between every two steps of the pack's ``Trainer.fit`` one hand step runs between two barriers,
timed on its own (the pack's step time excludes it), so a slow spell of the machine hits both sides alike.
``--profile`` prints the cProfile top of one step of each side on rank 0 (``--profile-rank``: another rank);
``--breakdown`` prints, on rank 0, the medians of the pieces of the pack's step outside torch's schedule: the pack's
network call around the schedule and its backward, Lightning's ``self.log``, the SIGTERM flag its loop broadcasts
every step, its data fetch, and the rest of its loop (hooks, closure, ``zero_grad``, the optimizer step).
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
from typing import Callable

WIDTH, BLOCKS, SEQ, BATCH, MICRO, HEADS = 128, 4, 64, 16, 4, 4
# wall time of every torch schedule ``step`` (both sides run torch's schedules): what of each side's step is the
# schedule itself, and what the rest (optimizer, Lightning's loop, the pack's own work around the schedule)
_SCHEDULE_TIMES: list[float] = []


def _timed(owner: type, name: str, record: Callable[[float], None]) -> None:
    """Replace ``owner.name`` with a wrapper that passes each call's wall time to `record`."""
    call = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            record(time.perf_counter() - t0)

    setattr(owner, name, timed)


def _time_schedules() -> None:
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        _timed(cls, "step", _SCHEDULE_TIMES.append)


# --breakdown: wall time per step of the calls a pack step makes around torch's schedule (rank 0's are printed)
_PIECES: dict[str, float] = {}


def _time_pieces() -> None:
    """Wrap the strategy's ``training_step`` (the network call: the schedule and the pack's work around it, and the
    replayed ``self.log`` calls) and ``backward`` (the held gradients added, the returned loss checked), Lightning's
    ``self.log``, the SIGTERM flag its loop broadcasts every step and its data fetch (Lightning's private names, in
    this benchmark only)."""
    from lightning.pytorch.core.module import LightningModule
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from lightning_dist.strategies import PipelineStrategy

    for owner, name, label in (
        (PipelineStrategy, "training_step", "training_step"),
        (PipelineStrategy, "backward", "backward"),
        (LightningModule, "log", "log"),
        (_TrainingEpochLoop, "_broadcast_sigterm_tensor", "sigterm"),
        (_PrefetchDataFetcher, "__next__", "fetch"),
    ):
        _timed(owner, name, lambda dt, label=label: _PIECES.__setitem__(label, _PIECES.get(label, 0.0) + dt))


def _breakdown(pieces: list[dict], steps: list[float], scheduled: list[float]) -> str:
    """The medians of a pack step's pieces outside torch's schedule (ms)."""

    def med(values) -> float:
        return 1e3 * statistics.median(values)

    ts, bw, log, sig, fetch = (
        [d.get(k, 0.0) for d in pieces] for k in ("training_step", "backward", "log", "sigterm", "fetch")
    )
    own = [t - s - lg for t, s, lg in zip(ts, scheduled, log)]
    rest = [st - t - b - sg - f for st, t, b, sg, f in zip(steps, ts, bw, sig, fetch)]
    return (
        f"the pack's network call around the schedule {med(own):.2f} ms, its backward {med(bw):.2f} ms;"
        f" Lightning's self.log {med(log):.2f} ms, SIGTERM broadcast {med(sig):.2f} ms, data fetch {med(fetch):.2f} ms,"
        f" the rest of its loop (hooks, closure, zero_grad, the optimizer step) {med(rest):.2f} ms"
    )


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

    # each micro-batch's share of the batch mean (the schedule runs with scale_grads=False, as torchtitan's does)
    return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1)) / MICRO


def _hand_pipeline(vocab: int, schedule: str, device) -> tuple[list, object, bool, bool]:
    """This rank's stage modules, torch's schedule over them (the loss on the last stage, torchtitan's way), and
    whether the rank holds the first / the last stage."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    rank = dist.get_rank()
    model = _model(vocab)
    blocks, ranks = _stages(schedule)
    n = len(blocks)
    local = [s for s in range(n) if ranks[s] == rank]
    mods = [_stage_module(model, blocks[s], s == 0, s == n - 1) for s in local]
    stages = [pipelining.PipelineStage(m, s, n, device) for m, s in zip(mods, local)]
    cls = pipelining.Schedule1F1B if schedule == "1f1b" else pipelining.ScheduleInterleaved1F1B
    sched = cls(stages[0] if schedule == "1f1b" else stages, n_microbatches=MICRO, loss_fn=_loss, scale_grads=False)
    return mods, sched, 0 in local, n - 1 in local


def _hand_step(sched, first: bool, last: bool, x, y) -> list:
    """One schedule step; the micro-batches' losses (on the last stage's rank)."""
    losses: list = []
    kw = {"target": y, "losses": losses} if last else {}
    # no output kept or joined on the last stage (the stronger baseline; the pack's training steps do the same)
    sched.step(*((x,) if first else ()), **kw, return_outputs=False)
    return losses


class _Hand:
    """torch's pipelining driven by hand (torchtitan's way): stages, schedule, loss on the last stage, SGD."""

    def __init__(self, vocab: int, schedule: str) -> None:
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        self.mods, self.sched, self.first, self.last = _hand_pipeline(vocab, schedule, torch.device("cpu"))
        self.opt = torch.optim.SGD([p for m in self.mods for p in m.parameters()], lr=1e-3)
        # the same batch as the pack's loader gives, read from a DataLoader every step as a training loop does
        x, y = _data(vocab, BATCH)
        self.loader = DataLoader(TensorDataset(x.repeat(64, 1), y.repeat(64, 1)), batch_size=BATCH)
        self.batches = iter(self.loader)

    def step(self) -> None:
        batch = next(self.batches, None)
        if batch is None:
            self.batches = iter(self.loader)
            batch = next(self.batches)
        x, y = batch
        self.opt.zero_grad()
        _hand_step(self.sched, self.first, self.last, x, y)
        self.opt.step()


def _hand_extras(hand: _Hand, profile: bool) -> tuple[dict, str]:
    """Bytes per op of one hand step (the pack's recorder around it) and, with `profile`, its cProfile top."""
    from lightning_dist.callbacks.ledger import CollectiveRecorder

    with CollectiveRecorder() as rec:
        hand.step()
    ops: dict[str, int] = {}
    for op, _, nbytes in rec.calls:
        ops[op] = ops.get(op, 0) + nbytes
    if not profile:
        return ops, ""
    prof = cProfile.Profile()
    prof.enable()
    hand.step()
    prof.disable()
    return ops, _stats(prof)


def _lightning_hand(vocab: int, schedule: str):
    """torch's pipelining driven by hand inside Lightning: what a Lightning user writes without the pack.

    Lightning's ``ModelParallelStrategy`` starts the processes (it wraps nothing), manual optimization, the stages
    and schedule built in ``setup``, one schedule step in ``training_step`` between ``zero_grad`` and ``step``, the
    loss logged on the last stage's rank only (where it is: torchtitan reports a pipeline's loss from there too).
    Against the bare hand loop it measures Lightning's own loop; against the pack, the pack's cost for a step
    Lightning users write unchanged (the loss on every rank, identical logged values, gradient checks)."""
    import lightning.pytorch as pl
    import torch

    class LightningHand(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def setup(self, stage: str) -> None:
            mods, self.sched, self.first, self.last = _hand_pipeline(vocab, schedule, self.trainer.strategy.root_device)
            self.mods = torch.nn.ModuleList(mods)

        def configure_model(self) -> None:  # ModelParallelStrategy requires it; the stages are built in `setup`
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def training_step(self, batch, batch_idx):
            x, y = batch
            opt = self.optimizers()
            opt.zero_grad()
            losses = _hand_step(self.sched, self.first, self.last, x, y)
            opt.step()
            if self.last:
                self.log("train_loss", torch.stack(losses).sum())

    return LightningHand()


def _fit_times(
    vocab: int,
    schedule: str,
    steps: int,
    warmup: int,
    profile: bool,
    ledger: bool = False,
    hand: _Hand | None = None,
    lightning_hand: bool = False,
) -> tuple[list[float], list[float], dict, str, tuple[list[float], list[float]], list[dict]]:
    """The step times of a Lightning fit: the pack's (`lightning_hand`: :func:`_lightning_hand`'s instead) and,
    with `hand`, one hand step timed between every two of its steps (paired: a slow spell of the machine hits both
    sides alike); with `ledger`, the CommunicationLedger's bytes per op instead (its dispatch mode sees every op of
    the step: a separate fit, not timed); last, the time in torch's schedule of each timed step (fit, hand), and the
    pieces of each timed step (``--breakdown``)."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dist.callbacks import CommunicationLedger
    from lightning_dist.models.gpt import CharGPT
    from lightning_dist.strategies import PipelineStrategy

    class Task(CharGPT):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Timer(pl.Callback):
        """Wall time from one step's start to the next's: the whole loop (data, hooks, step, optimizer), less the
        hand step run (and timed on its own) in between."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.hand_times: list[float] = []
            self.schedule_times: tuple[list[float], list[float]] = ([], [])  # (pack, hand)
            self.pieces: list[dict] = []  # --breakdown: each timed step's pieces
            self.mark = 0
            self.prof: cProfile.Profile | None = None
            self.text = ""
            self.t0 = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            now = time.perf_counter()
            if warmup < batch_idx <= warmup + steps:
                self.times.append(now - self.t0)
                self.schedule_times[0].append(sum(_SCHEDULE_TIMES[self.mark :]))
                self.pieces.append(dict(_PIECES))
            if self.prof is not None:
                self.prof.disable()
                self.text, self.prof = _stats(self.prof), None
            if hand is not None and batch_idx <= warmup + steps:
                # barriers around the hand step: each side's step starts with the ranks aligned, so neither side's
                # time holds the other's tail (the last stage waiting for the first's last backward)
                dist.barrier()
                t0 = time.perf_counter()
                hand.step()
                if batch_idx >= warmup:
                    self.hand_times.append(time.perf_counter() - t0)
                    self.schedule_times[1].append(_SCHEDULE_TIMES[-1])
                dist.barrier()
            if profile and batch_idx == warmup + steps:
                self.prof = cProfile.Profile()
                self.prof.enable()
            self.mark = len(_SCHEDULE_TIMES)
            _PIECES.clear()
            self.t0 = time.perf_counter()

    if lightning_hand:
        from lightning.pytorch.strategies import ModelParallelStrategy

        task = _lightning_hand(vocab, schedule)
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    else:
        task = Task(vocab_size=vocab, block_size=SEQ, n_layer=BLOCKS, n_head=HEADS, n_embd=WIDTH)
        task.model.load_state_dict(_model(vocab).state_dict())
        split = [2] if schedule == "1f1b" else [1, 2, 3]
        strategy = PipelineStrategy(pp=2, n_microbatches=MICRO, schedule=schedule, split=split)
    x, y = _data(vocab, BATCH)
    total = warmup + steps + 2
    loader = DataLoader(TensorDataset(x.repeat(total, 1), y.repeat(total, 1)), batch_size=BATCH)
    timer = Timer()
    recorder = CommunicationLedger(skip_steps=warmup, planned=None, log=False, print_table=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        precision="32-true",
        max_steps=total,
        logger=False,
        strategy=strategy,
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
    return timer.times, timer.hand_times, ops, timer.text, timer.schedule_times, timer.pieces


def _stats(prof: cProfile.Profile) -> str:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    return buf.getvalue()


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
    _time_schedules()
    if args.breakdown:
        _time_pieces()
    results = []
    for vocab in args.vocabs:
        for schedule in args.schedules:
            hand, pack, prof, in_schedule, pieces = [], [], {}, ([], []), []
            # Lightning + torch's pipelining by hand: its step times, its paired hand steps, its times in the schedule
            lit, lit_hand, lit_schedule = [], [], []
            for r in range(args.rounds):  # each round a fit with a hand step timed between every two pack steps
                last = args.profile and r == args.rounds - 1
                paired = _Hand(vocab, schedule)
                pack_times, hand_times, _, prof["pack"], sched, step_pieces = _fit_times(
                    vocab, schedule, args.steps, args.warmup, last, hand=paired
                )
                pieces += step_pieces
                pack += pack_times
                hand += hand_times
                in_schedule[0].extend(sched[0])
                in_schedule[1].extend(sched[1])
                if args.lightning_hand:  # the same round for the hand pipeline inside Lightning
                    lit_times, lit_hand_times, _, _, lit_sched, _ = _fit_times(
                        vocab,
                        schedule,
                        args.steps,
                        args.warmup,
                        False,
                        hand=_Hand(vocab, schedule),
                        lightning_hand=True,
                    )
                    lit += lit_times
                    lit_hand += lit_hand_times
                    lit_schedule += lit_sched[0]
            hand_ops, prof["hand"] = _hand_extras(paired, args.profile)
            _, _, pack_ops, _, _, _ = _fit_times(vocab, schedule, 2, 1, False, ledger=True)
            h, p = _slowest(statistics.median(hand)), _slowest(statistics.median(pack))
            # the rest of each side's step outside torch's schedule, on rank 0 (stage 0's rank: its schedule ends
            # last, with the last backward, so its rest holds no wait for a peer)
            rest_p = statistics.median(t - s for t, s in zip(pack, in_schedule[0]))
            rest_h = statistics.median(t - s for t, s in zip(hand, in_schedule[1]))
            sched_p, sched_h = statistics.median(in_schedule[0]), statistics.median(in_schedule[1])
            row = {
                "vocab": vocab,
                "vocab_per_width": vocab / WIDTH,
                "schedule": schedule,
                "hand_ms": 1e3 * h,
                "pack_ms": 1e3 * p,
                "ratio": p / h,
                "hand_outside_schedule_ms": 1e3 * rest_h,
                "pack_outside_schedule_ms": 1e3 * rest_p,
                "hand_in_schedule_ms": 1e3 * sched_h,
                "pack_in_schedule_ms": 1e3 * sched_p,
                "hand_bytes": hand_ops,
                "pack_bytes": pack_ops,
            }
            if lit:
                # each Lightning side against the hand steps run beside it in its own fits
                lh, lhh = _slowest(statistics.median(lit)), _slowest(statistics.median(lit_hand))
                rest_l = statistics.median(t - s for t, s in zip(lit, lit_schedule))
                row.update(
                    lightning_hand_ms=1e3 * lh,
                    lightning_hand_ratio=lh / lhh,
                    pack_vs_lightning_hand=(p / h) / (lh / lhh),
                    lightning_hand_outside_schedule_ms=1e3 * rest_l,
                )
            results.append(row)
            if args.profile and rank == args.profile_rank:
                for side in ("hand", "pack"):
                    print(f"---- cProfile, one {side} step, rank {rank} ({schedule}, vocab {vocab}) ----\n{prof[side]}")
            if rank == 0:
                print(
                    f"vocab {vocab} (vocab/width {vocab / WIDTH:g}) {schedule}: hand {1e3 * h:.1f} ms,"
                    f" pack {1e3 * p:.1f} ms, pack/hand {p / h:.3f}",
                    flush=True,
                )
                print(
                    f"  rank 0 outside torch's schedule (optimizer, loop, the pack's work):"
                    f" hand {1e3 * rest_h:.1f} ms,"
                    f" pack {1e3 * rest_p:.1f} ms; in it: hand {1e3 * sched_h:.1f} ms, pack {1e3 * sched_p:.1f} ms",
                    flush=True,
                )
                if lit:
                    print(
                        f"  Lightning + torch's pipelining by hand: {row['lightning_hand_ms']:.1f} ms,"
                        f" its paired hand steps {1e3 * lhh:.1f} ms:"
                        f" Lightning-hand/hand {row['lightning_hand_ratio']:.3f}"
                        f" (rank 0 outside the schedule {1e3 * rest_l:.1f} ms); pack/Lightning-hand"
                        f" {row['pack_vs_lightning_hand']:.3f}",
                        flush=True,
                    )
                if args.breakdown:
                    print(f"  rank 0's pack step outside the schedule: {_breakdown(pieces, pack, in_schedule[0])}")
                print(f"  bytes per step on rank 0: hand {hand_ops}; pack {pack_ops}", flush=True)
    if rank == 0:
        lit = args.lightning_hand
        extra = " Lightning-hand/hand | pack/Lightning-hand |" if lit else ""
        print(
            "\n| vocab | vocab/width | schedule | hand (ms) | pack (ms) | pack/hand | rank 0 outside schedule (ms) |"
            + extra
        )
        print("| --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if lit else ""))
        for r in results:
            cells = f" {r['lightning_hand_ratio']:.3f} | {r['pack_vs_lightning_hand']:.3f} |" if lit else ""
            print(
                f"| {r['vocab']} | {r['vocab_per_width']:g} | {r['schedule']} | {r['hand_ms']:.1f} |"
                f" {r['pack_ms']:.1f} | {r['ratio']:.3f} | hand {r['hand_outside_schedule_ms']:.1f},"
                f" pack {r['pack_outside_schedule_ms']:.1f} |" + cells
            )
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per round and side")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="fits per case, each with its paired hand steps")
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32 * WIDTH, 2 * WIDTH])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved_1f1b"])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--no-lightning-hand",
        dest="lightning_hand",
        action="store_false",
        help="skip the third side: torch's pipelining driven by hand inside Lightning (ModelParallelStrategy)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="time the pieces of the pack's step outside torch's schedule (rank 0's medians; a few us of wrappers)",
    )
    parser.add_argument("--profile-rank", type=int, default=0, help="the rank whose cProfile --profile prints")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        sys.exit(_launch(sys.argv[1:]))
    _worker(args)


if __name__ == "__main__":
    main()
