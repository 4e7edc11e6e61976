"""One-process tests of the callbacks: sampler reach, exact-evaluation sampling, SyncBatchNorm math,
GradientParityCheck on one device. The multi-process behaviour is in tests/distributed/test_callbacks.py."""

from __future__ import annotations

import copy
import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import free_port
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import CombinedLoader
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler, TensorDataset
from torchmetrics import MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_dist.callbacks import (
    DataParallelBatchNorm,
    ExactBatchSampler,
    ExactEvaluation,
    ExactMetric,
    GradientParityCheck,
    GradientParityError,
    MeshSyncBatchNorm,
    SamplerEpoch,
    check_sampler_seeds,
    convert_sync_batchnorm,
    exact_eval_mask,
    find_epoch_holders,
    revert_sync_batchnorm,
    set_epoch_everywhere,
)
from lightning_dist.callbacks.exact_eval import _exact_loader
from lightning_dist.callbacks.sync_batchnorm import _SyncBatchNormFn

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def _trainer(**kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


# ---- SamplerEpoch: reach ------------------------------------------------------------------------
class EpochIterable(IterableDataset):
    """A streaming dataset that shuffles by epoch (like streaming datasets exposing set_epoch)."""

    def __init__(self, n: int = 8):
        self.n, self.epoch, self.iterated_at = n, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        self.iterated_at.append(self.epoch)
        g = torch.Generator().manual_seed(self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())


class EpochBatchSampler(BatchSampler):
    def __init__(self, sampler, batch_size):
        super().__init__(sampler, batch_size, drop_last=False)
        self.epoch = -1

    def set_epoch(self, epoch):
        self.epoch = epoch


class WrappingSampler(Sampler):
    """A user sampler wrapper that does not forward set_epoch (the inner one is only reachable by attribute)."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)


class EpochSampler(Sampler):
    def __init__(self, n):
        self.n, self.epoch = n, -1

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist())

    def __len__(self):
        return self.n


def test_reaches_distributed_sampler_and_order_changes():
    ds = list(range(20))
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3)
    dl = DataLoader(ds, sampler=sampler, batch_size=4)
    assert find_epoch_holders(dl) == [sampler]
    set_epoch_everywhere(dl, 0)
    first = [int(i) for b in dl for i in b]
    set_epoch_everywhere(dl, 1)
    second = [int(i) for b in dl for i in b]
    assert sorted(first) == sorted(second) == ds and first != second


def test_reaches_custom_batch_sampler_itself():
    inner = DistributedSampler(range(10), num_replicas=1, rank=0)
    bs = EpochBatchSampler(inner, 2)
    dl = DataLoader(range(10), batch_sampler=bs)
    set_epoch_everywhere(dl, 5)
    assert bs.epoch == 5 and inner.epoch == 5


def test_reaches_nested_wrappers():
    innermost = EpochSampler(12)
    lightning_wrapped = DistributedSamplerWrapper(WrappingSampler(innermost), num_replicas=1, rank=0)
    dl = DataLoader(range(12), sampler=lightning_wrapped)
    holders = find_epoch_holders(dl)
    assert innermost in holders and lightning_wrapped in holders
    set_epoch_everywhere(dl, 4)
    assert innermost.epoch == 4 and lightning_wrapped.epoch == 4


def test_reaches_iterable_dataset_across_combined_list_and_dict():
    streams = [EpochIterable() for _ in range(4)]
    samplers = [EpochSampler(6) for _ in range(2)]
    combined = CombinedLoader({"a": DataLoader(streams[0]), "b": [DataLoader(streams[1]), DataLoader(streams[2])]})
    loaders = [
        combined,
        {"x": DataLoader(streams[3])},
        (DataLoader(range(6), sampler=samplers[0]),),
        DataLoader(range(6), sampler=samplers[1]),
    ]
    assert set_epoch_everywhere(loaders, 7) == 6
    assert [s.epoch for s in streams] == [7] * 4 and [s.epoch for s in samplers] == [7] * 2


def test_shards_disjoint_and_covering_every_epoch():
    n, world = 40, 4
    orders = []
    for epoch in (0, 1):
        shards = []
        for rank in range(world):
            s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=11)
            dl = DataLoader(range(n), batch_sampler=EpochBatchSampler(s, 5))  # reachable only via the batch sampler
            set_epoch_everywhere(dl, epoch)
            shards.append([int(i) for b in dl for i in b])
        flat = [i for s in shards for i in s]
        assert sorted(flat) == list(range(n))  # disjoint and covering
        orders.append(shards)
    assert all(a != b for a, b in zip(orders[0], orders[1]))


def test_seed_check_names_the_bad_sampler():
    dl = DataLoader(range(8), sampler=DistributedSampler(range(8), num_replicas=2, rank=1, seed=3))
    with pytest.raises(ValueError, match=r"num_replicas=2, rank=1.*num_replicas=1, rank=0"):
        check_sampler_seeds(dl, dp_size=1, dp_rank=0)
    assert check_sampler_seeds(DataLoader(range(4)), dp_size=1, dp_rank=0) == [[]]


class EpochRecorder(pl.LightningModule):
    """Records, per epoch, the batches it trained on."""

    def __init__(self, loader_fn):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.loader_fn = loader_fn
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).extend(int(i) for i in batch)
        return (self.w * batch.float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return self.loader_fn()


def test_sampler_epoch_reaches_an_iterable_dataset_in_a_run():
    stream = EpochIterable(8)
    model = EpochRecorder(lambda: DataLoader(stream, batch_size=2))
    _trainer(max_epochs=3, callbacks=[SamplerEpoch()]).fit(model)
    assert stream.iterated_at == [0, 1, 2]  # Lightning alone never tells an iterable dataset the epoch
    assert model.seen[0] != model.seen[1] != model.seen[2]


def test_sampler_epoch_restores_the_epoch_on_mid_epoch_resume(tmp_path):
    # a sampler Lightning cannot reach (wrapped); its order depends on the epoch; 4 batches per epoch
    def loader():
        return DataLoader(torch.arange(8), sampler=WrappingSampler(EpochSampler(8)), batch_size=2)

    first = EpochRecorder(loader)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1)  # step 6: mid epoch 1
    _trainer(max_epochs=2, callbacks=[SamplerEpoch(), ckpt], enable_checkpointing=True).fit(first)
    assert first.seen[0] != first.seen[1]
    path = tmp_path / "epoch=1-step=6.ckpt"
    saved = torch.load(path, weights_only=True)
    assert [v for k, v in saved["callbacks"].items() if "SamplerEpoch" in k] == [{"epoch": 1}]

    resumed = EpochRecorder(loader)
    cb = SamplerEpoch()
    _trainer(max_epochs=2, callbacks=[cb]).fit(resumed, ckpt_path=path)
    # Lightning runs the batches left in the interrupted epoch, drawn from a fresh iterator: that order must
    # be epoch 1's again (without the callback the wrapped sampler would be at epoch -1)
    n = len(resumed.seen[1])
    assert n == 4 and resumed.seen[1] == first.seen[1][:n] and cb.epoch == 1


# ---- exact evaluation ---------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 3, 4, 5])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("full_batches", [False, True])
def test_exact_batch_sampler_scores_each_sample_once(world, batch_size, full_batches):
    n = 31
    samplers = [
        ExactBatchSampler(num_samples=n, num_replicas=world, rank=r, batch_size=batch_size, full_batches=full_batches)
        for r in range(world)
    ]
    lengths = {len(s) for s in samplers}
    assert len(lengths) == 1  # every rank runs the same number of steps ...
    real = []
    for s in samplers:
        batches = list(s)
        assert len(batches) == len(s)
        for b, batch in enumerate(batches):
            mask = s.mask(b)
            assert len(mask) == len(batch) == len(samplers[0].mask(b))  # ... of the same sizes
            real += [i for i, keep in zip(batch, mask.tolist()) if keep]
    assert sorted(real) == list(range(n))
    per_rank = -(-n // world)
    rows = world * (-(-per_rank // batch_size) * batch_size if full_batches else per_rank)
    assert sum(len(b) for s in samplers for b in s) == rows  # padding kept, only masked
    if full_batches:
        assert {len(b) for s in samplers for b in s} == {batch_size}


@pytest.mark.parametrize("n", [2, 10, 31])
@pytest.mark.parametrize("world", [1, 3, 4, 5])
@pytest.mark.parametrize("batch_size", [1, 2, 3, 4, 8])
def test_trimmed_batches_hold_each_sample_once_in_lockstep(n, world, batch_size):
    samplers = [
        ExactBatchSampler(num_samples=n, num_replicas=world, rank=r, batch_size=batch_size, trim=True)
        for r in range(world)
    ]
    assert len({len(s) for s in samplers}) == 1  # every rank runs the same number of steps
    seen, empty = [], False
    for s in samplers:
        batches = list(s)
        assert len(batches) == len(s) and all(len(b) <= batch_size for b in batches)
        assert [len(b) for b in batches] == s.sizes and all(bool(s.mask(i).all()) for i in range(len(s)))
        empty |= any(len(b) == 0 for b in batches)
        sizes = [len(b) for b in batches]
        assert sizes == sorted(sizes, reverse=True)  # full batches first; an empty one only at the end
        seen += [i for b in batches for i in b]
    assert sorted(seen) == list(range(n))  # no repeated sample, none dropped
    assert empty == samplers[0].empty_anywhere()
    # a batch is empty only where a rank has fewer samples than steps: batch_size 1, or fewer samples than ranks
    assert empty == (n < world or (batch_size == 1 and n % world != 0))


def test_trim_mode_options_and_empty_batch_collate():
    with pytest.raises(ValueError, match="mode='mask'"):
        ExactEvaluation(full_batches=True)
    with pytest.raises(ValueError, match="'trim'"):
        ExactEvaluation(mode="drop")
    ds = TensorDataset(torch.arange(10, dtype=torch.float64).view(5, 2), torch.arange(5))
    # 5 samples, 3 ranks, batch size 1: rank 2 holds 1 sample for 2 steps
    dl = _exact_loader(DataLoader(ds, batch_size=1), num_replicas=3, rank=2, trim=True)
    (x0, y0), (x1, y1) = list(dl)
    assert y0.tolist() == [2] and x1.shape == (0, 2) and x1.dtype == torch.float64 and y1.shape == (0,)
    with pytest.raises(ValueError, match="collectives"):  # a sharded strategy cannot skip that step
        _exact_loader(DataLoader(ds, batch_size=1), num_replicas=3, rank=0, trim=True, may_skip=False)
    with pytest.raises(ValueError, match="5 samples for 6 data-parallel"):
        _exact_loader(DataLoader(ds, batch_size=2), num_replicas=6, rank=0, trim=True)


class PlainEvalModel(pl.LightningModule):
    """An existing project: plain torchmetrics, len(batch) and self.log, nothing about the callback."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(2, 1)
        self.rows = SumMetric()
        self.sizes: list[int] = []

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.rows.update(len(x))
        self.sizes.append(len(x))
        self.log("val_loss", (self.net(x) ** 2).mean(), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return batch[0]


def test_trim_mode_in_one_process_validate_and_predict():
    cb = ExactEvaluation()
    model = PlainEvalModel()
    ds = TensorDataset(torch.randn(11, 2))
    out = _trainer(callbacks=[cb]).validate(model, DataLoader(ds, batch_size=4, drop_last=True), verbose=False)
    assert out[0]["val_samples"] == 11.0 and model.sizes == [4, 4, 3] and float(model.rows.compute()) == 11
    with torch.no_grad():
        assert torch.isclose(torch.tensor(out[0]["val_loss"]), (model.net(ds.tensors[0]) ** 2).mean())
    preds = _trainer(callbacks=[cb]).predict(model, DataLoader(ds, batch_size=4, drop_last=True))
    assert torch.equal(torch.cat(preds), ds.tensors[0]) and cb.last_count == 11


def test_exact_loader_keeps_every_sample_and_refuses_iterables():
    ds = TensorDataset(torch.arange(10))
    rebuilt = _exact_loader(DataLoader(ds, batch_size=3, drop_last=True), num_replicas=1, rank=0)
    assert [int(i) for (b,) in rebuilt for i in b] == list(range(10))
    with pytest.raises(TypeError, match="map-style"):
        _exact_loader(DataLoader(EpochIterable()), num_replicas=2, rank=0)


def test_exact_metric_applies_the_mask():
    m = ExactMetric(SumMetric())
    m.update(torch.tensor([1.0, 2.0, 4.0]), mask=torch.tensor([True, False, True]))
    m.update(torch.tensor([8.0]))  # no mask, no callback: passes through
    assert float(m.compute()) == 13.0
    acc = ExactMetric(MulticlassAccuracy(num_classes=3, average="micro"))
    acc.update(torch.randn(2, 3), torch.tensor([0, 1]), mask=torch.tensor([False, False]))  # padding only
    acc.update(torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([0]), mask=torch.tensor([True]))
    assert float(acc.compute()) == 1.0
    with pytest.raises(TypeError, match="torchmetrics"):
        ExactMetric(lambda x: x)


class EvalModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(2, 1)
        self.val_loss = ExactMetric(MeanMetric())
        self.masks: list[torch.Tensor] = []

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.val_loss.update((self.net(x) ** 2).squeeze(-1))
        self.log("val_loss", self.val_loss)
        self.masks.append(exact_eval_mask(self))


def test_exact_evaluation_counts_samples_in_one_process():
    cb = ExactEvaluation()
    model = EvalModel()
    ds = TensorDataset(torch.randn(11, 2))
    out = _trainer(callbacks=[cb]).validate(model, DataLoader(ds, batch_size=4, drop_last=True), verbose=False)
    assert out[0]["val_samples"] == 11.0 and cb.last_count == 11
    assert [m.tolist() for m in model.masks] == [[True] * 4, [True] * 4, [True] * 3]  # drop_last undone
    with torch.no_grad():
        assert torch.isclose(torch.tensor(out[0]["val_loss"]), (model.net(ds.tensors[0]) ** 2).mean())


def test_unsynced_batchnorm_warning():
    from lightning_dist.callbacks.sync_batchnorm import unsynced_batchnorm, warn_unsynced_batchnorm

    model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4, track_running_stats=False))
    assert unsynced_batchnorm(model) == ["1"]
    with pytest.warns(UserWarning, match=r"\['1'\].*over 4 ranks.*MeshSyncBatchNorm\(\)"):
        assert warn_unsynced_batchnorm(model, dp_size=4)
    assert not warn_unsynced_batchnorm(model, dp_size=1)  # one replica: nothing differs
    assert unsynced_batchnorm(convert_sync_batchnorm(model, process_group=None)) == []


