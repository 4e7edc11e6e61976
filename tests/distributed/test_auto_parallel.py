"""strategy="auto_parallel": each forced choice runs as that strategy with float64 parity (one 4-process launch).

Scenario: tests/scenarios/auto_parallel_parity.py.
"""

from __future__ import annotations

import pytest
from _harness import results, run_torchrun

pytestmark = pytest.mark.distributed

EXPECTED = {  # target layout -> (strategy it runs as, mesh pp x dp_replicate x dp_shard x cp x tp)
    "hsdp-2": ("HybridShardStrategy", [1, 2, 2, 1, 1]),
    "fsdp": ("FullyShardStrategy", [1, 1, 4, 1, 1]),
    "tp2-fsdp2": ("TensorParallelStrategy", [1, 1, 2, 1, 2]),
    "pp2-ddp2": ("PipelineStrategy", [2, 2, 1, 1, 1]),
    "fsdp-offload": ("HybridShardStrategy", [1, 1, 4, 1, 1]),  # with FSDP2's CPUOffloadPolicy
}


def test_auto_parallel_choices_keep_parity():
    everything = results(run_torchrun("auto_parallel_parity.py", nproc=4, timeout=500))
    rows = [r for r in everything if r["kind"] == "auto"]
    refused = [r for r in everything if r["kind"] == "nothing-fits"]
    # on every rank, naming the smallest layout's need: with global_batch=6 the tp2-fsdp2 states (7,456 parameters x
    # 32 bytes / 4); at 1 KB the offload layout's largest FSDP unit (a block of 3,136 parameters, gathered and its
    # gradient, 8 + 8 bytes each), which the planner's "device bytes" column counts as 0
    want = {
        "batch6": "no layout fits device_memory=1 bytes with global_batch=6 on 4 devices, not even with everything"
        " offloaded to host memory. The smallest layout, tp2-fsdp2, needs 61,952 bytes per device",
        "1KB": "no layout fits device_memory=1,000 bytes on 4 devices, not even with everything offloaded to host"
        " memory. The smallest layout, fsdp-offload, needs 50,176 bytes per device",
    }
    assert sorted(r["name"] for r in refused) == sorted(4 * list(want)), refused
    assert all(want[r["name"]] in (r["error"] or "") for r in refused), refused
    assert {r["target"] for r in rows} == set(EXPECTED)
    for r in rows:
        ran_as, mesh = EXPECTED[r["target"]]
        assert r["choice"] == r["target"], r
        assert r["ran_as"] == ran_as and r["mesh"] == mesh, r
        assert r["diff"] <= 1e-12, r
        if r["target"] == "fsdp-offload":
            assert r["offload_policy"] == "CPUOffloadPolicy", r
    assert len(rows) == 4 * len(EXPECTED)
