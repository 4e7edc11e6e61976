"""Callbacks under Lightning's DDP and the pack's hsdp / tp / pipeline strategies on CPU/gloo, several checks
per launch.

    python callbacks_ddp.py --devices 4 --parts exact,syncbn,parity,sampler,hsdp,tp,pipeline

Prints one ``RESULT {...}`` line per rank with the figures of every part; the test asserts on them.
Every single-device reference is computed in this run on each rank from the same data and weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset
from torchmetrics import MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_dist.callbacks import (
    DataParallelBatchNorm,
    ExactEvaluation,
    ExactMetric,
    GradientParityCheck,
    MeshSyncBatchNorm,
    SamplerEpoch,
    check_sampler_seeds,
    convert_sync_batchnorm,
)
from lightning_dist.callbacks.sync_batchnorm import _partition_group
from lightning_dist.mesh import data_parallel_info
from lightning_dist.models.gpt import CharGPT

warnings.filterwarnings("ignore")


def trainer(devices: int, **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=devices,
        strategy="ddp",
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


# ---- exact evaluation ---------------------------------------------------------------------------
def eval_data(n: int = 31) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))


class EvalModel(pl.LightningModule):
    def __init__(self, loaders: dict):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Linear(8, 3)
        self.loaders = loaders
        for stage in ("val", "test"):
            setattr(self, f"{stage}_acc", ExactMetric(MulticlassAccuracy(num_classes=3, average="micro")))
            setattr(self, f"{stage}_loss", ExactMetric(MeanMetric().set_dtype(torch.float64)))
        self.naive_rows = 0  # rows seen without the mask (the control: padding included)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def _eval(self, batch, stage):
        x, y = batch
        logits = self.net(x)
        getattr(self, f"{stage}_acc").update(logits, y)
        getattr(self, f"{stage}_loss").update(F.cross_entropy(logits, y, reduction="none"))
        self.log(f"{stage}_acc", getattr(self, f"{stage}_acc"))
        self.log(f"{stage}_loss", getattr(self, f"{stage}_loss"))
        self.naive_rows += len(y)

    def validation_step(self, batch, batch_idx):
        self._eval(batch, "val")

    def _epoch_end(self, stage):
        # read the metrics themselves: Lightning's logged copies are rounded to float32
        self.final = {k: float(getattr(self, f"{stage}_{k}").compute()) for k in ("acc", "loss")}

    def _float64_means(self):
        # torchmetrics resets a metric's dtype to the default on `.to(device)`: set it again once placed
        for stage in ("val", "test"):
            getattr(self, f"{stage}_loss").metric.set_dtype(torch.float64)

    def on_validation_start(self):
        self._float64_means()

    def on_test_start(self):
        self._float64_means()

    def on_validation_epoch_end(self):
        self._epoch_end("val")

    def on_test_epoch_end(self):
        self._epoch_end("test")

    def test_step(self, batch, batch_idx):
        self._eval(batch, "test")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return self.loaders["train"]

    def val_dataloader(self):
        return self.loaders["val"]

    def test_dataloader(self):
        return self.loaders["test"]


def reference_eval(model: EvalModel, ds: TensorDataset) -> dict:
    x, y = ds.tensors
    with torch.no_grad():
        logits = model.net(x)
    return {
        "acc": float((logits.argmax(-1) == y).double().mean()),
        # the same metric on one device: the distributed value must equal it bit for bit
        "acc_metric": float(MulticlassAccuracy(num_classes=3, average="micro")(logits, y)),
        "loss": float(F.cross_entropy(logits, y)),
    }


def part_exact(devices: int) -> dict:
    ds = eval_data(31)
    out = {}
    for drop_last in (False, True):
        loaders = {k: DataLoader(ds, batch_size=3, drop_last=drop_last) for k in ("train", "val", "test")}
        model = EvalModel(loaders)
        cb = ExactEvaluation(mode="mask")  # padding kept and masked (ExactMetric); the naive count shows it
        t = trainer(devices, max_epochs=1, limit_train_batches=2, num_sanity_val_steps=0, callbacks=[cb])
        t.fit(model)
        fit_val = {**model.final, "samples": float(t.callback_metrics["val_samples"])}
        ref = reference_eval(model, ds)
        model.naive_rows = 0
        samples = t.validate(model, verbose=False)[0]["val_samples"]  # before reading `final` (set by it)
        val = {**model.final, "samples": samples}
        naive = torch.tensor(model.naive_rows)
        dist.all_reduce(naive)
        samples = t.test(model, verbose=False)[0]["test_samples"]
        test = {**model.final, "samples": samples}
        out[f"drop_last={drop_last}"] = {
            "ref": ref,
            "fit_val": fit_val,
            "val": val,
            "test": test,
            "naive_rows": int(naive),
            "last_count": cb.last_count,
        }
    return out


# ---- drop-in exact evaluation: an existing project, unchanged but for the callback ----------------
class DictSet(torch.utils.data.Dataset):
    """The same samples as a dict per row (dict batches)."""

    def __init__(self, ds: TensorDataset):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y, idx = self.ds[i]
        return {"x": x, "y": y, "idx": idx}


def dropin_sets() -> list[TensorDataset]:
    """(31 samples, batches of 3), (10 samples, batches of 4), (10 samples, batches of 1: empty last batches)."""
    out = []
    for n in (31, 10, 10):
        x, y = eval_data(n).tensors
        out.append(TensorDataset(x, y, torch.arange(n)))
    return out


DROPIN_BATCH = (3, 4, 1)


class DropInModel(pl.LightningModule):
    """What a user has before adding the callback: plain torchmetrics, a row count, a logged mean loss."""

    def __init__(self, dict_batches: bool = False):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.dict_batches = dict_batches
        self.acc = nn.ModuleList(MulticlassAccuracy(num_classes=3, average="micro") for _ in DROPIN_BATCH)
        self.rows = nn.ModuleList(SumMetric() for _ in DROPIN_BATCH)
        self.loss_mean = nn.ModuleList(MeanMetric() for _ in DROPIN_BATCH)
        self.ids: dict[int, list[int]] = {}  # what each step saw (to check: each sample once, over all ranks)
        self.sizes: dict[int, list[int]] = {}

    def on_validation_epoch_start(self):
        for m in self.loss_mean:
            m.set_dtype(torch.float64)  # `.to(device)` resets a metric's dtype; float64 for the comparison
        self.ids, self.sizes = {}, {}

    on_test_epoch_start = on_validation_epoch_start

    def _eval(self, batch, batch_idx, dataloader_idx, stage):
        x, y, idx = (batch["x"], batch["y"], batch["idx"]) if isinstance(batch, dict) else batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.acc[dataloader_idx].update(logits, y)
        self.rows[dataloader_idx].update(len(y))
        self.loss_mean[dataloader_idx].update(F.cross_entropy(logits, y, reduction="none"))
        self.ids.setdefault(dataloader_idx, []).extend(idx.tolist())
        self.sizes.setdefault(dataloader_idx, []).append(len(y))
        self.log(f"{stage}_loss", loss, sync_dist=True)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self._eval(batch, batch_idx, dataloader_idx, "val")

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self._eval(batch, batch_idx, dataloader_idx, "test")

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return batch[2]

    def _epoch_end(self):
        self.final = {
            k: {
                "acc": float(self.acc[k].compute()),
                "rows": float(self.rows[k].compute()),
                "loss_mean": float(self.loss_mean[k].compute()),
            }
            for k in self.ids
        }
        for metrics in (self.acc, self.rows, self.loss_mean):
            for m in metrics:
                m.reset()

    def on_validation_epoch_end(self):
        self._epoch_end()

    on_test_epoch_end = on_validation_epoch_end

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the reference keeps the weights

    def loaders(self, which=(0, 1, 2)):
        sets = dropin_sets()
        return [
            DataLoader(DictSet(sets[k]) if self.dict_batches else sets[k], batch_size=DROPIN_BATCH[k]) for k in which
        ]

    def train_dataloader(self):
        return DataLoader(dropin_sets()[0], batch_size=4)


def dropin_reference(net: nn.Module) -> list[dict]:
    """One device: the same metrics on each whole dataset, and Lightning's batch-weighted mean of the loss
    over the one-device batches."""
    out = []
    for ds, bs in zip(dropin_sets(), DROPIN_BATCH):
        x, y, _ = ds.tensors
        with torch.no_grad():
            logits = net(x)
            acc = MulticlassAccuracy(num_classes=3, average="micro", sync_on_compute=False)(logits, y)
            mean = MeanMetric(sync_on_compute=False).set_dtype(torch.float64)
            mean.update(F.cross_entropy(logits, y, reduction="none"))
            logged = sum(
                F.cross_entropy(logits[i : i + bs], y[i : i + bs]) * len(y[i : i + bs]) for i in range(0, len(y), bs)
            ) / len(y)
        out.append(
            {"acc": float(acc), "rows": float(len(y)), "loss_mean": float(mean.compute()), "logged_loss": float(logged)}
        )
    return out


def _gather(obj, group=None):
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)  # over dp: tensor-parallel peers hold the same rows
    return everyone


def _dropin_run(t: pl.Trainer, model: DropInModel, fn: str, which=(0, 1, 2)) -> dict:
    loaders = model.loaders(which)
    if fn == "fit":
        t.fit(model, train_dataloaders=model.train_dataloader(), val_dataloaders=loaders)
        logged = {k: v for k, v in t.callback_metrics.items() if k.startswith("val_loss")}
    else:
        logged = getattr(t, fn)(model, loaders, verbose=False)
        logged = {k: v for d in logged for k, v in d.items() if "_loss" in k}
    stage = "test" if fn == "test" else "val"
    group = data_parallel_info(t.strategy)[0]
    by_loader = {}
    for pos, k in enumerate(which):
        key = f"{stage}_loss/dataloader_idx_{pos}" if len(which) > 1 else f"{stage}_loss"
        by_loader[k] = {
            **model.final[pos],
            "logged_loss": float(logged[key]),
            "ids": sorted(i for ids in _gather(model.ids.get(pos, []), group) for i in ids),
            "sizes": model.sizes.get(pos, []),
        }
    return by_loader


def part_dropin(devices: int, strategy_factory=None, model_cls=None, pipeline: bool = False) -> dict:
    """ExactEvaluation() alone on an unchanged project: validation in fit, validate (tuple batches), test
    (dict batches), predict, several loaders, limit_val_batches; Lightning's DDP unless `strategy_factory`."""
    strategy = strategy_factory or (lambda: "ddp")
    model = (model_cls or DropInModel)()
    ref = dropin_reference(copy.deepcopy(model.net).double())
    out: dict = {"ref": ref}
    kw = dict(num_sanity_val_steps=0, callbacks=[ExactEvaluation()])
    if strategy_factory is None:
        out["fit"] = _dropin_run(trainer(devices, max_epochs=1, limit_train_batches=1, **kw), model, "fit")
        out["validate"] = _dropin_run(trainer(devices, **kw), model, "validate")
        dict_model = DropInModel(dict_batches=True)
        out["test_dict"] = _dropin_run(trainer(devices, **kw), dict_model, "test")
        preds = trainer(devices, callbacks=[ExactEvaluation()]).predict(model, model.loaders((0,)))
        out["predict_ids"] = sorted(i for ids in _gather([int(i) for p in preds for i in p]) for i in ids)
        # limit_val_batches: 2 batches per rank, no sample twice
        out["limit2"] = _dropin_run(trainer(devices, limit_val_batches=2, **kw), model, "validate", (0,))
    else:
        # the pack's sharded strategies: batches of 1 would leave an empty batch (refused), so loaders 0, 1
        if not pipeline:
            out["validate"] = _dropin_run(trainer(devices, strategy=strategy(), **kw), model, "validate", (0, 1))
        try:
            # pipelines: 31 rows in batches of 3 on 2 dp pipelines give them different batch sizes (refused)
            trainer(devices, strategy=strategy(), **kw).validate(
                model, model.loaders((0,) if pipeline else (2,)), verbose=False
            )
            out["refused"] = None
        except ValueError as err:
            out["refused"] = str(err)
    return out


