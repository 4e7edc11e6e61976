"""CommunicationLedger / MemoryReport pieces in one process: labels, formatting, options, a single-device fit."""

from __future__ import annotations

import types

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import planner
from lightning_dist.callbacks import CommunicationLedger, MemoryReport, _planned
from lightning_dist.callbacks.ledger import format_ledger
from lightning_dist.callbacks.memory import format_memory, peak_memory_bytes
from lightning_dist.mesh import MeshSpec


def _mesh(**dims):
    # group_label only reads `mesh.spec`
    return types.SimpleNamespace(spec=MeshSpec(world_size=4, devices_per_node=4, **dims).resolve())


def test_group_label_prefers_elementary_dims():
    hsdp = _mesh(dp_replicate=2, dp_shard=2)
    assert _planned.group_label([0, 1], mesh=hsdp, rank=0, world=4) == "dp_shard"
    assert _planned.group_label([1, 3], mesh=hsdp, rank=1, world=4) == "dp_replicate"
    assert _planned.group_label([0, 1, 2, 3], mesh=hsdp, rank=0, world=4) == "dp"
    full = _mesh(dp_replicate=1, dp_shard=4)  # dp_shard spans the same ranks as dp: the elementary name wins
    assert _planned.group_label([3, 2, 1, 0], mesh=full, rank=2, world=4) == "dp_shard"
    tp = _mesh(tp=2, dp_shard=2, dp_replicate=1)
    assert _planned.group_label([2, 3], mesh=tp, rank=3, world=4) == "tp"
    assert _planned.group_label([1, 3], mesh=tp, rank=3, world=4) == "dp_shard"
    assert _planned.group_label([0, 2], mesh=None, rank=0, world=4) == "ranks0,2"
    assert _planned.group_label([0, 1, 2, 3], mesh=None, rank=0, world=4) == "world"
    # a planner dim maps to the same label as the group it runs on
    assert _planned.dim_label("dp", mesh=full, rank=0, world=4) == "dp_shard"
    assert _planned.dim_label("dp", mesh=_mesh(dp_replicate=4, dp_shard=1), rank=0, world=4) == "dp_replicate"


def test_group_label_names_expert_parallel_groups():
    full = _mesh(dp_replicate=1, dp_shard=4)
    # ep = 2 inside dp_shard = 4: consecutive pairs hold every expert (ep), every second rank shards them further
    assert _planned.group_label([2, 3], mesh=full, rank=3, world=4, ep=2) == "ep"
    assert _planned.group_label([1, 3], mesh=full, rank=3, world=4, ep=2) == "dp_shard_mod_ep"
    assert _planned.group_label([0, 1, 2, 3], mesh=full, rank=3, world=4, ep=2) == "dp_shard"
    assert _planned.group_label([2, 3], mesh=full, rank=3, world=4) == "ranks2,3"  # without ep: no such dim
    # ep = dp_shard: the ep group is the dp_shard group, which keeps its own name
    assert _planned.group_label([0, 1, 2, 3], mesh=full, rank=0, world=4, ep=4) == "dp_shard"
    assert _planned.dim_label("ep", mesh=full, rank=2, world=4, ep=2) == "ep"
    assert _planned.dim_label("ep", mesh=full, rank=2, world=4, ep=4) == "dp_shard"
    assert _planned.dim_label("dp_shard_mod_ep", mesh=full, rank=2, world=4, ep=2) == "dp_shard_mod_ep"
    hsdp = _mesh(dp_replicate=2, dp_shard=2)  # ranks (0, 1) and (2, 3) are the dp_shard groups
    assert _planned.dim_label("ep", mesh=hsdp, rank=3, world=4, ep=2) == "dp_shard"


