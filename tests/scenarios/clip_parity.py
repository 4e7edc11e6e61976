"""Gradient clipping on every layout against torch's clip_grad_norm_ / clip_grad_value_ on one device (4 processes).

A small CharGPT (once with its head tied to the token embedding across pipeline stages), float64, 3 SGD steps
(SGD: the update is the clipped gradient itself, so a wrong norm shows; Adam would hide a constant scale). For
each layout (hsdp, fsdp2 ZeRO-2, ZeRO-1, tp=4, tp x dp_shard, sequence parallel, pp x tp, pp x dp, FSDP2
offload, auto_parallel: tp x dp_replicate) and algorithm ("norm", "value"), by `Trainer(gradient_clip_val=...)`
and by `self.clip_gradients` in manual optimization, each rank reports the max relative difference of the
parameters it holds from the single-device run, which records that clipping triggered on every step (norm
above the clip value; some gradient elements beyond it). `unclipped_diff`: how far the same run without
clipping lands (what a clipping that silently did nothing would show). Args: layouts to run (default all).
"""

from __future__ import annotations

import os
import sys

import torch
from _common import emit_gathered as emit
from _common import full_params, max_rel_diff, trainer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist._compat import TP_SEQUENCE_PARALLEL_WITH_DP_HANGS
from lightning_dist.models.gpt import CharGPT
from lightning_dist.strategies import (
    AutoParallelStrategy,
    FSDP2OffloadStrategy,
    FullyShardStrategy,
    HybridShardStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
)

STEPS, SEQ, N, GLOBAL_BATCH, LR = 3, 8, 48, 8, 0.5
SIZES = dict(vocab_size=32, block_size=SEQ, n_layer=2, n_head=4, n_embd=16, mlp_ratio=2)
CLIP = {"norm": 0.3, "value": 0.01}  # below the gradients' norm / largest elements: clipping triggers every step
WORLD = int(os.environ["WORLD_SIZE"])
ONLY = set(sys.argv[1].split(",")) if len(sys.argv) > 1 else None  # layouts to run (a quick look); default all


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, 32, (N, SEQ), generator=g), torch.randint(0, 32, (N, SEQ), generator=g))


class Task(CharGPT):
    def __init__(self, manual: str = "", tie: bool = False) -> None:
        torch.manual_seed(0)  # the same initial weights on every rank and in the reference
        super().__init__(**SIZES, tie_weights=tie)
        self.manual = manual  # "norm"/"value": manual optimization calling self.clip_gradients
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        if not self.manual:
            return super().training_step(batch, batch_idx)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.pipeline_loss(self(batch[0]), batch[1]))
        self.clip_gradients(opt, gradient_clip_val=CLIP[self.manual], gradient_clip_algorithm=self.manual)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(data(), shuffle=False, **kw)
        return DataLoader(sampler.dataset, batch_size=GLOBAL_BATCH // kw["num_replicas"], sampler=sampler)


def reference(algorithm, tie: bool = False) -> tuple[dict, list[bool]]:
    """One device: torch's own clipping after each backward; whether it changed the gradients, per step."""
    task = Task(tie=tie).double()
    opt = torch.optim.SGD(task.parameters(), lr=LR)
    ds, triggered = data(), []
    for k in range(STEPS):
        x, y = ds[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        task.pipeline_loss(task(x), y).backward()
        if algorithm == "norm":
            triggered.append(torch.nn.utils.clip_grad_norm_(task.parameters(), CLIP["norm"]).item() > CLIP["norm"])
        elif algorithm == "value":
            triggered.append(any((p.grad.abs() > CLIP["value"]).any().item() for p in task.parameters()))
            torch.nn.utils.clip_grad_value_(task.parameters(), CLIP["value"])
        opt.step()
    # a tied weight under both names: each pipeline stage holding it compares its copy
    return {n: p.detach().clone() for n, p in task.named_parameters(remove_duplicate=False)}, triggered


REFS = {(a, tie): reference(a, tie) for a in ("norm", "value", None) for tie in (False, True)}


def run(layout: str, strategy, algorithm: str, *, manual: bool = False, tie: bool = False) -> None:
    if ONLY is not None and layout not in ONLY:
        return
    task = Task(manual=algorithm if manual else "", tie=tie)
    clip = {} if manual else {"gradient_clip_val": CLIP[algorithm], "gradient_clip_algorithm": algorithm}
    t = trainer(strategy, devices=WORLD, steps=STEPS, **clip)
    t.fit(task)
    got = full_params(task)  # a pipeline rank holds only its stage: compared with those reference parameters
    ref, triggered = REFS[algorithm, tie]
    emit(
        kind="clip",
        layout=layout,
        algorithm=algorithm,
        manual=manual,
        ran_as=type(t.strategy).__name__,
        diff=max_rel_diff(got, {k: v for k, v in ref.items() if k in got}),
        triggered=triggered,
        unclipped_diff=max_rel_diff(
            {k: v for k, v in REFS[None, tie][0].items() if k in got}, {k: v for k, v in ref.items() if k in got}
        ),
        mesh=list(t.strategy.mesh.spec.shape),
    )


pipe = dict(schedule="1f1b", n_microbatches=2, split="params")
run("hsdp", HybridShardStrategy(dp_replicate=2, shard_size=2), "value")
run("fsdp2_zero2", FullyShardStrategy(zero_stage=2), "norm")
run("zero1", HybridShardStrategy(shard_size=1, zero_stage=1), "norm")
run("tp4", TensorParallelStrategy(tp=4), "norm")
for algorithm in ("norm", "value"):
    run("tp2xdp_shard2", TensorParallelStrategy(tp=2, dp_shard=2, dp_replicate=1), algorithm)
    run("pp2xtp2", PipelineStrategy(pp=2, tp=2, **pipe), algorithm)
run("tp2xdp_shard2", TensorParallelStrategy(tp=2, dp_shard=2, dp_replicate=1), "norm", manual=True)
for algorithm in ("norm", "value") if not TP_SEQUENCE_PARALLEL_WITH_DP_HANGS else ():  # norms fed sequence shards
    run("tp2_sp_xdp2", TensorParallelStrategy(tp=2, dp_shard=2, dp_replicate=1, sequence_parallel=True), algorithm)
run("pp2xdp2", PipelineStrategy(pp=2, dp_shard=2, **pipe), "value")
# the head tied to the token embedding across the two stages: both copies clipped alike, the weight counted once
run("pp2xdp2_tied", PipelineStrategy(pp=2, dp_shard=2, **pipe), "norm", tie=True)
run("offload_fsdp2", FSDP2OffloadStrategy(report=False), "norm", manual=True)
run("auto_parallel", AutoParallelStrategy(device_memory=1e12, global_batch=GLOBAL_BATCH, prefer=("tp",)), "norm")