def part_dropin_mesh(devices: int) -> dict:
    from lightning_dist.strategies import HybridShardStrategy, PipelineStrategy, TensorParallelStrategy

    class PipeDropIn(DropInModel):
        def pipeline_loss(self, output, target):  # what PipelineStrategy trains with; evaluation is forward-only
            return F.cross_entropy(output, target)

    return {
        "hsdp": part_dropin(devices, lambda: HybridShardStrategy(shard_size=2)),
        "tp": part_dropin(devices, lambda: TensorParallelStrategy(tp=2)),
        # the steps compute metrics from the logits: the opt-in gives every pp rank the whole output
        "pipeline": part_dropin(
            devices,
            lambda: PipelineStrategy(pp=2, n_microbatches=2, split="params", network="net", broadcast_output=True),
            model_cls=PipeDropIn,
            pipeline=True,
        ),
    }


# ---- SyncBatchNorm, directly on the process group ----------------------------------------------
def part_syncbn(devices: int) -> dict:
    if not dist.is_initialized():  # Lightning's launcher starts the ranks on the first fit
        trainer(devices, max_steps=1, limit_val_batches=0).fit(ParityModel())
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    cases = [([4] * world, None), ([3, 5, 2, 6, 1, 4][:world], None)]
    if world % 2 == 0:
        cases.append(([3, 5, 2, 6, 1, 4][:world], 2))  # groups of 2 consecutive ranks (e.g. per node)
    for sizes, group_size in cases:
        g = torch.Generator().manual_seed(5)
        total = sum(sizes)
        x_all = torch.randn(total, 3, 4, 4, generator=g, dtype=torch.float64) * 2 + 1
        target_all = torch.randn(total, 3, 4, 4, generator=g, dtype=torch.float64)
        if group_size is None:
            members, group = list(range(world)), dist.group.WORLD
        else:
            members = [r for r in range(world) if r // group_size == rank // group_size]
            group = _partition_group(None, world, group_size)
        offsets = [sum(sizes[:r]) for r in range(world + 1)]
        lo, hi = offsets[rank], offsets[rank + 1]
        sub_lo, sub_hi = offsets[members[0]], offsets[members[-1] + 1]
        n_sub = sub_hi - sub_lo

        def build(sync: bool):
            torch.manual_seed(3)
            m = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)).double()
            return convert_sync_batchnorm(m, process_group=group) if sync else m

        def run(m, x, t, n_norm):
            x = x.clone().requires_grad_(True)
            loss = ((m(x) - t) ** 2).sum() / n_norm  # a sum: the full-batch mean splits across ranks
            loss.backward()
            return x.grad, [p.grad.clone() for p in m.parameters()]

        # distributed: every rank its own rows, param grads summed over the sync group
        dist_model = build(True)
        assert isinstance(dist_model[1], DataParallelBatchNorm)
        gx, gp = run(dist_model, x_all[lo:hi], target_all[lo:hi], n_sub)
        for p in gp:
            dist.all_reduce(p, group=group)
        # control: per-shard statistics
        cx, cp = run(build(False), x_all[lo:hi], target_all[lo:hi], n_sub)
        for p in cp:
            dist.all_reduce(p, group=group)
        # reference: the whole batch of the sync group on one device
        ref_model = build(False)
        rx, rp = run(ref_model, x_all[sub_lo:sub_hi], target_all[sub_lo:sub_hi], n_sub)
        rx = rx[lo - sub_lo : hi - sub_lo]

        def rel(a, b):
            return float((a - b).norm() / b.norm())

        def flat(ts):
            return torch.cat([t.flatten() for t in ts])

        stats = torch.cat([dist_model[1].running_mean, dist_model[1].running_var])
        gathered = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        ref_stats = torch.cat([ref_model[1].running_mean, ref_model[1].running_var])
        out[f"sizes={sizes},group_size={group_size}"] = {
            "input_grad_rel": rel(gx, rx),
            # over all parameters together: the conv bias gradient is ~0 (BatchNorm removes shifts)
            "param_grad_rel": rel(flat(gp), flat(rp)),
            "control_input_grad_rel": rel(cx, rx),
            "control_param_grad_rel": rel(flat(cp), flat(rp)),
            "running_stats_equal_in_group": all(torch.equal(gathered[r], stats) for r in members),
            "running_stats_vs_full_rel": rel(stats, ref_stats),
        }
    return out


