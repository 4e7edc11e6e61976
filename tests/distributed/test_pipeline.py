"""PipelineStrategy vs single-device training in float64: two torchrun launches (2 and 4 processes), many fits each.

Scenario: tests/scenarios/pipeline_parity.py. Each rank reports the parameters it holds (single-device names)
against a reference trained on one device in the same process, the losses its training_step logged, and the
validation metric computed through the pipeline.
"""

from __future__ import annotations

import pytest
from _harness import results, run_torchrun

from lightning_dist._compat import matplotlib_available

TOL = 1e-12
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


def _by_tag(ranks: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in ranks:
        if r["kind"] == "parity":
            out.setdefault(r["tag"], []).append(r)
    return out


@pytest.fixture(scope="module")
def pp2() -> list[dict]:
    return results(run_torchrun("pipeline_parity.py", "pp2", nproc=2, timeout=400))


@pytest.fixture(scope="module")
def pp4() -> list[dict]:
    return results(run_torchrun("pipeline_parity.py", "pp4", nproc=4, timeout=500))


def _check_parity(rows: list[dict], world: int, pp: int) -> None:
    assert sorted(r["rank"] for r in rows) == list(range(world))
    for r in rows:
        assert r["diff"] <= TOL, (r["tag"], r["rank"], r["diff"])
        assert r["shape"][0] == pp
        # the loss logged with sync_dist (progress bar) is the single-device loss of the last step
        assert r["logged"] == pytest.approx(r["ref_losses"][-1], rel=TOL, abs=0), (r["tag"], r["logged"])
        # validation and predict run forward-only through the pipeline and give the single-device values
        assert r["val"] == pytest.approx(r["ref_val"], rel=TOL, abs=0), (r["tag"], r["val"], r["ref_val"])
        assert r["predict_diff"] <= TOL, (r["tag"], r["predict_diff"])
        # training_step's stand-in has the whole batch's output shape (no output kept: read off the micro-batches)
        assert r["out_shapes"] and all(s == [s[0], s[0], 5] for s in r["out_shapes"]), (r["tag"], r["out_shapes"])
    # the pp ranks of one dp replica hold disjoint parameters that together make the whole model
    dp = world // pp
    for replica in range(dp):
        keys = [k for r in rows if r["shape"][0] == pp and (r["rank"] % dp) == replica for k in r["keys"]]
        assert len(keys) == len(set(keys)) == rows[0]["n_keys"], (rows[0]["tag"], replica, len(keys))


@pytest.mark.distributed
@pytest.mark.compat
@pytest.mark.parametrize("schedule", SCHEDULES + ("interleaved_zero_bubble",))
def test_pp2_parity(pp2, schedule):
    rows = _by_tag(pp2)[f"pp2_{schedule}"]
    _check_parity(rows, world=2, pp=2)
    assert all(r["schedule"] == schedule for r in rows)  # gpipe runs as Trainer(strategy="pipeline_gpipe")
    # with pp=1 dp, every rank's training_step saw the global batch: its loss is the reference loss each step
    for r in rows:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=TOL, abs=0)
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        assert all(len(r["stages"]) == 2 for r in rows)
    if schedule == "zero_bubble":  # V layout: rank 0 holds the first and the last stage
        assert {tuple(r["stages"]) for r in rows} == {(0, 3), (1, 2)}


# issue 40, one owner per step: the package's modules a steady-state training batch of pp=2 1F1B enters (rank 0 and
# rank 1: first and last stage), measured with sys.setprofile from on_train_batch_start to on_train_batch_end
STEP_MODULES = {  # the pipeline's step: hooks, the step's state and the LightningModule's view, runner, torch's stage
    "lightning_dist/strategies/pipeline/strategy.py",
    "lightning_dist/strategies/pipeline/step.py",
    "lightning_dist/parallelize/pipeline/schedule.py",
    "lightning_dist/_integrations/torch_pipelining.py",
}
NETWORK = {  # the split network itself (as the user's model code): the model's own forward run as a stage (the blocks
    # it does not own passed over, the hand-over at its first and last block), the call convention
    "lightning_dist/parallelize/pipeline/stages.py": {"forward", "plain_call_inputs", "plain_call_output"},
    "lightning_dist/parallelize/pipeline/pruned.py": {
        "<lambda>",
        "<listcomp>",
        "__call__",
        "__init__",
        "__iter__",
        "_run_forward",
        "_running",
        "_seen",
        "finish",
        "forward",
        "model_input_call",
        "run_local",
        "stand_in",
        "start",
        "zeros",
    },
}
LIFECYCLE = {  # what Lightning calls on every MeshStrategy each batch (data guard, self.log's reduce, optimizer step)
    "lightning_dist/strategies/base.py": {"on_train_batch_start", "reduce", "training_step"},
    "lightning_dist/strategies/_processes.py": {"root_device", "is_distributed"},
    "lightning_dist/strategies/_checkpoints.py": {"optimizer_step"},
}


