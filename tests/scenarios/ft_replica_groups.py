"""Fault-tolerant replica groups (torchft): one replica group per launch of this script (Lightning's launcher).

``group G GROUPS SHARD OUT PORT``: replica group G of GROUPS, SHARD ranks, embedded lighthouse on PORT (group 0);
3 AdamW steps in float64 under ``CommunicationLedger`` and ``MemoryReport``, the full parameters saved to
OUT/ft_{GROUPS}x{SHARD}_g{G}.pt. Group 0 of a 2-rank group also trains plain hsdp 2 x 1 on its two ranks
(OUT/plain_2x1.pt), the reference of the 1-rank groups.
``plain REP SHARD OUT``: plain hsdp REP x SHARD (OUT/plain_{REP}x{SHARD}.pt).
``diloco G SHARD OUT PORT``: replica group G of 2 under ``sync="diloco"``, ``sync_every=2``, SHARD ranks (FSDP2 inside
a group of two), embedded lighthouse on PORT (group 0); 6 AdamW inner steps in float64 (3 syncs, the default outer
SGD-Nesterov), the full parameters saved to OUT/diloco_2x{SHARD}_g{G}.pt; Lightning checkpoints after steps 2 (a sync)
and 3 (between two) in OUT/diloco_g{G}_step{2,3}.ckpt (a ResumableDataLoader: an exact mid-epoch resume); under
``CommunicationLedger`` (its row of the all-reduce across the groups, each step and planned).
``diloco_resume G SHARD OUT PORT STEP``: the same run, from another initial model, resumed from
OUT/diloco_g{G}_step{STEP}.ckpt to step 6; the full parameters saved to OUT/diloco_resumed_2x{SHARD}_g{G}.pt, torchft's
step counter and DiLoCo's inner steps at the first resumed batch emitted.
``unreachable ADDRESS``: a replica group whose lighthouse does not answer (connect_timeout 3 s): must fail.
``heal G OUT ADDRESS TOTAL KILL_AT [LAYOUT]``: replica group G of 2 (LAYOUT: ``1``, ``2`` ranks of hsdp's dp_shard, or
``pp2``, a 2-stage 1F1B pipeline) against the lighthouse at ADDRESS, 0.2 s per step, until torchft's committed step
TOTAL and 3 steps with both groups; with KILL_AT > 0 one rank SIGKILLs itself once step KILL_AT is committed in a step
both groups took: a group of one rank its only rank, of two ranks its rank 1 (a failure inside the group's own mesh:
the launcher ends the group). Every rank prints each step
(torchft's step, participants, the sample indices it trained, Lightning's global step, the LR, one random draw, the
``ft/`` figures of the progress bar and of the loggers, the ledger's cross-group all-reduce); the weights and optimizer
state are saved to OUT/heal_g{G}.pt (a pipeline: each rank's stage to OUT/heal_g{G}_r{RANK}.pt).
``heal_diloco G OUT ADDRESS TOTAL KILL``: the same under ``sync="diloco"``, ``sync_every=2`` (one rank per group, its
outer optimizer the default SGD-Nesterov), until torchft's committed sync TOTAL and 3 syncs with both groups; KILL
``sync``: SIGKILLed right after a sync both groups took (torchft's step >= 3, the second such sync at least),
``between``: one inner step past the second sync both groups took since this launch started (a launch that healed: its
heal and one more), ``none``. Every inner step printed (the sample indices, the batch read, Lightning's global step,
DiLoCo's inner steps, the LR, one random draw; at a sync its record, the heals, the ``ft/`` figures, the ledger's
cross-group row); the weights, the inner AdamW state and DiLoCo's state (global weights, outer momentum) saved to
OUT/heal_diloco_g{G}.pt.
``orphan OUT ADDRESS``: replica group 0 of 2 (two ranks, quorum_timeout 5 s) stepping until its lighthouse goes
away; it touches OUT/stepping after step 3. Must fail.
"""

