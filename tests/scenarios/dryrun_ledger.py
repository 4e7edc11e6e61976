"""The dry run held to the real run: CommunicationLedger rows against the dry run's, per layout and rank (4 ranks).

Each rank first trains every case for a few float32 steps under torchrun with a ``CommunicationLedger``
(the pack's CharGPT, 8 sequences per data-parallel rank, no logging: only the strategy's collectives are in a
step) and prints ``RESULT {"case", "kind": "ledger", "rows"}`` with the mean calls and payload bytes per (op, dim)
of the steps after the first. Then it leaves the gloo group and runs the dry run of its own rank for the same
cases (:func:`lightning_dist.dryrun.simulate_rank`, in one fresh process per rank on torch's fake process group:
same world size, model, batch and precision) and prints ``RESULT {"case", "kind": "dry", "rows"}`` or the dry
run's refusal.
Both results carry ``peak``: torch's MemTracker figures of the same step (the real run's through
``MemoryReport(track_step=...)``, the same tracker as the dry run's).
"""

from __future__ import annotations

import os
import subprocess
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _common import emit, trainer
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.callbacks import CommunicationLedger, MemoryReport
from lightning_dist.dryrun import _JOB_ENV, DryRunConfig, simulate_rank
from lightning_dist.models.gpt import CharGPT
from lightning_dist.models.moe import MoE, MoEGPT

STEPS = 3
BATCH = 8  # sequences per data-parallel rank: divides into the pipelines' 4 micro-batches
GPT = {"vocab_size": 64, "block_size": 16, "n_layer": 4, "n_head": 4, "n_embd": 32, "bias": False}
PIPE = {"pp": 2, "split": "params"}
CASES = {
    "hsdp_2x2": ("hsdp", {"dp_replicate": 2, "shard_size": 2}),
    "fsdp2_1x4": ("fsdp2", {}),
    "hsdp_shard1": ("hsdp", {"shard_size": 1}),
    "zero1": ("hsdp", {"zero_stage": 1}),  # DDP's reducer and ZeroRedundancyOptimizer's parameter broadcasts
    "offload_fsdp2": ("offload_fsdp2", {}),  # FSDP2 with CPUOffloadPolicy (DeepSpeed's engine is not simulated)
    "tp2_dp2": ("tp", {"tp": 2, "dp_shard": 2, "dp_replicate": 1}),
    "pp2_1f1b_dp2": ("pipeline", {**PIPE, "schedule": "1f1b"}),
    "pp2_interleaved_dp2": ("pipeline", {**PIPE, "schedule": "interleaved_1f1b"}),
    "pp2_zero_bubble_dp2": ("pipeline", {**PIPE, "schedule": "zero_bubble"}),
    "pp2_tp2": ("pipeline", {**PIPE, "tp": 2}),
    # context parallelism: Ulysses all-to-alls on cp, FSDP2 over dp_shard x cp
    "cp2_dp2": ("hsdp", {"cp": 2, "dp_replicate": 1}),
    # the ring: torch's ring attention's all-gathers and all-to-alls on cp
    "cp2_dp2_ring": ("hsdp", {"cp": 2, "dp_replicate": 1, "cp_style": "ring"}),
    # expert parallelism (BalancedMoE below): the all-to-alls on ep, the experts' FSDP2 on dp_shard_mod_ep
    "ep2_dp_shard4": ("hsdp", {"dp_shard": 4, "dp_replicate": 1, "ep": 2}),
}
MOE = {**GPT, "n_experts": 8, "top_k": 2, "expert_hidden": 16}


class QuietGPT(CharGPT):
    """CharGPT without its `sync_dist` logging (the dry run drops `self.log`), with random token batches."""

    def log(self, *args, **kwargs) -> None:
        pass

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        n, t, v = 64, GPT["block_size"], GPT["vocab_size"]
        ds = TensorDataset(torch.randint(0, v, (n, t), generator=g), torch.randint(0, v, (n, t), generator=g))
        kw = self.trainer.strategy.distributed_sampler_kwargs
        return DataLoader(ds, batch_size=BATCH, sampler=DistributedSampler(ds, shuffle=False, **kw))


