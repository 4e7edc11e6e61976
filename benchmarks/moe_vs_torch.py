"""FullyShardStrategy(ep=N) vs expert parallelism written by hand with torch, side by side in one run (CPU, gloo).

One invocation (it starts torchrun itself, once per process count)::

    python benchmarks/moe_vs_torch.py [--procs 2 4] [--steps 12] [--rounds 3] [--profile] [--json FILE]

The same model (the pack's :class:`~lightning_dist.models.moe.MoEGPT`: width 128, 2 blocks, 8 experts of width 256,
top-2 softmax routing, sequence 64, 8 sequences per rank, float32), the same routing, loss (cross-entropy plus 0.01
times the router loss over the global batch) and AdamW, with ``ep`` = the number of processes, trained:

* by hand, as torchtitan's token dispatcher does it: each experts module's parameters ``Shard(0)`` DTensors on the
  ``ep`` mesh, the (token, choice) pairs sorted by expert, the per-expert counts exchanged with ``all_to_all_single``
  first, the tokens sent with the differentiable functional ``all_to_all_single``, regrouped by local expert, run one
  expert at a time on its local weights, regrouped back, returned the same way and added into each token, weighted;
  experts FSDP2-sharded over the data-parallel ranks left (``dp_shard / ep``, with torchtitan's gradient divide factor),
  every block on the data-parallel mesh, the model as root;
* by Lightning with ``FullyShardStrategy(ep=N)`` and a ``training_step`` that returns the same loss.

Per process count it prints the median step time of each side (steps after warm-up, the slower rank), pack/hand, and
the all-to-all bytes of one step on rank 0 from the pack's ``CommunicationLedger`` (a separate, untimed fit: its
dispatch mode sees every op) beside the same recorder around one hand step. The two sides run paired in one process
per rank: between every two steps of the pack's ``Trainer.fit`` one hand step runs between two barriers, timed on its
own (the pack's step time excludes it), so a slow spell of the machine hits both sides alike. Both sides start from
the same weights and see the same batches: their losses are printed side by side as a check that they compute the
same thing. ``--profile`` prints the cProfile top of one step of each side on rank 0.
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

VOCAB, SEQ, BATCH, WIDTH, BLOCKS, HEADS = 512, 64, 8, 128, 2, 4
EXPERTS, TOP_K, EXPERT_HIDDEN, COEF, LR = 8, 2, 256, 0.01, 1e-3


def _launch(procs: int, argv: list[str]) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={procs}",
        "--master-addr=127.0.0.1",
        f"--master-port={29500 + (os.getpid() + procs) % 1000}",
        __file__,
        *argv,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.call(cmd, env=env)


def _model():
    import torch

    from lightning_dist.models.moe import MoEGPT

    torch.manual_seed(0)
    return MoEGPT(
        vocab_size=VOCAB,
        block_size=SEQ,
        n_layer=BLOCKS,
        n_head=HEADS,
        n_embd=WIDTH,
        n_experts=EXPERTS,
        top_k=TOP_K,
        expert_hidden=EXPERT_HIDDEN,
    )


def _batches(rank: int, n: int):
    """`n` batches of this rank's own sequences (each rank routes different tokens)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, VOCAB, (n * BATCH, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), batch_size=BATCH)


def _loss(model, x, y):
    import torch.nn.functional as F

    return F.cross_entropy(model(x).flatten(0, 1), y.flatten()) + COEF * model.aux_loss()


def _hand_experts_forward(experts, group, ep: int):
    """torchtitan's token dispatch and combine around `experts`' own math, on its local experts (a DTensor's local
    part): counts first, then the tokens, both with ``all_to_all_single``."""
    import torch
    import torch.nn.functional as F
    from torch.distributed import _functional_collectives as funcol

    n_local = experts.num_experts // ep

    def forward(x, top_k_index, top_k_weights):
        n_tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs in expert order
        tokens = order // k
        counts = torch.bincount(flat, minlength=experts.num_experts)
        with torch.no_grad():  # the token counts first: every rank learns its splits
            counts_in = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, group))
            per_source = counts_in.view(ep, n_local)
            send = counts.view(ep, n_local).sum(1).tolist()
            recv = per_source.sum(1).tolist()
        arrived = funcol.all_to_all_single_autograd(x[tokens], recv, send, group)
        # rows arrive grouped by (source rank, local expert): regroup by local expert (torchtitan's _permute)
        expert_of_row = torch.arange(n_local).repeat(ep).repeat_interleave(per_source.reshape(-1))
        perm = torch.argsort(expert_of_row, stable=True)
        gate_up, down = experts.gate_up.to_local(), experts.down.to_local()
        outs = []
        for e, rows in enumerate(torch.split(arrived[perm], per_source.sum(0).tolist())):
            gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, down[e]))
        out = torch.cat(outs)[torch.argsort(perm)]  # back to the arrival order
        back = funcol.all_to_all_single_autograd(out, send, recv, group)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add(0, tokens, back * weights)

    return forward


