"""HybridShardStrategy on 4 CPU processes: parity with single-device training, checkpoints, bad input."""

import json
import sys
import time

import pytest
import torch
from _harness import SCENARIOS, results, run_script, run_torchrun

pytestmark = pytest.mark.distributed


@pytest.mark.compat
def test_parity_every_mesh_and_stage_float64_and_float32_vs_ddp_and_without_seed():
    proc = run_torchrun("hsdp_parity.py", nproc=4, timeout=600)
    rows = results(proc)
    parity = [r for r in rows if r["kind"] == "parity64"]
    assert len(parity) == 4 * 9, proc.stdout[-3000:]
    seen = set()
    for r in parity:
        rep, shard = r["mesh"]
        seen.add((rep, shard, r["stage"]))
        assert r["diff"] <= 1e-12, r
        # the mesh that ran is the one asked for, and data parallelism spans all 4 ranks
        assert r["shape"] == [1, rep, shard, 1, 1], r
        assert r["sampler"] == {"num_replicas": 4, "rank": r["rank"]}, r
        assert r["seen"] == 3 * 16 // 4, r  # 3 steps of a 16-sample global batch, 4 per rank
    assert seen == {(rep, shard, s) for rep, shard in [(4, 1), (2, 2), (1, 4)] for s in (1, 2, 3)}
    noseed = [r for r in rows if r["kind"] == "noseed"]
    assert len(noseed) == 4 * 2, noseed
    for r in noseed:
        # every rank trained rank 0's initial model, whatever it built itself
        assert r["diff"] <= 1e-12, r
        assert r["rank"] == 0 or r["own_seed_diff"] > 1e-3, r
    injected = [r for r in rows if r["kind"] == "injection"]
    assert len(injected) == 4 and all(
        r["sampler"] == "DistributedSampler" and r["replicas"] == 4 and r["batches"] == 6 for r in injected
    ), injected
    f32 = [r for r in rows if r["kind"] == "parity32"]
    assert len(f32) == 4
    for r in f32:
        # float32 rounding differs with the reduction order; the bar is Lightning's own DDPStrategy on the
        # same work, with a factor 2 for a different (equally valid) summation order
        assert 0 < r["ddp"] < 1e-4 and r["hsdp"] <= 2 * r["ddp"], r


@pytest.mark.compat
def test_checkpoint_resume_reshard_and_single_device(tmp_path):
    from lightning.pytorch import Trainer

    from lightning_dist.checkpoint import consolidate

    sys.path.insert(0, str(SCENARIOS))
    from _common import Classifier, full_params, max_rel_diff

    rows = results(run_script("hsdp_checkpoint.py", "save", str(tmp_path), timeout=600))
    saved = [r for r in rows if r["kind"] == "resume"]
    assert len(saved) == 4
    background = [r for r in rows if r["kind"] == "async"]
    assert len(background) == 4
    for r in background:  # async_checkpoint=True: same checkpoints, written in the background
        assert r["checkpointing_changes_nothing"] and r["bitwise"] and r["global_step"] == 6, r
        assert r["files"] == ["g3.ckpt", "g6.ckpt"] and r["staged"] > 0, r  # the step-6 save was waited for
        # the staged copy: this rank's shards of parameters and AdamW state, as MemoryReport shows it
        assert r["reported"] == r["staged"], r
        # and the planner's figure for it (parameter + optimizer shards), step counters aside
        assert abs(r["planned_staging"] - r["staged"]) <= 0.01 * r["staged"], r
        assert abs(r["staged"] - r["params_optimizer"]) <= 0.01 * r["params_optimizer"], r  # step counters aside
    for r in saved:
        assert r["bitwise"] and r["diff"] == 0.0, r  # resume continues exactly (float64, same mesh)
        assert r["checkpointing_changes_nothing"] == 0.0, r
        assert r["global_step"] == 6 and abs(r["lr"] - 0.01 * 0.5**3) < 1e-15, r  # LR scheduler restored
        assert "meta.pt" in r["files"] and ".metadata" in r["files"], r

    resharded = results(run_script("hsdp_checkpoint.py", "reshard", str(tmp_path), timeout=600))
    loads = [r for r in resharded if r["kind"] == "load"]
    assert {r["source"] for r in loads} == {"b3.ckpt", "f3.ckpt", "g3.ckpt"} and len(loads) == 6
    for r in loads:
        assert r["equal"] and r["shape"] == [1, 1, 2, 1, 1] and r["global_step"] == 3, r
    for r in (r for r in resharded if r["kind"] == "reshard_resume"):
        assert r["diff"] <= 1e-12 and r["global_step"] == 6, r

    # 2x2 sharded directory -> one file -> a plain single-device Lightning run
    single = consolidate(tmp_path / "b3.ckpt", tmp_path / "single.ckpt")
    full = torch.load(tmp_path / "f3.ckpt", weights_only=True)
    mine = torch.load(single, weights_only=True)
    assert mine["state_dict"].keys() == full["state_dict"].keys()
    diffs = {
        k: (mine["state_dict"][k].dtype, (mine["state_dict"][k] - full["state_dict"][k]).abs().max().item())
        for k in full["state_dict"]
    }
    assert all(d == (torch.float64, 0.0) for d in diffs.values()), diffs
    assert mine["global_step"] == 3 and len(mine["optimizer_states"]) == 1
    torch.set_default_dtype(torch.float64)  # the checkpoint is float64: build the module in float64 to compare
    try:
        loaded = Classifier.load_from_checkpoint(single, weights_only=True, n=48, schedule=True)
    finally:
        torch.set_default_dtype(torch.float32)
    assert all(torch.equal(p, full["state_dict"][n]) for n, p in loaded.named_parameters())

    # Lightning's single-device strategy loads weights before converting the module to float64, so the
    # module is built in float64 here, or the weights would round-trip through float32 (4e-8 off)
    torch.set_default_dtype(torch.float64)
    try:
        module = Classifier(n=48, schedule=True)
    finally:
        torch.set_default_dtype(torch.float32)
    Trainer(
        accelerator="cpu",
        devices=1,
        precision="64-true",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module, ckpt_path=single)
    a6 = torch.load(tmp_path / "a6.pt", weights_only=True)
    assert max_rel_diff(full_params(module), a6) <= 1e-12


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("hsdp", {"dp_replicate": 3}, "dp_replicate=3"),
        ("hsdp", {"tp": 3}, "pp x tp = 1 x 3 = 3 does not divide world_size=4"),
    ],
)
def test_bad_mesh_fails_on_every_rank_without_hang(name, kwargs, message):
    start = time.monotonic()
    # torchrun: every rank runs to its own end (Lightning's launcher would end its children once rank 0 fails)
    proc = run_torchrun("bad_config.py", "4", name, json.dumps(kwargs), nproc=4, expect_ok=False, timeout=240)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    # every one of the 4 ranks raised the same ValueError itself (nobody waited in a collective)
    assert proc.stderr.count("ValueError: Invalid device mesh") >= 4, proc.stderr[-3000:]
    assert message in proc.stderr
    assert elapsed < 200


