"""ThroughputSummary in one process: figures reach CSVLogger (and TensorBoard when installed), the table prints."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist.callbacks import CommunicationLedger, MemoryReport, ThroughputSummary, format_summary

STEPS, BATCH = 6, 4


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
        return DataLoader(data, batch_size=BATCH)


def _fit(tmp_path, loggers, callbacks):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=loggers,
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Tiny())
    return trainer


def _csv_rows(logger) -> list[dict[str, str]]:
    with open(f"{logger.log_dir}/metrics.csv") as f:
        return list(csv.DictReader(f))


def test_csv_logger_receives_throughput_memory_and_comm(tmp_path, capsys):
    logger = pl.loggers.CSVLogger(tmp_path, name="csv")
    cb = ThroughputSummary(window_size=2)
    _fit(tmp_path, [logger], [cb, MemoryReport(print_table=False), CommunicationLedger(print_table=False)])
    rows = _csv_rows(logger)
    per_step = [float(r["throughput/samples_per_sec"]) for r in rows if r.get("throughput/samples_per_sec")]
    assert len(per_step) == STEPS - 1 and all(v > 0 for v in per_step)  # from the second step: a full window
    assert any(r.get("memory/model_state_bytes") for r in rows)  # MemoryReport's figures, same logger
    assert any(r.get("comm/bytes") for r in rows)  # CommunicationLedger's (0 bytes in one process)
    fit = [r for r in rows if r.get("throughput/fit_samples")]
    assert len(fit) == 1 and float(fit[0]["throughput/fit_samples"]) == STEPS * BATCH
    assert float(fit[0]["throughput/fit_samples_per_sec"]) == pytest.approx(cb.summary["samples_per_sec"])
    # the summary: counts, memory figures from MemoryReport and the final metric
    assert cb.summary["samples"] == STEPS * BATCH and cb.summary["steps"] == STEPS and cb.summary["dp_size"] == 1
    assert cb.summary["ranks"][0]["memory"]["model_state_bytes"] == (8 * 2 + 2) * 4 * 2  # fp32 params + grads (SGD)
    assert "train_loss" in cb.summary["metrics"]
    out = capsys.readouterr().out
    assert "Fit summary" in out and "throughput (global samples/s)" in out and "model-state bytes" in out


def _scalar_tags(log_dir) -> set[str]:
    """Scalar tags of TensorBoard event files, read with tensorboardX's protobufs (TFRecord framing:
    8-byte length, 4-byte crc, payload, 4-byte crc)."""
    import struct
    from pathlib import Path

    from tensorboardX.proto import event_pb2

    tags = set()
    for path in Path(log_dir).glob("events.out.tfevents.*"):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            tags.update(v.tag for v in event.summary.value)
            pos += 12 + length + 4
    return tags


def test_tensorboard_logger_receives_throughput(tmp_path):
    pytest.importorskip("tensorboardX", reason="tensorboardX (the test extra) is not installed")
    logger = pl.loggers.TensorBoardLogger(tmp_path, name="tb")
    _fit(tmp_path, [logger], [ThroughputSummary(window_size=2, print_table=False)])
    logger.experiment.flush()
    tags = _scalar_tags(logger.log_dir)
    assert "throughput/samples_per_sec" in tags and "throughput/fit_samples_per_sec" in tags


def test_no_table_and_no_logging_when_off(tmp_path, capsys):
    logger = pl.loggers.CSVLogger(tmp_path, name="off")
    cb = ThroughputSummary(window_size=2, log=False, print_table=False)
    _fit(tmp_path, [logger], [cb])
    assert not any("throughput/samples_per_sec" in r for r in _csv_rows(logger))
    assert "Fit summary" not in capsys.readouterr().out
    assert cb.summary["samples"] == STEPS * BATCH  # still measured


def test_format_summary_without_optional_figures():
    text = format_summary(
        {
            "strategy": "DDPStrategy",
            "world_size": 2,
            "dp_size": 2,
            "steps": 3,
            "samples": 24,
            "time_s": 1.5,
            "samples_per_sec": 16.0,
            "metrics": {"val_loss": 0.5},
            "ranks": [{"memory": None, "comm": None}],
        }
    )
    assert "16.0" in text and "val_loss" in text and "model-state" not in text


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"window_size": 1}, "window_size=1"),
        ({"skip_steps": -1}, "skip_steps=-1"),
        ({"batch_size_fn": 3}, "batch_size_fn=3"),
    ],
)
def test_bad_options_raise_with_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ThroughputSummary(**kwargs)
