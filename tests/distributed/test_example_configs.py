"""Smoke test: every YAML in examples/configs/ trains for its few steps through its example entry point.

Each config names its entry point in a comment line ``python examples/<name>/train.py fit --config ...``.
"""

from __future__ import annotations

import re

import pytest
from _harness import ROOT, run_script

CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
ENTRY = re.compile(r"python (examples/\w+/train\.py) fit --config")


def _entry_point(config) -> str:
    match = ENTRY.search(config.read_text())
    if match is None:
        raise AssertionError(f"{config.name} must name its entry point: '# python examples/<name>/train.py fit --config ...'")
    return match.group(1)


@pytest.mark.distributed
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_example_config_runs(config, tmp_path):
    proc = run_script(ROOT / _entry_point(config), "fit", "--config", str(config), cwd=tmp_path, timeout=600)
    log = proc.stdout + proc.stderr
    assert "`Trainer.fit` stopped: `max_steps=" in log, log[-3000:]
    assert "Traceback" not in log
