"""Tensor parallelism on 4 CPU processes (tp=2 x dp_shard=2): step time and tensor-parallel traffic.

One invocation (it starts torchrun itself)::

    python benchmarks/tensor_parallel.py [--steps 10] [--json FILE]

Compares ``Trainer(strategy=TensorParallelStrategy(tp=2, dp_shard=2))`` with Lightning's
``ModelParallelStrategy`` running the same plan written by hand in ``configure_model``
(``parallelize_module`` + ``fully_shard``), on the pack's GPT, float32. Reports:

* step time (median of the timed steps, slowest rank) and the ratio ours / Lightning's (goal <= 1.05);
* bytes per rank moved by collectives on the ``tp`` group in one training step, measured by intercepting
  torch's functional collectives, vs the traffic the plan implies (goal within 5%).

Expected traffic, per rank per step, ring algorithms on ``p = tp`` ranks, ``f = (p - 1) / p``, ``S = b*T*d*e``
(one activation of the local batch: b sequences of T tokens, width d, e bytes per element),
``S_out = b*T*V*e`` (the logits), L blocks:

* without sequence parallelism: per block two all-reduces in forward (``attn.proj``, ``mlp.fc2`` outputs)
  and two in backward (input gradients of ``attn`` and ``mlp``), plus the output head's input-gradient
  all-reduce and its logits all-gather: ``(4L + 1) * 2f*S + f*S_out``;
* with sequence parallelism: per block the four all-reduces become all-gather + reduce-scatter pairs
  (``8L * f*S``, the same bytes), plus the all-gathers entering (backward) and leaving (forward) the
  sequence-parallel region ``2f*S``, the head ``2f*S + f*S_out``, and the all-reduce of the norms'
  parameter gradients (computed from sequence shards) ``4L * 2f*d*e``.

Wire bytes of a measured collective: all-reduce ``2f * size``, all-gather ``f * output size``,
reduce-scatter ``f * input size``.
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

import torch

B, T, D, V, L, HEADS = 8, 64, 128, 64, 2, 4  # per data-parallel rank: 8 sequences of 64 tokens
WARMUP = 3


def _launch(argv: list[str]) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=4",
        "--master-addr=127.0.0.1",
        f"--master-port={29500 + os.getpid() % 1000}",
        __file__,
        *argv,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.call(cmd, env=env)


# ---- measuring -------------------------------------------------------------------------------------
def collective_mode():
    """A dispatch mode recording every functional collective (op, group, wire bytes).

    Hand-written because torch's CommDebugMode counts collectives but not their sizes; like CommDebugMode
    it lets DTensor desugar into plain-tensor collectives first (returns NotImplemented for DTensors).
    """
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.records: list[dict] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            if getattr(func, "namespace", "") == "_c10d_functional" and func._overloadpacket.__name__ != "wait_tensor":
                name = func._overloadpacket.__name__.rstrip("_")
                kwargs = kwargs or {}
                named = {
                    a.name: (args[i] if i < len(args) else kwargs.get(a.name))
                    for i, a in enumerate(func._schema.arguments)
                }
                if "group_name" not in named:  # helpers of the namespace that move no data
                    return out
                pg = c10d._resolve_process_group(named["group_name"])
                # groups are told apart by their ranks: torch may reuse an equal group made by an earlier mesh
                group, p = tuple(c10d.get_process_group_ranks(pg)), pg.size()
                f = (p - 1) / p
                size = args[0].numel() * args[0].element_size()
                wire = {
                    "all_reduce": 2 * f * size,
                    "all_gather_into_tensor": f * size * p,
                    "reduce_scatter_tensor": f * size,
                }.get(name, size)
                self.records.append({"op": name, "group": group, "bytes": wire})
            return out

    return Collectives()


def expected_tp_bytes(*, sequence_parallel: bool, p: int = 2, e: int = 4) -> float:
    """The plan's tensor-parallel traffic per rank per step (formula in the module docstring)."""
    f, S, S_out = (p - 1) / p, B * T * D * e, B * T * V * e
    if not sequence_parallel:
        return (4 * L + 1) * 2 * f * S + f * S_out
    return 8 * L * f * S + 2 * f * S + 2 * f * S + f * S_out + 4 * L * 2 * f * D * e


def make_callback(steps: int, tp_group_name):
    import lightning.pytorch as pl
    import torch.distributed as dist

    class Measure(pl.Callback):
        """Times steps after warm-up; records the tp collectives of the last step."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.mode = None
            self.tp_bytes = 0.0
            self.ops: dict[str, int] = {}
            self.other_groups: dict[str, float] = {}  # functional collectives seen on other groups

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == WARMUP + steps:
                self.mode = collective_mode()
                self.mode.__enter__()
            dist.barrier()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            elapsed = time.perf_counter() - self.t0
            if self.mode is not None:
                self.mode.__exit__(None, None, None)
                name = tp_group_name(trainer)
                mine = [r for r in self.mode.records if r["group"] == name]
                self.tp_bytes = sum(r["bytes"] for r in mine)
                for r in mine:
                    self.ops[r["op"]] = self.ops.get(r["op"], 0) + 1
                for r in self.mode.records:
                    if r["group"] != name:
                        key = str(list(r["group"]))
                        self.other_groups[key] = self.other_groups.get(key, 0.0) + r["bytes"]
                self.mode = None
            elif batch_idx >= WARMUP:
                self.times.append(elapsed)
            self.mode = None

    return Measure()


# ---- the two set-ups -------------------------------------------------------------------------------
def gpt_module(hand_written: bool):
    import lightning.pytorch as pl
    import torch.nn.functional as F

    from lightning_dist.models import GPT

    class Bench(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(vocab_size=V, block_size=T, n_layer=L, n_head=HEADS, n_embd=D)

        def training_step(self, batch, batch_idx):
            idx, target = batch
            return F.cross_entropy(self.model(idx).flatten(0, 1), target.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class HandWritten(Bench):
        """Lightning's documented recipe: the same TP plan and FSDP2 units, by hand."""

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                PrepareModuleInput,
                RowwiseParallel,
                parallelize_module,
            )

            tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
            region = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
            )
            for block in self.model.blocks:
                parallelize_module(
                    block,
                    tp_mesh,
                    {
                        "attn": region,
                        "attn.q": ColwiseParallel(),
                        "attn.k": ColwiseParallel(),
                        "attn.v": ColwiseParallel(),
                        "attn.proj": RowwiseParallel(),
                        "mlp": region,
                        "mlp.fc1": ColwiseParallel(),
                        "mlp.fc2": RowwiseParallel(),
                    },
                )
            parallelize_module(self.model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
            for block in self.model.blocks:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(self.model, mesh=dp_mesh)

    return HandWritten() if hand_written else Bench()


def loader():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    n = 2 * B * 64
    data = TensorDataset(torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g))
    return DataLoader(data, batch_size=B)