# ---- GradientParityCheck ------------------------------------------------------------------------
class ParityModel(pl.LightningModule):
    def __init__(
        self, *, manual: str = "", perturb_rank: int = -1, batch_size: int = 4, n: int = 32, own_sampler: bool = False
    ):
        super().__init__()
        torch.manual_seed(2)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
        self.manual, self.perturb_rank, self.batch_size, self.n = manual, perturb_rank, batch_size, n
        self.automatic_optimization = not manual
        self.own_sampler = own_sampler  # shard with a sampler built here (with use_distributed_sampler=False)

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def on_train_start(self):
        if self.global_rank == self.perturb_rank:  # planted bug: a parameter changed on one rank
            with torch.no_grad():
                self.net[0].weight[0, 0] += 0.5

    def training_step(self, batch, batch_idx):
        if not self.manual:
            return self.loss(batch)
        opt = self.optimizers()
        loss = self.loss(batch)
        # planted bug "undivided": accumulate 2 micro-batches without dividing the loss
        self.manual_backward(loss if self.manual == "undivided" else loss / 2)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(4)
        ds = TensorDataset(
            torch.randn(self.n, 4, generator=g, dtype=torch.float64),
            torch.randn(self.n, 2, generator=g, dtype=torch.float64),
        )
        if self.own_sampler:
            kwargs = self.trainer.strategy.distributed_sampler_kwargs
            return DataLoader(ds, batch_size=self.batch_size, sampler=DistributedSampler(ds, shuffle=False, **kwargs))
        return DataLoader(ds, batch_size=self.batch_size)