def test_group_label_follows_the_expert_meshes():
    # DistMesh.expert_meshes cuts ep groups (consecutive) and dp_shard_mod_ep (every ep-th) from dp_shard x cp, or
    # dp_shard x cp x tp when ep is a multiple of tp (the groups span tp); tp the fastest dim
    def mesh(world, **dims):
        return types.SimpleNamespace(spec=MeshSpec(world_size=world, devices_per_node=world, **dims).resolve())

    wide = mesh(8, tp=2, dp_shard=4, dp_replicate=1)  # ep 4: two data-parallel ranks' tp pairs
    assert [_planned._group_ranks(wide, r, "ep", 4) for r in (0, 5)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [_planned._group_ranks(wide, r, "dp_shard_mod_ep", 4) for r in (0, 5)] == [[0, 4], [1, 5]]
    assert _planned.group_label([0, 1, 2, 3], mesh=wide, rank=2, world=8, ep=4) == "ep"
    assert _planned.group_label([1, 5], mesh=wide, rank=5, world=8, ep=4) == "dp_shard_mod_ep"
    assert _planned.group_label([4, 5], mesh=wide, rank=5, world=8, ep=4) == "tp"  # its tp all-gathers
    assert _planned.dim_label("dp_shard_mod_ep", mesh=wide, rank=6, world=8, ep=4) == "dp_shard_mod_ep"
    # ep = tp = 2 over dp_shard 2: each ep group is a tp group and the experts' FSDP2 groups are the dp_shard ones;
    # a group is named by its ranks, so the all-to-alls are labelled `tp` (and the plan's ep rows map there too)
    same = mesh(4, tp=2, dp_shard=2, dp_replicate=1)
    assert _planned._group_ranks(same, 3, "ep", 2) == [2, 3] and _planned._group_ranks(same, 3, "dp_shard_mod_ep", 2)
    assert _planned.group_label([2, 3], mesh=same, rank=3, world=4, ep=2) == "tp"
    assert _planned.dim_label("ep", mesh=same, rank=3, world=4, ep=2) == "tp"
    assert _planned.dim_label("dp_shard_mod_ep", mesh=same, rank=3, world=4, ep=2) == "dp_shard"
    # ep 2 < tp 4: the old layout, ep groups inside dp_shard at each tp coordinate (here the dp_shard group)
    narrow = mesh(8, tp=4, dp_shard=2, dp_replicate=1)
    assert _planned._group_ranks(narrow, 5, "ep", 2) == [1, 5]
    assert _planned.group_label([1, 5], mesh=narrow, rank=5, world=8, ep=2) == "dp_shard"
    # context parallelism: the block is dp_shard x cp, cp peers first (here ep = the cp group); HSDP replicas apart
    cp = mesh(8, cp=2, dp_shard=2, dp_replicate=2)
    assert _planned._group_ranks(cp, 5, "ep", 2) == [4, 5]
    assert _planned._group_ranks(cp, 5, "dp_shard_mod_ep", 2) == [5, 7]
    assert _planned.group_label([4, 5], mesh=cp, rank=5, world=8, ep=2) == "cp"
    assert _planned.group_label([5, 7], mesh=cp, rank=5, world=8, ep=2) == "dp_shard"  # every 2nd: the dp_shard group
    cp4 = mesh(8, cp=2, dp_shard=4, dp_replicate=1)  # dp_shard x cp = 8 ranks, ep 4: [0..3], outer every 4th
    assert _planned.group_label([1, 5], mesh=cp4, rank=5, world=8, ep=4) == "dp_shard_mod_ep"
    assert _planned.group_label([4, 5, 6, 7], mesh=cp4, rank=5, world=8, ep=4) == "ep"
    # the tp all-gathers the ledger plans: N = 4 x 32 tokens of the block input, k = 256 rows / 2 forwards / 64
    routing = {"experts": 8, "hidden": 64, "bytes": 4, "calls": 2, "rows": 256, "received": 256}
    activation = {"batch": 4, "seq": 32}
    got = _planned._ep_tp_gathers(routing, activation, tp=2, tp_rank=1)
    assert sum(c.payload_bytes for c in got) == 2 * (2 * 128 * 64 * 4 + 128 * 2 * 4)
    assert {(c.op, c.dim) for c in got} == {("all_gather", "tp")}
    assert _planned._ep_tp_gathers(routing, None, tp=2, tp_rank=0) == []


def test_optimizer_names():
    p = [nn.Parameter(torch.zeros(2))]
    assert _planned.optimizer_name([torch.optim.AdamW(p)]) == "adamw"
    assert _planned.optimizer_name([torch.optim.SGD(p, lr=0.1)]) == "sgd"
    assert _planned.optimizer_name([torch.optim.SGD(p, lr=0.1, momentum=0.9)]) == "sgd-momentum"
    assert _planned.optimizer_name([torch.optim.Adagrad(p)]) is None  # the planner has no entry: no prediction


def test_ledger_options_are_validated():
    with pytest.raises(ValueError, match="skip_steps"):
        CommunicationLedger(skip_steps=-1)
    with pytest.raises(ValueError, match="planned"):
        CommunicationLedger(planned="guess")
    CommunicationLedger(planned=[planner.Collective(op="all_reduce", dim="dp", group_size=2, payload_bytes=8)])


def test_recorder_resolves_each_group_object_once(monkeypatch):
    # c10d is asked once per group object: torchft's group (one c10d does not know, so asking raises) is not asked
    # again at every collective, and the new group object torchft builds after a quorum change is asked again
    import torch.distributed as dist

    from lightning_dist.callbacks.ledger import CollectiveRecorder

    asked: list[str] = []

    def resolve(name: str) -> tuple[int, ...]:
        asked.append(name)
        if name.startswith("ft"):
            raise RuntimeError(f"Could not resolve the process group registered under the name {name}")
        return (0, 1)

    monkeypatch.setattr(CollectiveRecorder, "_resolve", staticmethod(resolve))

    class Group(dist.ProcessGroup):  # a group object with a name and a size, nothing registered with c10d
        def __init__(self, name: str, size: int) -> None:
            super().__init__(0, size)
            self.name = name

        @property
        def group_name(self) -> str:
            return self.name

    rec = CollectiveRecorder(outside="replica_group")
    ft, known = Group("ft0", 3), Group("known", 2)
    for _ in range(3):
        assert rec._group_ranks(ft) == "replica_group" and rec._group_ranks(ft.boxed()) == "replica_group"
        assert rec._group_ranks(known) == (0, 1)
    assert asked == ["ft0", "known"] and rec.outside_size == 3
    ft = Group("ft1", 2)  # the quorum changed: a new group object
    assert rec._group_ranks(ft) == "replica_group" and rec._group_ranks(ft) == "replica_group"
    assert asked == ["ft0", "known", "ft1"] and rec.outside_size == 2


def test_per_step_mean_skips_the_first_steps():
    ledger = CommunicationLedger(skip_steps=1)
    ledger.steps = [{("broadcast", "dp"): [4, 400]}, {("all_reduce", "dp"): [1, 100]}, {("all_reduce", "dp"): [3, 300]}]
    assert ledger.per_step() == {("all_reduce", "dp"): (2.0, 200.0)}
    ledger.steps = ledger.steps[:1]  # fewer steps than skipped: use them all
    assert ledger.per_step() == {("broadcast", "dp"): (4.0, 400.0)}


def test_tables_render():
    ledger_rows = [
        [
            {
                "op": "all_gather",
                "dim": "dp_shard",
                "count": 8.0,
                "bytes": 1000.0,
                "wire_bytes": 500.0,
                "planned_bytes": 1000.0,
                "ratio": 1.0,
            },
            {
                "op": "broadcast",
                "dim": "dp",
                "count": 1.0,
                "bytes": 36.0,
                "wire_bytes": 27.0,
                "planned_bytes": None,
                "ratio": None,
            },
        ]
    ]
    text = format_ledger(ledger_rows)
    assert "all_gather" in text and "dp_shard" in text and "1.000" in text
    mem = [
        {
            "rank": 0,
            "measured": {"params": 4, "grads": 4, "optimizer": 8, "total": 16},
            "planned": {"total": 16.0},
            "ratio": 1.0,
            "peak_bytes": 10_000,
            "peak_what": "process max RSS",
        }
    ]
    text = format_memory(mem)
    assert "1.000" in text and "process max RSS" in text


def test_peak_memory_on_cpu_is_the_rss_high_water_mark():
    nbytes, what = peak_memory_bytes(torch.device("cpu"))
    assert what == "process max RSS" and nbytes > 10 * 2**20  # a Python process with torch holds > 10 MiB


class _Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 6), torch.randint(0, 3, (16,))), batch_size=4)


