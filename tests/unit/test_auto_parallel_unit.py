"""The auto_parallel chooser (planner.rank_layouts), its strategy mapping, and the dry run's pure parts."""

from __future__ import annotations

import pytest
import torch

from lightning_dist import planner
from lightning_dist.dryrun import DryRunConfig, check_cluster, representative_ranks
from lightning_dist.mesh import MeshSpec
from lightning_dist.models.gpt import CharGPT
from lightning_dist.parallelize.counts import count_params
from lightning_dist.strategies import AutoParallelStrategy
from lightning_dist.strategies.auto_parallel import format_choice, strategy_for

STATE = planner.state_bytes(precision="64-true")  # 8 + 8 + 16 bytes per parameter


@pytest.fixture(scope="module")
def counts() -> planner.ParamCounts:
    with torch.device("meta"):
        module = CharGPT(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, bias=False)
    return count_params(module)


def _layouts(counts, memory, *, world=4, per_node=4):
    return planner.candidate_layouts(
        counts, world_size=world, devices_per_node=per_node, state=STATE, device_memory=memory
    )


def _memory(counts, name, **kw):
    return next(layout for layout in _layouts(counts, None, **kw) if layout.name == name).memory.total


@pytest.mark.parametrize(
    ("target", "global_batch", "prefer", "per_node", "cls", "mesh"),
    [
        ("ddp", None, (), 4, "HybridShardStrategy", (1, 4, 1, 1, 1)),
        ("hsdp-2", None, (), 4, "HybridShardStrategy", (1, 2, 2, 1, 1)),
        ("fsdp", None, (), 4, "FullyShardStrategy", (1, 1, 4, 1, 1)),
        ("tp2-fsdp2", 6, (), 4, "TensorParallelStrategy", (1, 1, 2, 1, 2)),
        ("pp2-ddp2", 6, (), 1, "PipelineStrategy", (2, 2, 1, 1, 1)),  # one device per node: no tensor parallelism
        ("pp2-ddp2", 6, ("pp",), 4, "PipelineStrategy", (2, 2, 1, 1, 1)),
        ("fsdp-offload", None, (), 4, "HybridShardStrategy", (1, 1, 4, 1, 1)),
    ],
)
def test_budget_forces_each_choice(counts, target, global_batch, prefer, per_node, cls, mesh):
    budget = max(1.0, _memory(counts, target, per_node=per_node) * 1.01)
    ranked = planner.rank_layouts(_layouts(counts, budget, per_node=per_node), global_batch=global_batch, prefer=prefer)
    assert ranked[0].name == target, [layout.name for layout in ranked]
    strategy_cls, kwargs = strategy_for(ranked[0])
    assert strategy_cls.__name__ == cls
    if target == "fsdp-offload":
        assert type(kwargs["offload_policy"]).__name__ == "CPUOffloadPolicy"
    # every less parallel layout the order prefers is too big (or cannot split the global batch)
    assert all(layout.memory.total <= budget for layout in ranked)
    assert tuple(ranked[0].mesh.values()) == mesh  # pp, dp_replicate, dp_shard, cp, tp
    if len(ranked) > 1:
        assert "runner-up" in format_choice(ranked[:2], device_memory=budget)


def test_nothing_fits_and_bad_options(counts):
    layouts = [layout for layout in _layouts(counts, 1.0) if layout.name != "fsdp-offload"]
    assert planner.rank_layouts(layouts) == []
    with pytest.raises(ValueError, match="are not layout kinds"):
        planner.rank_layouts(layouts, prefer="zero3")
    with pytest.raises(ValueError, match=r"Invalid AutoParallelStrategy configuration:\n  - Cannot parse memory size"):
        AutoParallelStrategy(device_memory="lots")
    with pytest.raises(ValueError, match="are not layout kinds"):
        AutoParallelStrategy(device_memory="1GB", prefer="zero3")
    assert AutoParallelStrategy(device_memory="2GB").device_memory == 2 * 10**9


def test_registered_by_name():
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_dist  # noqa: F401

    assert StrategyRegistry["auto_parallel"]["strategy"] is AutoParallelStrategy


def test_representative_ranks_and_cluster_checks():
    spec = MeshSpec(world_size=1024, devices_per_node=8, pp=4, dp_replicate=4, dp_shard=8, tp=8)
    assert representative_ranks(spec) == [0, 256, 512, 768, 1023]
    assert representative_ranks(MeshSpec(world_size=1, devices_per_node=1)) == [0]
    with pytest.raises(ValueError, match="world_size=1020 is not divisible by devices_per_node=8"):
        check_cluster(1020, 8)
    config = DryRunConfig(model="m.M", world_size=16, devices_per_node=8, ranks=(0, 15), init_args={"a": 1})
    assert DryRunConfig.from_json(config.to_json()) == config


