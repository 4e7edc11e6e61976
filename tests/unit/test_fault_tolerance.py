"""fault_tolerance= in one process: the configuration, the job's own mesh, the lighthouse address, the heal state
(model and optimizer shards; Lightning's loop, LR schedulers, loader position and RNG taken over mid-run)."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dist import _compat
from lightning_dist.parallelize.shard_state import (
    load_module_state,
    load_optimizer_state,
    module_state,
    optimizer_state,
)
from lightning_dist.strategies import FullyShardStrategy, HybridShardStrategy, PipelineStrategy
from lightning_dist.strategies.ft_config import FaultTolerance
from lightning_dist.strategies.heal import group_loader, load_training_state, training_state

needs_torchft = pytest.mark.skipif(
    not _compat.torchft_available(), reason="torchft (the `fault-tolerance` extra) is not installed"
)


@needs_torchft
def test_replicate_dim_becomes_replica_groups_and_the_job_mesh_has_one():
    strategy = HybridShardStrategy(dp_replicate=3, dp_shard=2, fault_tolerance=FaultTolerance(replica_group=2))
    assert strategy._sizes["dp_replicate"] == 1 and strategy._ft_groups == 3
    assert strategy.fault_tolerance == FaultTolerance(replica_group=2)
    # a dict of the fields (LightningCLI YAML) and fsdp2 with replica groups
    fsdp2 = FullyShardStrategy(dp_replicate=2, fault_tolerance={"replica_group": 1, "min_replicas": 2})
    assert fsdp2.fault_tolerance.min_replicas == 2 and fsdp2._sizes["dp_replicate"] == 1
    assert HybridShardStrategy().fault_tolerance is None
    # a pipeline's replica groups: each group a pp x dp_shard job (the schedule's gradients averaged after it)
    pipeline = PipelineStrategy(pp=2, dp_replicate=2, fault_tolerance=FaultTolerance(replica_group=1))
    assert pipeline._sizes["dp_replicate"] == 1 and pipeline.replica_groups == 2 and pipeline._sizes["pp"] == 2


@needs_torchft
def test_every_configuration_problem_is_listed_at_once():
    bad = FaultTolerance(replica_group=2, min_replicas=3, timeout=0, lighthouse="lighthouse:29510", lighthouse_port=0)
    with pytest.raises(ValueError) as err:
        HybridShardStrategy(dp_replicate=2, fault_tolerance=bad)
    text = str(err.value)
    for needle in (
        "replica_group=2)` is outside dp_replicate=2: the groups are 0 .. 1",
        "min_replicas=3)` exceeds dp_replicate=2",
        "timeout=0)` must be a positive number of seconds",
        "lighthouse='lighthouse:29510')` must be the lighthouse's URL",
        "lighthouse_port=0)` must be a port number",
    ):
        assert needle in text, text
    with pytest.raises(ValueError, match=r"dp_replicate` to be the number of replica groups .* not 'auto'"):
        HybridShardStrategy(fault_tolerance=FaultTolerance(replica_group=0))
    with pytest.raises(ValueError, match="zero_stage=1 is not supported yet .*: pass zero_stage=2 or 3"):
        HybridShardStrategy(dp_replicate=2, zero_stage=1, fault_tolerance=FaultTolerance(replica_group=0))
    with pytest.raises(ValueError, match=r"unknown keys \['group'\]"):
        HybridShardStrategy(dp_replicate=2, fault_tolerance={"group": 0})
    with pytest.raises(ValueError, match="must be a FaultTolerance"):
        HybridShardStrategy(dp_replicate=2, fault_tolerance=True)
    with pytest.raises(ValueError, match=r"pp=2 on HybridShardStrategy: .* pass PipelineStrategy\(pp=\.\.\."):
        HybridShardStrategy(pp=2, dp_replicate=2, fault_tolerance=FaultTolerance(replica_group=0))
    diloco = FaultTolerance(replica_group=0, sync="diloco", sync_every=4)
    with pytest.raises(ValueError, match="sync='diloco' under PipelineStrategy is not supported yet"):
        PipelineStrategy(pp=2, dp_replicate=2, fault_tolerance=diloco)


@needs_torchft
def test_lighthouse_address_argument_then_environment_then_embedded(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    embedded = HybridShardStrategy(
        dp_replicate=2, fault_tolerance=FaultTolerance(replica_group=0, lighthouse_port=29611)
    )
    assert embedded.lighthouse_address() == ("http://127.0.0.1:29611", True)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lh:29510")
    assert embedded.lighthouse_address() == ("http://lh:29510", False)
    given = HybridShardStrategy(
        dp_replicate=2, fault_tolerance=FaultTolerance(replica_group=1, lighthouse="http://x:1")
    )
    assert given.lighthouse_address() == ("http://x:1", False)


def test_torchft_outside_the_tested_range_is_refused_with_the_range():
    _compat.require_torchft(version="0.2.0")
    with pytest.raises(RuntimeError, match=r"torchft>=0\.2\.0,<0\.3\.0; found torchft 0\.3\.1"):
        _compat.require_torchft(version="0.3.1")


def test_heal_state_round_trips_weights_and_adamw_state():
    """What a healthy group sends (local tensors) and a healing one loads: equal weights, moments and step counts."""

    def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(seed + 1):
            model(torch.randn(5, 4)).square().mean().backward()
            opt.step()
        return model, opt

    healthy, healthy_opt = trained(2)
    healing, healing_opt = trained(0)
    state = module_state(healthy)
    assert "1.running_mean" in state  # buffers travel too (BatchNorm statistics)
    load_module_state(healing, state)
    load_optimizer_state(healing_opt, optimizer_state(healthy_opt))
    for a, b in zip(healthy.state_dict().values(), healing.state_dict().values()):
        assert torch.equal(a, b)
    for p, q in zip(healthy.parameters(), healing.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(healthy_opt.state[p][key], healing_opt.state[q][key])


class _Counted(torch.utils.data.Dataset):
    """40 samples that carry their index; counts the samples read."""

    def __init__(self) -> None:
        self.x, self.reads = torch.randn(40, 3, generator=torch.Generator().manual_seed(1)), 0

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        self.reads += 1
        return self.x[i], i


def _loader(cls=DataLoader) -> DataLoader:
    data = _Counted()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)  # the order changes per epoch
    return cls(data, batch_size=4, sampler=sampler)


@pytest.mark.parametrize("stateful", [False, True], ids=["DataLoader-reads-and-drops", "ResumableDataLoader-skips"])
def test_group_loader_asks_before_each_batch_and_moves_to_another_groups_position(stateful):
    from lightning_dist._integrations.lightning import set_sampler_epoch
    from lightning_dist.data import ResumableDataLoader

    cls = ResumableDataLoader if stateful else DataLoader
    asked = []
    healthy = group_loader(_loader(cls), lambda: asked.append(len(asked)))
    assert len(healthy) == 10 and hasattr(healthy, "state_dict") == stateful  # Lightning checkpoints it if stateful
    set_sampler_epoch(healthy, 1)  # Lightning sets the epoch on the loader it was handed: it reaches the sampler
    assert healthy.sampler.epoch == 1
    batches = iter(healthy)
    seen = [next(batches)[1].tolist() for _ in range(3)]
    assert asked == [0, 1, 2] and healthy.position == 3  # the quorum before each batch is read

    healing = group_loader(_loader(cls), lambda: None)
    healing_batches = iter(healing)
    reads = healing.dataset.reads
    healing.seek(healthy.position_state(), epoch=1, same_epoch=False)
    # a stateful loader skips by index; any other reads the 3 batches before the position and drops them
    assert healing.dataset.reads - reads == (0 if stateful else 12)
    assert healing.position == 3 and healing.sampler.epoch == 1
    assert [b[1].tolist() for b in healing_batches] == [b[1].tolist() for b in batches]  # the rest of epoch 1
    assert seen[0] != sorted(seen[0])  # shuffled: a wrong epoch would give another order

    same = group_loader(_loader(cls), lambda: None)
    iter(same)
    reads = same.dataset.reads
    same.seek({"position": 0, "loader": None}, epoch=0, same_epoch=True)  # already there: nothing moves
    assert same.dataset.reads == reads and same.position == 0


class _Net(pl.LightningModule):
    """A linear layer on shuffled indexed samples (10 steps an epoch); one random draw per step; AdamW with a
    per-step and a per-epoch LR scheduler.
    ``before_batch`` (the group loader's hook, where the quorum is asked) snapshots or heals."""

    def __init__(self, *, snapshot_at: int = -1, heal_from: dict | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 2)
        self.snapshot_at, self.heal_from, self.snapshot, self.trace = snapshot_at, heal_from, None, []

    def train_dataloader(self):
        return group_loader(_loader(), self.before_batch)

    def before_batch(self) -> None:
        import copy

        trainer, optimizer = self.trainer, self.trainer.optimizers[0]
        if self.heal_from is not None:  # what the strategy's torchft callbacks load, in their order
            load_module_state(self, self.heal_from["model"])
            load_optimizer_state(optimizer, self.heal_from["optimizer"])
            load_training_state(trainer, self.heal_from["trainer"])
            self.heal_from = None
        elif trainer.global_step == self.snapshot_at and self.snapshot is None:  # what torchft sends (a copy)
            state = {"model": module_state(self), "optimizer": optimizer_state(optimizer)}
            self.snapshot = copy.deepcopy({**state, "trainer": training_state(trainer)})

    def training_step(self, batch, batch_idx):
        x, index = batch
        trainer = self.trainer
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.trace.append(
            (trainer.global_step, trainer.current_epoch, batch_idx, trainer.is_last_batch, index.tolist(), lr)
            + (torch.rand(()).item(),)
        )
        return self.layer(x).square().mean()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.1)
        steps = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        epochs = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)  # stepped by Lightning at each epoch's end
        return [opt], [{"scheduler": steps, "interval": "step"}, {"scheduler": epochs, "interval": "epoch"}]


