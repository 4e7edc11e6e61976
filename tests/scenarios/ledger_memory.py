"""CommunicationLedger and MemoryReport against the planner on 4 gloo processes (torchrun, many short fits).

Each case trains a few float32 AdamW steps with both callbacks and prints, per rank, one
``RESULT {"case", "comm": [{op, dim, bytes, planned_bytes, ratio}...], "memory": {...}}`` line:
hsdp 2x2, fsdp2 1x4, replicate (shard_size=1: DDP's bucketed reducer), zero1, and tp=2 x dp_shard=2 on a
ViT whose plan covers the blocks only (the planner counts block activations, not a parallel head);
pipeline pp=2 x dp_shard=2 (memory; send/recv recorded), FSDP2 CPU offload, and Lightning's own
DDPStrategy (no mesh: groups are named ``world``).
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import Classifier, emit, trainer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.callbacks import CommunicationLedger, MemoryReport
from lightning_dist.models import ViT
from lightning_dist.strategies import FullyShardStrategy, HybridShardStrategy

STEPS = 3


class ViTTask(pl.LightningModule):
    """A small ViT (2 blocks, 5 tokens of width 16) on random images."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ViT(image_size=16, patch_size=8, dim=16, depth=2, n_heads=4, mlp_ratio=2, num_classes=4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        ds = TensorDataset(torch.randn(64, 1, 16, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
        kw = self.trainer.strategy.distributed_sampler_kwargs
        return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, shuffle=False, **kw))


def run(case: str, strategy, module: pl.LightningModule) -> None:
    ledger, memory = CommunicationLedger(), MemoryReport()
    t = trainer(
        strategy, devices=int(os.environ["WORLD_SIZE"]), steps=STEPS, precision="32-true", callbacks=[ledger, memory]
    )
    t.fit(module)
    mine = memory.rows[dist.get_rank()]
    emit(
        case=case,
        comm=ledger.summary,
        memory=mine,
        steps=len(ledger.steps),
        logged=sorted(k for k in t.callback_metrics if k.startswith(("comm/", "memory/"))),
    )


class Quiet(Classifier):
    """The parity classifier without its `sync_dist` logging: only the strategy's collectives are in a step."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.pipeline_loss(self(x), y)


def classifier() -> Classifier:
    # odd widths: uneven FSDP2 shards and padded collectives
    return Quiet(dtype=torch.float32, global_batch=16, d_in=12, width=18, depth=3, n_out=5)


class PipeQuiet(Quiet):
    """The PipelineStrategy contract: a loss on the last stage's output and an example input for the split."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.example_input_array = torch.randn(4, 12)

    def pipeline_loss(self, output, target):
        return F.cross_entropy(output, target)


def _pipeline() -> None:
    from lightning_dist.strategies import PipelineStrategy

    module = PipeQuiet(dtype=torch.float32, global_batch=16, d_in=12, width=18, depth=6, n_out=5)
    run("pipeline_pp2_dp2", PipelineStrategy(pp=2, split="params"), module)


def _ddp() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    run("lightning_ddp", DDPStrategy(), classifier())


def _offload() -> None:
    from lightning_dist.strategies import FSDP2OffloadStrategy

    run("offload_fsdp2", FSDP2OffloadStrategy(), classifier())


CASES = {
    "hsdp_2x2": lambda: run("hsdp_2x2", HybridShardStrategy(dp_replicate=2, shard_size=2), classifier()),
    "fsdp2_1x4": lambda: run("fsdp2_1x4", FullyShardStrategy(), classifier()),
    "replicate": lambda: run("replicate", HybridShardStrategy(shard_size=1), classifier()),
    "zero1": lambda: run("zero1", HybridShardStrategy(shard_size=1, zero_stage=1), classifier()),
    "tp2_fsdp2": lambda: _tp(),
    "pipeline_pp2_dp2": _pipeline,
    "lightning_ddp": lambda: _ddp(),
    "offload_fsdp2": _offload,
}


def _tp() -> None:
    from lightning_dist.strategies import TensorParallelStrategy

    run("tp2_fsdp2", TensorParallelStrategy(tp=2, dp_shard=2, dp_replicate=1, tp_plan="transformer"), ViTTask())


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in sys.argv[1].split(",") if len(sys.argv) > 1 else CASES:
        CASES[name]()
