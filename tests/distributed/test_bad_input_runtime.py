"""Bad input that shows only in a running job (docs/bad_input.md): one torchrun launch, several fits.

Each case must raise the same error on both ranks at the same point; the next case then runs in the
same process group, which proves no rank was left inside a collective. A bad mesh inside a job is
tested in test_hsdp.py::test_bad_mesh_fails_on_every_rank_without_hang (`mesh-in-job`).
"""

import pytest
from _harness import results, run_torchrun

pytestmark = pytest.mark.distributed

EXPECTED = {
    "empty_dataset": ("ValueError", ["len(dataset)=0"]),
    "fewer_samples_than_ranks": (
        "ValueError",
        ["has 1 samples but there are 2 data-parallel ranks", "Use at most 1 data-parallel ranks"],
    ),
    "smaller_than_one_batch": ("ValueError", ["6 samples", "batch_size=8", "Lower batch_size to <= 3"]),
    "nan_loss_one_rank": ("FloatingPointError", ["rank(s) [1] at global step 2", "gradient_clip_val"]),
    "callback_wrong_strategy": ("TypeError", ["PipelineBubble needs", "HybridShardStrategy"]),
}


def test_runtime_bad_input_fails_on_every_rank(tmp_path):
    rows = results(run_torchrun("bad_data.py", str(tmp_path), nproc=2, timeout=600))
    by_case = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)
    for case, (error, needles) in EXPECTED.items():
        got = by_case.get(case, [])
        assert len(got) == 2, (case, got)
        assert got[0]["message"] == got[1]["message"], got  # every rank raised the same error itself
        for r in got:
            assert r["error"] == error and all(n in r["message"] for n in needles), r
            assert r["finite"], r  # the weights were not overwritten with NaN
    assert all(r["step"] == 0 for r in by_case["empty_dataset"] + by_case["fewer_samples_than_ranks"])
    assert all(r["step"] == 2 for r in by_case["nan_loss_one_rank"])
    # nothing was written for the step whose loss was NaN: the checkpoints of steps 1 and 2 only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s1.ckpt", "s2.ckpt"]
    control = by_case["control_run"]
    assert len(control) == 2 and all(r["error"] is None and r["step"] == 4 for r in control), control