def test_a_heal_continues_lightning_exactly_where_the_healthy_group_was():
    """Lightning's side of a heal in one process: a fresh run takes over another's state (snapshot between its steps
    13 and 14, mid-epoch 1) at its own first batch, and continues as that run did: the same global steps, epochs,
    batch indices, last-batch flags, samples (shuffled per epoch), LR schedule and random draws, into epoch 2, and
    bitwise-identical weights at the end."""

    def fit(module: _Net) -> _Net:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=25, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        )  # fmt: skip
        trainer.fit(module)
        assert trainer.global_step == 25
        return module

    healthy = fit(_Net(snapshot_at=13))
    healed = fit(_Net(heal_from=healthy.snapshot))
    assert healthy.trace[13][:4] == (13, 1, 3, False) and healthy.trace[19][3]  # step 20: epoch 1's last batch
    assert healed.trace == healthy.trace[13:]
    assert all(torch.equal(a, b) for a, b in zip(healthy.parameters(), healed.parameters()))


# ---- sync="diloco" --------------------------------------------------------------------------------------------


@needs_torchft
def test_diloco_configuration_and_every_refusal_listed_at_once():
    import functools

    from lightning_dist.strategies.diloco import outer_optimizer_factory

    diloco = {"replica_group": 0, "sync": "diloco", "sync_every": 50}
    strategy = HybridShardStrategy(dp_replicate=2, fault_tolerance=diloco)  # a dict, as in a LightningCLI YAML
    assert strategy.fault_tolerance.diloco and strategy.fault_tolerance.sync_every == 50
    # the outer optimizer: the DiLoCo paper's SGD by default, a class, a factory, or LightningCLI's class_path form
    params = [torch.nn.Parameter(torch.zeros(2))]
    default = outer_optimizer_factory(None)(params)
    assert isinstance(default, torch.optim.SGD)
    assert {k: default.defaults[k] for k in ("lr", "momentum", "nesterov")} == {
        "lr": 0.7,
        "momentum": 0.9,
        "nesterov": True,
    }
    assert isinstance(outer_optimizer_factory(torch.optim.Adam)(params), torch.optim.Adam)
    given = functools.partial(torch.optim.SGD, lr=0.5)
    assert outer_optimizer_factory(given) is given
    yaml = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.3, "momentum": 0.5}}
    assert outer_optimizer_factory(yaml)(params).defaults["lr"] == 0.3

    bad = FaultTolerance(replica_group=0, sync="diloco", sync_every=0, outer_optimizer=torch.nn.Linear)
    with pytest.raises(ValueError) as err:
        HybridShardStrategy(dp_replicate=1, fault_tolerance=bad)
    text = str(err.value)
    for needle in (
        "`FaultTolerance(sync_every=0)` must be an integer >= 1",
        "dp_replicate=1 has one. Pass dp_replicate >= 2 (one job per group), or sync='step'",
        "`FaultTolerance(outer_optimizer=<class 'torch.nn.modules.linear.Linear'>)` must be a torch.optim.Optimizer",
    ):
        assert needle in text, text
    for value, needle in [
        ({"sync": "async"}, "`FaultTolerance(sync='async')` must be 'step' (every step) or 'diloco'"),
        ({"sync_every": 10}, "`FaultTolerance(sync_every=10)` applies to sync='diloco' only"),
        ({"sync": "diloco", "outer_optimizer": 0.7}, "`FaultTolerance(outer_optimizer=0.7)` must be a torch.optim"),
        ({"sync": "diloco", "outer_optimizer": {"class_path": "torch.nn.Linear"}}, "is not a torch.optim.Optimizer"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            HybridShardStrategy(dp_replicate=2, fault_tolerance=FaultTolerance(replica_group=0, **value))


@needs_torchft
def test_diloco_heal_state_brings_global_weights_and_outer_state_and_skips_the_first_sync():
    """torchft's DiLoCo registers its own heal state: the global weights (its backup) and the outer optimizer's state,
    here as local shards (LocalShardState); the strategy's own (weights, inner optimizer, loop) are not loaded at step
    0, where torchft's init_sync heals every group but one at the first sync (each keeps its own first interval)."""
    from types import SimpleNamespace

    from lightning_dist._integrations.torchft import diloco
    from lightning_dist.parallelize.shard_state import LocalShardState
    from lightning_dist.strategies.fault_tolerance import _healing

    def group(seed: int):
        registered = {}
        manager = SimpleNamespace(_use_async_quorum=False, step=0, current_step=lambda: manager.step)
        manager.register_state_dict_fn = lambda key, load, save: registered.setdefault(key, (load, save))
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 2)
        outer = LocalShardState(torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True))
        diloco(manager, model, torch.optim.AdamW(model.parameters()), outer, sync_every=2)  # copies the weights
        return manager, model, outer, registered

    _, healthy, healthy_outer, sent = group(0)
    for p in healthy.parameters():  # an outer step: momentum state to send
        p.grad = torch.ones_like(p)
    healthy_outer.step()
    (key,) = sent
    state = sent[key][1]()
    assert key == "StreamingDiLoCoFragment_0" and set(state) == {"original_parameters", "outer_optimizer"}
    manager, healing, healing_outer, loads = group(1)
    loads[key][0](state)
    backup = state["original_parameters"]
    assert all(torch.equal(backup[n], p) for n, p in group(0)[1].named_parameters())  # the weights when copied
    for p, q in zip(healthy.parameters(), healing.parameters()):
        assert torch.equal(
            healthy_outer.optimizer.state[p]["momentum_buffer"], healing_outer.optimizer.state[q]["momentum_buffer"]
        )

    loaded = []
    load = _healing(lambda target, s: loaded.append(s), None, manager=manager)
    load("first sync")  # step 0: skipped
    manager.step = 3
    load("a restarted group")
    assert loaded == ["a restarted group"]