# ---- SyncBatchNorm ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-process gloo group: the collectives run, with nothing to pool."""
    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def test_sync_batchnorm_function_gradcheck_and_stats(one_rank_group):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b: _SyncBatchNormFn.apply(x, w, b, None, None, 1e-5, 0.1, one_rank_group, 1), (x, w, b)
    )
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    rm2, rv2 = rm.clone(), rv.clone()
    y = _SyncBatchNormFn.apply(x, w, b, rm, rv, 1e-5, 0.1, one_rank_group, 1)
    y2 = F.batch_norm(x, rm2, rv2, w, b, True, 0.1, 1e-5)
    torch.testing.assert_close(y, y2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rv, rv2, rtol=1e-12, atol=1e-12)  # unbiased running variance, like torch


def test_convert_and_revert_keep_keys_and_tensors(one_rank_group):
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.Flatten(), nn.BatchNorm1d(16)))
    keys = list(model.state_dict())
    weight = model[1].weight
    model = convert_sync_batchnorm(model, process_group=one_rank_group)
    assert isinstance(model[1], DataParallelBatchNorm) and isinstance(model[2][1], DataParallelBatchNorm)
    assert model[1].weight is weight  # reused, so a wrapper holding the parameters keeps working
    assert list(model.state_dict()) == keys
    model.train()(torch.randn(4, 3, 2, 2))
    assert copy.deepcopy(model)[1].process_group is None  # a copy is a local BatchNorm
    plain = revert_sync_batchnorm(copy.deepcopy(model))
    assert type(plain[1]) is nn.BatchNorm2d and type(plain[2][1]) is nn.BatchNorm1d
    fresh = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.Flatten(), nn.BatchNorm1d(16)))
    fresh.load_state_dict(model.state_dict())  # a single-device model loads the converted checkpoint
    model.eval(), fresh.eval()
    x = torch.randn(2, 3, 2, 2)
    torch.testing.assert_close(model(x), fresh(x))


