"""Checkpoint save / resume / reshard for hybrid sharding, through Lightning's own launcher.

usage: python hsdp_checkpoint.py save OUT      (4 processes, hsdp 2x2)
       python hsdp_checkpoint.py reshard OUT   (2 processes, fsdp2 1x2)

`save`: A = 6 steps uninterrupted; B = the same run with ModelCheckpoint every 3 steps (sharded DCP
directories) and F = the same with consolidated files; C = resume from B's step-3 checkpoint to step 6,
which must equal A; G = B with `async_checkpoint=True` (saves written in the background; the step-6 one is
waited for at the end of fit) and H = resume from G's step-3 checkpoint, which must equal A too.
`reshard`: load step-3 checkpoints (B's, F's and the async G's) into a 1x2 mesh (identical parameters), then
resume to step 6 there (equal to A to float64 round-off).
"""

import sys
from pathlib import Path

import torch
from _common import Classifier, emit, full_params, max_rel_diff, trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dist.callbacks import MemoryReport
from lightning_dist.strategies import FullyShardStrategy, HybridShardStrategy

mode, out = sys.argv[1], Path(sys.argv[2])
KW = dict(n=48, schedule=True)  # 3 steps of 16 per epoch, StepLR every 2 steps


def fit(strategy, devices, steps, ckpt_path=None, prefix=None, extra=()):
    module = Classifier(**KW)
    kw = {}
    if prefix:
        kw = dict(
            enable_checkpointing=True,
            callbacks=[
                ModelCheckpoint(
                    dirpath=out,
                    filename=prefix + "{step}",
                    auto_insert_metric_name=False,
                    save_top_k=-1,
                    every_n_train_steps=3,
                ),
                *extra,
            ],
        )
    t = trainer(strategy, devices=devices, steps=steps, **kw)
    t.fit(module, ckpt_path=ckpt_path)
    return module, t


def hsdp(**kw):
    return HybridShardStrategy(dp_replicate=2, shard_size=2, **kw)


if mode == "save":
    a6, _ = fit(hsdp(), 4, 6)
    pa = full_params(a6)
    if torch.distributed.get_rank() == 0:
        torch.save(pa, out / "a6.pt")
    b6, _ = fit(hsdp(), 4, 6, prefix="b")
    fit(hsdp(save_distributed_checkpoint=False), 4, 6, prefix="f")
    c6, tc = fit(hsdp(), 4, 6, ckpt_path=out / "b3.ckpt")
    pc = full_params(c6)
    memory = MemoryReport(log=False, print_table=False)
    g6, tg = fit(hsdp(async_checkpoint=True), 4, 6, prefix="g", extra=[memory])
    pg = full_params(g6)
    g_files = sorted(p.name for p in out.iterdir() if p.name.startswith("g"))  # after fit: every save committed
    h6, th = fit(hsdp(async_checkpoint=True), 4, 6, ckpt_path=out / "g3.ckpt")
    ph = full_params(h6)
    emit(
        kind="async",
        checkpointing_changes_nothing=all(torch.equal(pa[k], pg[k]) for k in pa),
        bitwise=all(torch.equal(pa[k], ph[k]) for k in pa),
        global_step=th.global_step,
        files=g_files,
        staged=tg.strategy.checkpoint_writer().staging_bytes,
        reported=memory.rows[torch.distributed.get_rank()]["checkpoint_staging_bytes"],
        planned_staging=memory.rows[torch.distributed.get_rank()]["planned_checkpoint_staging_bytes"],
        params_optimizer=memory.measured["params"] + memory.measured["optimizer"],
    )
    emit(
        kind="resume",
        bitwise=all(torch.equal(pa[k], pc[k]) for k in pa),
        diff=max_rel_diff(pc, pa),
        checkpointing_changes_nothing=max_rel_diff(full_params(b6), pa),
        global_step=tc.global_step,
        lr=tc.optimizers[0].param_groups[0]["lr"],
        files=sorted(p.name for p in (out / "b3.ckpt").iterdir()),
    )
elif mode == "reshard":
    ref3 = torch.load(out / "f3.ckpt", weights_only=True)["state_dict"]
    ref6 = torch.load(out / "a6.pt", weights_only=True)
    for name in ("b3.ckpt", "f3.ckpt", "g3.ckpt"):
        loaded, t = fit(FullyShardStrategy(), 2, 3, ckpt_path=out / name)
        p = full_params(loaded)
        emit(
            kind="load",
            source=name,
            equal=all(torch.equal(p[k], ref3[k]) for k in p),
            diff=max_rel_diff(p, ref3),
            shape=list(t.strategy.mesh.spec.shape),
            global_step=t.global_step,
        )
    resumed, t = fit(FullyShardStrategy(), 2, 6, ckpt_path=out / "b3.ckpt")
    emit(kind="reshard_resume", diff=max_rel_diff(full_params(resumed), ref6), global_step=t.global_step)