class _SyncNet(_Net):
    """`_Net` healed as under DiLoCo: in the optimizer step (the hook DiLoCo syncs in), not in a batch read."""

    def __init__(self, *, heal_at: int = -1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.heal_at = heal_at

    def before_batch(self) -> None:
        pass

    def configure_optimizers(self):
        config = super().configure_optimizers()
        config[0][0].register_step_post_hook(lambda *_: self.after_step())
        return config

    def after_step(self) -> None:
        import copy

        trainer, optimizer = self.trainer, self.trainer.optimizers[0]
        if self.heal_from is not None and trainer.global_step == self.heal_at:
            load_module_state(self, self.heal_from["model"])
            load_optimizer_state(optimizer, self.heal_from["optimizer"])
            load_training_state(trainer, self.heal_from["trainer"])
            self.heal_from = None
        elif trainer.global_step == self.snapshot_at and self.snapshot is None:
            state = {"model": module_state(self), "optimizer": optimizer_state(optimizer)}
            self.snapshot = copy.deepcopy({**state, "trainer": training_state(trainer)})


def test_a_heal_inside_the_optimizer_step_continues_lightning_exactly_where_the_healthy_group_was():
    """A DiLoCo heal happens in a sync, inside the optimizer step: a fresh run that took 2 steps of its own (DiLoCo's
    inner steps before its first sync) takes over another's state taken inside its 14th step (mid-epoch 1), and
    continues as that run did (steps, epochs, batch indices, last-batch flags, samples, LR schedules, random draws)
    into epoch 2, with bitwise-identical weights at the end."""

    def fit(module: _Net) -> _Net:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=25, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        )  # fmt: skip
        trainer.fit(module)
        assert trainer.global_step == 25
        return module

    healthy = fit(_SyncNet(snapshot_at=13))
    healed = fit(_SyncNet(heal_from=healthy.snapshot, heal_at=1))
    assert healthy.trace[13][:4] == (13, 1, 3, False)
    assert healed.trace[2:] == healthy.trace[14:] and healed.trace[:2] != healthy.trace[12:14]
    assert all(torch.equal(a, b) for a, b in zip(healthy.parameters(), healed.parameters()))