class LateBatchNorm(pl.LightningModule):
    def __init__(self, late: bool):
        super().__init__()
        self.late = late
        self.net = nn.Sequential(nn.Linear(2, 3)) if late else nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))

    def configure_model(self):
        if self.late and len(self.net) == 1:
            self.net.append(nn.BatchNorm1d(3))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)


def test_mesh_sync_batchnorm_config_and_lifecycle_errors():
    with pytest.raises(ValueError, match="group_size=0"):
        MeshSyncBatchNorm(group_size=0)
    model = LateBatchNorm(late=False)
    _trainer(max_steps=1, callbacks=[MeshSyncBatchNorm()]).fit(model)
    assert isinstance(model.net[1], DataParallelBatchNorm)
    with pytest.raises(RuntimeError, match=r"\['net.1'\] were created after `setup`"):
        _trainer(max_steps=1, callbacks=[MeshSyncBatchNorm()]).fit(LateBatchNorm(late=True))


def test_mesh_sync_batchnorm_warns_once_on_a_model_without_batchnorm(recwarn):
    """Without any BatchNorm the callback would do nothing: it says so once (issue 29: was a silent no-op)."""

    class NoBatchNorm(LateBatchNorm):
        def __init__(self):
            super().__init__(late=False)
            self.net = nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3))

    callback = MeshSyncBatchNorm()
    with pytest.warns(UserWarning, match=r"NoBatchNorm has no BatchNorm layer.*\(LayerNorm normalize.*Remove the"):
        _trainer(max_steps=1, callbacks=[callback]).fit(NoBatchNorm())
    recwarn.clear()
    _trainer(max_steps=1, callbacks=[callback]).fit(NoBatchNorm())
    assert not [w for w in recwarn if "no BatchNorm layer" in str(w.message)]  # once
    _trainer(max_steps=1, callbacks=[MeshSyncBatchNorm()]).fit(LateBatchNorm(late=False))
    assert not [w for w in recwarn if "no BatchNorm layer" in str(w.message)]  # a model with BatchNorm: silent


