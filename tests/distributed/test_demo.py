"""`make demo` (lightning_dist/demo.py) on 4 processes, one short epoch: its report shows what the pack promises.

The mesh is a real hybrid one (2 replicas x 2 shards); the distributed gradients of the first and last steps equal
the single-device ones in float64 (GradientParityCheck's measured figures are printed); BatchNorm is synchronized
and validation exact (so the pack warns about nothing of its own); the model-state table is measured while
gradients and optimizer state exist; the output ends on the report, which names the run's own log folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _harness import ROOT, run_script

pytestmark = pytest.mark.distributed


def test_demo_report_shows_the_hybrid_mesh_float64_parity_and_its_logs(tmp_path):
    args = ("--devices", "4", "--epochs", "1", "--n-train", "256", "--log-dir", str(tmp_path / "logs"))
    proc = run_script(ROOT / "lightning_dist" / "demo.py", *args, timeout=300)
    out = proc.stdout
    assert "mesh dp_replicate=2 x dp_shard=2, 4 CPU processes, 2 steps" in out, out[-3000:]
    parity = re.findall(
        r"step (\d+): distributed gradient vs one device on the whole batch of (\d+) images: relative difference"
        r" ([0-9.e+-]+) \(64-true precision",
        out,
    )
    assert [(step, batch) for step, batch, _ in parity] == [("0", "128"), ("1", "128")], out[-3000:]  # 4 ranks x 32
    assert all(float(rel) < 1e-12 for _, _, rel in parity), parity  # float64 rounding: the same update
    assert "every one of 256 validation images scored once" in out
    table = out[out.index("model-state bytes per rank") :]
    rows = re.findall(r"│\s+(\d)\s+│\s+([\d,]+)\s+│\s+([\d,]+)\s+│\s+([\d,]+)\s+│", table)
    assert len(rows) == 4, out[-3000:]
    for _, params, grads, optimizer in rows:
        params, grads, optimizer = (int(v.replace(",", "")) for v in (params, grads, optimizer))
        assert grads == params and optimizer == 2 * params > 0  # float64 grads and AdamW's two moments, sharded
    # the report is the last thing printed (after the progress bar) and ends on this run's own log folder
    last = out.rstrip().splitlines()[-1]
    logs = Path(re.fullmatch(r"logs: (\S+)", last)[1])
    assert logs.is_file() and logs.parent == tmp_path / "logs" / "demo" / "version_0", last
    assert "val_loss" in logs.read_text()  # what the run logged (2 steps: before the first train_loss row)
    assert "v_num" not in out and "/-2" not in out  # the progress bar says what runs
    # Lightning prints warnings as "path:line: message": one raised by the pack names its file or its subject
    own = [
        line
        for line in proc.stderr.splitlines()
        if any(word in line for word in ("lightning_dist", "BatchNorm", "ExactEvaluation", "GradientParity"))
    ]
    assert not own, own  # no warning of the pack's own (e.g. unsynchronized BatchNorm statistics)
