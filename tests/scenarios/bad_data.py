"""Bad inputs that only show in a running job; each must raise the same clear error on every rank.

usage: torchrun --nproc-per-node 2 bad_data.py OUT

Runs one short `fit` per case in the same job (a failed fit leaves the process group usable, which is
itself the proof that no rank was left inside a collective) and prints one RESULT per rank and case.
"""

import sys
from datetime import timedelta
from pathlib import Path

import torch
from _common import Classifier, dataset, emit, full_params, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dist.callbacks import FiniteLossGuard, TrainDataGuard
from lightning_dist.callbacks.pipeline_bubble import PipelineBubble
from lightning_dist.strategies import HybridShardStrategy

out = Path(sys.argv[1])


class DropLast(Classifier):
    def train_dataloader(self):
        sampler = DistributedSampler(dataset(self.n), shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(sampler.dataset, batch_size=8, sampler=sampler, drop_last=True)


class NaNAtStep2(Classifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 2 and self.global_rank == 1:
            loss = loss * float("nan")  # one rank only: the others' losses are fine
        return loss


def case(name, module, callbacks, **kw):
    strategy = HybridShardStrategy(timeout=timedelta(seconds=30))
    t = trainer(strategy, devices=2, steps=4, callbacks=callbacks, **kw)
    try:
        t.fit(module)
    except Exception as err:  # noqa: BLE001 - the scenario reports whatever was raised
        emit(
            case=name,
            error=type(err).__name__,
            message=str(err),
            step=t.global_step,
            finite=all(torch.isfinite(p).all().item() for p in full_params(module).values()),
        )
        return
    emit(case=name, error=None, step=t.global_step)


case("empty_dataset", Classifier(n=0), [TrainDataGuard()])
case("fewer_samples_than_ranks", Classifier(n=1, global_batch=2), [TrainDataGuard()])
case("smaller_than_one_batch", DropLast(n=6), [TrainDataGuard()])
case(
    "nan_loss_one_rank",
    NaNAtStep2(),
    [
        FiniteLossGuard(),
        ModelCheckpoint(
            dirpath=out, filename="s{step}", auto_insert_metric_name=False, every_n_train_steps=1, save_top_k=-1
        ),
    ],
    enable_checkpointing=True,
)
case("callback_wrong_strategy", Classifier(), [PipelineBubble()])
case("control_run", Classifier(), [TrainDataGuard(), FiniteLossGuard()])  # the guards pass good data through