def test_callbacks_from_a_cli_config():
    """LightningCLI builds callbacks with jsonargparse from `class_path`/`init_args`."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch import Callback

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--callbacks", type=list[Callback])
    config = {
        "callbacks": [
            {"class_path": "lightning_dist.callbacks.SamplerEpoch", "init_args": {"check_seeds": False}},
            {"class_path": "lightning_dist.callbacks.ExactEvaluation"},
            {"class_path": "lightning_dist.callbacks.MeshSyncBatchNorm", "init_args": {"group_size": 8}},
            {
                "class_path": "lightning_dist.callbacks.GradientParityCheck",
                "init_args": {"steps": [0, 10], "on_mismatch": "warn", "tolerance": 1e-6},
            },
        ]
    }
    callbacks = parser.instantiate_classes(parser.parse_object(config)).callbacks
    assert [type(c).__name__ for c in callbacks] == [
        "SamplerEpoch",
        "ExactEvaluation",
        "MeshSyncBatchNorm",
        "GradientParityCheck",
    ]
    assert callbacks[2].group_size == 8 and callbacks[3].steps == {0, 10} and callbacks[3].on_mismatch == "warn"


# ---- GradientParityCheck ------------------------------------------------------------------------
class ParityModel(pl.LightningModule):
    def __init__(self, manual: str = ""):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1))
        self.manual = manual
        self.automatic_optimization = not manual

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        if not self.manual:
            self.log("loss", self.loss(batch))
            return self.loss(batch)
        opt = self.optimizers()
        loss = self.loss(batch)
        self.manual_backward(loss if self.manual == "undivided" else loss / 2)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        ds = TensorDataset(
            torch.randn(16, 3, generator=g, dtype=torch.float64), torch.randn(16, 1, generator=g, dtype=torch.float64)
        )
        return DataLoader(ds, batch_size=4)


def test_gradient_parity_passes_on_one_device():
    check = GradientParityCheck(steps=(0, 2))
    _trainer(max_steps=3, precision="64-true", callbacks=[check]).fit(ParityModel())
    assert [r["step"] for r in check.results] == [0, 2]
    assert all(r["ok"] and r["rel_diff"] <= 1e-12 for r in check.results)


def test_gradient_parity_catches_undivided_accumulation():
    check = GradientParityCheck(loss_fn=lambda m, b: m.loss(b))
    with pytest.raises(GradientParityError, match="relative gradient difference 1.000e\\+00"):
        _trainer(max_steps=1, precision="64-true", callbacks=[check]).fit(ParityModel(manual="undivided"))


def test_gradient_parity_says_when_the_reference_loss_gives_no_gradient():
    """A loss that does not reach the copy's parameters gives a zero reference gradient: the ratio over the 1e-30
    floor is meaningless (issue 29's 1.430e+31 looked like a strategy bug), so the message says what happened."""
    outside = ParityModel().double()  # a network the copy does not hold: the "loss" never touches the copy's parameters
    check = GradientParityCheck(loss_fn=lambda m, b: outside.loss(b) if m is not live[0] else m.loss(b))
    live = []

    class Model(ParityModel):
        def on_fit_start(self):
            live.append(self)

    with pytest.raises(GradientParityError, match=r"e\+\d\d.*gave no gradient at all.*Pass `loss_fn="):
        _trainer(max_steps=1, precision="64-true", callbacks=[check]).fit(Model())


def test_unsharded_clone_of_fsdp2_modules(one_rank_group):
    """The reference copy of FSDP2-sharded layers whose ``__init__`` needs arguments is the user's plain model,
    without FSDP state, picklable (pipeline stages are sent between ranks) and computing the same output."""
    import pickle

    from torch.distributed.device_mesh import init_device_mesh

    from lightning_dist._compat import fully_shard_api
    from lightning_dist.callbacks.gradient_parity import unsharded_clone

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    expected = model(x)
    fully_shard, mesh = fully_shard_api()[0], init_device_mesh("cpu", (1,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    clone = pickle.loads(pickle.dumps(unsharded_clone(model, {}, {})))
    assert type(clone) is nn.Sequential and [type(m) for m in clone] == [nn.Linear, nn.Tanh, nn.Linear]
    assert all(type(p) is nn.Parameter for p in clone.parameters())
    torch.testing.assert_close(clone(x), expected)


def test_gradient_parity_config_errors():
    with pytest.raises(ValueError, match="on_mismatch='fail'"):
        GradientParityCheck(on_mismatch="fail")
    with pytest.raises(ValueError, match="steps"):
        GradientParityCheck(steps=())
    with pytest.raises(ValueError, match="loss_fn"):
        _trainer(max_steps=1, callbacks=[GradientParityCheck()]).fit(ParityModel(manual="divided"))


def test_reference_clone_rebinds_methods_left_in_the_instance_dict():
    """Lightning's forward redirection (ddp) leaves ``forward`` bound to the real module in its instance dict:
    the reference copy must run its own parameters, never the real ones."""
    from lightning_dist.callbacks._reference_model import unsharded_clone

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            return self.lin(x)

    real = Net()
    real.forward = real.forward  # what _ForwardRedirection's unpatch leaves behind
    ref = unsharded_clone(real, {id(p): p.detach() for p in real.parameters()}, {})
    ref(torch.randn(4, 3)).sum().backward()
    assert all(p.grad is None for p in real.parameters())  # the real gradients untouched
    assert all(p.grad is not None for p in ref.parameters())
