"""Fault-tolerant replica groups (torchft): one replica group per launch of this script (Lightning's launcher).

``group G GROUPS SHARD OUT PORT``: replica group G of GROUPS, SHARD ranks, embedded lighthouse on PORT (group 0);
3 AdamW steps in float64, the full parameters saved to OUT/ft_{GROUPS}x{SHARD}_g{G}.pt. Group 0 of a 2-rank
group also trains plain hsdp 2 x 1 on its two ranks (OUT/plain_2x1.pt), the reference of the 1-rank groups.
``plain REP SHARD OUT``: plain hsdp REP x SHARD (OUT/plain_{REP}x{SHARD}.pt).
``unreachable ADDRESS``: a replica group whose lighthouse does not answer (connect_timeout 3 s): must fail.
``heal G OUT ADDRESS TOTAL KILL_AT [SHARD]``: replica group G of 2 (SHARD ranks, default 1) against the lighthouse
at ADDRESS, 0.2 s per step, until torchft's committed step TOTAL with both groups stepping; with KILL_AT > 0 its
rank 0 SIGKILLs itself (its other ranks die with it) once step KILL_AT is committed in a step both groups took. The
weights and optimizer state are saved to OUT/heal_g{G}.pt.
``orphan OUT ADDRESS``: replica group 0 of 2 (two ranks, quorum_timeout 5 s) stepping until its lighthouse goes
away; it touches OUT/stepping after step 3. Must fail.
"""

import os
import signal
import sys
import time

import lightning.pytorch as pl
import torch
from _common import Classifier, emit, full_params, rank, trainer

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.strategies import HybridShardStrategy
from lightning_dist.strategies.fault_tolerance import FaultTolerance

STEPS = 3
mode = sys.argv[1]


def save(module, path) -> None:
    params = full_params(module)  # a collective: every rank
    if torch.distributed.get_rank() == 0:
        torch.save(params, path)


if mode == "group":
    group, groups, shard, out, port = (
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
        int(sys.argv[6]),
    )
    ft = FaultTolerance(replica_group=group, min_replicas=groups, lighthouse_port=port, connect_timeout=30)
    strategy = HybridShardStrategy(dp_replicate=groups, dp_shard=shard, fault_tolerance=ft)
    # one rank per group: group 1 starts from another model, and torchft's first quorum hands it group 0's (with
    # more ranks torchft takes group rank r's shard from group r % groups: groups must seed alike to equal a reference)
    module = Classifier(seed=7 if group == 1 and shard == 1 else 0)
    start = time.perf_counter()
    t = trainer(strategy, devices=shard, steps=STEPS)
    t.fit(module)
    seconds = time.perf_counter() - start
    sampler = t.train_dataloader.sampler
    save(module, f"{out}/ft_{groups}x{shard}_g{group}.pt")
    emit(
        kind="ft",
        group=group,
        groups=groups,
        shard=shard,
        steps=list(strategy.committed_steps),
        sampler={"num_replicas": sampler.num_replicas, "rank": sampler.rank},  # training's: over every group
        eval_sampler=strategy.distributed_sampler_kwargs,  # outside training: the group's own ranks
        shape=list(strategy.mesh.spec.shape),
        seen=module.seen,
        seconds=seconds,
    )
    if group == 0 and shard == 2:
        module = Classifier()
        trainer(HybridShardStrategy(dp_replicate=2, dp_shard=1), devices=2, steps=STEPS).fit(module)
        save(module, f"{out}/plain_2x1.pt")
elif mode == "plain":
    rep, shard, out = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    module = Classifier()
    trainer(HybridShardStrategy(dp_replicate=rep, dp_shard=shard), devices=rep * shard, steps=STEPS).fit(module)
    save(module, f"{out}/plain_{rep}x{shard}.pt")
    emit(kind="plain", mesh=[rep, shard])
elif mode == "unreachable":
    ft = FaultTolerance(replica_group=1, lighthouse=sys.argv[2], connect_timeout=3)
    strategy = HybridShardStrategy(dp_replicate=2, dp_shard=2, fault_tolerance=ft)
    emit(kind="start", t=time.time(), local=rank())
    trainer(strategy, devices=2, steps=STEPS).fit(Classifier())
    emit(kind="unexpected-success")
elif mode == "heal":
    group, out, address, total, kill_at = int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    shard = int(sys.argv[7]) if len(sys.argv) > 7 else 1

    class Chaos(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            time.sleep(0.2)  # a step long enough for the other group to be restarted during the outage
            step = trainer.strategy.manager.current_step()
            steps = trainer.strategy.committed_steps
            if kill_at and step >= kill_at and steps[-1]["participants"] == 2:  # killed while both groups step
                if trainer.global_rank == 0:  # the launcher: its other ranks die with it (PR_SET_PDEATHSIG)
                    emit(kind="killed", group=group, steps=list(trainer.strategy.committed_steps))
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
            together = trainer.strategy.committed_steps[-1]["participants"] == 2
            if step >= total and (together or step >= 4 * total):  # end together, whenever the restart rejoined
                trainer.should_stop = True

    ft = FaultTolerance(replica_group=group, lighthouse=address, min_replicas=1, timeout=10, quorum_timeout=60)
    strategy = HybridShardStrategy(dp_replicate=2, dp_shard=shard, fault_tolerance=ft)
    module = Classifier(n=4096)
    trainer(strategy, devices=shard, steps=10_000, callbacks=[Chaos()]).fit(module)
    optimizer = strategy.optimizers[0]
    moments = {f"opt.{n}.{k}": v for n, p in module.named_parameters() for k, v in optimizer.state[p].items()}
    moments = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in moments.items()}  # collectives
    state = {**full_params(module), **moments}
    if torch.distributed.get_rank() == 0:
        torch.save(state, f"{out}/heal_g{group}.pt")
    emit(kind="heal", group=group, steps=list(strategy.committed_steps))
elif mode == "orphan":
    out, address = sys.argv[2], sys.argv[3]

    class Mark(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            time.sleep(0.1)
            if trainer.strategy.manager.current_step() == 3 and torch.distributed.get_rank() == 0:
                open(f"{out}/stepping", "w").close()

    ft = FaultTolerance(replica_group=0, lighthouse=address, quorum_timeout=5, connect_timeout=5, timeout=5)
    strategy = HybridShardStrategy(dp_replicate=2, dp_shard=2, fault_tolerance=ft)
    trainer(strategy, devices=2, steps=10_000, callbacks=[Mark()]).fit(Classifier(n=4096))
    emit(kind="unexpected-success")