class BalancedMoE(MoE):
    """:class:`MoE` whose token i chooses experts (i k + j) mod E, j < k: every expert receives the same rows, the
    routing the dry run assumes (``dryrun.UniformRouting``), so a real step's all-to-alls are the dry run's."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = self.router(x).softmax(-1)
        chosen = (torch.arange(x.shape[0], device=x.device)[:, None] * self.top_k + torch.arange(self.top_k)) % (
            self.n_experts
        )
        weights = scores.gather(-1, chosen)
        return chosen, weights / weights.sum(-1, keepdim=True), scores


class BalancedMoEGPT(MoEGPT):
    def make_block(self, cfg):
        block = super().make_block(cfg)
        moe = self._moe
        block.mlp = BalancedMoE(dim=cfg.n_embd, n_experts=moe["n_experts"], top_k=moe["top_k"], hidden=moe["hidden"])
        return block


class QuietMoE(QuietGPT):
    """QuietGPT with :class:`BalancedMoEGPT` and its router loss (over the global batch: an all-reduce a layer)."""

    def __init__(self, **sizes) -> None:
        pl.LightningModule.__init__(self)
        self.model = BalancedMoEGPT(**sizes)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.pipeline_loss(self.model(x), y) + 0.01 * self.model.aux_loss()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def model_of(case: str) -> tuple[str, dict]:
    """(class path the dry run imports, its init args): the MoE for the ep case, CharGPT otherwise."""
    if case.startswith("ep"):
        return f"{os.path.abspath(__file__)}:QuietMoE", MOE
    return "lightning_dist.models.gpt.CharGPT", GPT


def rows(per_step: dict) -> list[dict]:
    return [{"op": op, "dim": dim, "calls": c, "bytes": b} for (op, dim), (c, b) in sorted(per_step.items())]


def real(case: str) -> None:
    name, args = CASES[case]
    entry = StrategyRegistry[name]  # as Trainer(strategy=name) and the dry run build it, with these arguments
    strategy = entry["strategy"](**{**entry["init_params"], **args})
    # DDP's reducer rebuilds its buckets once, in the second step (two broadcasts of their layout): its steady steps
    # are those after it (the dry run's one step has DDP's first buckets; a tiny model's are the same)
    replicated = args.get("shard_size") == 1 or args.get("zero_stage") == 1
    ledger = CommunicationLedger(planned=None, log=False, print_table=False, skip_steps=2 if replicated else 1)
    # the dry run's tracker around the step the dry run measures: a pipeline's second (after a warm-up), else the first
    memory = MemoryReport(log=False, print_table=False, track_step=1 if name == "pipeline" else 0)
    torch.manual_seed(0)
    devices = int(os.environ["WORLD_SIZE"])
    t = trainer(strategy, devices=devices, steps=STEPS + replicated, precision="32-true", callbacks=[ledger, memory])
    t.fit(QuietMoE(**MOE) if case.startswith("ep") else QuietGPT(**GPT))
    emit(case=case, kind="ledger", rows=rows(ledger.per_step()), steps=len(ledger.steps), peak=memory.step_peak)


def dry(case: str, rank: int, world: int) -> None:
    """The dry run of one rank, in this process (a fresh one with no process group: see `dry_worker`)."""
    name, args = CASES[case]
    model, init_args = model_of(case)
    config = DryRunConfig(
        model=model,
        init_args=init_args,
        strategy=name,
        strategy_args=args,
        world_size=world,
        devices_per_node=world,
        precision="32-true",
        batch_size=BATCH,
    )
    try:
        result = simulate_rank(config, rank)
    except (ValueError, TypeError, RuntimeError) as err:
        emit(case=case, kind="dry", rank=rank, refused=str(err)[:300])
        return
    got = [
        {"op": c["op"], "dim": c["dim"], "calls": c["calls"], "bytes": c["payload_bytes"]}
        for c in result["collectives"]
    ]
    peak = {k: result[k] for k in ("peak_total_bytes", "peak_activation_bytes", "peak_breakdown")}
    emit(case=case, kind="dry", rank=rank, rows=got, seconds=result["seconds"], peak=peak)


def dry_worker(names: list[str], rank: int, world: int) -> None:
    """Every case's dry run of `rank` in one fresh process, one after another (`simulate_rank` destroys its fake
    group after each): the imports are paid once per rank, not once per (case, rank) as `lightning-dist dry-run`
    would (a case run after another gives the rows it gives in a process of its own: `simulate_rank` leaves no group
    behind)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_JOB_ENV)}
    cmd = [sys.executable, os.path.abspath(__file__), "--dry", ",".join(names), str(rank), str(world)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    os.write(1, proc.stdout.encode())
    if proc.returncode != 0:
        raise RuntimeError(f"rank {rank}'s dry runs failed:\n{proc.stderr[-4000:]}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1:2] == ["--dry"]:  # the worker of one rank's dry runs (no torchrun, no process group)
        for case in sys.argv[2].split(","):
            dry(case, int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CASES)
    for case in names:
        real(case)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if dist.is_initialized():
        dist.destroy_process_group()
    dry_worker(names, rank, world)