class _Hand:
    """Expert parallelism written by hand (torchtitan's layout and dispatcher), FSDP2, AdamW, a plain loop."""

    def __init__(self, rank: int, world: int, n_batches: int) -> None:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard, distribute_tensor

        ep = world
        self.model = model = _model()
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        group = mesh["ep"].get_group()
        for block in model.blocks:
            experts = block.mlp.experts
            for name, p in list(experts.named_parameters(recurse=False)):
                shard = distribute_tensor(p.detach(), mesh["ep"], [Shard(0)], src_data_rank=None)
                experts.register_parameter(name, nn.Parameter(shard))
            experts.forward = _hand_experts_forward(experts, group, ep)
            fully_shard(experts, mesh=mesh["efsdp"])
            # each rank's experts ran every ep peer's tokens: divide their summed gradient by the whole dp degree
            experts.set_gradient_divide_factor(float(world))
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=None)
        self.group = dist.group.WORLD  # the router loss over the global batch (the data-parallel ranks)
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.loader = _batches(rank, n_batches)
        self.batches = iter(self.loader)
        self.losses: list[float] = []
        self.profile = ""  # --profile: the cProfile top of one step

    def step(self) -> None:
        from lightning_dist.parallelize.moe import global_balance_loss

        x, y = next(self.batches)
        self.opt.zero_grad()
        with global_balance_loss(self.group):  # the model's router loss reduced as the pack's step reduces it
            loss = _loss(self.model, x, y)
        loss.backward()
        self.opt.step()
        self.losses.append(loss.item())


