"""The dry run's report in one process: the fit verdict (synthetic rank figures: the rule, not a measurement), and an
expert-parallel step simulated here (its all-to-alls next to the plan's under the assumed routing)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_dist.dryrun import DryRunConfig
from lightning_dist.dryrun_report import DryRunReport
from lightning_dist.models.moe import MoEGPT


def _rank(states: int, act: int, peak: int) -> dict:
    return {"states": {"total": states}, "peak_activation_bytes": act, "peak_total_bytes": peak}


def test_a_rank_needs_its_whole_peak_when_it_exceeds_states_plus_activations():
    config = DryRunConfig(model="m", world_size=2, devices_per_node=2, device_memory=100.0)
    report = DryRunReport(config=config, ranks=[])
    # a sharded step: states (optimizer included, created by the step) + activations dominate the step's peak
    assert DryRunReport.need(_rank(60, 30, 70)) == 90 and report.fits(_rank(60, 30, 70)) is True
    # a pipeline's steady step: the last step's gradients held through the schedule, next to the new ones
    assert DryRunReport.need(_rank(60, 30, 120)) == 120 and report.fits(_rank(60, 30, 120)) is False
    assert (
        DryRunReport(config=DryRunConfig(model="m", world_size=2, devices_per_node=2), ranks=[]).fits(_rank(1, 1, 1))
        is None
    )


class MoETask(pl.LightningModule):
    """The pack's MoE GPT with its router loss (the global one: an all-reduce per MoE layer)."""

    def __init__(self, **sizes) -> None:
        super().__init__()
        self.model = MoEGPT(**sizes)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten()) + 0.01 * self.model.aux_loss()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_an_ep_step_dry_runs_in_one_process_and_its_all_to_alls_equal_the_uniform_plan(fake_world, precision):
    # rank 1 of ep=2 x dp_shard=4 on torch's fake process group: the ep dispatch sized by the assumed uniform routing
    from lightning_dist.dryrun import DryRunConfig, simulate_rank

    sizes = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=32, n_experts=8, top_k=2, expert_hidden=32)
    config = DryRunConfig(
        model=f"{__name__}.MoETask",
        init_args=sizes,
        strategy="hsdp",
        strategy_args={"dp_shard": 4, "ep": 2},
        world_size=4,
        devices_per_node=4,
        precision=precision,
        batch_size=2,
    )
    rank = simulate_rank(config, 1)
    assert not dist.is_initialized()
    report = DryRunReport(config=config, ranks=[rank])
    comm = report.collective_ratios(rank)
    calls = {(c["op"], c["dim"]): c["calls"] for c in rank["collectives"]}
    # per MoE layer: the counts, the dispatch, the combine, and the two in backward
    assert calls[("all_to_all", "ep")] == 5 * sizes["n_layer"]
    row = 2 * 32 * 2 * 64 * (4 if precision == "32-true" else 2)  # batch x seq x top_k rows of width n_embd
    assert comm[("all_to_all", "ep")] == (sizes["n_layer"] * (8 * 8 + 4 * row),) * 2  # ratio 1.000
    # FSDP2 over dp_shard (dense) and dp_shard_mod_ep (each rank's 4 experts): as planned too
    for key in (("all_gather", "dp_shard"), ("all_gather", "dp_shard_mod_ep"), ("reduce_scatter", "dp_shard_mod_ep")):
        measured, planned = comm[key]
        assert planned > 0 and measured == planned, (key, measured, planned)
    assert rank["states"]["total"] == rank["planned"]["states"]["total"]
    assert "uniform routing" in rank["routing"]
    assert "(ep's all-to-all bytes) assume uniform routing" in " ".join(report.format(width=200).split())
