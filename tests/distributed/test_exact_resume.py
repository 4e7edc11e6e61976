"""Exact mid-epoch resume under Lightning's injected shuffling DistributedSampler.

hsdp 2x2, tp2 x dp2 and pipeline pp2 x dp2 in float64 on 4 processes; offload (DeepSpeed ZeRO-3, optimizer
state and parameters in host memory) in float32 on 2 processes (DeepSpeed has no float64 on CPU).
"""

import os
import sys

import pytest
from _harness import results, run_script

from lightning_dist._compat import module_available

pytestmark = pytest.mark.distributed

PROCESSES = {"hsdp": 4, "tp": 4, "pipeline": 4, "offload": 2}


@pytest.mark.parametrize("strategy", list(PROCESSES))
def test_mid_epoch_resume_is_bitwise_identical(tmp_path, strategy):
    # DeepSpeed's compiled ops: the environment's cache, as `make` sets it
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))}
    proc = run_script("resume_exact.py", str(tmp_path), strategy, timeout=600, env=env)
    rows = [r for r in results(proc) if r["kind"] == "resume"]
    assert sorted(r["rank"] for r in rows) == list(range(PROCESSES[strategy]))
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
        if strategy == "offload":
            continue
        # torchdata's StatefulDataLoader: Lightning keeps its class around the injected sampler and saves and
        # restores its own state_dict; with ResumeRNG the resume equals its uninterrupted run bitwise
        if not module_available("torchdata"):
            pytest.skip("torchdata (the `test` extra) is not installed: the StatefulDataLoader cases did not run")
        assert r["td_loader"] == "StatefulDataLoader" and r["td_sampler"] == "DistributedSampler", r
        assert r["td_checkpointing_changes_nothing"] and r["td_from4"] and r["td_from8"], r
        assert r["td_steps"] == [9, 9] and r["td_order"] == r["td_order_a"] and r["td_same_order_as_a"], r
        assert r["td_epochs_differ"], r