def part_parity(devices: int) -> dict:
    cases = {
        # name: (model kwargs, sync BN?, expect ok)
        "correct_syncbn": (dict(), True, True),
        "correct_manual_accumulation": (dict(manual="divided"), True, True),
        "bug_per_shard_batchnorm": (dict(), False, False),
        "bug_undivided_accumulation": (dict(manual="undivided"), True, False),
        "bug_padded_duplicates": (dict(n=31, batch_size=8), True, False),
        "bug_param_changed_on_one_rank": (dict(perturb_rank=1), True, False),
        "bug_unsharded_data": (dict(), True, False),  # run with use_distributed_sampler=False below
    }
    out = {}
    for name, (kwargs, sync, expect_ok) in cases.items():
        model = ParityModel(**kwargs)
        check = GradientParityCheck(
            steps=(0,), on_mismatch="warn", loss_fn=(lambda m, b: m.loss(b)) if kwargs.get("manual") else None
        )
        callbacks = [check] + ([MeshSyncBatchNorm()] if sync else [])
        t = trainer(
            devices,
            max_steps=1,
            callbacks=callbacks,
            limit_val_batches=0,
            use_distributed_sampler=name != "bug_unsharded_data",
        )
        t.fit(model)
        r = check.results[0]
        keys = ("ok", "rel_diff", "tolerance", "params_equal", "same_batch_on_all_ranks", "global_batch")
        out[name] = {"expect_ok": expect_ok, **{k: r[k] for k in keys}}
    return out


