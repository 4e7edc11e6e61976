"""The planner's exact per-rank counts against real FSDP2 / HSDP / ZeroRedundancyOptimizer on 4 gloo processes."""

from __future__ import annotations

import pytest
from _harness import results, run_torchrun


@pytest.mark.distributed
def test_planner_counts_match_live_shards():
    proc = run_torchrun("planner_shards.py", nproc=4, timeout=300)
    ranks = results(proc)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    for r in ranks:
        for case in ("fsdp", "hsdp"):
            got = r[case]
            assert got["mismatches"] == [], (r["rank"], case, got["mismatches"])
            for part in ("params", "grads", "optimizer"):
                assert got["live"][part] == got["planned"][part], (r["rank"], case, part, got)
            # Adam's float32 `step` scalar, one per parameter tensor on every rank
            assert got["live"]["optimizer"] + got["live"]["step_scalars"] == got["planned_optimizer_with_steps"]
            # collectives of one forward + backward: exact (padded) prediction, bytes for bytes
            assert got["traffic"] == got["planned_traffic"], (r["rank"], case, got["traffic"], got["planned_traffic"])
        z1 = r["zero1"]
        assert z1["owned"] == z1["planned"], r
        live = z1["live_bytes"]
        assert [live["params"], live["grads"], live["optimizer"] + live["step_scalars"]] == [
            z1["planned_bytes"]["params"],
            z1["planned_bytes"]["grads"],
            z1["planned_bytes"]["optimizer"],
        ], z1
    # uneven shards: ranks really hold different amounts, and together the whole model
    fsdp_params = [r["fsdp"]["live"]["params"] for r in ranks]
    assert len(set(fsdp_params)) > 1
    hsdp_params = [r["hsdp"]["live"]["params"] for r in ranks]
    assert hsdp_params[0] == hsdp_params[2] and hsdp_params[1] == hsdp_params[3]  # replicas hold the same shard
    assert sum(fsdp_params) == hsdp_params[0] + hsdp_params[1]