def _trainer(callbacks: list, **kwargs) -> pl.Trainer:
    """A one-device CPU Trainer with nothing but `callbacks` (no logger, checkpoints, progress bar or summary)."""
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )


def test_single_device_fit_reports_exact_bytes_and_no_collectives(capsys):
    ledger, memory = CommunicationLedger(), MemoryReport()
    # two micro-batches per optimizer step: the ledger's steps are optimizer steps
    trainer = _trainer([ledger, memory], max_steps=2, accumulate_grad_batches=2)
    trainer.fit(_Tiny())
    n = 6 * 10 + 10 + 10 * 3 + 3
    assert memory.measured == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n, "total": 16 * n}
    assert memory.planned["total"] == 16 * n and memory.rows[0]["ratio"] == 1.0
    assert ledger.steps == [{}, {}]  # 4 batches = 2 optimizer steps; one process: nothing communicated
    assert trainer.callback_metrics["memory/model_state_bytes"].item() == 16 * n
    assert trainer.callback_metrics["comm/bytes"].item() == 0
    out = capsys.readouterr().out
    assert "Model-state bytes per rank" in out and "Communication per step" in out


def test_log_false_is_respected_although_lightning_sets_callback_log_attributes():
    ledger, memory = CommunicationLedger(log=False, print_table=False), MemoryReport(log=False, print_table=False)
    trainer = _trainer([ledger, memory], max_steps=1)
    trainer.fit(_Tiny())
    assert not any(k.startswith(("memory/", "comm/")) for k in trainer.callback_metrics)
    assert memory.measured["total"] > 0  # measured all the same


