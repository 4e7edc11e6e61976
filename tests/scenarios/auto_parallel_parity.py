"""strategy="auto_parallel" on 4 processes (torchrun), float64: budgets that force each choice, parity with one device.

For each target (hsdp, fsdp2, tp x dp, pp x dp, offload) the device memory is the planner's model-state bytes
of the target layout + 1% (so every less parallel layout is too big), with the global batch (6 for tp / pp:
a data-parallel size of 4 cannot split it) and `prefer` where the order alone would pick another fitting
layout (pp: tp comes first). Each run trains 2 AdamW steps of a small GPT and reports its choice, the strategy
it ran as and the max relative parameter difference from single-device training on the same global batches.
"""

from __future__ import annotations

import os

import torch
from _common import emit_gathered as emit
from _common import full_params, max_rel_diff, trainer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist import planner
from lightning_dist.models.gpt import CharGPT
from lightning_dist.parallelize.counts import count_params
from lightning_dist.strategies import AutoParallelStrategy
from lightning_dist.strategies.auto_parallel import device_need

STEPS, SEQ, N = 2, 8, 48
SIZES = dict(vocab_size=32, block_size=SEQ, n_layer=2, n_head=4, n_embd=16, bias=False)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, 32, (N, SEQ), generator=g), torch.randint(0, 32, (N, SEQ), generator=g))


class Task(CharGPT):
    def __init__(self, global_batch: int) -> None:
        torch.manual_seed(0)  # the same initial weights on every rank and in the reference
        super().__init__(**SIZES, lr=1e-2)
        self.global_batch = global_batch

    def train_dataloader(self):
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(data(), shuffle=False, **kw)
        return DataLoader(sampler.dataset, batch_size=self.global_batch // kw["num_replicas"], sampler=sampler)


def reference(global_batch: int) -> dict:
    task = Task(global_batch).double()
    opt = torch.optim.AdamW(task.parameters(), lr=1e-2, weight_decay=0.0)
    ds = data()
    for k in range(STEPS):
        x, y = ds[k * global_batch : (k + 1) * global_batch]
        opt.zero_grad()
        task.pipeline_loss(task(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in task.named_parameters()}


def budget(target: str, world: int) -> float:
    """The target layout's device bytes as the chooser counts them (float64 AdamW; for the offload layout, the largest
    FSDP unit gathered with its gradient) + 1%."""
    counts, state = count_params(Task(8)), planner.state_bytes(precision="64-true")
    layouts = planner.candidate_layouts(counts, world_size=world, devices_per_node=world, state=state)
    layout = next(lay for lay in layouts if lay.name == target)
    return device_need(layout, counts, state) * 1.01


world = int(os.environ["WORLD_SIZE"])
runs = [  # (target layout, global batch, prefer)
    ("hsdp-2", 8, ()),
    ("fsdp", 8, ()),
    ("tp2-fsdp2", 6, ()),
    ("pp2-ddp2", 6, ("pp",)),
    ("fsdp-offload", 8, ()),
]
refs = {g: reference(g) for g in {g for _, g, _ in runs}}
for target, global_batch, prefer in runs:
    task = Task(global_batch)
    strategy = AutoParallelStrategy(
        device_memory=budget(target, world),
        global_batch=global_batch,
        prefer=prefer,
        options={"PipelineStrategy": {"n_microbatches": 3, "split": "params"}},
    )
    t = trainer(strategy, devices=world, steps=STEPS)
    t.fit(task)
    got = full_params(task)  # a pipeline rank holds only its stage: compared with those reference parameters
    diff = max_rel_diff(got, {k: v for k, v in refs[global_batch].items() if k in got})
    emit(
        kind="auto",
        target=target,
        choice=t.strategy.choice.name,
        ran_as=type(t.strategy).__name__,
        diff=diff,
        mesh=list(t.strategy.mesh.spec.shape),
        offload_policy=type(getattr(t.strategy, "offload_policy", None)).__name__,
    )

# nothing fits: 1 byte per device and a global batch of 6 (rules out full sharding with everything offloaded); 1 KB,
# less than the offload layout's largest FSDP unit gathered on the device (it trained with "device bytes 0 B")
for name, memory, global_batch in (("batch6", 1, 6), ("1KB", "1KB", None)):
    try:
        strategy = AutoParallelStrategy(device_memory=memory, global_batch=global_batch)
        trainer(strategy, devices=world, steps=STEPS).fit(Task(global_batch or 8))
        emit(kind="nothing-fits", name=name, error=None)
    except ValueError as err:
        emit(kind="nothing-fits", name=name, error=str(err))
