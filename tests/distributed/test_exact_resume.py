"""Exact mid-epoch resume (hsdp 2x2 and tp2 x dp2, float64, Lightning's injected shuffling DistributedSampler)."""

import pytest

from _harness import results, run_script

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("strategy", ["hsdp", "tp"])
def test_mid_epoch_resume_is_bitwise_identical(tmp_path, strategy):
    proc = run_script("resume_exact.py", str(tmp_path), strategy, timeout=600)
    rows = [r for r in results(proc) if r["kind"] == "resume"]
    assert len(rows) == 4
    for r in rows:
        assert r["strategy"] == strategy, r
        assert r["sampler"] == "DistributedSampler" and r["shuffle"], r  # Lightning's injected sampler
        assert r["checkpointing_changes_nothing"], r
        # parameters, optimizer, LR scheduler, sampler position and RNG all restored: bitwise equal
        assert r["from4"] and r["from8"] and r["steps"] == [9, 9], r
        assert r["order_c"] == r["order_a"] and r["lr"] == r["lr_a"] == 0.01 * 0.5**4, r
        # controls: a plain DataLoader restarts the epoch; without ResumeRNG the dropout masks differ
        assert not r["plain_loader"] and r["order_e"] != r["order_a"], r
        assert not r["no_rng"], r
