"""Shared pieces of the scenario scripts: a small model, data in a fixed order, a single-device reference."""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def emit(**payload) -> None:
    """One RESULT line for the test to parse."""
    payload.setdefault("rank", torch.distributed.get_rank() if torch.distributed.is_initialized() else rank())
    # one write call per line, so lines of ranks sharing a pipe do not interleave
    os.write(1, ("RESULT " + json.dumps(payload) + "\n").encode())


def emit_gathered(**payload) -> None:
    """Gather every rank's RESULT on rank 0 and print them there (one stdout, no interleaved lines)."""
    payload["rank"] = torch.distributed.get_rank()
    rows = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(rows, payload)
    if torch.distributed.get_rank() == 0:
        os.write(1, "".join("RESULT " + json.dumps(r) + "\n" for r in rows).encode())


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class MLP(nn.Module):
    """A stem, a block list and a head: the shape the pack's units/splits expect."""

    def __init__(self, d_in: int = 12, width: int = 16, depth: int = 3, n_out: int = 5) -> None:
        super().__init__()
        self.stem = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        # odd sizes so FSDP2's dim-0 chunks are uneven on 4 ranks
        self.head = nn.Linear(width, n_out)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dataset(n: int = 96, d_in: int = 12, n_out: int = 5, dtype=torch.float64, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=dtype)
    y = torch.randint(0, n_out, (n,), generator=g)
    return TensorDataset(x, y)


class Classifier(pl.LightningModule):
    """Mean cross-entropy; data in the single-device order (a non-shuffling sampler over the dp ranks)."""

    def __init__(
        self,
        *,
        global_batch: int = 16,
        lr: float = 1e-2,
        n: int = 96,
        seed: int = 0,
        dtype=torch.float64,
        weight_decay: float = 0.01,
        schedule: bool = False,
        **model_kwargs,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the same initial weights on every rank and in the reference
        self.model = MLP(**model_kwargs)
        self.global_batch, self.lr, self.n, self.dtype_, self.wd, self.schedule = (
            global_batch,
            lr,
            n,
            dtype,
            weight_decay,
            schedule,
        )
        self.seen = 0

    def forward(self, x):
        return self.model(x)

    def pipeline_loss(self, output, target):  # the loss of one batch (PipelineStrategy: of one micro-batch)
        return F.cross_entropy(output, target)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.pipeline_loss(self(x), y)  # PipelineStrategy serves it on every pp rank (a scalar)
        self.log("train_loss", loss, sync_dist=True)
        self.seen += len(x)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.wd)
        if not self.schedule:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        kw = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        per_rank = self.global_batch // kw["num_replicas"]
        sampler = DistributedSampler(dataset(self.n, dtype=self.dtype_), shuffle=False, **kw)
        return DataLoader(sampler.dataset, batch_size=per_rank, sampler=sampler)


def reference(
    steps: int,
    *,
    global_batch: int = 16,
    lr: float = 1e-2,
    n: int = 96,
    seed: int = 0,
    dtype=torch.float64,
    weight_decay: float = 0.01,
    schedule: bool = False,
    **model_kwargs,
) -> dict:
    """Single-device training on the whole global batch, same order, same optimizer: the parity reference.

    The global batch of step k under a non-shuffling DistributedSampler over W ranks is the set of indices
    [k*G, (k+1)*G); its mean loss equals the mean of the ranks' mean losses.
    """
    torch.manual_seed(seed)
    model = MLP(**model_kwargs).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if schedule else None
    data = dataset(n, dtype=dtype)
    steps_per_epoch = n // global_batch
    for k in range(steps):
        j = k % steps_per_epoch
        x, y = data[j * global_batch : (j + 1) * global_batch]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if sched:
            sched.step()
    return {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}


def full_params(module: nn.Module) -> dict:
    """Unsharded parameters (a collective for DTensors: call on every rank)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().cpu().clone()
    return out


def whole_params(module: nn.Module) -> dict:
    """Whole parameters of this rank: FSDP/TP shards joined, DeepSpeed ZeRO-3 partitions gathered (collectives)."""
    params = list(module.parameters())
    if not any(hasattr(p, "ds_id") for p in params):
        return full_params(module)
    import deepspeed

    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm()).item() for k in a)


def trainer(strategy, *, devices: int, steps: int, precision: str = "64-true", **kw) -> pl.Trainer:
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("logger", False)
    kw.setdefault("use_distributed_sampler", False)
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )
