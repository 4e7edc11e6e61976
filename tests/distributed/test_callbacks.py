"""The callbacks on 3 and 4 CPU processes (scenario: tests/scenarios/callbacks_ddp.py): Lightning's DDP,
and the pack's ``hsdp`` (2 x 2), ``tp`` (dp 2 x tp 2) and ``pipeline`` (pp 2 x dp 2) strategies.

One launch per world size runs every part; the tests below assert on the figures each rank printed.
"""

from __future__ import annotations

import pytest
from _harness import results, run_script

pytestmark = pytest.mark.distributed

SCENARIO = "callbacks_ddp.py"


def _by_part(proc, world: int) -> dict[str, list[dict]]:
    parts: dict[str, list[dict]] = {}
    for r in results(proc):
        parts.setdefault(r["part"], []).append(r[r["part"]])
    for name, ranks in parts.items():
        assert len(ranks) == world, f"part {name}: {len(ranks)} of {world} ranks reported"
    return parts


@pytest.fixture(scope="module")
def ddp4() -> dict[str, list[dict]]:
    proc = run_script(
        SCENARIO,
        "--devices",
        "4",
        "--parts",
        "exact,dropin,dropin_mesh,syncflag,syncbn,parity,parity_tied_gpt,sampler,hsdp,tp,pipeline",
        timeout=900,
    )
    return _by_part(proc, 4)


@pytest.fixture(scope="module")
def ddp3() -> dict[str, list[dict]]:
    proc = run_script(SCENARIO, "--devices", "3", "--parts", "exact,dropin,syncbn", timeout=600)
    return _by_part(proc, 3)


def _check_exact(ranks: list[dict], world: int) -> None:
    for out in ranks:
        for variant, r in out.items():  # drop_last False / True
            ref = r["ref"]
            # the control: without masking, the padded rows are scored (31 -> 32 on 4 ranks, 33 on 3)
            assert r["naive_rows"] == -(-31 // world) * world, variant
            assert r["last_count"] == 31, variant
            for where in ("fit_val", "val", "test"):
                got = r[where]
                assert got["samples"] == 31.0, (variant, where)
                assert got["acc"] == ref["acc_metric"], (variant, where)  # the same metric on one device, exactly
                assert abs(got["acc"] - ref["acc"]) < 1e-7, (variant, where)  # torchmetrics computes in float32
                assert abs(got["loss"] - ref["loss"]) <= 1e-12 * abs(ref["loss"]), (variant, where, got, ref)


@pytest.mark.compat
def test_exact_evaluation_4_ranks(ddp4):
    _check_exact(ddp4["exact"], 4)


def test_exact_evaluation_3_ranks(ddp3):
    _check_exact(ddp3["exact"], 3)


def _ulps(a: float, b: float) -> int:
    """Distance in units of the last place between two float64 values."""
    import struct

    return abs(struct.unpack("<q", struct.pack("<d", a))[0] - struct.unpack("<q", struct.pack("<d", b))[0])


def _check_dropin(out: dict, runs: tuple[str, ...]) -> None:
    """An unchanged project with ExactEvaluation() alone: counts equal the datasets, the accuracy equals one
    device bit for bit, the mean loss (MeanMetric, and self.log(sync_dist=True) weighted by the real batch
    sizes) within 1 ulp (2 for Lightning's logged mean, which divides both synced sums by the world size)."""
    ref = out["ref"]
    for run in runs:
        for k, got in out[run].items():
            r = ref[int(k)]
            n = int(r["rows"])
            assert got["ids"] == list(range(n)), (run, k)  # every sample once, over the data-parallel ranks
            assert got["rows"] == r["rows"], (run, k, got["rows"])  # SumMetric of len(y)
            assert got["acc"] == r["acc"], (run, k, got, r)
            assert _ulps(got["loss_mean"], r["loss_mean"]) <= 1, (run, k, got, r)
            assert _ulps(got["logged_loss"], r["logged_loss"]) <= 2, (run, k, got, r)


def _check_dropin_ddp(ranks: list[dict], world: int) -> None:
    for out in ranks:
        _check_dropin(out, ("fit", "validate", "test_dict"))
        assert out["predict_ids"] == list(range(31))
        limited = out["limit2"]["0"]  # 2 batches of 3 per rank: each sample at most once, counted right
        assert limited["ids"] == sorted(set(limited["ids"])) and limited["rows"] == len(limited["ids"]) == 6 * world
    # batches of 1 on 10 samples: the ranks with fewer samples skip their empty last step (sizes: steps run)
    sizes = [out["validate"]["2"]["sizes"] for out in ranks]
    assert sum(sum(s) for s in sizes) == 10 and min(len(s) for s in sizes) < max(len(s) for s in sizes)


def test_exact_evaluation_drop_in_4_ranks(ddp4):
    _check_dropin_ddp(ddp4["dropin"], 4)


def test_exact_evaluation_drop_in_3_ranks(ddp3):
    _check_dropin_ddp(ddp3["dropin"], 3)


def test_exact_evaluation_drop_in_under_hsdp_tp_and_pipeline(ddp4):
    for out in ddp4["dropin_mesh"]:
        for name in ("hsdp", "tp"):
            _check_dropin(out[name], ("validate",))
        # pp 2 x dp 2: pipelines given batches of different sizes would run different micro-batch counts
        assert "different numbers of micro-batches" in out["pipeline"]["refused"]
        assert "mode='mask', full_batches=True" in out["pipeline"]["refused"]
        # hsdp, 4 dp ranks, batches of 1 on 10 samples: an empty step would leave FSDP peers in a collective
        assert "batch_size >= 2" in out["hsdp"]["refused"] and "mode='mask'" in out["hsdp"]["refused"]
        assert out["tp"]["refused"] is None  # tp 2 x dp 2: 10 samples divide, no empty batch


def test_sync_batchnorm_flag_and_unsynced_warning_under_hsdp(ddp4):
    """Trainer(sync_batchnorm=True) under hsdp (2 x 2) converts BatchNorm to the pack's data-parallel layer:
    running statistics equal on every rank and equal to one device on the global batch, like
    MeshSyncBatchNorm; without either, rank 0 warns once, naming the callback."""
    for rank, out in enumerate(ddp4["syncflag"]):
        for case in ("sync_batchnorm_flag", "mesh_sync_callback"):
            r = out[case]
            assert r["layer"] == "DataParallelBatchNorm" and r["equal_across_ranks"], (case, r)
            assert r["rel_vs_one_device"] <= 1e-12, (case, r)
            assert not r["warned"], (case, r)
        unsynced = out["unsynced"]
        assert not unsynced["equal_across_ranks"] and unsynced["rel_vs_one_device"] > 1e-3  # the control
        assert len(unsynced["warned"]) == (1 if rank == 0 else 0), unsynced["warned"]
        if rank == 0:
            assert "MeshSyncBatchNorm()" in unsynced["warned"][0] and "'net.1'" in unsynced["warned"][0]


def _check_syncbn(ranks: list[dict]) -> None:
    for out in ranks:
        for case, r in out.items():
            assert r["input_grad_rel"] <= 1e-12, (case, r)
            assert r["param_grad_rel"] <= 1e-12, (case, r)
            # per-shard statistics (the control) give a visibly different gradient
            assert r["control_input_grad_rel"] > 1e-2, (case, r)
            assert r["control_param_grad_rel"] > 1e-3, (case, r)
            assert r["running_stats_equal_in_group"], case
            assert r["running_stats_vs_full_rel"] <= 1e-12, (case, r)


@pytest.mark.compat
def test_sync_batchnorm_4_ranks(ddp4):
    cases = ddp4["syncbn"][0]
    assert any("[3, 5, 2, 6]" in c and "None" in c for c in cases)  # unequal per-rank batches
    assert any("group_size=2" in c for c in cases)  # groups of 2 ranks
    _check_syncbn(ddp4["syncbn"])


def test_sync_batchnorm_3_ranks(ddp3):
    _check_syncbn(ddp3["syncbn"])


@pytest.mark.compat
def test_gradient_parity_check(ddp4):
    for out in ddp4["parity"]:
        assert set(out) >= {
            "correct_syncbn",
            "correct_manual_accumulation",
            "bug_per_shard_batchnorm",
            "bug_undivided_accumulation",
            "bug_padded_duplicates",
            "bug_param_changed_on_one_rank",
            "bug_unsharded_data",
        }
        for case, r in out.items():
            assert r["ok"] == r["expect_ok"], (case, r)
            if r["expect_ok"]:
                assert r["rel_diff"] <= 1e-12, (case, r)
            else:
                assert r["rel_diff"] > 1e-3 or not r["params_equal"] or r["same_batch_on_all_ranks"], (case, r)
        assert abs(out["bug_undivided_accumulation"]["rel_diff"] - 1.0) < 1e-9  # gradient x 2
        assert out["bug_padded_duplicates"]["global_batch"] == 31  # the duplicate was removed
        assert out["bug_param_changed_on_one_rank"]["params_equal"] is False
        # every rank trained on the same rows (use_distributed_sampler=False, no sampler of its own)
        assert out["bug_unsharded_data"]["same_batch_on_all_ranks"] is True
    assert len({str(out) for out in ddp4["parity"]}) == 1  # one verdict on every rank


def test_gradient_parity_check_forward_redirection(ddp4):
    """A tied GPT whose training_step calls ``self(idx)``: under Lightning's ddp the module's instance dict holds
    the ``forward`` that Lightning's forward redirection left there; the reference copy must run its own
    parameters (before: no reference gradient, a false alarm of ~1e31 on ``model.norm.weight``)."""
    for out in ddp4["parity_tied_gpt"]:
        ok, bug = out["correct_tied_gpt_forward"], out["bug_tied_grad_scaled_on_one_rank"]
        assert ok["ok"] and ok["rel_diff"] <= 1e-12, ok
        assert ok["real_grad_changed_by_check"] == 0.0 and ok["params_spread_after_step"] == 0.0, ok
        assert not bug["ok"] and bug["rel_diff"] > 1e-2, bug  # the doubled tied gradient on one rank is caught
        assert bug["real_grad_changed_by_check"] == 0.0, bug
    assert (
        len(
            {
                (o["correct_tied_gpt_forward"]["rel_diff"], o["bug_tied_grad_scaled_on_one_rank"]["rel_diff"])
                for o in ddp4["parity_tied_gpt"]
            }
        )
        == 1
    )  # one verdict on every rank


@pytest.mark.compat
def test_sampler_epoch(ddp4):
    seen = ddp4["sampler"][0]["seen"]  # per rank: epoch -> indices
    orders = []
    for epoch in ("0", "1", "2"):
        shards = [rank_seen[epoch] for rank_seen in seen]
        flat = [i for s in shards for i in s]
        assert sorted(flat) == list(range(24)), epoch  # disjoint shards that cover the dataset
        orders.append(shards)
    assert orders[0] != orders[1] != orders[2]  # the custom batch sampler and the sampler got the epoch
    for out in ddp4["sampler"]:
        # Lightning itself never reaches a custom batch sampler: only the callback sets its epoch
        assert out["batch_sampler_epochs"] == {"0": 0, "1": 1, "2": 2}
        assert out["seed_error"] is not None and "different sampler seeds" in out["seed_error"]
        assert "dp rank 3: [('DistributedSampler', 3)]" in out["seed_error"]


@pytest.mark.compat
def test_callbacks_under_hsdp(ddp4):
    """The pack's ``hsdp`` strategy, 2 x 2 (replicate x shard), FSDP2 DTensor parameters."""
    for out in ddp4["hsdp"]:
        exact = out["exact"]
        assert exact["last_count"] == 31 and exact["val"]["samples"] == 31.0
        assert exact["val"]["acc"] == exact["ref"]["acc_metric"]
        assert abs(exact["val"]["loss"] - exact["ref"]["loss"]) <= 1e-12 * exact["ref"]["loss"]
        assert out["correct_syncbn"]["ok"] and out["correct_syncbn"]["rel_diff"] <= 1e-12
        assert not out["bug_per_shard_batchnorm"]["ok"] and out["bug_per_shard_batchnorm"]["rel_diff"] > 1e-3
        assert out["injected_sampler_shards_data"]


@pytest.mark.compat
def test_exact_evaluation_under_tp(ddp4):
    """The pack's ``tp`` strategy, dp 2 x tp 2: tensor-parallel peers see the same samples and are not
    double-counted (31, not 62); a batch of padding only (the last step of dp rank 1) is skipped."""
    for out in ddp4["tp"]:
        exact = out["exact"]
        assert exact["last_count"] == 31 and exact["val"]["samples"] == 31.0
        assert exact["val"]["acc"] == exact["ref"]["acc_metric"]
        assert abs(exact["val"]["loss"] - exact["ref"]["loss"]) <= 1e-12 * exact["ref"]["loss"]


def _check_parity_cases(ranks: list[dict], prefix: str) -> dict:
    cases = {k: v for k, v in ranks[0].items() if k.startswith(prefix)}
    for out in ranks:
        for case in cases:
            r = out[case]
            assert r["ok"] == r["expect_ok"], (case, r)
            assert not r["same_batch_on_all_ranks"], (case, r)
            if r["expect_ok"]:
                assert r["rel_diff"] <= 1e-12 and r["params_equal"], (case, r)
            else:
                assert r["rel_diff"] > 1e-3 or not r["params_equal"], (case, r)
        # one verdict on every rank (the worst parameter may differ where a rank holds other values)
        assert all({**out[k], "worst": None} == {**cases[k], "worst": None} for k in cases)
    return cases


@pytest.mark.compat
def test_gradient_parity_under_tp(ddp4):
    """DTensor gradients sharded over tp=2 (x FSDP dp_shard=2) equal the single-device gradient; the global
    batch is gathered over dp only (2 dp ranks x 4 rows, not x tp); planted bugs are caught."""
    cases = _check_parity_cases(ddp4["tp"], "tp2x")
    assert len(cases) == 4
    assert cases["tp2xdp_shard2_correct"]["global_batch"] == 8
    assert cases["tp2xdp_shard2_correct_manual_accumulation"]["global_batch"] == 16  # 2 micro-batches
    assert abs(cases["tp2xdp_shard2_bug_undivided_accumulation"]["rel_diff"] - 1.0) < 1e-9  # gradient x 2
    # replicated over dp_replicate: the replicas diverged
    assert cases["tp2xdp_replicate2_bug_param_changed_on_one_rank"]["params_equal"] is False


@pytest.mark.compat
def test_gradient_parity_under_pipeline(ddp4):
    """pp=2 x dp=2: each rank compares its own stage's gradients with the whole single-device network's,
    joined from every stage (also 2 stages per rank, interleaved); automatic accumulation; planted bug: a
    replica changed on one rank. (A pipeline_loss that sums where training_step averages no longer trains: the
    strategy refuses it, see test_pipeline.py.)"""
    cases = _check_parity_cases(ddp4["pipeline"], "pp2x")
    assert len(cases) == 4 and cases["pp2xdp_shard2_correct_interleaved"]["ok"]
    assert cases["pp2xdp_shard2_correct"]["global_batch"] == 8
    assert cases["pp2xdp_shard2_correct_accumulate_2"]["global_batch"] == 16
    assert cases["pp2xdp_replicate2_bug_param_changed_on_one_rank"]["params_equal"] is False


@pytest.mark.compat
def test_exact_evaluation_under_pipeline(ddp4):
    """ExactEvaluation(full_batches=True) through the pipeline, pp=2 x dp=2 and pp=4: 31 samples scored once."""
    for out in ddp4["pipeline"]:
        # the control: rows that went through the network on each rank, padding included (batches of 6)
        for case, naive_rows in (("exact", 18), ("exact_pp4", 36)):  # 16 rows per dp rank; 31 rows on dp=1
            exact = out[case]
            assert exact["naive_rows"] == naive_rows, case
            assert exact["last_count"] == 31 and exact["val"]["samples"] == 31.0, case
            assert exact["val"]["acc"] == exact["ref"]["acc_metric"], case
            assert abs(exact["val"]["loss"] - exact["ref"]["loss"]) <= 1e-12 * exact["ref"]["loss"], (case, exact)
