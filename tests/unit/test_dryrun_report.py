"""The dry run's fit verdict in one process (synthetic rank figures: the rule, not a measurement)."""

from __future__ import annotations

from lightning_dist.dryrun import DryRunConfig
from lightning_dist.dryrun_report import DryRunReport


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
