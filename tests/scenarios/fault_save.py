"""A process killed while it saves a checkpoint must leave the previous good checkpoint loadable.

usage: python fault_save.py MODE OUT     (Lightning's launcher, 2 processes, hsdp)

``last.ckpt`` in OUT is rewritten every 2 steps. During the second save (step 4), rank 0 stalls inside
the real writer of ``lightning_dist.checkpoint`` and prints ``SAVING <pid>``; the test then kills it
with SIGKILL. MODE:
  ``dir_write``:  sharded directory; stalls in the fsync of ``meta.pt`` (shards already in ``.tmp``);
  ``dir_swap``:   sharded directory; stalls between the two renames of the swap (old one moved aside);
  ``file_write``: consolidated file; stalls in the fsync of the temporary file.
  ``async_write``: ``async_checkpoint=True``, 8 steps; rank 1 (not rank 0, who commits) stalls in the fsync
                  of its shard file of the step-6 save, on the background writer thread, while training goes on;
  ``async_resume``: no kill: ``ckpt_path="last"`` after ``async_write`` (the step-4 checkpoint, an epoch
                  boundary: the plain loader restarts the epoch), trained to step 8 (async saves).
  ``listen``:     no kill: every rank reports MASTER_ADDR and the addresses its sockets listen on.
"""

import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
from _common import Classifier, emit, full_params, max_rel_diff, reference, trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_dist.checkpoint as ckpt
from lightning_dist.strategies import HybridShardStrategy

mode, out = sys.argv[1], Path(sys.argv[2])
KW = dict(n=64, schedule=True, width=64)  # a few hundred kB of float64 state per save


def stall() -> None:
    os.write(1, f"SAVING {os.getpid()} {time.time()}\n".encode())
    time.sleep(600)  # the test kills this process here


saves = {"n": 0, "step": 0, "shards": 0}
real_swap, real_fsync = ckpt._swap_in, os.fsync


def counting_swap(tmp, path):
    saves["n"] += 1
    if mode == "dir_swap" and saves["n"] == 2:
        os.replace(path, path.with_name(path.name + ".old"))  # the first rename of the real swap
        stall()
    real_swap(tmp, path)


def slow_fsync(fd):
    real_fsync(fd)
    if mode in ("dir_write", "file_write") and saves["step"] == 4:
        stall()
    if mode == "async_write" and threading.current_thread() is not threading.main_thread():
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):  # this rank's shard file, one per save
            saves["shards"] += 1
            if saves["shards"] == 3:  # the step-6 save
                stall()


class CountSaves(ModelCheckpoint):
    def _save_checkpoint(self, trainer, filepath):
        saves["step"] = trainer.global_step
        super()._save_checkpoint(trainer, filepath)


class Listening(Callback):
    def on_train_start(self, trainer, pl_module):
        socks = psutil.Process().net_connections(kind="inet")
        emit(
            master_addr=os.environ["MASTER_ADDR"],
            listening=sorted({c.laddr.ip for c in socks if c.status == psutil.CONN_LISTEN}),
        )


if mode == "listen":
    if os.environ.get("MASTER_ADDR") == "":
        del os.environ["MASTER_ADDR"]  # as on a fresh machine: the launcher chooses the address
    trainer(HybridShardStrategy(), devices=2, steps=1, callbacks=[Listening()]).fit(Classifier())
    sys.exit(0)

if int(os.environ.get("LOCAL_RANK", "0")) == (1 if mode == "async_write" else 0):
    ckpt._swap_in = counting_swap
    ckpt.os.fsync = slow_fsync  # `os` is the module `ckpt` uses; only this scenario process is affected

strategy = HybridShardStrategy(
    timeout=timedelta(seconds=30),
    save_distributed_checkpoint=mode != "file_write",
    async_checkpoint=mode.startswith("async"),
)
callback = CountSaves(dirpath=out, save_top_k=0, save_last=True, every_n_train_steps=2)
steps = 8 if mode.startswith("async") else 6
t = trainer(strategy, devices=2, steps=steps, enable_checkpointing=True, callbacks=[callback])
module = Classifier(**KW)
t.fit(module, ckpt_path="last" if mode == "async_resume" else None)
if mode == "async_resume":
    emit(
        kind="async_resume",
        global_step=t.global_step,
        diff=max_rel_diff(full_params(module), reference(8, **KW)),
        files=sorted(p.name for p in out.iterdir()),
    )
    sys.exit(0)
print('RESULT {"finished": true}')  # never reached: the save at step 4 is killed