import os
import signal
import sys
import time

import lightning.pytorch as pl
import torch
from _common import Classifier, dataset, emit, full_params, rank, trainer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.callbacks import CommunicationLedger, MemoryReport
from lightning_dist.data import ResumableDataLoader
from lightning_dist.strategies import FaultTolerance, HybridShardStrategy, PipelineStrategy

STEPS = 3
CROSS = ("all_reduce", "replica_group")  # the ledger's row of torchft's all-reduce across the groups
mode = sys.argv[1]


def shown(trainer) -> dict:
    """The ``ft/`` figures as the progress bar shows them, and as the loggers receive them."""
    pick = lambda metrics: {k: float(v) for k, v in metrics.items() if k.startswith("ft/")}  # noqa: E731
    return {"bar": pick(trainer.progress_bar_metrics), "logged": pick(trainer.logged_metrics)}


class Indexed(Classifier):
    """Samples that carry their index, shuffled per epoch (32 steps an epoch); one random draw per step (an RNG stream
    the heal must carry on); StepLR every 16 steps (the tests' replays use the same). `position`: the record also
    holds the epoch and the batch read (before a heal in this step's DiLoCo sync moves the loader)."""

    position = False

    def train_dataloader(self):
        kw = self.trainer.strategy.distributed_sampler_kwargs
        x, y = dataset(self.n, dtype=self.dtype_).tensors
        data = TensorDataset(x, y, torch.arange(self.n))
        sampler = DistributedSampler(data, shuffle=True, seed=0, **kw)
        return DataLoader(data, batch_size=self.global_batch // kw["num_replicas"], sampler=sampler)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        where = {"epoch": self.trainer.current_epoch, "batch": batch_idx} if self.position else {}
        self.record = {
            "indices": index.tolist(),
            **where,
            "draw": torch.rand(()).item(),
            "lr": self.trainer.optimizers[0].param_groups[0]["lr"],
        }
        return self.pipeline_loss(self(x), y)  # cross-entropy (served by PipelineStrategy on every pp rank)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.wd)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=16, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


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
    ledger, memory = CommunicationLedger(skip_steps=0, print_table=False), MemoryReport(print_table=False)
    start = time.perf_counter()
    t = trainer(strategy, devices=shard, steps=STEPS, callbacks=[ledger, memory])
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
        cross=[step.get(CROSS) for step in ledger.steps],  # [calls, payload bytes] per step
        cross_summary=next(r for r in ledger.summary if (r["op"], r["dim"]) == CROSS),
        memory_ratio=memory.rows[torch.distributed.get_rank()]["ratio"],
        shown=shown(t),
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
elif mode in ("diloco", "diloco_resume"):
    group, shard, out, port = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])

    class Resumable(Classifier):
        def train_dataloader(self):
            plain = super().train_dataloader()
            return ResumableDataLoader(plain.dataset, batch_size=plain.batch_size, sampler=plain.sampler)

    class SaveAt(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step in (2, 3):  # right after a sync; one inner step past it
                trainer.save_checkpoint(f"{out}/diloco_g{group}_step{trainer.global_step}.ckpt")

    class Counters(pl.Callback):
        """torchft's step counter and DiLoCo's inner steps at the first batch (DiLoCo is entered after the
        callbacks' on_train_start), torchft's batches committed at the end (the manager is gone after fit)."""

        first = batches_committed = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.first is None:
                strategy = trainer.strategy
                self.first = {"step": strategy.manager.current_step(), "inner_steps": strategy._diloco.inner_steps}

        def on_train_end(self, trainer, pl_module):
            self.batches_committed = trainer.strategy.manager.batches_committed()

    ft = FaultTolerance(replica_group=group, min_replicas=2, lighthouse_port=port, sync="diloco", sync_every=2)
    strategy = HybridShardStrategy(dp_replicate=2, dp_shard=shard, fault_tolerance=ft)
    resume = mode == "diloco_resume"
    module = Resumable(seed=7 if resume else 0)  # every group seeded alike: DiLoCo's groups start from one model
    counters = Counters()
    ledger = CommunicationLedger(skip_steps=0, print_table=False)  # its plan: DiLoCo's row (planner)
    start = time.perf_counter()
    t = trainer(strategy, devices=shard, steps=6, callbacks=[counters] if resume else [counters, SaveAt(), ledger])
    t.fit(module, ckpt_path=f"{out}/diloco_g{group}_step{sys.argv[6]}.ckpt" if resume else None)
    seconds = time.perf_counter() - start
    save(module, f"{out}/diloco{'_resumed' if resume else ''}_2x{shard}_g{group}.pt")
    emit(
        kind=mode,
        group=group,
        steps=list(strategy.committed_steps),
        seen=module.seen,
        seconds=seconds,
        first=counters.first,
        batches_committed=counters.batches_committed,
        cross=[step.get(CROSS) for step in ledger.steps],  # [calls, payload bytes] per step: the syncs' only
        cross_summary=next((r for r in ledger.summary if (r["op"], r["dim"]) == CROSS), None),
    )
elif mode == "unreachable":
    ft = FaultTolerance(replica_group=1, lighthouse=sys.argv[2], connect_timeout=3)
    strategy = HybridShardStrategy(dp_replicate=2, dp_shard=2, fault_tolerance=ft)
    emit(kind="start", t=time.time(), local=rank())
    trainer(strategy, devices=2, steps=STEPS).fit(Classifier())
    emit(kind="unexpected-success")
elif mode == "heal":
    group, out, address, total, kill_at = int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    layout = sys.argv[7] if len(sys.argv) > 7 else "1"  # "1", "2": dp_shard; "pp2": a 2-stage pipeline (1F1B)
    ranks = 2 if layout in ("2", "pp2") else 1
    victim = ranks - 1  # a group of one rank: its only rank (all of it); of two: rank 1, inside the group's own mesh

    class Chaos(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            last = trainer.strategy.committed_steps[-1]
            cross = ledger.steps[-1].get(CROSS)  # the ledger's callback runs first: this step's row
            emit(kind="step", group=group, global_step=trainer.global_step, **last, **pl_module.record, cross=cross,
                 stage_bytes=sum(8 * p.numel() for p in pl_module.parameters()), **shown(trainer))  # fmt: skip
            time.sleep(0.2)  # a step long enough for the other group to be restarted during the outage
            step = trainer.strategy.manager.current_step()
            if kill_at and step >= kill_at and last["participants"] == 2:  # killed while both groups step
                if trainer.global_rank == victim:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)  # the group's other rank: ended with it (PR_SET_PDEATHSIG, or the launcher exits 1)
            self.together = self.together + 1 if last["participants"] == 2 else 0
            if step >= total and (
                self.together >= 3 or step >= 600
            ):  # end together, 3 steps after the restart rejoined
                trainer.should_stop = True

        together = 0

    ft = FaultTolerance(replica_group=group, lighthouse=address, min_replicas=1, timeout=10, quorum_timeout=60)
    if layout == "pp2":
        strategy = PipelineStrategy(pp=2, dp_replicate=2, fault_tolerance=ft)
    else:
        strategy = HybridShardStrategy(dp_replicate=2, dp_shard=int(layout), fault_tolerance=ft)
    module = Indexed(n=512)
    ledger = CommunicationLedger(skip_steps=0, print_table=False)
    t = trainer(strategy, devices=ranks, steps=10_000, callbacks=[ledger, Chaos()])
    t.fit(module)
    optimizer = strategy.optimizers[0]
    moments = {f"opt.{n}.{k}": v for n, p in module.named_parameters() for k, v in optimizer.state[p].items()}
    moments = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in moments.items()}  # collectives
    state = {**full_params(module), **moments}
    if layout == "pp2":  # each rank its stage's
        torch.save(state, f"{out}/heal_g{group}_r{rank()}.pt")
    elif torch.distributed.get_rank() == 0:
        torch.save(state, f"{out}/heal_g{group}.pt")
    emit(
        kind="heal",
        group=group,
        steps=list(strategy.committed_steps),
        global_step=t.global_step,
        scheduler=t.lr_scheduler_configs[0].scheduler.state_dict(),
        rng=torch.get_rng_state().tolist(),
    )
