"""Run several example configs one after another in one torchrun launch (the imports are paid once).

    torchrun --nproc-per-node N tests/scenarios/run_configs.py examples/configs/a.yaml examples/configs/b.yaml

Every config must ask for N devices. Each is run through the entry point its comment line names
(``# python examples/<name>/train.py fit --config ...``), exactly as ``fit --config <file>`` would; under
torchrun Lightning uses the launcher's processes (TorchElasticEnvironment) instead of spawning its own.
Per config and rank it prints ``RESULT {"config", "rank", "global_step", "max_steps", "seconds", ...}``. A
config that raises ends the launch (torchrun then stops the other ranks), so no rank waits in a collective.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch.distributed as dist
import yaml

from lightning_dist._integrations.torch_distributed import destroy_process_groups_for_exit

ROOT = Path(__file__).resolve().parents[2]
ENTRY = re.compile(r"python (examples/\w+/train\.py) fit --config")


def entry_point(config: Path) -> Path:
    match = ENTRY.search(config.read_text())
    if match is None:
        raise ValueError(
            f"{config.name} must name its entry point: '# python examples/<name>/train.py fit --config ...'"
        )
    return ROOT / match.group(1)


def load_main(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def prepare(config: Path) -> None:
    """Create the NVMe swap folder a config names (the user's `mkdir -p` in the config's comment)."""
    strategy = (yaml.safe_load(config.read_text()).get("trainer") or {}).get("strategy")
    nvme = strategy.get("init_args", {}).get("nvme_path") if isinstance(strategy, dict) else None
    if nvme:
        os.makedirs(nvme, exist_ok=True)


PACK = (ROOT / "lightning_dist", ROOT / "callbacks")


def pack_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """The warnings raised by the pack's own code (its files are where they point: rank_zero_warn's stacklevel)."""
    return [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if any(Path(w.filename).resolve().is_relative_to(p) for p in PACK)
    ]


def run(config: Path) -> dict:
    prepare(config)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = load_main(entry_point(config))(["fit", "--config", str(config)])
    shown = {warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught}
    print("".join(sorted(shown)), file=sys.stderr, end="")  # each once, as without the recording
    trainer = cli.trainer
    out = {
        "config": config.stem,
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "max_steps": trainer.max_steps,
        "seconds": round(time.perf_counter() - start, 2),
        "strategy": type(trainer.strategy).__name__,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1},
        "pack_warnings": pack_warnings(caught),
    }
    for cb in trainer.callbacks:
        if type(cb).__name__ == "ThroughputSummary":
            s = cb.summary
            out["throughput"] = {k: s[k] for k in ("samples", "steps", "dp_size", "samples_per_sec")}
            out["throughput"]["has_memory"] = all(r["memory"] is not None for r in s["ranks"])
            out["throughput"]["has_comm"] = all(r["comm"] is not None for r in s["ranks"])
        if type(cb).__name__ == "MeshSyncBatchNorm":
            out["batch_size"] = cli.datamodule.batch_size
    if trainer.logger is not None and trainer.logger.log_dir:
        out["log_dir"] = str(Path(trainer.logger.log_dir).resolve())
    return out


def main(configs: list[str]) -> None:
    for name in configs:
        config = Path(name).resolve()
        try:
            result = run(config)
        except BaseException:  # noqa: BLE001 (report which config failed, then end the whole launch)
            traceback.print_exc()
            print(f"CONFIG FAILED {config.stem}", file=sys.stderr, flush=True)
            sys.stderr.flush()
            os._exit(1)
        print("RESULT " + json.dumps(result), flush=True)
        if dist.is_initialized():
            dist.barrier()  # every rank done with this config before the next one builds its mesh
    destroy_process_groups_for_exit()  # flushes gloo's workers first: no abort at exit


if __name__ == "__main__":
    configs, sys.argv = sys.argv[1:], sys.argv[:1]  # LightningCLI gets its args explicitly, not these
    main(configs)
