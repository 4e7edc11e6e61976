"""Per-block torch.compile on every strategy family, and FSDP2 offload on a mesh with dp size 1: float64 parity
with eager single-device training."""

import pytest
from _harness import results, run_script

pytestmark = pytest.mark.distributed

KEYS = [f"model.blocks.{i}.{p}" for i in range(2) for p in ("fc.bias", "fc.weight", "norm.bias", "norm.weight")]


def test_compile_parity_hsdp_tp_pipeline_and_offload_with_dp_size_1():
    out = [r for r in results(run_script("compile_offload_parity.py", timeout=900)) if r["kind"] == "compile"]
    assert sorted({r["case"] for r in out}) == [
        "hsdp",
        "hsdp_ac",
        "hsdp_sac",
        "pipeline_1f1b",
        "tp",
        "tp_offload",
        "tp_sac",
    ]
    offload = [r for r in out if r["case"] == "tp_offload"]
    for r in offload:  # tp=2, dp=1: FSDP2 with the offload policy on every block and the root, same update
        assert r["diff"] <= 1e-12 and r["policies"] == ["CPUOffloadPolicy"] * 3, r
        assert r["compiled"] == [False, False], r
    out = [r for r in out if r["case"] != "tp_offload"]
    for r in out:
        assert r["diff"] <= 1e-12, r  # inductor (CPU) vs eager single device, float64, 3 AdamW steps
        assert r["compiled"] and all(r["compiled"]), r  # every block of this rank runs compiled
        assert not any("_orig_mod" in k for k in r["keys"]), r  # state-dict keys as without compile
        if not r["case"].startswith("pipeline"):
            assert r["keys"] == sorted(
                KEYS + ["model.head.bias", "model.head.weight", "model.stem.bias", "model.stem.weight"]
            ), r
    # pipeline: each rank compiled its own stage's block
    assert sorted(len(r["compiled"]) for r in out if r["case"] == "pipeline_1f1b") == [1, 1]
