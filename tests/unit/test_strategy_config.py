"""Strategy construction, registration and LightningCLI configs (one process, no process group)."""

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy, StrategyRegistry

import lightning_dist
from lightning_dist._compat import deepspeed_available
from lightning_dist.strategies import REGISTERED, FullyShardStrategy, HybridShardStrategy


def test_every_name_is_registered_with_lightning():
    for name, (cls, _, params) in REGISTERED.items():
        assert name in StrategyRegistry.available_strategies()
        if issubclass(cls, DeepSpeedStrategy) and not deepspeed_available():
            continue  # registered, but built only where the `deepspeed` extra is installed
        assert isinstance(StrategyRegistry.get(name), Strategy)  # some names build a backend-specific class
    for name in ("hsdp", "hsdp_zero2", "hsdp_zero1", "fsdp2", "fsdp2_zero2"):
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, REGISTERED[name][0])
        for key, value in REGISTERED[name][2].items():
            assert getattr(strategy, key) == value


def test_trainer_accepts_string_names():
    trainer = Trainer(strategy="hsdp_zero2", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, HybridShardStrategy) and trainer.strategy.zero_stage == 2
    trainer = Trainer(strategy="fsdp2", accelerator="cpu", devices=1, logger=False, precision="64-true")
    assert isinstance(trainer.strategy, FullyShardStrategy)
    assert trainer.strategy._sizes["dp_replicate"] == 1  # full sharding: no replica groups


def test_mesh_spec_resolves_from_devices_and_nodes():
    trainer = Trainer(strategy=HybridShardStrategy(), accelerator="cpu", devices=4, num_nodes=2, logger=False)
    assert trainer.strategy.mesh_spec().shape == (1, 2, 4, 1, 1)  # shard in a node, replicate across nodes
    trainer = Trainer(strategy=HybridShardStrategy(shard_size=2), accelerator="cpu", devices=4, logger=False)
    assert trainer.strategy.mesh_spec().shape == (1, 2, 2, 1, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"zero_stage": 4}, "`zero_stage=4` must be 1, 2 or 3"),
        ({"shard_size": 0}, '`shard_size=0` must be an integer >= 1, "auto" or "full"'),
        ({"shard_size": "half"}, "`shard_size='half'`"),
        ({"tp": 0}, "`tp=0` must be an integer >= 1"),
        ({"dp_replicate": -2}, '`dp_replicate=-2` must be an integer >= 1 or "auto"'),
        ({"parallelize_fn": 3}, "`parallelize_fn=3` must be callable"),
        ({"shard_size": 2, "dp_shard": 2}, "Pass either shard_size=2 or dp_shard=2"),
    ],
)
def test_bad_options_raise_value_error_naming_the_value(kwargs, message):
    with pytest.raises(ValueError) as err:
        HybridShardStrategy(**kwargs)
    assert message in str(err.value)


def test_the_base_strategy_without_a_plan_is_refused_at_construction():
    """MeshStrategy alone has no plan: refused when built (before: a bare NotImplementedError inside fit, after the
    process group started), naming the fix; with `parallelize_fn` it is a strategy."""
    from lightning_dist.strategies import MeshStrategy

    with pytest.raises(ValueError, match=r"MeshStrategy has no built-in plan: pass `parallelize_fn=") as err:
        MeshStrategy(tp=2)
    assert "TensorParallelStrategy 'tp'" in str(err.value)
    MeshStrategy(parallelize_fn=lambda model, mesh: None)


def test_mesh_is_a_lifecycle_error_before_fit():
    with pytest.raises(RuntimeError, match="not available before"):
        HybridShardStrategy().mesh


def test_precision_maps_to_fsdp2_mixed_precision():
    trainer = Trainer(strategy="hsdp", accelerator="cpu", devices=1, precision="bf16-mixed", logger=False)
    policy = trainer.strategy.mp_policy()
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    trainer = Trainer(strategy="hsdp", accelerator="cpu", devices=1, precision="64-true", logger=False)
    assert trainer.strategy.mp_policy() is None


def test_lightning_cli_yaml_by_name_and_by_class_path(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    from lightning_dist.models.data import ShapesDataModule
    from lightning_dist.models.vision import ShapesClassifier

    by_name = tmp_path / "name.yaml"
    by_name.write_text("trainer:\n  strategy: hsdp_zero1\n  accelerator: cpu\n  devices: 1\n")
    cli = LightningCLI(ShapesClassifier, ShapesDataModule, run=False, args=["--config", str(by_name)])
    assert isinstance(cli.trainer.strategy, HybridShardStrategy) and cli.trainer.strategy.zero_stage == 1

    by_class = tmp_path / "class.yaml"
    by_class.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  strategy:\n"
        "    class_path: lightning_dist.strategies.HybridShardStrategy\n"
        "    init_args:\n      shard_size: 2\n      zero_stage: 2\n      activation_checkpointing: true\n"
    )
    cli = LightningCLI(ShapesClassifier, ShapesDataModule, run=False, args=["--config", str(by_class)])
    s = cli.trainer.strategy
    assert isinstance(s, HybridShardStrategy) and s.zero_stage == 2 and s.activation_checkpointing is True
    assert s._sizes["dp_shard"] == 2


def test_package_exports():
    assert lightning_dist.HybridShardStrategy is HybridShardStrategy
    assert lightning_dist.DIM_NAMES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def test_model_options_are_one_type_checked_once_with_every_problem_listed():
    """activation checkpointing, compile and the TP plan are declared once (MeshStrategy) and checked together with the
    strategy's own options and the mesh's: one ValueError lists every problem."""
    from lightning_dist.options import ModelOptions
    from lightning_dist.strategies import PipelineStrategy, TensorParallelStrategy

    with pytest.raises(ValueError) as err:
        HybridShardStrategy(zero_stage=4, activation_checkpointing="sometimes", compile=3, tp=0, tp_plan="mlp")
    msg = str(err.value)
    for needle in ("zero_stage=4", "sometimes", "compile=3", "`tp=0`", "no tensor-parallel plan"):
        assert needle in msg, (needle, msg)
    with pytest.raises(ValueError) as err:
        PipelineStrategy(schedule="zero_bubble", compile=True, tp_plan="zigzag", activation_checkpointing="selective")
    msg = str(err.value)
    for needle in ("'zero_bubble' is not supported", "tp_plan='zigzag'", "selective"):
        assert needle in msg, (needle, msg)
    with pytest.raises(ValueError, match="`activation_checkpointing`, `compile` are applied by the built-in plan"):
        HybridShardStrategy(activation_checkpointing=True, compile=True, parallelize_fn=lambda m, mesh: None)
    # the same option has the same name and type on every strategy
    for strategy in (
        HybridShardStrategy(activation_checkpointing="every:2"),
        TensorParallelStrategy(activation_checkpointing="every:2", tp_plan="mlp"),
        PipelineStrategy(activation_checkpointing="every:2", tp_plan="mlp"),
    ):
        assert isinstance(strategy.model_options, ModelOptions)
        assert strategy.activation_checkpointing == strategy.model_options.activation_checkpointing == "every:2"
    assert TensorParallelStrategy(tp_plan={"head": "colwise_gather"}).tp_plan == {"head": "colwise_gather"}
