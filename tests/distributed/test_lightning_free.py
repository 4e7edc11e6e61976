"""``lightning_dist.parallelize`` without Lightning: a 2-stage pipeline step with ``lightning`` unimportable."""

import pytest

from tests._harness import results, run_torchrun

pytestmark = pytest.mark.distributed


def test_parallelize_runs_a_pipeline_step_without_lightning():
    rows = results(run_torchrun("lightning_free_pipeline.py", nproc=2, timeout=300))
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["leaked"] == [], r  # nothing of Lightning was imported
        assert r["params"] > 0
        assert r["grad_rel"] < 1e-12 and r["loss_rel"] < 1e-12, r
        assert "pip install lightning" in r["refusal"]  # a strategy asked for says what is missing