@needs_torchft
def test_diloco_from_the_docs_lightningcli_yaml(monkeypatch):
    """The DiLoCo YAML of docs/fault_tolerance.md through LightningCLI: the outer optimizer's `class_path` becomes a
    factory of the parameters."""
    import yaml
    from _docs import ROOT, blocks
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    (block,) = [b for b in blocks(ROOT / "docs" / "fault_tolerance.md") if b.lang == "yaml" and "diloco" in b.body]
    config = yaml.safe_load(block.body)
    config["trainer"].update(logger=False, enable_checkpointing=False)
    monkeypatch.setattr("sys.argv", ["cli"])  # LightningCLI reads the command line too
    cli = LightningCLI(BoringModel, run=False, args=config, seed_everything_default=False)
    ft = cli.trainer.strategy.fault_tolerance
    assert ft.diloco and ft.sync_every == 100 and cli.trainer.strategy._ft_groups == 4
    outer = ft.outer_optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(outer, torch.optim.SGD) and outer.defaults["nesterov"] and outer.defaults["lr"] == 0.7


def test_what_the_user_sees_participants_failures_and_heal_time():
    """``ft/participants`` per step; ``ft/failures`` counts each group that left the quorum and each uncommitted step
    (a group joining is none); ``ft/heal_s`` the last heal's seconds (0: none)."""
    from lightning_dist.strategies.fault_tolerance import ReplicaGroupFigures

    figures, shown = ReplicaGroupFigures(), []
    for participants, committed in [(1, True), (3, True), (2, True), (2, False), (1, True), (3, True)]:
        figures.stepped(participants, committed)
        shown.append(figures.as_dict())
    assert [s["ft/participants"] for s in shown] == [1, 3, 2, 2, 1, 3]
    assert [s["ft/failures"] for s in shown] == [0, 0, 1, 2, 3, 3]
    assert shown[-1]["ft/heal_s"] == 0.0
    figures.healed(1.5)
    assert figures.as_dict()["ft/heal_s"] == 1.5 and figures.heals == 1


