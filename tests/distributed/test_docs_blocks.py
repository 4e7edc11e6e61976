"""Every runnable python and bash block of README.md and docs/ runs here, as a reader would run it.

A python block is a complete script: it is saved to a file and run with ``python file.py`` (Lightning's launcher
starts the other ranks by running it again). A bash block runs in ``bash -euo pipefail`` from a scratch folder that
sees the checkout's ``examples/`` and ``benchmarks/`` and this environment's ``lightning-dist`` and ``python``
first on its PATH. Blocks that cannot run here say why in their page (tests/_docs.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _docs import ROOT, all_blocks

pytestmark = pytest.mark.distributed


def _distinct(lang: str) -> dict[str, list]:
    """The runnable blocks of `lang`, one per distinct body (the README's quickstart is also the getting-started
    page's: run once), each with every place it appears."""
    by_body: dict[str, list] = {}
    for b in all_blocks():
        if b.runs and b.lang == lang:
            by_body.setdefault(b.body, []).append(b)
    return {" = ".join(b.where for b in same): same[0] for same in by_body.values()}


PYTHON = _distinct("python")
BASH = _distinct("bash")


def _scratch(tmp_path: Path) -> Path:
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # the README's `.venv/bin/python`
    return tmp_path


def _env() -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("block", PYTHON.values(), ids=PYTHON.keys())
def test_python_block_runs(block, tmp_path):
    script = _scratch(tmp_path) / "block.py"
    script.write_text(block.body)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{block.where}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    parity = re.search(r"step-0 gradient vs one device: ([0-9.e+-]+)", proc.stdout)
    if parity:  # the quickstart prints GradientParityCheck's measured figure: float64 rounding
        assert float(parity.group(1)) < 1e-12, proc.stdout[-2000:]


@pytest.mark.parametrize("block", BASH.values(), ids=BASH.keys())
def test_bash_block_runs(block, tmp_path):
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.body],
        cwd=_scratch(tmp_path),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{block.where}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
