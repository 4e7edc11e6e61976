"""Fault-tolerant replica groups in the planner and the dry run (one process): the plain layout's states and traffic,
the all-reduce across the groups labelled torchft's, and the heal's bytes, planned and measured on the strategy's own
state after one fake-tensor step (hsdp 2x2 as 2 groups of 2, ZeRO-3 and ZeRO-2; groups of one rank: DDP)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from lightning_dist import _compat, inputs, planner
from lightning_dist.cli import build_parser, dry_run_config, main
from lightning_dist.parallelize.counts import count_params

GPT = "lightning_dist.models.gpt.CharGPT"
SIZES = {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 64, "block_size": 16}  # every dim 0 even: exact /2
FP32 = planner.state_bytes(precision="32-true", optimizer="adamw")

needs_torchft = pytest.mark.skipif(
    not _compat.torchft_available(), reason="torchft (the `fault-tolerance` extra) is not installed"
)


def _counts():
    return count_params(inputs.build_meta_model(GPT, SIZES))


def _plan(counts, world_size: int, groups: int):
    plain = planner.candidate_layouts(counts, world_size=world_size, devices_per_node=2, state=FP32)
    return plain, planner.fault_tolerant_layouts(plain, replica_groups=groups, counts=counts, state=FP32)


# ---- the planner ------------------------------------------------------------------------------------------
def test_fault_tolerant_layouts_are_the_plain_ones_with_dp_replicate_groups_plus_the_heal():
    counts = _counts()
    P, tensors = counts.total, len(counts.shapes)
    plain, ft = _plan(counts, 8, 2)
    by_name = {lay.name: lay for lay in plain}
    # dp_replicate = 2 groups: hsdp of shard 4 (tp2 x ddp4 and pp2 x ddp4 replicate over 4; pp4 needs 4 blocks)
    assert [lay.name for lay in ft] == ["hsdp-4"]
    (hsdp,) = ft
    base = by_name["hsdp-4"]
    assert hsdp.memory == base.memory and hsdp.replica_groups == 2 and base.replica_groups == 1
    assert [(c.op, c.dim, c.group_size, c.payload_bytes) for c in hsdp.traffic] == [
        (c.op, c.dim, c.group_size, c.payload_bytes) for c in base.traffic
    ]
    assert hsdp.wire_bytes == base.wire_bytes  # the heal is once per heal, not in the step's traffic
    across = [c for c in hsdp.traffic if planner.ACROSS_GROUPS in c.what]
    assert [(c.op, c.dim) for c in across] == [("all_reduce", "dp_replicate")]
    # heal: this rank's quarter of the params (4 B) and of both Adam moments (8 B), and one float32 step per tensor
    assert hsdp.heal.payload_bytes == P / 4 * (4 + 8) + 4 * tensors
    assert (hsdp.heal.op, hsdp.heal.dim, hsdp.heal.group_size) == ("send", "dp_replicate", 2)
    assert hsdp.to_dict()["heal"]["payload_bytes"] == hsdp.heal.payload_bytes and base.to_dict()["heal"] is None
    # groups of one rank: ddp; its all-reduce on dp is the one across the groups
    _, ft = _plan(counts, 2, 2)
    assert [lay.name for lay in ft] == ["ddp"]
    ddp = ft[0]
    assert ddp.heal.payload_bytes == P * (4 + 8) + 4 * tensors
    assert [(c.dim, planner.ACROSS_GROUPS in c.what) for c in ddp.traffic] == [("dp", True)]


def test_heal_transfer_formula_and_refusals():
    heal = planner.heal_transfer(1200, state=FP32, zero_stage=2, shard_size=4, replica_groups=3, tensors=5)
    assert heal.payload_bytes == 300 * 12 + 5 * 4 == heal.wire_bytes  # ZeRO-2 rests sharded as ZeRO-3 under FSDP2
    assert planner.heal_transfer(1200, state=FP32, zero_stage=3, shard_size=4, replica_groups=3, tensors=5) == heal
    with pytest.raises(ValueError, match="zero_stage=1 is not supported by fault_tolerance"):
        planner.heal_transfer(1200, state=FP32, zero_stage=1, shard_size=4, replica_groups=2)
    with pytest.raises(ValueError, match="`replica_groups=1`: .* at least 2 groups"):
        _plan(1200, 4, 1)


def test_diloco_replaces_the_per_step_all_reduce_across_the_groups_by_one_per_sync_averaged_per_step():
    """sync="diloco": the pseudo-gradients of this rank's parameter shards, in the parameters' dtype, once every H steps
    (per step: / H), on the same dim; everything else (inside a group, memory, the heal) as under sync="step"."""
    counts = _counts()
    P = counts.total
    plain = planner.candidate_layouts(counts, world_size=8, devices_per_node=2, state=FP32)
    (step,) = planner.fault_tolerant_layouts(plain, replica_groups=2, counts=counts, state=FP32)
    (diloco,) = planner.fault_tolerant_layouts(
        plain, replica_groups=2, counts=counts, state=FP32, sync="diloco", inner_steps=4
    )
    assert diloco.name == step.name == "hsdp-4" and diloco.memory == step.memory and diloco.heal == step.heal
    assert "DiLoCo every 4 steps" in diloco.note
    across = [c for c in diloco.traffic if planner.DILOCO_SYNC in c.what]
    assert [(c.op, c.dim, c.group_size) for c in across] == [("all_reduce", "dp_replicate", 2)]
    (sync,) = across
    assert sync.payload_bytes == P / 4 * 4 / 4  # this rank's quarter, fp32, every 4th step
    assert f"{P / 4 * 4:,.0f} B per sync every 4 steps" in sync.what and planner.ACROSS_GROUPS in sync.what
    (per_step,) = [c for c in step.traffic if planner.ACROSS_GROUPS in c.what]
    assert sync.payload_bytes == per_step.payload_bytes / 4  # fp32 gradients every step, fp32 weights every 4th
    inside = lambda lay: [c for c in lay.traffic if planner.ACROSS_GROUPS not in c.what]  # noqa: E731
    assert inside(diloco) == inside(step) and inside(step)  # dp_shard's gathers and reduce-scatters
    # groups of one rank: DDP's all-reduce on dp is the one across the groups; DiLoCo sends every parameter
    plain = planner.candidate_layouts(counts, world_size=2, devices_per_node=2, state=FP32)
    (ddp,) = planner.fault_tolerant_layouts(plain, replica_groups=2, counts=counts, state=FP32, sync="diloco",
                                            inner_steps=100)  # fmt: skip
    assert [(c.dim, c.payload_bytes) for c in ddp.traffic] == [("dp", P * 4 / 100)]
    # the row on its own (as CommunicationLedger plans it: the strategy's dim for torchft's process group)
    row = planner.diloco_sync_traffic(1205, param_bytes=8, inner_steps=2, replica_groups=2, dim="replica_group")
    assert (row.op, row.dim, row.payload_bytes, row.wire_bytes) == ("all_reduce", "replica_group", 4820, 4820)
    sharded = planner.diloco_sync_traffic(1200, param_bytes=2, inner_steps=3, replica_groups=4, shard_size=4)
    assert sharded.payload_bytes == 1200 / 4 * 2 / 3 and sharded.dim == "dp_replicate"
    with pytest.raises(ValueError, match="`inner_steps=0` must be an integer >= 1"):
        planner.diloco_sync_traffic(1200, param_bytes=2, inner_steps=0, replica_groups=2)
    with pytest.raises(ValueError, match="`sync='local'` must be 'step'"):
        planner.fault_tolerant_layouts(plain, replica_groups=2, counts=counts, state=FP32, sync="local")
    with pytest.raises(ValueError, match="`inner_steps=None` must be an integer >= 1"):
        planner.fault_tolerant_layouts(plain, replica_groups=2, counts=counts, state=FP32, sync="diloco")
    with pytest.raises(ValueError, match="`inner_steps=4` applies to sync='diloco' only"):
        planner.fault_tolerant_layouts(plain, replica_groups=2, counts=counts, state=FP32, inner_steps=4)


def test_cli_plan_replica_groups_prints_the_heal_column(capsys):
    argv = ["plan", "--model", GPT, "--init-args", json.dumps(SIZES), "--world-size", "4", "--devices-per-node", "2"]
    assert main([*argv, "--precision", "32-true", "--replica-groups", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    counts = _counts()
    assert data["replica_groups"] == 2
    rows = {lay["name"]: lay for lay in data["layouts"]}
    assert set(rows) == {"hsdp-2", "tp2-ddp2", "pp2-ddp2"} and data["recommended"] == "hsdp-2"
    assert data["sync"] == "step" and data["sync_every"] is None
    assert rows["hsdp-2"]["heal"]["payload_bytes"] == counts.total / 2 * 12 + 4 * len(counts.shapes)
    assert main([*argv, "--replica-groups", "2"]) == 0
    out = capsys.readouterr().out
    assert "heal" in out and "fault-tolerant replica groups" in out and "hsdp-2 *" in out
    # docs/planner.md's command: 8e9 parameters as 8 groups of 8 ranks
    big = ["plan", "--params", "8e9", "--world-size", "64", "--devices-per-node", "8", "--device-memory", "80GB"]
    assert main([*big, "--replica-groups", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {lay["name"]: lay for lay in data["layouts"]}
    assert set(rows) == {"hsdp-8", "tp8-ddp8", "pp8-ddp8"} and data["recommended"] == "hsdp-8"
    assert rows["hsdp-8"]["memory"]["total"] == 16e9 and rows["hsdp-8"]["heal"]["payload_bytes"] == 12e9
    assert rows["pp8-ddp8"]["heal"]["payload_bytes"] == 12e9  # a stage of 1e9 parameters, whole (ddp)
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--replica-groups", "3"])
    assert exc.value.code == 2 and "--replica-groups 3 does not divide --world-size 4" in capsys.readouterr().err


def _across(row: dict) -> list[dict]:
    """The JSON traffic rows of a layout that cross the replica groups."""
    return [c for c in row["traffic"] if planner.ACROSS_GROUPS in c["what"]]


def test_cli_plan_sync_diloco_reports_the_pseudo_gradient_all_reduce_per_step(capsys):
    """--sync diloco --sync-every 4: the all-reduce across the groups is DiLoCo's, 1/4 of a sync per step, in the
    JSON (sync, sync_every, the row) and the table's caption; no pipeline (PipelineStrategy refuses DiLoCo)."""
    argv = ["plan", "--model", GPT, "--init-args", json.dumps(SIZES), "--world-size", "4", "--devices-per-node", "2"]
    ft = ["--precision", "32-true", "--replica-groups", "2", "--sync", "diloco", "--sync-every", "4"]
    assert main([*argv, *ft, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    counts = _counts()
    assert (data["replica_groups"], data["sync"], data["sync_every"]) == (2, "diloco", 4)
    rows = {lay["name"]: lay for lay in data["layouts"]}
    assert set(rows) == {"hsdp-2", "tp2-ddp2"}  # pp2-ddp2: under --sync step only
    (hsdp,) = _across(rows["hsdp-2"])
    want = planner.diloco_sync_traffic(counts.total, param_bytes=4, inner_steps=4, replica_groups=2, shard_size=2)
    assert (hsdp["op"], hsdp["dim"], hsdp["payload_bytes"]) == ("all_reduce", "dp_replicate", want.payload_bytes)
    assert hsdp["payload_bytes"] == counts.total / 2 * 4 / 4 and planner.DILOCO_SYNC in hsdp["what"]
    assert "every 4 steps" in rows["hsdp-2"]["note"]
    # tensor parallel x replicated dp: this rank's tp shard of every parameter, whole, on dp
    (tp,) = _across(rows["tp2-ddp2"])
    local = planner.tp_local_params(
        tp_sharded_params=counts.tp_sharded_params, replicated_params=counts.total - counts.tp_sharded_params, tp=2
    )
    want = planner.diloco_sync_traffic(local, param_bytes=4, inner_steps=4, replica_groups=2, dim="dp")
    assert (tp["dim"], tp["payload_bytes"]) == ("dp", want.payload_bytes)
    # the table says so
    assert main([*argv, *ft]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the caption wraps at 140 columns
    assert "DiLoCo's all-reduce of this rank's pseudo-gradients once every 4 steps" in out
    assert "traffic counts its mean per step, 1/4 of a sync" in out and "hsdp-2 *" in out
    # docs/planner.md's command: 8e9 parameters as 8 groups of 8 ranks, DiLoCo every 100 steps
    big = ["plan", "--params", "8e9", "--world-size", "64", "--devices-per-node", "8", "--device-memory", "80GB"]
    assert main([*big, "--replica-groups", "8", "--sync", "diloco", "--sync-every", "100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {lay["name"]: lay for lay in data["layouts"]}
    assert set(rows) == {"hsdp-8", "tp8-ddp8"} and data["recommended"] == "hsdp-8"
    b_p = data["state_bytes"]["param"]
    (hsdp,) = _across(rows["hsdp-8"])
    want = planner.diloco_sync_traffic(8e9, param_bytes=b_p, inner_steps=100, replica_groups=8, shard_size=8)
    assert hsdp["payload_bytes"] == want.payload_bytes == 4e7  # 1e9 parameters of 4 B, once every 100 steps


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--replica-groups", "2", "--sync", "diloco"], "--sync diloco needs --sync-every H"),
        (["--replica-groups", "2", "--sync-every", "4"], "--sync-every 4 is DiLoCo's inner steps: add --sync diloco"),
        (["--replica-groups", "2", "--sync", "step", "--sync-every", "4"], "--sync-every 4 is DiLoCo's inner steps"),
        (["--replica-groups", "2", "--sync", "diloco", "--sync-every", "0"], "--sync-every 0: DiLoCo syncs once"),
        (["--sync", "diloco", "--sync-every", "4"], "--sync diloco --sync-every 4 plans how fault-tolerant replica"),
        (["--sync", "step"], "--sync step plans how fault-tolerant replica groups sync: add --replica-groups N"),
        (["--sync-every", "4"], "--sync-every 4 plans how fault-tolerant replica groups sync: add --replica-groups"),
    ],
)
def test_cli_plan_refuses_sync_options_that_do_not_go_together(capsys, extra, message):
    argv = ["plan", "--params", "1e6", "--world-size", "4", "--devices-per-node", "2"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, *extra])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"lightning-dist plan: error: {message}" in err, err


def test_pipeline_layouts_are_kept_with_their_stages_heal_and_all_reduce_across_the_groups():
    """A pp x dp layout with dp_replicate = groups: each group a whole pipeline; rank r of a group all-reduces (and
    heals) its stage's parameters with rank r of the others: the plain layout's per-device parameters."""
    counts = _counts()
    plain, ft = _plan(counts, 4, 2)
    base = {lay.name: lay for lay in plain}["pp2-ddp2"]
    pp = {lay.name: lay for lay in ft}["pp2-ddp2"]
    stage = base.memory.params / FP32.param  # the largest stage, as the plain layout sizes it
    assert stage == max(counts.stage_params(2)) < counts.total
    assert pp.memory == base.memory and pp.replica_groups == 2 and pp.idle_fraction == base.idle_fraction
    # heal: the stage's params and Adam moments (the plain layout's), plus a float32 step per parameter tensor
    assert pp.heal.payload_bytes == base.memory.params + base.memory.optimizer + 4 * len(counts.shapes)
    assert pp.heal.payload_bytes < counts.total * (4 + 8)  # not the whole model's
    # the per-step gradient all-reduce across the groups: the stage's bytes, labelled torchft's
    (plain_ar,) = base.traffic
    (across,) = [c for c in pp.traffic if planner.ACROSS_GROUPS in c.what]
    assert (across.op, across.dim, across.group_size) == ("all_reduce", "dp", 2)
    assert across.payload_bytes == plain_ar.payload_bytes == stage * FP32.reduce
    assert across.what == f"{plain_ar.what}, {planner.ACROSS_GROUPS}"
    # with activations: the pipeline's point-to-point transfers stay the plain layout's
    shape = planner.ActivationShape(batch=2, seq=16, hidden=64, bytes_per_element=4, blocks=2)
    plain = planner.candidate_layouts(counts, world_size=4, devices_per_node=2, state=FP32, activation=shape)
    base = {lay.name: lay for lay in plain}["pp2-ddp2"]
    step = planner.fault_tolerant_layouts(plain, replica_groups=2, counts=counts, state=FP32)
    (pp,) = [lay for lay in step if lay.name == "pp2-ddp2"]
    p2p = [c for c in base.traffic if c.dim == "pp"]
    assert p2p and [c for c in pp.traffic if c.dim == "pp"] == p2p and pp.wire_bytes == base.wire_bytes
    # sync="diloco": no pipeline (PipelineStrategy refuses fault_tolerance with DiLoCo for now)
    kept = planner.fault_tolerant_layouts(
        plain, replica_groups=2, counts=counts, state=FP32, sync="diloco", inner_steps=4
    )
    assert kept and all(lay.mesh["pp"] == 1 for lay in kept)


@needs_torchft
def test_cli_dry_run_refuses_a_bad_fault_tolerance_with_the_strategys_message_before_any_rank_starts(capsys):
    bad = {"dp_replicate": 2, "dp_shard": 2, "fault_tolerance": {"replica_group": 2}}
    argv = [
        "dry-run",
        "--model",
        GPT,
        "--strategy-args",
        json.dumps(bad),
        "--world-size",
        "4",
        "--devices-per-node",
        "2",
    ]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "replica_group=2)` is outside dp_replicate=2" in capsys.readouterr().err


# ---- the dry run ------------------------------------------------------------------------------------------
def _yaml_config(tmp_path, strategy_args: dict, world_size: int):
    """A DryRunConfig as `lightning-dist dry-run --config` reads it from a LightningCLI YAML."""
    import yaml

    path = tmp_path / "ft.yaml"
    spec = {"class_path": "lightning_dist.strategies.HybridShardStrategy", "init_args": strategy_args}
    path.write_text(
        yaml.safe_dump(
            {"model": {"class_path": GPT, "init_args": SIZES}, "trainer": {"strategy": spec, "precision": "32-true"}}
        )
    )
    argv = ["dry-run", "--config", str(path), "--world-size", str(world_size), "--devices-per-node", "2"]
    return dry_run_config(build_parser().parse_args([*argv, "--batch-size", "2"]))


@needs_torchft
def test_dry_run_of_replica_groups_measures_the_planned_heal_and_the_plain_layouts_states_and_traffic(
    fake_world, tmp_path
):
    from lightning_dist.dryrun import simulate_rank
    from lightning_dist.dryrun_report import DryRunReport

    ft = {"replica_group": 0}
    hsdp = {"dp_replicate": 2, "dp_shard": 2}
    # hsdp 2x2 as 2 replica groups of 2 (from a YAML, so no lighthouse: the plain layout is simulated), last rank
    config = _yaml_config(tmp_path, {**hsdp, "fault_tolerance": ft}, 4)
    assert config.strategy_args["fault_tolerance"] == ft
    rank = simulate_rank(config, 3)
    plain = simulate_rank(_yaml_config(tmp_path, hsdp, 4), 3)
    assert not dist.is_initialized()
    _, (layout, *_) = _plan(_counts(), 4, 2)
    assert layout.name == "hsdp-2"
    assert rank["replica_groups"] == 2 and plain["replica_groups"] is None and plain["heal_bytes"] is None
    assert rank["heal_bytes"] == rank["planned"]["heal_bytes"] == layout.heal.payload_bytes  # ratio 1.000
    # states and collectives as the plain layout's (the all-reduce across the groups: its dp_replicate row)
    assert rank["states"] == plain["states"] and rank["collectives"] == plain["collectives"]
    assert rank["planned"]["collectives"] == plain["planned"]["collectives"]
    assert rank["planned"]["states"] == plain["planned"]["states"]
    text = DryRunReport(config=config, ranks=[rank]).format()
    assert "fault_tolerance: a heal sends" in text and "1.000)" in text and "across the 2 replica groups" in text
    # ZeRO-2 rests sharded as ZeRO-3 (FSDP2): the same heal
    zero2 = simulate_rank(_yaml_config(tmp_path, {**hsdp, "zero_stage": 2, "fault_tolerance": ft}, 4), 3)
    assert zero2["heal_bytes"] == zero2["planned"]["heal_bytes"] == rank["heal_bytes"]
    # groups of one rank: the average across the groups is the whole data parallelism (DDP's all-reduce)
    ddp = simulate_rank(_yaml_config(tmp_path, {"dp_replicate": 2, "dp_shard": 1, "fault_tolerance": ft}, 2), 1)
    _, (row, *_) = _plan(_counts(), 2, 2)
    assert row.name == "ddp" and ddp["heal_bytes"] == ddp["planned"]["heal_bytes"] == row.heal.payload_bytes