@needs_torchft
def test_the_ledger_names_the_group_outside_the_mesh_replica_group():
    strategy = HybridShardStrategy(dp_replicate=2, dp_shard=1, fault_tolerance=FaultTolerance(replica_group=0))
    assert strategy.outside_group_dim == "replica_group" and strategy.replica_groups == 2
    plain = HybridShardStrategy(dp_replicate=2, dp_shard=1)
    assert plain.outside_group_dim is None and plain.replica_groups == 1


def _diloco_sync(seed: int, outer_optimizer=None):
    """A DiLoCoSync over a small model, on a stand-in manager (no process group)."""
    from types import SimpleNamespace

    from lightning_dist.strategies.diloco import DiLoCoSync

    manager = SimpleNamespace(_use_async_quorum=False, current_step=lambda: 0)
    manager.register_state_dict_fn = lambda key, load, save: None
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2).double()
    inner = torch.optim.AdamW(model.parameters())
    return DiLoCoSync(manager, model, inner, outer_optimizer=outer_optimizer, every=2)


@needs_torchft
def test_diloco_checkpoint_state_round_trips_through_weights_only_load(tmp_path):
    """A checkpoint's DiLoCo state (plain tensors: torch.load(weights_only=True)) brings the global weights, the outer
    optimizer's momentum and the inner steps (DiLoCo's own counter of the steps since its last sync too)."""
    from lightning_dist._integrations.torchft import diloco_global_weights

    saved = _diloco_sync(0)
    for p in saved.module.parameters():  # an outer step: momentum; then the weights moved on from the backup
        p.grad = torch.ones_like(p)
    saved.outer.step()
    with torch.no_grad():
        for p in saved.module.parameters():
            p.add_(1.0)
    saved.inner_steps = 3
    torch.save(saved.state_dict(), tmp_path / "diloco.pt")
    state = torch.load(tmp_path / "diloco.pt", weights_only=True)
    resumed = _diloco_sync(1)
    resumed.load_state_dict(state)
    assert resumed.inner_steps == 3 and resumed._sync._local_step == 1  # the next sync after one more step
    backup, expected = diloco_global_weights(resumed._sync), diloco_global_weights(saved._sync)
    assert set(backup) == {"weight", "bias"} and all(torch.equal(backup[k], expected[k]) for k in backup)
    assert not any(torch.equal(backup[n], p) for n, p in saved.module.named_parameters())  # global, not local
    for p, q in zip(saved.module.parameters(), resumed.module.parameters()):
        momentum = saved.outer.state[p]["momentum_buffer"]
        assert momentum.abs().max() > 0 and torch.equal(momentum, resumed.outer.state[q]["momentum_buffer"])