def run(label: str, steps: int) -> dict:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_dist.strategies import TensorParallelStrategy

    ours = label != "lightning"
    if ours:
        strategy = TensorParallelStrategy(
            tp=2, dp_shard=2, dp_replicate=1, tp_plan="transformer", sequence_parallel=label == "tp_sp"
        )

        def tp_group(trainer):
            return tuple(dist.get_process_group_ranks(trainer.strategy.mesh.group("tp")))
    else:
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)

        def tp_group(trainer):
            return tuple(dist.get_process_group_ranks(trainer.strategy.device_mesh["tensor_parallel"].get_group()))

    measure = make_callback(steps, tp_group)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        precision="32-true",
        max_steps=WARMUP + steps + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[measure],
    )
    trainer.fit(gpt_module(hand_written=not ours), train_dataloaders=loader())
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        rows, {"times": measure.times, "bytes": measure.tp_bytes, "ops": measure.ops, "other": measure.other_groups}
    )
    return {
        "step_times": [max(step) for step in zip(*(r["times"] for r in rows))],  # the slowest rank per step
        "tp_bytes": rows[0]["bytes"],
        "tp_ops": rows[0]["ops"],
        "other_group_bytes": rows[0]["other"],
    }


_SHORT = {"all_reduce": "AR", "all_gather_into_tensor": "AG", "reduce_scatter_tensor": "RS"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run (after 3 warm-up steps)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each of the two set-ups")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        sys.exit(_launch(sys.argv[1:]))

    import lightning_dist  # noqa: F401

    # alternate the set-ups so that load from other jobs on a shared machine hits both alike; pool the steps
    results: dict[str, dict] = {}
    for label in ["tp", "lightning"] * args.repeats + ["tp_sp"]:
        r = run(label, args.steps)
        if label in results:
            r["step_times"] = results[label]["step_times"] + r["step_times"]
        results[label] = r
    if int(os.environ["RANK"]) != 0:
        return
    for label, r in results.items():
        r["step_s"] = statistics.median(r["step_times"])
        r["step_s_min"] = min(r["step_times"])
        r["expected_tp_bytes"] = expected_tp_bytes(sequence_parallel=label == "tp_sp")
        r["bytes_ratio"] = r["tp_bytes"] / r["expected_tp_bytes"]
    summary = {
        "config": {
            "world": 4,
            "tp": 2,
            "dp_shard": 2,
            "batch_per_dp_rank": B,
            "seq": T,
            "dim": D,
            "vocab": V,
            "blocks": L,
            "dtype": "float32",
            "timed_steps": args.steps,
        },
        "runs": results,
        "step_time_ratio": results["tp"]["step_s"] / results["lightning"]["step_s"],
        "step_time_ratio_min": results["tp"]["step_s_min"] / results["lightning"]["step_s_min"],
    }
    from rich.console import Console
    from rich.table import Table

    names = {"tp": 'strategy="tp"', "tp_sp": 'strategy="tp_sp" (SP)', "lightning": "ModelParallelStrategy + hand plan"}
    table = Table(title="Tensor parallel, tp=2 x dp_shard=2, 4 CPU processes, GPT float32")
    for col in (
        "run",
        "steps",
        "median ms",
        "min ms",
        "vs Lightning",
        "tp KiB/step",
        "expected KiB",
        "measured/expected",
        "tp collectives",
    ):
        table.add_column(col, justify="right" if col != "run" else "left")
    for label, r in results.items():
        table.add_row(
            names[label],
            str(len(r["step_times"])),
            f"{1e3 * r['step_s']:.1f}",
            f"{1e3 * r['step_s_min']:.1f}",
            f"{r['step_s'] / results['lightning']['step_s']:.3f}",
            f"{r['tp_bytes'] / 1024:.1f}",
            f"{r['expected_tp_bytes'] / 1024:.1f}",
            f"{r['bytes_ratio']:.4f}",
            ", ".join(f"{_SHORT.get(k, k)} x{v}" for k, v in sorted(r["tp_ops"].items())),
        )
    Console(width=160).print(table)
    print(
        f"step time ratio tp / ModelParallelStrategy: median {summary['step_time_ratio']:.3f},"
        f" min {summary['step_time_ratio_min']:.3f} (goal <= 1.05)"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
