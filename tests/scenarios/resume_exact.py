"""Exact mid-epoch resume under Lightning's injected shuffling DistributedSampler (hsdp 2x2, float64).

usage: python resume_exact.py OUT [STRATEGY]    (Lightning's launcher; STRATEGY: hsdp | tp | pipeline | offload)

hsdp 2x2, tp2 x dp2 and pipeline pp2 x dp2 run 4 processes in float64; offload (DeepSpeed ZeRO-3 with
optimizer state and parameters in host memory) runs 2 processes in float32, as DeepSpeed has no float64 on
CPU: "bitwise" then means bitwise in float32.

A = 9 steps uninterrupted (6 steps per epoch: step 9 is mid-epoch 1); B = the same with checkpoints
every 4 steps (4: mid-epoch 0, 8: mid-epoch 1); C = resume from step 4 to 9, D = resume from step 8 to 9;
both must equal A bitwise. The model applies dropout, so the RNG streams matter; StepLR every 2 steps.
Controls (must differ from A, showing what each piece fixes): E = plain DataLoader resumed from step 4,
F = ResumableDataLoader without ResumeRNG resumed from step 4 (E resumes from a plain-loader checkpoint).
With torchdata installed (not under offload), the same with torchdata's StatefulDataLoader: A2 = 9 steps
uninterrupted, G = with checkpoints every 4 steps, H / I = resume from its steps 4 / 8; G, H, I must equal A2
bitwise. A2 is its own reference: the batches come in A's order, but for `shuffle=True` the loader builds
torchdata's RandomSampler (replaced by Lightning's DistributedSampler), which draws a seed from the torch RNG
when the loader is built, so the dropout masks (and parameters) differ from A's.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import Classifier, dataset, emit, trainer, whole_params
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_dist._compat import module_available
from lightning_dist.callbacks import ResumeRNG
from lightning_dist.data import ResumableDataLoader
from lightning_dist.strategies import HybridShardStrategy, OffloadStrategy, PipelineStrategy
from lightning_dist.strategies.tp import TensorParallelStrategy

out = Path(sys.argv[1])
name = sys.argv[2] if len(sys.argv) > 2 else "hsdp"
STRATEGIES = {  # name -> (strategy, processes, precision)
    "hsdp": (lambda: HybridShardStrategy(dp_replicate=2, shard_size=2), 4, "64-true"),
    "tp": (lambda: TensorParallelStrategy(tp=2, dp_shard=2, tp_plan={"model.stem": "colwise_gather"}), 4, "64-true"),
    "pipeline": (
        lambda: PipelineStrategy(pp=2, dp_shard=2, schedule="1f1b", n_microbatches=2, split="params"),
        4,
        "64-true",
    ),
    "offload": (lambda: OffloadStrategy(optimizer="cpu", parameters="cpu", zero_stage=3, report=False), 2, "32-true"),
}
make, DEVICES, PRECISION = STRATEGIES[name]
DTYPE = torch.float64 if PRECISION == "64-true" else torch.float32


class Shuffled(Classifier):
    def __init__(self, *, resumable="ours", **kw) -> None:
        super().__init__(n=96, schedule=True, dtype=DTYPE, **kw)
        self.resumable = resumable
        self.order = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.order.append(int(y.sum()))
        x = F.dropout(x, p=0.2, training=True)  # consumes the torch RNG every step
        loss = self.pipeline_loss(self(x), y)
        return loss

    def pipeline_loss(self, output, target):  # PipelineStrategy: the loss of one micro-batch
        return F.cross_entropy(output, target)

    def train_dataloader(self):
        cls = LOADERS[self.resumable]
        # Lightning replaces the shuffle with a DistributedSampler(shuffle=True) over the dp ranks
        replicas = self.trainer.strategy.distributed_sampler_kwargs["num_replicas"]
        return cls(dataset(self.n, dtype=DTYPE), batch_size=self.global_batch // replicas, shuffle=True)


LOADERS = {"ours": ResumableDataLoader, "plain": DataLoader}
if module_available("torchdata"):
    from torchdata.stateful_dataloader import StatefulDataLoader

    LOADERS["torchdata"] = StatefulDataLoader


def fit(steps, *, ckpt_path=None, every=None, resumable="ours", rng=True, prefix="s"):
    seed_everything(0)
    module = Shuffled(resumable=resumable)
    callbacks = [ResumeRNG()] if rng else []
    if every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=out,
                filename=prefix + "{step}",
                auto_insert_metric_name=False,
                save_top_k=-1,
                every_n_train_steps=every,
            )
        )
    t = trainer(
        make(),
        devices=DEVICES,
        precision=PRECISION,
        steps=steps,
        use_distributed_sampler=True,
        enable_checkpointing=bool(every),
        callbacks=callbacks,
    )
    t.fit(module, ckpt_path=ckpt_path)
    return whole_params(module), t, module


a, ta, ma = fit(9)
b, _, _ = fit(9, every=4)
c, tc, mc = fit(9, ckpt_path=out / "s4.ckpt")
d, td, _ = fit(9, ckpt_path=out / "s8.ckpt")
fit(9, every=4, resumable="plain", prefix="plain")  # Lightning refuses loader state for a plain loader
e, _, me = fit(9, ckpt_path=out / "plain4.ckpt", resumable="plain")
f, _, _ = fit(9, ckpt_path=out / "s4.ckpt", rng=False)


def same(x, ref=a):
    return all(torch.equal(x[k], ref[k]) for k in ref)


stateful = {}
if "torchdata" in LOADERS and name != "offload":
    a2, _, ma2 = fit(9, resumable="torchdata")
    g, tg, _ = fit(9, every=4, resumable="torchdata", prefix="td")
    h, th, mh = fit(9, ckpt_path=out / "td4.ckpt", resumable="torchdata")
    i, ti, _ = fit(9, ckpt_path=out / "td8.ckpt", resumable="torchdata")
    loader = tg.train_dataloader
    stateful = dict(
        td_checkpointing_changes_nothing=same(g, a2),
        td_from4=same(h, a2),
        td_from8=same(i, a2),
        td_steps=[th.global_step, ti.global_step],
        td_order=mh.order,
        td_order_a=ma2.order[4:],
        td_same_order_as_a=ma2.order == ma.order,
        td_epochs_differ=ma2.order[:3] != ma2.order[6:9],  # the sampler's epoch was set
        td_loader=type(loader).__name__,
        # Lightning rebuilds torchdata's own BatchSampler around the DistributedSampler
        td_sampler=type(loader.batch_sampler.sampler).__name__,
    )
emit(
    kind="resume",
    **stateful,
    strategy=name,
    checkpointing_changes_nothing=same(b),
    from4=same(c),
    from8=same(d),
    plain_loader=same(e),
    no_rng=same(f),
    steps=[tc.global_step, td.global_step],
    sampler=type(ta.train_dataloader.sampler).__name__,
    shuffle=bool(getattr(ta.train_dataloader.sampler, "shuffle", False)),
    order_a=ma.order[4:],
    order_c=mc.order,
    order_e=me.order,
    lr=tc.optimizers[0].param_groups[0]["lr"],
    lr_a=ta.optimizers[0].param_groups[0]["lr"],
)
