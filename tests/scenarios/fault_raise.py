"""One rank fails; every process of the job must exit non-zero, promptly, showing the original error.

usage: python fault_raise.py WHERE RANK DEVICES OUT [STRATEGY]     (Lightning's launcher spawns the ranks)
       torchrun --nproc-per-node DEVICES fault_raise.py WHERE RANK DEVICES OUT [STRATEGY]

STRATEGY: a name of lightning_dist.strategies.REGISTERED (default "hsdp").

WHERE: ``training_step`` | ``setup`` | ``configure_model``: rank RANK raises ``InjectedFault``;
       ``sigkill``: rank RANK kills itself with SIGKILL at step 5 (checkpoints every 2 steps in OUT);
       ``resume``: restart of the ``sigkill`` job from ``ckpt_path="last"`` to step 8;
       ``restart``: for ``torchrun --max-restarts 1``: the first attempt dies at step 5, the second resumes;
       ``short_data``: an IterableDataset that yields 1 batch on rank RANK and 4 on the others (one epoch);
       ``exit_after_fit``: training succeeds, then rank RANK exits with code 3 (a rank that failed after fit).
Every rank prints ``FAULT <time>`` right before it fails, so the test can measure the time to exit.
"""

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from _common import Classifier, dataset, emit, full_params, max_rel_diff, rank, reference, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset

from lightning_dist.strategies import REGISTERED

where, bad_rank, devices, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
name = sys.argv[5] if len(sys.argv) > 5 else "hsdp"
# strategies whose built-in plans do not fit the scenario's MLP get a small plan of their own
OPTIONS = {
    "tp": {"tp": 2, "plan": {"model.stem": "colwise_gather"}},
    "pipeline": {"split": "params", "pp": 2},
}  # pp 2 (x dp 2 on 4 ranks)
PRECISION = {"offload": "32-true"}  # DeepSpeed refuses float64
TIMEOUT = timedelta(seconds=90)  # the bound on how long survivors wait in a collective for a dead peer
KW = dict(n=64, schedule=True)  # 4 steps of 16 per epoch: steps 5..8 are the second epoch


class InjectedFault(RuntimeError):
    pass


def _fail(what: str) -> None:
    os.write(1, f"FAULT {time.time()}\n".encode())
    raise InjectedFault(f"injected failure in {what} on rank {bad_rank}")


class ShortOnOneRank(IterableDataset):
    """Batches of 4 rows of this rank's share; rank `bad_rank` runs out after one batch."""

    def __init__(self, rank: int, dtype) -> None:
        self.rank, self.data = rank, dataset(64, dtype=dtype)

    def __iter__(self):
        x, y = self.data.tensors
        for b in range(1 if self.rank == bad_rank else 4):
            rows = slice(self.rank * 16 + 4 * b, self.rank * 16 + 4 * b + 4)
            yield x[rows], y[rows]
        if self.rank == bad_rank:
            os.write(1, f"FAULT {time.time()}\n".encode())  # out of data: the fault of this scenario


class Faulty(Classifier):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.example_input_array = torch.randn(4, 12, dtype=torch.float64)  # PipelineStrategy's sample micro-batch

    def pipeline_loss(self, output, target):  # PipelineStrategy computes the loss on the last stage with this
        return torch.nn.functional.cross_entropy(output, target)

    def setup(self, stage):
        if where == "setup" and self.global_rank == bad_rank:
            _fail("setup")

    def configure_model(self):
        if where == "configure_model" and self.global_rank == bad_rank:
            _fail("configure_model")

    def train_dataloader(self):
        if where != "short_data":
            return super().train_dataloader()
        return DataLoader(ShortOnOneRank(self.global_rank, self.dtype_), batch_size=None)

    def training_step(self, batch, batch_idx):
        if self.global_rank == bad_rank:
            if where == "training_step" and self.global_step == 1:
                _fail("training_step")
            die = where == "sigkill" or (where == "restart" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0")
            if die and self.global_step == 5:
                os.write(1, f"FAULT {time.time()}\n".encode())
                os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


def fit(steps: int, ckpt_path=None, **kw):
    module = Faulty(**KW, dtype=torch.float32 if name in PRECISION else torch.float64)
    callback = ModelCheckpoint(
        dirpath=out,
        filename="step{step}",
        auto_insert_metric_name=False,
        save_top_k=-1,
        every_n_train_steps=2,
        save_last=True,
    )
    cls, _, params = REGISTERED[name]
    t = trainer(
        cls(**{**params, **OPTIONS.get(name, {})}, timeout=TIMEOUT),
        devices=devices,
        precision=PRECISION.get(name, "64-true"),
        steps=steps,
        enable_checkpointing=True,
        callbacks=[callback],
        **kw,
    )
    t.fit(module, ckpt_path=ckpt_path)
    return module, t


if where in ("resume", "restart"):
    resuming = where == "resume" or os.environ.get("TORCHELASTIC_RESTART_COUNT") != "0"
    # `ckpt_path="last"` finds ModelCheckpoint's `last.ckpt` (a sharded directory, swapped in atomically)
    module, t = fit(8, ckpt_path="last" if resuming else None)
    params = full_params(module)
    emit(
        kind=where,
        global_step=t.global_step,
        diff=max_rel_diff(params, reference(8, **KW)),
        restart=os.environ.get("TORCHELASTIC_RESTART_COUNT"),
        last=os.path.realpath(out / "last.ckpt"),
    )
elif where == "exit_after_fit":
    fit(2)
    if rank() == bad_rank:
        os.write(1, f"FAULT {time.time()}\n".encode())
        sys.exit(3)
    emit(kind="finished")
elif where == "short_data":
    fit(-1, max_epochs=1)  # one pass over the data: the ranks disagree on its length
    emit(kind="finished")
else:
    fit(8)
    emit(kind="finished")  # reached only when no fault was injected
