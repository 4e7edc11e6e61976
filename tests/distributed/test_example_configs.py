"""Smoke test: every YAML in examples/configs/ trains for its few steps through its example entry point.

Each config names its entry point in a comment line ``python examples/<name>/train.py fit --config ...``.
To keep the whole file within a few minutes, configs asking for the same number of devices share one
torchrun launch (``tests/scenarios/run_configs.py`` runs them one after another, imports paid once;
DeepSpeed's configs get a launch of their own), and one config also runs exactly as documented, through
Lightning's own launcher.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import yaml
from _harness import ROOT, SCENARIOS, results, run_script, run_torchrun

from lightning_dist._compat import async_io_available

pytestmark = pytest.mark.distributed

# examples/hf/ (any HuggingFace causal LM) needs transformers: skipped with the reason when it is missing
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml")) + sorted((ROOT / "examples" / "hf").glob("*.yaml"))
ENTRY = re.compile(r"python (examples/\w+/train\.py) fit --config")

# config -> (text of the known failure, why): reported as xfail while the cause is open; passes once fixed
KNOWN_FAILURES: dict[str, tuple[str, str]] = {}  # config stem -> (error text, why); none today
# configs that train the same model on the same data and data-parallel size: the same loss, whatever the strategy
SAME_LOSS = [
    ("tp", "pipeline_1f1b", "pipeline_gpipe", "pp_tp"),
    ("pipeline_interleaved", "pipeline_zero_bubble"),
    ("fsdp2", "pp_dp", "offload_cpu", "cp"),
]


def _entry_point(config: Path) -> str:
    match = ENTRY.search(config.read_text())
    if match is None:
        raise AssertionError(
            f"{config.name} must name its entry point: '# python examples/<name>/train.py fit --config ...'"
        )
    return match.group(1)


def _trainer_cfg(config: Path) -> dict:
    return yaml.safe_load(config.read_text())["trainer"]


def _launch_key(config: Path) -> tuple[int, bool]:
    strategy = _trainer_cfg(config).get("strategy")
    name = strategy if isinstance(strategy, str) else (strategy or {}).get("class_path", "")
    return int(_trainer_cfg(config)["devices"]), "offload" in name.lower()  # DeepSpeed apart from the mesh strategies


def _skip_reason(config: Path) -> str | None:
    if config.parent.name == "hf" and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install -e '.[test]')"
    if "nvme" in config.stem and not async_io_available():
        return "libaio missing (apt-get install -y libaio-dev): DeepSpeed cannot build its async_io op"
    return None


def _env() -> dict:
    # DeepSpeed compiles async_io on first use (minutes): reuse the environment's cache, as `make` does
    return {
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    }


class _Launches:
    """Runs each launch group once, on first use: {config stem: [per-rank results]} and failures."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.done = workdir, {}

    def get(self, config: Path) -> tuple[list[dict], str | None]:
        key = _launch_key(config)
        if key not in self.done:
            group = [c for c in CONFIGS if _launch_key(c) == key and _skip_reason(c) is None]
            group.sort(key=lambda c: c.stem in KNOWN_FAILURES)  # a known failure ends its launch: run it last
            proc = run_torchrun(
                SCENARIOS / "run_configs.py",
                *map(str, group),
                nproc=key[0],
                timeout=600,
                env=_env(),
                expect_ok=False,
                cwd=self.workdir,
            )
            failed = re.search(r"CONFIG FAILED (\w+)", proc.stderr)
            self.done[key] = (results(proc), failed.group(1) if failed else None, proc)
        out, failed, proc = self.done[key]
        mine = [r for r in out if r["config"] == config.stem]
        if config.stem == failed or (not mine and proc.returncode != 0):
            return mine, (proc.stderr[-6000:] if config.stem == failed else f"not run: {failed} failed before it")
        return mine, None


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> _Launches:
    return _Launches(tmp_path_factory.mktemp("configs"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_example_config_runs(config, launches):
    _entry_point(config)
    reason = _skip_reason(config)
    if reason:
        pytest.skip(reason)
    out, error = launches.get(config)
    if error is not None:
        known = KNOWN_FAILURES.get(config.stem)
        if known and known[0] in error:
            pytest.xfail(known[1])
        raise AssertionError(f"{config.name} failed:\n{error}")
    devices = int(_trainer_cfg(config)["devices"])
    assert sorted(r["rank"] for r in out) == list(range(devices)), out
    for r in out:
        assert r["global_step"] == r["max_steps"] == _trainer_cfg(config)["max_steps"], r
        assert all(v == v for v in r["metrics"].values()), r  # no NaN loss
    assert len({r["metrics"]["train_loss"] for r in out}) == 1, out  # logged with sync_dist: one value
    # an example shows the pack used as intended: nothing of the pack's own warns (e.g. unsynced BatchNorm)
    assert [w for r in out for w in r["pack_warnings"]] == [], config.name


def test_callbacks_config_logs_throughput_memory_and_comm(launches):
    config = ROOT / "examples" / "configs" / "callbacks.yaml"
    out, error = launches.get(config)
    assert error is None, error
    cfg = yaml.safe_load(config.read_text())
    for r in out:
        t = r["throughput"]
        # global samples = steps x per-rank batch x data-parallel ranks, counted exactly at the end of fit
        assert t["samples"] == cfg["trainer"]["max_steps"] * cfg["data"]["batch_size"] * t["dp_size"], r
        assert t["dp_size"] == 2 and t["samples_per_sec"] > 0 and t["has_memory"] and t["has_comm"], r
        assert r["metrics"]["val_samples"] == cfg["data"]["n_val"], r  # ExactEvaluation: no padded duplicates
    with open(Path(out[0]["log_dir"]) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    assert {
        "throughput/samples_per_sec",
        "throughput/fit_samples_per_sec",
        "memory/model_state_bytes",
        "memory/peak_bytes",
        "comm/bytes",
    } <= columns, sorted(columns)
    fit = [r for r in rows if r["throughput/fit_samples"]]
    assert [float(r["throughput/fit_samples"]) for r in fit] == [out[0]["throughput"]["samples"]]


def test_throughput_counts_pipeline_peers_once(launches):
    config = ROOT / "examples" / "configs" / "pp_dp.yaml"
    out, error = launches.get(config)
    assert error is None, error
    cfg = yaml.safe_load(config.read_text())
    for r in out:  # 4 processes = 2 pipeline stages x 2 data-parallel ranks: samples of 2 ranks, not 4
        assert r["throughput"]["dp_size"] == 2, r
        assert r["throughput"]["samples"] == cfg["trainer"]["max_steps"] * cfg["data"]["batch_size"] * 2, r


@pytest.mark.parametrize("names", SAME_LOSS, ids=["+".join(n) for n in SAME_LOSS])
def test_same_model_same_loss_across_strategies(names, launches):
    losses = {}
    for name in names:
        config = ROOT / "examples" / "configs" / f"{name}.yaml"
        out, error = launches.get(config)
        if error is not None:
            pytest.skip(f"{name} did not run (see its own test)")
        losses[name] = out[0]["metrics"]["train_loss"]
    first = next(iter(losses.values()))
    assert all(abs(v - first) <= 1e-4 * abs(first) for v in losses.values()), losses


def test_documented_command_through_lightnings_launcher(tmp_path):
    """``python examples/vision/train.py fit --config examples/configs/callbacks.yaml``: Lightning spawns the ranks."""
    config = ROOT / "examples" / "configs" / "callbacks.yaml"
    proc = run_script(ROOT / _entry_point(config), "fit", "--config", str(config), cwd=tmp_path, timeout=600)
    log = proc.stdout + proc.stderr
    assert "`Trainer.fit` stopped: `max_steps=" in log, log[-3000:]
    assert "Traceback" not in log
    assert proc.stdout.count("Fit summary (HybridShardStrategy, 2 processes") == 1, proc.stdout[-3000:]  # rank 0 only
    assert "throughput (global samples/s)" in proc.stdout