elif mode == "heal_diloco":
    group, out, address, total, kill = int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
    EVERY = 2

    class Chaos(pl.Callback):
        syncs = together = 0
        state = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            strategy = trainer.strategy
            synced = len(strategy.committed_steps) > self.syncs  # this inner step ended with a sync
            self.syncs = len(strategy.committed_steps)
            row = {"sync": None}
            if synced:
                last = strategy.committed_steps[-1]
                self.together = self.together + 1 if last["participants"] == 2 else 0
                weights = sum(p.detach().double().abs().sum().item() for p in pl_module.parameters())
                row = {"sync": last, "heals": strategy.figures.heals, "together": self.together, "weights": weights,
                       **shown(trainer)}  # fmt: skip
            positions = [loader.position for loader in group_loaders(trainer)]  # after a heal: the healthy group's
            emit(kind="inner", group=group, global_step=trainer.global_step, inner_steps=strategy._diloco.inner_steps,
                 position=positions, cross=ledger.steps[-1].get(CROSS), **pl_module.record, **row)  # fmt: skip
            time.sleep(0.2)  # an inner step long enough for the other group to be restarted during the outage
            step = strategy.manager.current_step()
            if kill == "sync" and synced and step >= 3 and self.together >= 2:
                os.kill(os.getpid(), signal.SIGKILL)
            if kill == "between" and not synced and self.together >= 2 and strategy._diloco.inner_steps % EVERY == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if synced and step >= total and (self.together >= 3 or step >= 600):  # end together, at a sync
                trainer.should_stop = True

        def on_train_end(self, trainer, pl_module):  # DiLoCo's state, before the strategy leaves DiLoCo
            self.state = trainer.strategy._diloco.state_dict()

    from lightning_dist.strategies.heal import group_loaders

    ft = FaultTolerance(replica_group=group, lighthouse=address, min_replicas=1, timeout=10, quorum_timeout=60,
                        sync="diloco", sync_every=EVERY)  # fmt: skip
    strategy = HybridShardStrategy(dp_replicate=2, dp_shard=1, fault_tolerance=ft)
    module = Indexed(n=512)
    module.position = True
    ledger, chaos = CommunicationLedger(skip_steps=0, print_table=False), Chaos()
    t = trainer(strategy, devices=1, steps=10_000, callbacks=[ledger, chaos])
    t.fit(module)
    optimizer = strategy.optimizers[0]
    moments = {f"opt.{n}.{k}": v for n, p in module.named_parameters() for k, v in optimizer.state[p].items()}
    outer = chaos.state["outer_optimizer"]["state"]
    names = [n for n, _ in module.named_parameters()]
    state = {
        **full_params(module),
        **moments,
        **{f"global.{n}": w for n, w in chaos.state["global_weights"].items()},
        **{f"outer.{names[i]}.{k}": v for i, s in outer.items() for k, v in s.items()},
    }
    torch.save(state, f"{out}/heal_diloco_g{group}.pt")
    emit(
        kind="heal_diloco",
        group=group,
        steps=list(strategy.committed_steps),
        global_step=t.global_step,
        inner_steps=chaos.state["inner_steps"],
        scheduler=t.lr_scheduler_configs[0].scheduler.state_dict(),
        cross_summary=next(r for r in ledger.summary if (r["op"], r["dim"]) == CROSS),
        ledger_steps=len(ledger.steps),
    )
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