def test_activation_estimate_per_block():
    block = planner.BlockShape(hidden=64, heads=4, mlp_hidden=256)
    one = planner.activation_bytes(block, tokens=10, blocks=1, stem=False, head=False)
    # 2 f C + 16 + 2 a C + 4 a C / t + a C / t + 2 a H / t + 4 h / t, with a = f = 2, t = 1
    assert one == 10 * (2 * 2 * 64 + 16 + 2 * 2 * 64 + 5 * 2 * 64 + 2 * 2 * 256 + 16)
    assert planner.activation_bytes(block, tokens=10, blocks=3, stem=False, head=False) == 3 * one
    # two micro-batches in flight hold twice as much; tp shrinks the sharded parts; checkpointing keeps inputs
    assert planner.activation_bytes(block, tokens=10, blocks=1, stem=False, head=False, micro_batches_held=2) == 2 * one
    assert planner.activation_bytes(block, tokens=10, blocks=1, stem=False, head=False, tp=4) < one
    ckpt = planner.activation_bytes(block, tokens=10, blocks=4, stem=False, head=False, checkpointed=True)
    assert ckpt == 10 * 4 * 2 * 64 + one
    # autocast keeps four input copies and the block's weights in the compute dtype per micro-batch
    auto = planner.activation_bytes(block, tokens=10, blocks=1, stem=False, head=False, autocast=True)
    assert auto == one + 10 * 2 * 2 * 64 + 2 * block.params
    with_head = planner.activation_bytes(
        planner.BlockShape(hidden=64, heads=4, mlp_hidden=256, vocab=100), tokens=10, blocks=1, stem=False, head=True
    )
    assert with_head == one + 10 * ((2 + 2) * 64 + 16 + 3 * 2 * 100 + 2 * 100)


def test_grouped_query_attention():
    from lightning_dist.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=16, block_size=8, n_layer=1, n_head=4, n_kv_head=2, n_embd=16)
    attn = model.blocks[0].attn
    assert attn.k.weight.shape == (8, 16) and attn.v.weight.shape == (8, 16) and attn.q.weight.shape == (16, 16)
    x = torch.randn(2, 8, 16)
    # each key/value head serves two query heads: the same as full attention with the k/v heads repeated
    full = type(attn)(dim=16, n_heads=4, causal=True)
    with torch.no_grad():
        for name in ("q", "proj"):
            getattr(full, name).load_state_dict(getattr(attn, name).state_dict())
        for name in ("k", "v"):
            src = getattr(attn, name)
            getattr(full, name).weight.copy_(src.weight.view(2, 4, 16).repeat_interleave(2, 0).reshape(16, 16))
            getattr(full, name).bias.copy_(src.bias.view(2, 4).repeat_interleave(2, 0).reshape(16))
    torch.testing.assert_close(attn(x), full(x))
    assert model(torch.randint(0, 16, (2, 8))).shape == (2, 8, 16)
    with pytest.raises(ValueError, match="n_kv_head=3 must be an integer >= 1 dividing n_head=4"):
        GPT(n_head=4, n_kv_head=3, n_embd=16)


def test_dry_run_cli_config_from_lightningcli_yaml(tmp_path):
    from lightning_dist.cli import build_parser, dry_run_config

    path = tmp_path / "cfg.yaml"
    path.write_text(
        "model:\n  class_path: lightning_dist.models.gpt.CharGPT\n  init_args:\n    n_layer: 4\n"
        "trainer:\n  precision: bf16-mixed\n  strategy:\n    class_path: lightning_dist.strategies.PipelineStrategy\n"
        "    init_args:\n      pp: 4\n      tp: 8\n"
    )
    args = build_parser().parse_args(
        [
            "dry-run",
            "--config",
            str(path),
            "--world-size",
            "1024",
            "--devices-per-node",
            "8",
            "--device-memory",
            "80GB",
            "--ranks",
            "0,1023",
        ]
    )
    config = dry_run_config(args)
    assert config.model == "lightning_dist.models.gpt.CharGPT" and config.init_args == {"n_layer": 4}
    assert config.strategy == "lightning_dist.strategies.PipelineStrategy"
    assert config.strategy_args == {"pp": 4, "tp": 8}
    assert config.precision == "bf16-mixed" and config.device_memory == 80e9 and config.ranks == (0, 1023)


def test_tp_plan_refuses_key_value_heads_that_do_not_split():
    from lightning_dist.parallelize.tp.plan import resolve_plan

    with torch.device("meta"):
        module = CharGPT(vocab_size=32, block_size=8, n_layer=1, n_head=16, n_kv_head=4, n_embd=128)
    with pytest.raises(ValueError, match="has 4 key/value heads, not divisible by tp=8"):
        resolve_plan(module, "auto", tp=8)
    assert resolve_plan(module, "auto", tp=4)


