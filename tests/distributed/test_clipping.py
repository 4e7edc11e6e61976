"""Gradient clipping by norm and by value, by the Trainer and by ``self.clip_gradients`` in manual optimization, on
every layout of the pack at 4 processes, against torch's clip_grad_norm_ / clip_grad_value_ on one device (one launch;
DeepSpeed's clipping is checked in test_offload.py, the pipeline's with accumulation in test_pipeline.py)."""

import pytest

from lightning_dist._compat import TP_SEQUENCE_PARALLEL_WITH_DP_HANGS
from tests._harness import results, run_torchrun

pytestmark = pytest.mark.distributed

TOL = 1e-12  # float64, 3 SGD steps

EXPECTED = {  # (layout, algorithm, manual): the strategy it ran as
    ("hsdp", "value", False): "HybridShardStrategy",
    ("fsdp2_zero2", "norm", False): "FullyShardStrategy",
    ("zero1", "norm", False): "HybridShardStrategy",
    ("tp4", "norm", False): "TensorParallelStrategy",
    **{("tp2xdp_shard2", a, False): "TensorParallelStrategy" for a in ("norm", "value")},
    ("tp2xdp_shard2", "norm", True): "TensorParallelStrategy",  # manual optimization: self.clip_gradients
    **{("pp2xtp2", a, False): "PipelineStrategy" for a in ("norm", "value")},
    **(
        {}
        if TP_SEQUENCE_PARALLEL_WITH_DP_HANGS
        else {("tp2_sp_xdp2", a, False): "TensorParallelStrategy" for a in ("norm", "value")}
    ),
    ("pp2xdp2", "value", False): "PipelineStrategy",
    ("pp2xdp2_tied", "norm", False): "PipelineStrategy",
    ("offload_fsdp2", "norm", True): "FSDP2OffloadStrategy",
    ("auto_parallel", "norm", False): "TensorParallelStrategy",  # its pick: tp=2 x dp_replicate=2
}


@pytest.mark.compat
def test_clipping_on_every_layout_matches_one_device():
    rows = [r for r in results(run_torchrun("clip_parity.py", nproc=4, timeout=900)) if r["kind"] == "clip"]
    seen = {(r["layout"], r["algorithm"], r["manual"]): r["ran_as"] for r in rows}
    assert seen == EXPECTED
    assert len(rows) == 4 * len(EXPECTED)  # every rank reported
    assert {r["layout"]: r["mesh"] for r in rows}["auto_parallel"] == [1, 2, 1, 1, 2]
    for r in rows:
        assert all(r["triggered"]) and len(r["triggered"]) == 3, r  # clipping changed the gradients on every step
        assert r["diff"] <= TOL, r
        assert r["unclipped_diff"] > 1e-2, r  # a clipping that did nothing would be far off