class TiedGPTParity(CharGPT):
    """The pack's CharGPT with tied embedding/head; its training_step calls ``self(idx)``, which under Lightning's
    ddp is the ``forward`` that Lightning's forward redirection leaves in the instance dict (a bound method of the
    real module: a copy that kept it ran the real model, so the reference had no gradient, 1.2e31).
    ``scale_grad_rank``: planted bug, the tied weight's gradient doubled on that rank after the all-reduce."""

    def __init__(self, scale_grad_rank: int = -1):
        torch.manual_seed(5)
        super().__init__(tie_weights=True, n_layer=1, n_head=2, n_embd=16, block_size=8)
        self.scale_grad_rank = scale_grad_rank

    def on_after_backward(self):
        if self.global_rank == self.scale_grad_rank:
            self.model.lm_head.weight.grad.mul_(2.0)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(6)
        idx = torch.randint(0, self.model.config.vocab_size, (32, 9), generator=g)
        return DataLoader(TensorDataset(idx[:, :-1], idx[:, 1:]), batch_size=4)


class _GradSnapshot(pl.Callback):
    """The real gradients at on_before_optimizer_step (placed before and after the check)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.flat = torch.cat([p.grad.detach().flatten().clone() for p in pl_module.parameters()])


def part_parity_tied_gpt(devices: int) -> dict:
    out = {}
    for name, bug_rank, expect_ok in (
        ("correct_tied_gpt_forward", -1, True),
        ("bug_tied_grad_scaled_on_one_rank", 1, False),
    ):
        model = TiedGPTParity(scale_grad_rank=bug_rank)
        check, before, after = GradientParityCheck(steps=(0,), on_mismatch="warn"), _GradSnapshot(), _GradSnapshot()
        trainer(devices, max_steps=1, limit_val_batches=0, callbacks=[before, check, after]).fit(model)
        r = check.results[0]
        keys = ("ok", "rel_diff", "tolerance", "params_equal", "same_batch_on_all_ranks", "global_batch", "worst")
        out[name] = {"expect_ok": expect_ok, **{k: r[k] for k in keys}}
        # the check's reference backward must not touch the real gradients, and the ranks agree after the step
        out[name]["real_grad_changed_by_check"] = float((after.flat - before.flat).abs().max())
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = _gather(flat)
        out[name]["params_spread_after_step"] = max(float((g - gathered[0]).abs().max()) for g in gathered)
    return out


# ---- SamplerEpoch -------------------------------------------------------------------------------
class EpochBatchSampler(BatchSampler):
    """A custom batch sampler over a wrapped DistributedSampler that shuffles batches by epoch itself."""

    def __init__(self, sampler, batch_size):
        super().__init__(sampler, batch_size, drop_last=False)
        self.epoch = -1

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        batches = list(super().__iter__())
        order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(100 + self.epoch))
        return iter([batches[i] for i in order])


class SamplerModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1, dtype=torch.float64))
        self.seen: dict[int, list[int]] = {}
        self.batch_sampler_epochs: dict[int, int] = {}

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
        self.batch_sampler_epochs[self.current_epoch] = self.trainer.train_dataloader.batch_sampler.epoch
        return (self.w * idx.double()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(range(24), shuffle=True, seed=7, **kwargs)
        ds = TensorDataset(torch.arange(24))
        return DataLoader(ds, batch_sampler=EpochBatchSampler(sampler, 2))


def part_sampler(devices: int) -> dict:
    model = SamplerModel()
    t = trainer(devices, max_epochs=3, callbacks=[SamplerEpoch()], use_distributed_sampler=False, limit_val_batches=0)
    t.fit(model)
    world = dist.get_world_size()
    seen = [None] * world
    dist.all_gather_object(seen, model.seen)
    # the seed check, on a deliberately rank-dependent sampler
    bad = DataLoader(range(8), sampler=DistributedSampler(range(8), seed=dist.get_rank()))
    try:
        check_sampler_seeds(bad, group=None, dp_size=world, dp_rank=dist.get_rank())
        error = None
    except ValueError as err:
        error = str(err)
    return {"seen": seen, "batch_sampler_epochs": model.batch_sampler_epochs, "seed_error": error}


# ---- the pack's hsdp strategy (2 x 2: replicate x shard, FSDP2 DTensor parameters) -----------------
def part_hsdp(devices: int) -> dict:
    from lightning_dist.strategies import HybridShardStrategy

    def hsdp(**kwargs):
        return trainer(devices, strategy=HybridShardStrategy(shard_size=2), **kwargs)

    out: dict = {}
    # exact evaluation: the dp group is the flattened (dp_replicate x dp_shard) mesh dim
    ds = eval_data(31)
    loaders = {k: DataLoader(ds, batch_size=3, drop_last=True) for k in ("train", "val", "test")}
    model, cb = EvalModel(loaders), ExactEvaluation()
    # validation inside fit, at the end of a one-batch epoch (a second `validate` would re-shard the model)
    t = hsdp(max_epochs=1, limit_train_batches=1, num_sanity_val_steps=0, callbacks=[cb])
    t.fit(model)
    # the sharded weights, whole, for the single-device reference (a collective on every rank)
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.net.named_parameters()}
    plain = nn.Linear(8, 3).double()
    plain.load_state_dict({k: v.detach() for k, v in full.items()})
    ref = reference_eval(type("M", (), {"net": plain})(), ds)
    val = {**model.final, "samples": float(t.callback_metrics["val_samples"])}
    out["exact"] = {"ref": ref, "val": val, "last_count": cb.last_count}
    # gradient parity on FSDP2 parameters, with and without synced BatchNorm
    for name, sync, expect_ok in (("correct_syncbn", True, True), ("bug_per_shard_batchnorm", False, False)):
        check = GradientParityCheck(on_mismatch="warn")
        callbacks = [check] + ([MeshSyncBatchNorm()] if sync else [])
        pm = ParityModel(own_sampler=True)
        hsdp(max_steps=1, limit_val_batches=0, callbacks=callbacks, use_distributed_sampler=False).fit(pm)
        r = check.results[0]
        keys = ("ok", "rel_diff", "params_equal", "same_batch_on_all_ranks", "global_batch")
        out[name] = {"expect_ok": expect_ok, **{k: r[k] for k in keys}}
    # the strategy's own sampler injection: the data must be sharded over dp (different rows per rank)
    check = GradientParityCheck(on_mismatch="warn")
    hsdp(max_steps=1, limit_val_batches=0, callbacks=[check, MeshSyncBatchNorm()]).fit(ParityModel())
    out["injected_sampler_shards_data"] = not check.results[0]["same_batch_on_all_ranks"]
    return out


# ---- Trainer(sync_batchnorm=True) under the pack's strategies; the warning without any sync -------------
class _FirstBatch(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.x = batch[0].tolist()


def part_syncflag(devices: int) -> dict:
    from lightning_dist.strategies import HybridShardStrategy

    out: dict = {}
    for name, kwargs, callbacks in (
        ("sync_batchnorm_flag", dict(sync_batchnorm=True), []),
        ("mesh_sync_callback", dict(), [MeshSyncBatchNorm()]),
        ("unsynced", dict(), []),
    ):
        model = ParityModel()
        ref = copy.deepcopy(model.net).double()  # the Trainer runs in float64 (64-true)
        seen = _FirstBatch()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(
                devices,
                strategy=HybridShardStrategy(shard_size=2),
                max_steps=1,
                limit_val_batches=0,
                callbacks=[*callbacks, seen],
                **kwargs,
            ).fit(model)
        bn = model.net[1]
        stats = torch.cat([bn.running_mean, bn.running_var]).detach()
        everyone = _gather(stats.tolist())
        # one device on the global batch of the step: every dp rank's rows
        ref.train()
        ref(torch.cat([torch.tensor(rows, dtype=torch.float64) for rows in _gather(seen.x)]))
        ref_stats = torch.cat([ref[1].running_mean, ref[1].running_var])
        out[name] = {
            "layer": type(bn).__name__,
            "equal_across_ranks": all(e == everyone[0] for e in everyone),
            "rel_vs_one_device": float((stats - ref_stats).norm() / ref_stats.norm()),
            "warned": [str(w.message) for w in caught if "MeshSyncBatchNorm" in str(w.message)],
        }
    return out


# ---- the pack's tp strategy (dp 2 x tp 2): tensor-parallel peers hold the same samples -------------
class TPEvalModel(EvalModel):
    def __init__(self, loaders: dict):
        super().__init__(loaders)
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))  # column- then row-wise


def part_tp(devices: int) -> dict:
    from lightning_dist.strategies import TensorParallelStrategy

    ds = eval_data(31)
    loaders = {k: DataLoader(ds, batch_size=3) for k in ("train", "val", "test")}
    model, cb = TPEvalModel(loaders), ExactEvaluation()
    t = trainer(
        devices,
        strategy=TensorParallelStrategy(tp=2),
        max_epochs=1,
        limit_train_batches=1,
        num_sanity_val_steps=0,
        callbacks=[cb],
    )
    t.fit(model)
    whole = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.net.named_parameters()}
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    plain.load_state_dict(whole)
    ref = reference_eval(type("M", (), {"net": plain})(), ds)
    out = {
        "exact": {
            "ref": ref,
            "val": {**model.final, "samples": float(t.callback_metrics["val_samples"])},
            "last_count": cb.last_count,
        }
    }
    # gradient parity on DTensor parameters sharded over tp (and over dp_shard, or replicated over dp_replicate)
    cases = {
        # name: (strategy sizes, model kwargs, expect ok)
        "tp2xdp_shard2_correct": (dict(dp_shard=2), dict(), True),
        "tp2xdp_shard2_correct_manual_accumulation": (dict(dp_shard=2), dict(manual="divided"), True),
        "tp2xdp_shard2_bug_undivided_accumulation": (dict(dp_shard=2), dict(manual="undivided"), False),
        # replicated over dp: the change on one rank makes the replicas diverge
        "tp2xdp_replicate2_bug_param_changed_on_one_rank": (
            dict(dp_replicate=2, dp_shard=1),
            dict(perturb_rank=1),
            False,
        ),
    }
    for name, (sizes, kwargs, expect_ok) in cases.items():
        out[name] = _parity_fit(devices, TensorParallelStrategy(tp=2, **sizes), TPParityModel(**kwargs), expect_ok)
    return out


class _PerturbLocal:
    """Planted bug: the first parameter of this rank changed on `perturb_rank` only (on the local shard)."""

    def on_train_start(self):
        if self.global_rank == self.perturb_rank:
            p = next(self.parameters())
            with torch.no_grad():  # a DTensor's to_local() is its storage outside autograd
                (p.to_local() if hasattr(p, "to_local") else p).view(-1)[0] += 0.5


class TPParityModel(_PerturbLocal, ParityModel):
    """ParityModel without BatchNorm: two Linear layers, column- then row-wise over tp."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(2)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _parity_fit(devices: int, strategy, model, expect_ok: bool, **kwargs) -> dict:
    check = GradientParityCheck(
        steps=(0,), on_mismatch="warn", loss_fn=(lambda m, b: m.loss(b)) if getattr(model, "manual", "") else None
    )
    trainer(devices, strategy=strategy, max_steps=1, limit_val_batches=0, callbacks=[check], **kwargs).fit(model)
    r = check.results[0]
    keys = ("ok", "rel_diff", "params_equal", "same_batch_on_all_ranks", "global_batch", "worst")
    return {"expect_ok": expect_ok, **{k: r[k] for k in keys}}


