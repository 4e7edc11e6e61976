"""The README and the documentation site: the site builds with ``mkdocs build --strict`` (every page in the nav,
no broken link or anchor, the API reference from the docstrings), the README stays a landing page, and every code
block either runs in a test (tests/distributed/test_docs_blocks.py runs the python and bash ones; the YAML ones
build their strategies here) or says why it cannot run here."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys

import pytest
import yaml
from _docs import CODE, OUTPUT, ROOT, all_blocks
from lightning.pytorch import Trainer

README = ROOT / "README.md"


def test_mkdocs_builds_the_site_in_strict_mode(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + "\n(pip install -e '.[test]' installs MkDocs and its plugins)"
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "GradientParityCheck" in api and "shard_size" in api  # the reference was rendered from the docstrings


def test_the_readme_is_a_landing_page():
    text = README.read_text()
    assert len(text.splitlines()) < 300
    # the two set-up commands of a fresh machine, as the repository's checks look for them
    assert "make demo" in text and "make test" in text
    runnable = [b for b in all_blocks() if b.page == README and b.runs and b.lang == "python"]
    assert runnable and "pl.Trainer(" in runnable[0].body and "def training_step" in runnable[0].body  # the quickstart
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link


def test_every_code_block_runs_or_says_why_not():
    seen = all_blocks()
    assert {b.page for b in seen} >= {README, ROOT / "docs" / "getting_started.md"}
    for b in seen:
        assert b.lang in CODE + OUTPUT, f"{b.where}: a fence needs a language ({CODE + OUTPUT}), got {b.lang!r}"
        if b.marker == "not run":
            assert len(b.reason) >= 10, f"{b.where}: say why it cannot run here"
        if b.marker == "tested by":
            path, _, name = b.reason.partition("::")
            source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
            assert f"def {name}(" in source, f"{b.where}: no test {b.reason}"
    assert sum(b.runs for b in seen) >= 8, [b.where for b in seen if b.runs]


def _instantiate(spec):
    """A LightningCLI ``{class_path, init_args}`` (nested ones first), as the CLI would build it."""
    if isinstance(spec, dict) and "class_path" in spec:
        module, _, name = spec["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        return cls(**{k: _instantiate(v) for k, v in (spec.get("init_args") or {}).items()})
    if isinstance(spec, dict):
        return {k: _instantiate(v) for k, v in spec.items()}
    return spec


YAML = [b for b in all_blocks() if b.lang == "yaml" and b.runs]


@pytest.mark.parametrize("block", YAML, ids=[b.where for b in YAML])
def test_yaml_blocks_build_what_they_name(block):
    import lightning_dist  # noqa: F401  (the configs name the pack's classes)

    config = yaml.safe_load(block.body)
    trainer = config.get("trainer", {})
    accepted = inspect.signature(Trainer.__init__).parameters
    assert set(trainer) <= set(accepted), sorted(set(trainer) - set(accepted))
    strategy = trainer.get("strategy", config.get("strategy"))
    assert isinstance(strategy, dict), block.where
    built = _instantiate(strategy)
    assert type(built).__name__ == strategy["class_path"].rpartition(".")[2]