def _fit(rank: int, world: int, steps: int, warmup: int, *, hand=None, ledger: bool = False, profile: bool = False):
    """The pack's fit: its step times and, with `hand`, one hand step timed between every two of its steps; with
    `ledger`, the CommunicationLedger's bytes per (op, dim) of a step instead (not timed)."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist

    from lightning_dist.callbacks import CommunicationLedger
    from lightning_dist.strategies import FullyShardStrategy

    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = _loss(self.model, *batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class Timer(pl.Callback):
        """Wall time from one step's start to the next's (the whole loop), less the hand step run in between."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.hand_times: list[float] = []
            self.t0 = 0.0
            self.prof: cProfile.Profile | None = None
            self.text = ""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            now = time.perf_counter()
            if warmup < batch_idx <= warmup + steps:
                self.times.append(now - self.t0)
            if self.prof is not None:
                self.prof.disable()
                self.text, self.prof = _stats(self.prof), None
            if hand is not None and batch_idx <= warmup + steps:
                dist.barrier()  # each side's step starts with the ranks aligned
                t0 = time.perf_counter()
                if profile and batch_idx == warmup + steps:
                    prof = cProfile.Profile()
                    prof.enable()
                    hand.step()
                    prof.disable()
                    hand.profile = _stats(prof)
                else:
                    hand.step()
                if batch_idx >= warmup:
                    self.hand_times.append(time.perf_counter() - t0)
                dist.barrier()
            if profile and batch_idx == warmup + steps - 1:
                self.prof = cProfile.Profile()
                self.prof.enable()
            self.t0 = time.perf_counter()

    total = warmup + steps + (0 if ledger else 2)
    task = Task()
    timer = Timer()
    recorder = CommunicationLedger(skip_steps=warmup, planned=None, log=False, print_table=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        precision="32-true",
        max_steps=total,
        logger=False,
        strategy=FullyShardStrategy(ep=world),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[recorder] if ledger else [timer],
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(task, _batches(rank, total))
    ops: dict[str, int] = {}
    for (op, dim), (_, nbytes) in recorder.per_step().items() if ledger else ():
        ops[f"{op}/{dim}"] = ops.get(f"{op}/{dim}", 0) + int(nbytes)
    return timer.times, timer.hand_times, ops, task.losses, timer.text


def _hand_bytes(rank: int, world: int) -> dict[str, int]:
    """Bytes per (op, group) of a fresh hand run's first step (the pack's ledger records its first step: the same
    weights and batch, so the same routing), from the ledger's recorder."""
    from lightning_dist.callbacks.ledger import CollectiveRecorder

    hand = _Hand(rank, world, 1)
    with CollectiveRecorder() as rec:
        hand.step()
    return {f"{op}/{dim}": int(b) for (op, dim), (_, b) in rec.totals(mesh=None, rank=rank, world=world).items()}


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


def _all_to_all(ops: dict[str, int]) -> int:
    return sum(v for k, v in ops.items() if k.startswith("all_to_all/"))


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pack, hand_times, loss_gap = [], [], 0.0
    prof_pack = prof_hand = ""
    for r in range(args.rounds):  # each round a fit with a hand step timed between every two pack steps
        hand = _Hand(rank, world, args.warmup + args.steps + 2)
        last = args.profile and r == args.rounds - 1
        p, h, _, pack_losses, text = _fit(rank, world, args.steps, args.warmup, hand=hand, profile=last)
        pack += p
        hand_times += h
        # the same weights and batches: the two sides' losses step by step (float32, different reduction orders)
        loss_gap = max([loss_gap] + [abs(a - b) / abs(b) for a, b in zip(pack_losses, hand.losses)])
        if last:
            prof_pack, prof_hand = text, hand.profile
    hand_ops = _hand_bytes(rank, world)
    _, _, pack_ops, _, _ = _fit(rank, world, 1, 0, ledger=True)
    h, p = _slowest(statistics.median(hand_times)), _slowest(statistics.median(pack))
    loss_gap = _slowest(loss_gap)
    row = {
        "procs": world,
        "ep": world,
        "hand_ms": 1e3 * h,
        "pack_ms": 1e3 * p,
        "ratio": p / h,
        "max_rel_loss_gap": loss_gap,
        "hand_all_to_all_bytes": _all_to_all(hand_ops),
        "pack_all_to_all_bytes": _all_to_all(pack_ops),
        "hand_bytes": hand_ops,
        "pack_bytes": pack_ops,
    }
    if rank == 0:
        if args.profile:
            print(f"---- cProfile, one hand step, rank 0 ----\n{prof_hand}")
            print(f"---- cProfile, one pack step, rank 0 ----\n{prof_pack}")
        print(
            f"{world} processes, ep={world}: hand {row['hand_ms']:.1f} ms, pack {row['pack_ms']:.1f} ms,"
            f" pack/hand {row['ratio']:.3f} (losses agree to {loss_gap:.1e})",
            flush=True,
        )
        print(
            f"  all-to-all bytes per step on rank 0: hand {row['hand_all_to_all_bytes']:,},"
            f" pack {row['pack_all_to_all_bytes']:,}",
            flush=True,
        )
        print(f"  bytes per step on rank 0: hand {hand_ops}; pack {pack_ops}", flush=True)
    if rank == 0 and args.row_file:
        Path(args.row_file).write_text(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4], help="process counts (ep = each)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per round and side")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="fits per process count, each with its paired hand steps")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", default=None, help="write every process count's row to this file")
    parser.add_argument("--row-file", default=None, help=argparse.SUPPRESS)  # a worker's row, for the launcher
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        _worker(args)
        return
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for procs in args.procs:
            row_file = os.path.join(tmp, f"{procs}.json")
            code = _launch(procs, [*sys.argv[1:], "--row-file", row_file])
            if code:
                sys.exit(code)
            rows.append(json.loads(Path(row_file).read_text()))
    print("\n| processes (ep) | hand (ms) | pack (ms) | pack/hand | all-to-all bytes per step on rank 0, hand / pack |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['procs']} | {r['hand_ms']:.1f} | {r['pack_ms']:.1f} | {r['ratio']:.3f} |"
            f" {r['hand_all_to_all_bytes']:,} / {r['pack_all_to_all_bytes']:,} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