@pytest.mark.distributed
def test_pp2_step_enters_four_modules_of_the_package(pp2):
    rows = [r for r in pp2 if r["kind"] == "entries"]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        entered = {path: set(functions) for path, functions in r["modules"].items()}
        step = set(entered) - set(NETWORK) - set(LIFECYCLE)
        assert step == STEP_MODULES and len(step) <= 4, (r["rank"], sorted(step))
        for path, allowed in {**NETWORK, **LIFECYCLE}.items():  # nothing of the step's own work hides in these
            assert entered.get(path, set()) <= allowed, (r["rank"], path, entered.get(path))
        # one owner: the strategy's hook runs the step, whose network call runs the runner's schedule once
        assert {"training_step", "backward", "_run"} <= entered["lightning_dist/strategies/pipeline/strategy.py"]
        assert {"run", "backward"} <= entered["lightning_dist/strategies/pipeline/step.py"], r["rank"]
        assert {"step", "_loss_to_all"} <= entered["lightning_dist/parallelize/pipeline/schedule.py"], r["rank"]


@pytest.mark.distributed
def test_pp2_accumulation_clipping_lr_schedule(pp2):
    rows = _by_tag(pp2)["pp2_accum_clip_sched"]
    _check_parity(rows, world=2, pp=2)
    for r in rows:
        assert r["clipped"] == [True, True, True]  # the clip was active: a per-stage norm would break parity
        assert len(r["losses"]) == 6  # 3 optimizer steps x accumulate_grad_batches=2
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=TOL, abs=0)


@pytest.mark.distributed
def test_pp2_checkpoint_resume_and_single_device_load(pp2):
    rows = [r for r in pp2 if r["kind"] == "resume"]
    assert len(rows) == 2
    for r in rows:
        assert r["global_step"] == 4
        assert r["diff"] <= TOL  # 2 steps + resume for 2 == 4 uninterrupted single-device steps
        assert len(r["stages"]) == 2  # resumed in another layout (interleaved) than it was saved in (1F1B)
        assert r["pp1_diff"] <= TOL  # and into pp=1 (FSDP2 over both ranks) with the same parameters
    # the pp=2 checkpoint loads strictly into a plain single-device module with the reference parameters
    assert rows[0]["single_diff"] is not None and rows[0]["single_diff"] <= TOL


@pytest.mark.distributed
def test_pp2_bad_input_raises_on_every_rank(pp2):
    errors: dict[str, list[dict]] = {}
    for r in pp2:
        if r["kind"] == "error":
            errors.setdefault(r["case"], []).append(r)
    expected = {
        "too_many_stages": ("ValueError", "only 8 blocks"),
        "few_microbatches": ("ValueError", "n_microbatches >= pp = 2"),
        "indivisible_batch": ("ValueError", "does not divide into n_microbatches=3"),
        "no_loss_hook": ("ValueError", "pipeline_loss(output, target)"),
        "manual_optimization": ("ValueError", "supports automatic optimization only"),
    }
    for case, (kind, text) in expected.items():
        rows = errors[case]
        assert len(rows) == 2, case  # both ranks raised (nobody hung in a collective)
        for r in rows:
            assert r["type"] == kind and text in r["message"], (case, r)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp4_parity(pp4, schedule):
    rows = _by_tag(pp4)[f"pp4_{schedule}"]
    _check_parity(rows, world=4, pp=4)
    if schedule == "zero_bubble":
        assert {tuple(r["stages"]) for r in rows} == {(0, 7), (1, 6), (2, 5), (3, 4)}


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ("1f1b", "zero_bubble"))
def test_pp2_x_dp2_parity(pp4, schedule):
    rows = _by_tag(pp4)[f"pp2xdp2_{schedule}"]
    assert all(r["shape"] == [2, 1, 2, 1, 1] for r in rows)  # pp=2 x dp_shard=2 (FSDP2 on dp)
    _check_parity(rows, world=4, pp=2)


@pytest.mark.distributed
@pytest.mark.compat
@pytest.mark.parametrize("schedule", ("1f1b", "interleaved_1f1b"))
def test_pp2_x_tp2_parity(pp4, schedule):
    """Tensor parallelism inside the stages: one plan checked on the whole network, applied per stage."""
    rows = _by_tag(pp4)[f"pp2xtp2_{schedule}"]
    assert all(r["shape"] == [2, 1, 1, 1, 2] for r in rows)  # pp=2 x tp=2
    _check_parity(rows, world=4, pp=2)
    for r in rows:
        held = {k.rsplit(".", 1)[0] for k in r["keys"]}
        # every planned Linear this rank holds is split over tp (stem, blocks' fc, head), norms are not
        planned = {m for m in held if m == "model.stem" or m == "model.head" or m.endswith(".fc")}
        assert {k.rsplit(".", 1)[0] for k in r["tp_sharded"]} == planned and planned, r["tp_sharded"]
        if schedule == "1f1b":
            assert r["clipped"] == [True, True, True]  # the global norm spans DTensor and plain gradients
    if schedule == "1f1b":  # its sharded checkpoint consolidates into the single-device model
        (single,) = [r for r in pp4 if r["kind"] == "tp_consolidated"]
        assert single["diff"] <= TOL, single


@pytest.mark.distributed
def test_pp2_x_dp2_x_tp2_parity():
    """The full 3-D composition on 8 processes: split -> TP per stage -> FSDP2 per stage over the TP shards."""
    rows = _by_tag(results(run_torchrun("pipeline_parity.py", "3d", nproc=8, timeout=600)))["pp2xdp2xtp2_1f1b"]
    assert all(r["shape"] == [2, 1, 2, 1, 2] for r in rows)
    _check_parity(rows, world=8, pp=2)
    for r in rows:
        assert r["tp_sharded"] and r["clipped"] == [True, True, True], r


@pytest.mark.distributed
def test_pp2_ledger_pp_traffic_is_the_boundary_only(pp2):
    """Issue 24: per step the pp group exchanges the boundary activations and gradients plus O(1) scalars;
    the output (16 x 256 float64 = 32 kB here) crosses only with broadcast_output=True."""
    rows = [r for r in pp2 if r["kind"] == "ledger"]
    assert len(rows) == 2
    for r in rows:
        default, opt_in = r["rows"]["False"], r["rows"]["True"]
        # 4 micro-batches of 4 x 16 float64: rank 0 sends activations and receives gradients, rank 1 the reverse;
        # and the batch loss (one float64) goes point to point from the last stage's rank 1 to rank 0
        loss = {"send/pp": 8 * (r["rank"] == 1), "recv/pp": 8 * (r["rank"] == 0)}
        for key in ("send/pp", "recv/pp"):
            assert default[key] == r["boundary"] / 2 + loss[key], (r["rank"], default)
        assert "broadcast/pp" not in default, default
        pp_total = sum(v for k, v in default.items() if k.endswith("/pp"))
        assert pp_total - r["boundary"] < 1024, default
        assert sum(v for k, v in opt_in.items() if k.endswith("/pp")) - r["boundary"] >= r["output"], opt_in
    # the loss each rank logged (sync_dist) is the same value on both ranks, with or without the opt-in
    assert (
        rows[0]["rows"]["logged_False"]
        == rows[1]["rows"]["logged_False"]
        == pytest.approx(rows[0]["rows"]["logged_True"], rel=1e-12)
    )
    # the loss's receive posted after the schedule (NCCL's order, run here on gloo): the same values and bytes
    for r in rows:
        assert r["rows"]["logged_late"] == r["rows"]["logged_False"], r["rows"]
        assert r["rows"]["late"] == r["rows"]["False"], r["rows"]


@pytest.mark.distributed
def test_pp2_bubble_callback_records_the_timeline(pp2):
    rows = {(r["schedule"], r["rank"]): r for r in pp2 if r["kind"] == "bubble"}
    assert len(rows) == 6
    mbs = [0, 1, 2, 3]
    for rank in (0, 1):
        # every micro-batch runs F and B once on the rank's stage (1F1B, GPipe) ...
        for schedule in ("1f1b", "gpipe"):
            assert rows[(schedule, rank)]["kinds"] == {f"{rank}F": mbs, f"{rank}B": mbs}
        # ... and F, I (input grad), W (weight grad) on both stages of the V layout (zero bubble)
        stages = (0, 3) if rank == 0 else (1, 2)
        assert rows[("zero_bubble", rank)]["kinds"] == {f"{s}{k}": mbs for s in stages for k in "FIW"}
    for schedule in ("1f1b", "gpipe", "zero_bubble"):
        r0, r1 = rows[(schedule, 0)], rows[(schedule, 1)]
        assert r0["summary"] == r1["summary"]  # gathered over the pp group: one view on every rank
        assert 0 < r0["summary"]["idle_fraction"] < 1 and r0["summary"]["idle_theory"] == pytest.approx(1 / 5)
        assert r0["logged"]["pipeline/idle_theory"] == pytest.approx(0.2)
        if matplotlib_available():  # the optional `plot` extra draws the chart
            assert r0["png"] and r0["png"] > 5000  # the Gantt chart was written by rank 0
    # activations held by stage 0: 1F1B at most p = 2, GPipe all m = 4
    assert rows[("1f1b", 0)]["peak_held"]["0"] == 2 and rows[("1f1b", 0)]["logged"]["pipeline/peak_held_stage0"] == 2
    assert rows[("gpipe", 0)]["peak_held"]["0"] == 4


@pytest.mark.distributed
def test_pp2_silent_cases_match_one_device_or_refuse_on_every_rank(pp2):
    """Issue 20 cases 1, 5, 7: each trains as one device would, or every rank refuses with the reason."""
    rows: dict[str, list[dict]] = {}
    for r in pp2:
        if r["kind"] == "silent":
            rows.setdefault(r["case"], []).append(r)
    assert all(len(v) == 2 for v in rows.values()) and len(rows) == 9, {k: len(v) for k, v in rows.items()}
    # 1: residual adds in the network's own forward, with and without example_input_array: refused, naming the kind
    for case in ("residual_first_batch", "residual_example"):
        for r in rows[case]:
            assert r["type"] == "ValueError", r
            assert "Cannot split Residual into pipeline stages: the stages compute another function" in r["message"], r
            assert "a residual add outside the blocks" in r["message"], r
    # 5: an L2 term on the parameters in training_step gets its gradient (it would differ by ~5e-2 without)
    for r in rows["l2_penalty"]:
        assert r["diff"] <= TOL and r["without_l2"] > 1e-3, r
        # the logged loss is one device's (the penalty over every stage's parameters), the same on both pp ranks,
        # and a logged value that is not the returned loss is logged as it is
        assert r["logged"] == pytest.approx(r["ref_loss"], rel=1e-12, abs=0), r
        assert r["penalty_free"] == r["last_loss"] != r["logged"], r
    assert rows["l2_penalty"][0]["logged"] == rows["l2_penalty"][1]["logged"]
    # ... while a loss that scales the output term cannot be back-propagated by the schedule: refused
    for r in rows["scaled_output_loss"]:
        assert r["type"] == "ValueError" and "uses the network's output differently" in r["message"], r
        assert "pipeline_loss(output, target)" in r["message"], r
    # a term on the output outside pipeline_loss (the output exists on the last stage only): refused on every rank
    for r in rows["output_term"]:
        assert r["type"] == "ValueError" and "used the pipelined network's output (`pow`)" in r["message"], r
        assert "pipeline_loss(output, target)" in r["message"] and "broadcast_output=True" in r["message"], r
    # the output's values used by training_step (F.cross_entropy on it): refused on every rank, naming the opt-in ...
    for r in rows["direct_use"]:
        assert r["type"] == "ValueError" and "(`cross_entropy`) in training_step" in r["message"], r
        assert "broadcast_output=True" in r["message"], r
    # ... served with the opt-in (the output broadcast): one-device parity, the same logged loss on both ranks
    assert rows["direct_broadcast"][0]["logged"] == rows["direct_broadcast"][1]["logged"]
    for r in rows["direct_broadcast"]:
        assert r["diff"] <= TOL, r
    # ... where a scaled loss computed from the output is still refused
    for r in rows["direct_scaled_broadcast"]:
        assert r["type"] == "ValueError" and "uses the network's output differently" in r["message"], r
    # 7: the same nn.Linear used twice, both uses on stage 0 (split=[5]): trains as on one device
    for r in rows["shared_linear"]:
        assert r["diff"] <= TOL and r["split"] == [[0, 1, 2, 3, 4], [5, 6]], r


@pytest.mark.distributed
def test_pp2_x_dp2_block_used_twice_in_one_stage(pp4):
    rows = [r for r in pp4 if r["kind"] == "silent" and r["case"] == "shared_block_dp2"]
    assert len(rows) == 4, rows
    for r in rows:  # FSDP2 over the stage keeps the shared block in the stage's root unit: one-device parity
        assert r["shape"] == [2, 1, 2, 1, 1] and r["diff"] <= TOL, r
