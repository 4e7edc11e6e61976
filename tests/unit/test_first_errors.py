"""What a newcomer meets first: a misspelt strategy name, a mesh size that does not divide, a misspelt YAML key,
and the progress bar. Each error gives the fix in its first lines; the bar says what runs."""

from __future__ import annotations

import importlib.util
import io
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

import lightning_dist
from lightning_dist.lightning_cli import class_arguments, misspelt_key_hint
from lightning_dist.progress import RunProgressBar, epoch_description, step_metric
from lightning_dist.strategies import HybridShardStrategy, unknown_strategy_message

ROOT = Path(__file__).resolve().parents[2]
LIGHTNING = Path(pl.__file__).resolve().parents[1]  # the lightning package


# ---- strategy names ------------------------------------------------------------------------------------------
def test_a_misspelt_pack_name_gets_did_you_mean_in_the_first_line():
    with pytest.raises(ValueError) as err:
        pl.Trainer(strategy="hsdp_zero", accelerator="cpu", devices=1, logger=False)
    first = str(err.value).splitlines()[0]
    assert (
        first == "Unknown strategy name strategy='hsdp_zero'. Did you mean 'hsdp_zero2' or 'hsdp_zero1' or"
        " 'fsdp2_zero2'?"
    )
    assert "lightning-dist's names: hsdp, hsdp_zero2" in str(err.value)


def test_any_unknown_name_lists_the_pack_names_and_a_prefix_finds_its_family():
    assert "Did you mean" not in unknown_strategy_message("xyz")
    assert "tp_sp, auto_parallel." in unknown_strategy_message("xyz")
    assert "Did you mean 'pipeline' or 'pipeline_1f1b' or 'pipeline_gpipe'?" in unknown_strategy_message("pipeline_")
    with pytest.raises(ValueError, match="Unknown strategy name strategy='offlaod'. Did you mean 'offload'"):
        pl.Trainer(strategy="offlaod", accelerator="cpu", devices=1, logger=False)


def test_lightning_still_has_no_strategy_hook_the_pack_could_install():
    """`strategy="hsdp"` without `import lightning_dist` cannot work in Lightning 2.6: its only entry-point group
    (external callbacks) is read after the strategy name is checked. When this fails, Lightning gained a way:
    register the pack's names through it (README and docs/troubleshooting.md say to import lightning_dist)."""
    groups = sorted(
        str(path.relative_to(LIGHTNING))
        for path in LIGHTNING.rglob("*.py")
        if "entry_points(" in path.read_text(encoding="utf-8") and "__setup__" not in path.name
    )
    assert groups == ["fabric/utilities/registry.py"], groups  # _load_external_callbacks only
    from lightning.pytorch.trainer.trainer import Trainer

    source = Path(importlib.util.find_spec(Trainer.__module__).origin).read_text()
    assert source.index("_AcceleratorConnector(") < source.index("_CallbackConnector(self)")


# ---- mesh sizes ----------------------------------------------------------------------------------------------
def test_a_mesh_error_names_the_argument_the_user_wrote():
    trainer = pl.Trainer(strategy=HybridShardStrategy(shard_size=3), accelerator="cpu", devices=4, logger=False)
    with pytest.raises(ValueError) as err:
        trainer.strategy.mesh_spec()
    lines = str(err.value).splitlines()
    assert "shard_size=3 (dp_shard)" in lines[0], lines
    assert lines[1].startswith("  - `shard_size=3 (dp_shard)` does not divide the 4 data-parallel ranks"), lines
    assert "`dp_shard=3`" not in str(err.value)


def test_a_mesh_error_keeps_the_dim_name_when_the_user_wrote_it():
    trainer = pl.Trainer(strategy=HybridShardStrategy(dp_shard=3), accelerator="cpu", devices=4, logger=False)
    with pytest.raises(ValueError, match=r"`dp_shard=3` does not divide the 4 data-parallel ranks"):
        trainer.strategy.mesh_spec()


# ---- LightningCLI keys ---------------------------------------------------------------------------------------
def _vision_main():
    spec = importlib.util.spec_from_file_location("example_vision_train", ROOT / "examples" / "vision" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize(
    ("typo", "first_line"),
    [
        (
            ("zero_stage: 3", "zero_stag: 3"),
            "error: `zero_stag` is not an argument of lightning_dist.strategies.HybridShardStrategy: did you mean"
            " `zero_stage`?",
        ),
        (("max_steps: 3", "max_step: 3"), "error: `trainer.max_step` is not an argument of `"),
        (("{width: 8", "{widht: 8"), "error: `widht` is not an argument of lightning_dist.models.ShapesCNN: did you"),
    ],
    ids=["strategy-init-arg", "trainer-key", "model-init-arg"],
)
def test_a_misspelt_yaml_key_is_named_first_with_the_closest_one(typo, first_line, tmp_path, capsys):
    config = (ROOT / "examples" / "configs" / "hsdp.yaml").read_text()
    assert typo[0] in config
    bad = tmp_path / "bad.yaml"
    bad.write_text(config.replace(typo[0], typo[1]))
    with pytest.raises(SystemExit) as exit_:
        _vision_main()(["fit", "--config", str(bad)])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(first_line), lines[:5]
    assert len(lines) < 15 and not any(line.lstrip().startswith("[--") for line in lines), lines  # no usage text
    if typo[1].startswith("max_step"):
        assert "did you mean `trainer.max_steps`" in lines[0]


def test_misspelt_key_hints_follow_kwargs_into_base_classes():
    # HybridShardStrategy(**kwargs) forwards the mesh options to MeshStrategy: jsonargparse accepts them too
    assert {"shard_size", "dp_replicate", "timeout"} <= set(
        class_arguments("lightning_dist.strategies.HybridShardStrategy")
    )
    assert class_arguments("no.such.Class") == []
    hint = misspelt_key_hint(
        "Problem with given class_path 'lightning_dist.strategies.HybridShardStrategy':\n"
        "  Option 'dp_replicat' is not accepted",
        [],
    )
    assert hint.endswith("did you mean `dp_replicate`?")
    assert misspelt_key_hint("Parser key 'x': Expected a <class 'int'>", ["x"]) is None  # not a key error


# ---- progress bar --------------------------------------------------------------------------------------------
def test_bar_labels():
    assert epoch_description(3, -1) == "Epoch 3" and epoch_description(3, None) == "Epoch 3"
    assert epoch_description(3, 10) == "Epoch 3/9"  # Lightning's: the last epoch's 0-based index
    assert step_metric(40, 200) == {"step": "40/200"} and step_metric(40, -1) == {}


def test_the_pack_makes_its_bar_the_default_and_keeps_the_users():
    assert isinstance(pl.Trainer(logger=False).progress_bar_callback, RunProgressBar)
    mine = RichProgressBar(leave=True)
    assert pl.Trainer(logger=False, callbacks=[mine]).progress_bar_callback is mine
    assert lightning_dist.RunProgressBar is RunProgressBar


def test_a_max_steps_run_shows_its_epoch_and_step_and_no_v_num(tmp_path):
    screen = io.StringIO()
    bar = RunProgressBar(console_kwargs={"file": screen, "force_terminal": True, "width": 200})
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path),
        callbacks=[bar],
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    trainer.fit(BoringModel())
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", screen.getvalue())  # without the terminal's colour codes
    assert "Epoch 0" in text and "step: 3/3" in text, text[-2000:]
    assert "/-2" not in text and "v_num" not in text, text[-2000:]