@needs_torchft
def test_diloco_heal_state_carries_the_inner_steps_but_not_at_the_first_sync():
    """What the strategy registers with torchft besides DiLoCo's own heal state (key ``"diloco"``): the inner steps, so
    that a healed group counts them (its checkpoints, Lightning's global step) as the healthy group does; skipped at
    step 0 (torchft's init_sync: each group keeps its own first interval). DiLoCo's own counter of the steps since the
    last sync is the same in every group at a sync and is left alone."""
    from lightning_dist.strategies.diloco import DiLoCoSync
    from lightning_dist.strategies.fault_tolerance import _healing

    healthy, healing = _diloco_sync(0), _diloco_sync(1)
    healthy.inner_steps, healing.inner_steps = 46, 2
    state = healthy.heal_state()
    assert state == {"inner_steps": 46}
    load = _healing(DiLoCoSync.load_heal_state, healing, manager=healing.manager)
    load(state)  # the first sync
    assert healing.inner_steps == 2
    healing.manager.current_step = lambda: 23
    load(state)
    assert healing.inner_steps == 46 and healing._sync._local_step == 0


@needs_torchft
def test_a_checkpoint_of_another_sync_mode_or_outer_optimizer_is_refused_and_a_plain_one_warns():
    from lightning_dist.strategies.fault_tolerance import check_checkpoint_entry

    diloco, step = FaultTolerance(replica_group=0, sync="diloco"), FaultTolerance(replica_group=0)
    entry = {"sync": "step", "manager": {"step": 4, "batches_committed": 8}}
    with pytest.raises(ValueError, match=re.escape("sync='step', this run has FaultTolerance(sync='diloco')")):
        check_checkpoint_entry(entry, diloco, "last.ckpt")
    assert check_checkpoint_entry(entry, step, "last.ckpt")
    with pytest.raises(ValueError, match="saved before DiLoCo was entered"):
        check_checkpoint_entry({**entry, "sync": "diloco"}, diloco, "last.ckpt")
    with pytest.warns(UserWarning, match="not from a fault-tolerant run.*starts at 0 and DiLoCo"):
        assert not check_checkpoint_entry(None, diloco, "plain.ckpt")
    state = _diloco_sync(0).state_dict()
    with pytest.raises(ValueError, match="outer optimizer is torch.optim.sgd.SGD, this run's torch.optim.adam.Adam"):
        _diloco_sync(0, outer_optimizer=torch.optim.Adam).load_state_dict(state)


def test_average_gradients_sends_one_buffer_per_dtype_and_writes_every_gradient_back():
    """A pipeline's gradients averaged across the groups after its schedule: one call per dtype, each gradient
    (non-contiguous ones too) given back its part of the reduced buffer."""
    from lightning_dist._integrations.torchft import average_gradients

    class Manager:  # stands in for torchft's: the "average" adds the buffer's position, so misplaced parts show
        def __init__(self):
            self.calls = []

        def allreduce(self, flat):
            self.calls.append((flat.dtype, flat.numel()))
            flat += torch.arange(flat.numel(), dtype=flat.dtype)
            return type("Work", (), {"wait": lambda self: None})()

    grads = [torch.zeros(2, 3, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.float64).t(), torch.zeros(4)]
    manager = Manager()
    assert average_gradients(grads, manager) == 2
    assert manager.calls == [(torch.float64, 12), (torch.float32, 4)]
    assert torch.equal(grads[0].flatten(), torch.arange(6, dtype=torch.float64))
    assert torch.equal(grads[1].reshape(-1), torch.arange(6, 12, dtype=torch.float64))  # row-major order of its view
    assert torch.equal(grads[2], torch.arange(4, dtype=torch.float32))
