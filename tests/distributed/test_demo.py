"""`make demo` (lightning_dist/demo.py) on 2 processes, one short epoch: its report shows what the pack promises.

The distributed gradient of step 0 equals the single-device one (GradientParityCheck's measured figure is printed
and small), BatchNorm is synchronized and validation exact (so the pack warns about nothing of its own), and the
model-state table is measured while gradients and optimizer state exist.
"""

from __future__ import annotations

import re

import pytest
from _harness import ROOT, run_script

pytestmark = pytest.mark.distributed


def test_demo_report_shows_gradient_parity_and_live_model_state():
    proc = run_script(
        ROOT / "lightning_dist" / "demo.py", "--devices", "2", "--epochs", "1", "--n-train", "256", timeout=240
    )
    out = proc.stdout
    parity = re.search(
        r"gradient at step 0, distributed vs one device on the same (\d+) images: relative difference"
        r" ([0-9.e+-]+) \(32-true precision, tolerance ([0-9.e+-]+)",
        out,
    )
    assert parity, out[-3000:]
    assert int(parity.group(1)) == 64  # the global batch: 2 ranks x 32
    rel, tol = float(parity.group(2)), float(parity.group(3))
    assert rel < 1e-5 and tol == 1e-4, (
        rel,
        tol,
    )  # float32 rounding (BatchNorm pooled over 2 ranks), far below tolerance
    assert "every one of 256 validation images scored once" in out
    table = out[out.index("model-state bytes per rank") :]
    rows = re.findall(r"│\s+(\d)\s+│\s+([\d,]+)\s+│\s+([\d,]+)\s+│\s+([\d,]+)\s+│", table)
    assert len(rows) == 2, out[-3000:]
    for _, params, grads, optimizer in rows:
        params, grads, optimizer = (int(v.replace(",", "")) for v in (params, grads, optimizer))
        assert grads == params and optimizer == 2 * params > 0  # fp32 grads and AdamW's two moments, all sharded
    # Lightning prints warnings as "path:line: message": one raised by the pack names its file or its subject
    own = [
        line
        for line in proc.stderr.splitlines()
        if any(word in line for word in ("lightning_dist", "BatchNorm", "ExactEvaluation", "GradientParity"))
    ]
    assert not own, own  # no warning of the pack's own (e.g. unsynchronized BatchNorm statistics)