def test_auto_parallel_needs_device_memory_on_cpu(monkeypatch):
    from lightning.fabric.plugins.environments import LightningEnvironment

    monkeypatch.setenv("LOCAL_RANK", "0")
    strategy = AutoParallelStrategy()
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.cluster_environment = LightningEnvironment()
    with pytest.raises(
        ValueError, match="auto_parallel needs device_memory=... \\(e.g. '80GB'\\) on a non-CUDA device"
    ):
        strategy.setup_environment()


def test_auto_parallel_builds_every_strategy_it_picks(counts):
    # a factory: each choice is a new object of the chosen class, built from the chooser's options
    from lightning_dist.strategies import (
        FullyShardStrategy,
        HybridShardStrategy,
        PipelineStrategy,
        TensorParallelStrategy,
    )

    chooser = AutoParallelStrategy(
        device_memory="1GB", timeout=60, options={"PipelineStrategy": {"n_microbatches": 3}}, async_checkpoint=True
    )
    built = {}
    for layout in planner.rank_layouts(_layouts(counts, 1e12)):
        strategy = chooser.build(layout)
        cls, _ = strategy_for(layout)
        assert type(strategy) is cls and strategy.choice is layout and strategy is not chooser
        assert strategy._timeout.total_seconds() == 60 and strategy._async_checkpoint
        built[layout.kind] = strategy
    assert {type(s) for s in built.values()} == {
        HybridShardStrategy,
        FullyShardStrategy,
        TensorParallelStrategy,
        PipelineStrategy,
    }
    assert built["pp"].n_microbatches == 3
    assert type(chooser) is AutoParallelStrategy and chooser.choice is None  # the chooser itself is unchanged


def test_auto_parallel_hands_the_trainer_to_its_choice(counts):
    import lightning.pytorch as pl

    from lightning_dist._integrations.lightning import hand_over_strategy

    chooser = AutoParallelStrategy(device_memory="1GB")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=chooser, precision="64-true", logger=False, enable_progress_bar=False
    )
    module = CharGPT(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, bias=False)
    chooser.connect(module)
    chosen = chooser.build(planner.rank_layouts(_layouts(counts, 1e12, world=1, per_node=1))[0])
    hand_over_strategy(trainer, chooser, chosen)
    assert trainer.strategy is chosen and chosen.lightning_module is module and chosen.model is module
    for name in ("accelerator", "precision_plugin", "cluster_environment", "parallel_devices", "num_nodes", "launcher"):
        assert getattr(chosen, name) is getattr(chooser, name), name
    assert trainer.precision_plugin is chooser.precision_plugin and trainer.precision == "64-true"
    with pytest.raises(RuntimeError, match="is not this trainer's strategy"):
        hand_over_strategy(trainer, chooser, chooser.build(chosen.choice))


@pytest.mark.parametrize("strategy", ["auto_parallel", "lightning_dist.strategies.auto_parallel.AutoParallelStrategy"])
def test_the_dry_run_refuses_auto_parallel_and_names_what_to_dry_run(strategy):
    from lightning_dist.dryrun import dry_run

    config = DryRunConfig(
        model="lightning_dist.models.gpt.CharGPT", strategy=strategy, world_size=2, devices_per_node=2
    )
    with pytest.raises(ValueError, match="AutoParallelStrategy is not one .*auto_parallel picks one: dry-run that one"):
        dry_run(config)