def test_features_meta_init_ac_units_parallelize_fn_bf16_and_dp_logging():
    rows = results(run_torchrun("hsdp_features.py", nproc=4, timeout=600))
    by_kind = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r)
    assert len(by_kind["option"]) == 4 * 5
    for r in by_kind["option"]:
        assert r["diff"] <= 1e-12, r  # every AC mode / class-named units change nothing numerically
        assert r["logged"] == 16.0, r  # a sum over dp counts each sample once
    # meta-device init without a common seed: the replicas (ranks 0/2, 1/3) materialized the same model
    assert len({tuple(r["digest"]) for r in by_kind["meta"]}) == 1, by_kind["meta"]
    for r in by_kind["meta"]:
        assert r["mesh"] == [["pp", "dp_replicate", "dp_shard", "cp", "tp"], [1, 2, 2, 1, 1]], r
        assert r["is_dtensor"] and r["placements"] == ["R", "S(0)"] and r["local_rows"] == 8 and r["finite"], r
    for r in by_kind["parallelize_fn"]:
        assert r["calls"] == [[1, 1, 4, 1, 1]] and r["diff"] <= 1e-12, r
    for r in by_kind["bf16"]:
        assert r["compute"] == ["torch.bfloat16"] and r["params"] == ["torch.float32"], r
        assert 0 < r["loss"] < 10, r
    for r in by_kind["bf16_true"]:
        assert r["params"] == ["torch.bfloat16"] and 0 < r["loss"] < 10, r
    for r in by_kind["validate_after_fit"]:
        assert abs(r["val"] - r["expected"]) <= 1e-12 * abs(r["expected"]), r
        assert r["resharded"], r


def test_two_nodes_shard_inside_replicate_across():
    from _harness import run_torchrun_nodes

    rows = [
        r for proc in run_torchrun_nodes("multinode_hsdp.py", nnodes=2, nproc=2, timeout=600) for r in results(proc)
    ]
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3]
    for r in rows:
        assert r["shape"] == [1, 2, 2, 1, 1], r  # dp_replicate = nodes, dp_shard = devices per node
        assert r["node"] == r["rank"] // 2, r
        assert all(g // 2 == r["node"] for g in r["shard_group"]), r  # gathers stay inside the node
        assert sorted(g // 2 for g in r["replicate_group"]) == [0, 1], r  # only the replicate dim crosses
        assert r["diff"] <= 1e-12, r
        crossing = {k for k, v in r["traffic"].items() if v["cross_node"] and v["bytes"] > 0}
        # the ledger sees cross-node traffic on the replicate dim only; gathers/reduce-scatters stay in the node
        assert crossing and all(k.endswith("@dp_replicate") for k in crossing), r["traffic"]
        assert any(k.endswith("@dp_shard") and v["bytes"] > 0 for k, v in r["traffic"].items()), r["traffic"]