@pytest.mark.parametrize("step", [0, 1])
def test_memory_report_tracks_one_step_under_memtracker(step, capsys):
    # the dry run's tracker around a real step: parameters and Adam's state (from the first optimizer step on) counted
    # as such, the step's activations apart; step 0 runs before Adam has any state
    memory = MemoryReport(log=False, track_step=step)
    trainer = _trainer([memory], max_steps=3)
    trainer.fit(_Tiny())
    n = 6 * 10 + 10 + 10 * 3 + 3
    cat = memory.step_peak["peak_breakdown"]
    assert cat["Parameter"] == 4 * n
    assert cat.get("Optstate", 0) == (8 * n + 4 * 4 if step else 0)  # exp_avg, exp_avg_sq and 4 float32 `step`s
    # saved for backward: at least tanh's output [4, 10] in float32; the peak holds parameters and activations
    assert memory.step_peak["peak_activation_bytes"] >= 4 * 10 * 4
    assert memory.step_peak["peak_total_bytes"] >= 4 * n + memory.step_peak["peak_activation_bytes"]
    assert memory.rows[0]["step_peak"] == memory.step_peak
    assert f"step MemTracker {memory.step_peak['peak_total_bytes']:,}" in capsys.readouterr().out


def test_memory_report_track_step_is_validated():
    with pytest.raises(ValueError, match=r"track_step=-1.*index >= 0"):
        MemoryReport(track_step=-1)