def test_context_parallel_layouts_for_long_sequences(counts):
    # listed only for a sequence activation shape: FSDP2's states over all ranks, 1 / c of each sequence per device,
    # and the attention's all-to-alls on cp on top of fsdp's traffic
    assert not [layout for layout in _layouts(counts, None) if layout.kind == "cp"]
    act = planner.ActivationShape(batch=2, seq=64, hidden=16, bytes_per_element=8, heads=4)
    layouts = {
        x.name: x
        for x in planner.candidate_layouts(counts, world_size=4, devices_per_node=4, state=STATE, activation=act)
    }
    assert {"cp2-fsdp2", "cp4"} <= set(layouts), sorted(layouts)
    cp2, fsdp = layouts["cp2-fsdp2"], layouts["fsdp"]
    assert cp2.memory.total == fsdp.memory.total and cp2.sequence_share == 0.5
    assert cp2.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1}
    by_op = {(c.op, c.dim): c for c in cp2.traffic}
    assert {("all_gather", "dp_shard_cp"), ("reduce_scatter", "dp_shard_cp"), ("all_to_all", "cp")} == set(by_op)
    blocks = len(counts.layer_params)
    assert by_op[("all_to_all", "cp")].payload_bytes == blocks * 2 * 4 * act.batch * act.seq // 2 * act.hidden * 8
    # the heads and the load-balanced split decide which cp sizes are listed
    odd = planner.ActivationShape(batch=2, seq=12, hidden=16, heads=4)  # 12 splits into 2 x 2 chunks, not 2 x 4
    names = {
        x.name
        for x in planner.candidate_layouts(counts, world_size=4, devices_per_node=4, state=STATE, activation=odd)
        if x.kind == "cp"
    }
    assert names == {"cp2-fsdp2"}
    # heads that do not divide by cp: the ring (every rank keeps every head), with its keys and values gathered
    three = planner.ActivationShape(batch=2, seq=64, hidden=18, heads=3)
    rings = {
        x.name: x
        for x in planner.candidate_layouts(counts, world_size=4, devices_per_node=4, state=STATE, activation=three)
        if x.kind == "cp"
    }
    assert set(rings) == {"cp2-ring-fsdp2", "cp4-ring"} and {x.cp_style for x in rings.values()} == {"ring"}
    ring_ops = {(c.op, c.dim): c.payload_bytes for c in rings["cp2-ring-fsdp2"].traffic}
    kv = (
        2 * three.batch * three.seq // 2 * three.hidden * three.bytes_per_element
    )  # this rank's keys and values, whole width
    assert ring_ops[("all_gather", "cp")] == blocks * 2 * 2 * kv and ring_ops[("all_to_all", "cp")] == blocks * 2 * kv
    assert cp2.cp_style == "ulysses" and strategy_for(rings["cp4-ring"])[1]["cp_style"] == "ring"
    # auto_parallel runs it as HybridShardStrategy(cp=...), whose mesh is the layout's
    cls, kwargs = strategy_for(cp2)
    assert cls.__name__ == "HybridShardStrategy"
    assert kwargs == {"cp": 2, "cp_style": "ulysses", "dp_replicate": 1, "shard_size": 2}
    built = cls(**kwargs)
    built.parallel_devices, built.num_nodes = [torch.device("cpu")] * 4, 1
    spec = built.mesh_spec().resolve()
    assert (spec.cp, spec.dp_shard, spec.dp_replicate) == (2, 2, 1)


def test_auto_parallel_lists_cp_with_seq_len():
    def chooser(**kw):
        s = AutoParallelStrategy(device_memory=10e9, **kw)
        s.parallel_devices, s.num_nodes = [torch.device("cpu")] * 4, 1
        s.connect(CharGPT(vocab_size=32, block_size=64, n_layer=2, n_head=4, n_embd=16, bias=False))
        return s

    assert not [x for x in chooser().candidates() if x.kind == "cp"]
    ranked = chooser(seq_len=64, prefer=("cp",)).candidates()
    assert ranked[0].kind == "cp" and ranked[0].name == "cp2-fsdp2", [x.name for x in ranked]
    strategy = chooser(seq_len=64, prefer=("cp",)).build(ranked[0])
    strategy.parallel_devices, strategy.num_nodes = [torch.device("cpu")] * 4, 1
    assert type(strategy).__name__ == "HybridShardStrategy" and strategy.mesh_spec().resolve().cp == 2


@pytest.mark.parametrize("name", ["seq_len", "batch_size"])
@pytest.mark.parametrize("value", ["8k", -1, 0, 2.5, True])
def test_invalid_sizes_are_refused_naming_the_value(name, value):
    # seq_len="8k" failed later with "'<' not supported between instances of 'str' and 'int'"; seq_len=-1 was dropped
    with pytest.raises(ValueError, match=f"`{name}={value!r}` must be an integer >= 1"):
        AutoParallelStrategy(device_memory="1GB", **{name: value})
    assert AutoParallelStrategy(device_memory="1GB", seq_len=8192, batch_size=1).seq_len == 8192


def test_impossible_device_memory_is_refused_naming_the_smallest_need():
    def chooser(memory):
        s = AutoParallelStrategy(device_memory=memory)
        s.parallel_devices, s.num_nodes = [torch.device("cpu")] * 4, 1
        s.connect(CharGPT(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, bias=False))
        return s

    state = planner.state_bytes(precision="32-true")
    with torch.device("meta"):
        counts = count_params(CharGPT(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, bias=False))
    # everything in host memory still gathers one FSDP unit (a block here) on the device with its gradient
    need = max(counts.layer_params) * (state.gather + state.reduce)
    assert counts.pre_params + counts.post_params < max(counts.layer_params)
    small = chooser("1KB")
    assert small.candidates() == []  # the offload layout's "0 bytes on the device" no longer fits anything
    assert f"The smallest layout, fsdp-offload, needs {need:,} bytes per device" in small._nothing_fits()
    assert "no layout fits device_memory=1,000 bytes on 4 devices" in small._nothing_fits()
    assert chooser(need).candidates()[0].name == "fsdp-offload"
    assert chooser(need - 1).candidates() == []