# ---- the pack's pipeline strategy (pp 2 x dp 2): each rank holds one stage ----------------------------
class PipeEvalModel(EvalModel):
    """EvalModel whose network runs as a 2-stage pipeline; lr 0 keeps the weights of the reference."""

    def __init__(self, loaders: dict, hidden_layers: int = 1):
        super().__init__(loaders)
        torch.manual_seed(1)
        layers = [nn.Linear(8, 16), nn.Tanh()]
        for _ in range(hidden_layers - 1):
            layers += [nn.Linear(16, 16), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(16, 3))

    def pipeline_loss(self, output, target):
        return F.cross_entropy(output, target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class PipeParityModel(_PerturbLocal, ParityModel):
    """ParityModel without BatchNorm as a pipeline."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(2)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))

    def pipeline_loss(self, output, target):
        return F.mse_loss(output, target)


def part_pipeline(devices: int) -> dict:
    from lightning_dist.strategies import PipelineStrategy

    def pipe(**kwargs):  # the models' steps use the output's values (metrics, a loss on it): the opt-in serves them
        return PipelineStrategy(pp=2, n_microbatches=2, split="params", network="net", broadcast_output=True, **kwargs)

    # exact evaluation through the pipeline, 31 samples in batches of 6, the last one padded to 6 as well
    # (full_batches: one forward program for every step). pp2 x dp2: 16 per dp rank (one padding row on dp
    # rank 1) in batches of 6, 6, 4(+2); pp4 x dp1: 31 rows in 5 batches of 6 and 1(+5).
    ds = eval_data(31)
    loaders = {"train": DataLoader(ds, batch_size=4), "val": DataLoader(ds, batch_size=6), "test": None}
    out = {}
    for name, strategy, hidden in (
        ("exact", pipe(), 1),
        (
            "exact_pp4",
            PipelineStrategy(pp=4, n_microbatches=4, split="params", network="net", broadcast_output=True),
            3,
        ),
    ):
        model, cb = PipeEvalModel(loaders, hidden), ExactEvaluation(mode="mask", full_batches=True)
        plain = copy.deepcopy(model.net).double()  # lr 0: the weights the pipeline evaluates with
        t = trainer(
            devices, strategy=strategy, max_epochs=1, limit_train_batches=1, num_sanity_val_steps=0, callbacks=[cb]
        )
        t.fit(model)
        ref = reference_eval(type("M", (), {"net": plain})(), ds)
        out[name] = {
            "ref": ref,
            "val": {**model.final, "samples": float(t.callback_metrics["val_samples"])},
            "last_count": cb.last_count,
            "naive_rows": model.naive_rows,
        }
    cases = {
        # name: (strategy options, model kwargs, trainer kwargs, expect ok)
        "pp2xdp_shard2_correct": (dict(), dict(), dict(), True),
        "pp2xdp_shard2_correct_accumulate_2": (dict(), dict(), dict(accumulate_grad_batches=2), True),
        # 2 stages per rank (stages 0, 2 on pp rank 0): the whole network is joined from 4 stages
        "pp2xdp_shard2_correct_interleaved": (dict(schedule="interleaved_1f1b"), dict(), dict(), True),
        # (a pipeline_loss that sums where training_step averages is refused by the strategy itself since
        # issue 20: tests/distributed/test_pipeline.py, `scaled_output_loss`)
        "pp2xdp_replicate2_bug_param_changed_on_one_rank": (
            dict(dp_replicate=2, dp_shard=1),
            dict(perturb_rank=1),
            dict(),
            False,
        ),
    }
    for name, (sizes, kwargs, tkw, expect_ok) in cases.items():
        out[name] = _parity_fit(devices, pipe(**sizes), PipeParityModel(**kwargs), expect_ok, **tkw)
    return out


PARTS = {
    "exact": part_exact,
    "dropin": part_dropin,
    "dropin_mesh": part_dropin_mesh,
    "syncflag": part_syncflag,
    "syncbn": part_syncbn,
    "parity": part_parity,
    "parity_tied_gpt": part_parity_tied_gpt,
    "sampler": part_sampler,
    "hsdp": part_hsdp,
    "tp": part_tp,
    "pipeline": part_pipeline,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--parts", default=",".join(PARTS))
    args = parser.parse_args()
    for name in args.parts.split(","):
        result = {"part": name, name: PARTS[name](args.devices), "rank": dist.get_rank()}
        # one write per line (< 4 KiB, atomic on a pipe): the ranks share stdout
        sys.stdout.flush()
        os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())


if __name__ == "__main__":
    main()
