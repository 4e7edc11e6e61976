"""Mixtures of experts (HF Qwen3-MoE, Mixtral; the pack's MoEGPT, softmax and DeepSeek-V3-style routing) against one
device, float64, the router's auxiliary loss included.

Two launches: 2 processes (fsdp2, tp2 and expert parallelism ep2, its HF models exported to safetensors, its ledger
and memory report next to the plan, uniform routing against the planner's formula; ep2 with full activation
checkpointing and with offloaded activations; the exact global router loss and the per-rank one kept on purpose; a
pipeline, ep on a dense model, ep with cp and grouped_mm experts in float64 refused; tp2 x ep2, the ep group the tp
group; ep2 with a capacity factor) and 4 processes (hsdp 2 x 2, tp2 x dp_shard2, ep4, ep2 x dp_shard2, hsdp 2 x 2
with ep2, tp2 x ep4 (ep from dp_shard x tp), pp2 x tp2 x ep2, an ep rank that receives no token, a checkpoint from
ep4 to ep2 to one device).
"""

import pytest

from tests._harness import results, run_torchrun

pytestmark = [pytest.mark.distributed]

TOL = 1e-12
MODELS = {"qwen3_moe", "mixtral", "pack_moe", "pack_moe_ds"}


def _rows(rows: list[dict], world: int, cases: set[str], modes: set[str]) -> list[dict]:
    moe = [r for r in rows if r["kind"] == "moe"]
    assert {(r["model"], r["case"], r["mode"]) for r in moe} == {
        (m, c, o) for m in MODELS for c in cases for o in modes
    }
    assert len(moe) == world * len(MODELS) * len(cases) * len(modes), moe
    return moe


def _pipelined_router_loss(rows: list[dict], world: int, cases: set[str]) -> None:
    """Every model pipelined with its router loss (the counting pass, then the schedule): one device's update on
    every rank; the per-rank loss (``moe_aux_loss="local"``) differs, so the exact path's test can fail."""
    piped = [r for r in rows if r["kind"] == "moe_pp_aux"]
    got = sorted((r["model"], r["case"], r["rank"]) for r in piped)
    assert got == sorted((m, c, k) for m in MODELS for c in cases for k in range(world)), got
    for r in piped:
        assert r["held"] > 0 and r["ep"] == (2 if "ep2" in r["case"] else 1), r
        assert (r["diff"] > 1e-3) if r["case"].endswith("_local") else (r["diff"] <= TOL), r


@pytest.mark.compat  # all_to_all_single with uneven splits, DTensor experts, tp2's per-head norm sums: both torch ends
def test_moe_and_expert_parallelism_2_processes():
    pytest.importorskip("transformers")
    rows = results(run_torchrun("moe_parity.py", "local", nproc=2, timeout=600))
    for r in _rows(rows, 2, {"fsdp2", "tp2", "ep2", "tp2_ep2"}, {"global", "local"}):
        # expert parallelism ran where asked, only there (tp2_ep2: the ep group is the tp group, each tp rank
        # dispatching its half of the tokens both hold)
        assert r["ep"] == (2 if "ep2" in r["case"] else 1), r
        if "ep2" in r["case"]:  # the ep self-check held both layers' experts to whole copies at setup
            assert r["ep_check"]["modules"] == 2 and r["ep_check"]["worst"] <= TOL, r
        else:
            assert r["ep_check"] is None, r
        if r["case"].startswith("tp2"):  # the tp self-check ran, tp2 x ep2 too: each block against a whole copy
            assert r["tp_check"]["blocks"] == 2 and r["tp_check"]["worst"] <= TOL, r
        if r["mode"] == "global" or r["case"].startswith("tp2"):  # one data-parallel rank: both are one device's
            assert r["diff"] <= TOL, r
        else:  # each rank's own router loss, averaged: not the global batch's (so the exact path's test can fail)
            assert r["diff"] > 1e-3, r
    # ep2 with every block recomputed in backward (its tokens dispatched to the experts again) or its saved tensors
    # offloaded (host memory standing in for the device): one device's update, the router loss included
    acts = [r for r in rows if r["kind"] == "moe_activations"]
    assert sorted((r["model"], r["case"], r["rank"]) for r in acts) == sorted(
        (m, c, k) for m in MODELS for c in ("ep2_ac_full", "ep2_offload") for k in (0, 1)
    ), acts
    for r in acts:
        assert r["diff"] <= TOL and r["ep"] == 2, r
        if r["case"] == "ep2_ac_full":
            assert r["checkpointed"] == 2 and r["offloaded"] == 0, r  # both blocks, nothing offloaded
        else:
            assert r["checkpointed"] == 0 and r["offloaded"] > 0, r
    _pipelined_router_loss(rows, 2, {"pp2_1f1b", "pp2_gpipe_ac_full"})
    refusals = {(r["case"], r["rank"]): r["error"] or "" for r in rows if r["kind"] == "refusal"}
    assert len(refusals) == 8, refusals
    # cp2 x ep2: the experts split over the cp peers, the router loss over their tokens; the self-check ran
    cp_ep = [r for r in rows if r["kind"] == "moe_cp_ep"]
    assert sorted((r["model"], r["rank"]) for r in cp_ep) == sorted((m, k) for m in MODELS for k in (0, 1)), cp_ep
    assert all(r["diff"] <= TOL and r["ep"] == 2 and r["ep_check"]["worst"] <= TOL for r in cp_ep), cp_ep
    for rank in (0, 1):  # each refused on every rank, with the reason and the fix
        assert "has no experts module" in refusals["ep_dense", rank] and "drop ep" in refusals["ep_dense", rank]
        grouped = refusals["grouped_mm", rank]
        assert "model.model.layers.0.mlp.experts (Qwen3MoeExperts)" in grouped and "torch.float64 on cpu" in grouped
        assert 'experts_implementation="eager"' in grouped, grouped
        # the ep self-check at setup (forward and backward against whole copies of the experts): experts that use the
        # routing weight inside, and expert gradients not scaled by 1/ep (outputs right, gradients doubled)
        scaled, unscaled = refusals["ep_scaled_input", rank], refusals["ep_unscaled_grads", rank]
        assert "expert parallelism (ep=2): the setup self-check" in scaled and "mlp.experts (its output)" in scaled
        assert "mlp.experts." in unscaled and "(its gradient)" in unscaled, unscaled
    # ep2 with the CommunicationLedger and MemoryReport: every row that has a plan equals it (the all-to-alls planned
    # from the rows the step's routing sent and received), the model states and the routed experts' part too
    plans = [r for r in rows if r["kind"] == "ep_plan"]
    assert sorted((r["model"], r["rank"]) for r in plans) == sorted((m, k) for m in MODELS for k in (0, 1)), plans
    for r in plans:
        # counts, dispatch and combine per layer forward, the two token exchanges again in backward: 2 layers x 5
        assert r["all_to_all"] == [["dp_shard", 10.0, 1.0]], r  # ep == dp_shard here: the group is named dp_shard
        assert r["ledger"].keys() >= {"all_gather/dp_shard", "reduce_scatter/dp_shard", "all_to_all/dp_shard"}, r
        assert all(v == 1.0 for k, v in r["ledger"].items() if k != "all_reduce/dp_shard"), r  # router loss: no plan
        assert r["states"] == 1.0 and r["expert_states"] == 1.0, r
    # routing by a fixed balanced pattern: the measured all-to-all bytes are the planner's uniform-routing formula's
    uniform = [r for r in rows if r["kind"] == "ep_uniform"]
    assert len(uniform) == 2, uniform
    for r in uniform:
        assert r["a2a_measured"] == r["a2a_uniform"] > 0, r
        assert r["received"] == [
            {"experts": 8, "hidden": 32, "bytes": 8, "calls": 2.0, "rows": 128.0, "received": 128.0}
        ]
        assert r["expert_states_closed_form"] == 1.0 and r["states"] == 1.0 and r["expert_states"] == 1.0, r
    # token dropping, asked for (the pack's MoEGPT, Qwen3-MoE, Mixtral): a factor under which every pair fits trains as
    # one device; 0.5 drops pairs on every rank and layer, no expert receives more than its capacity from each rank,
    # and the update is not one device's. The self-check at setup ran dropless (its whole copies drop nothing) and held
    capacity = {(r["model"], r["case"], r["rank"]): r for r in rows if r["kind"] == "ep_capacity"}
    assert len(capacity) == 3 * 2 * 2, capacity
    for model in ("pack_moe", "qwen3_moe", "mixtral"):
        for rank in (0, 1):
            fits, drops = capacity[model, "ep2_capacity_all", rank], capacity[model, "ep2_capacity_0.5", rank]
            assert fits["diff"] <= TOL and fits["dropped"] == [0, 0] and fits["ep_check"] <= TOL, fits
            assert drops["diff"] > 1e-3 and min(drops["dropped"]) > 0 and drops["ep_check"] <= TOL, drops
            for cap, arrived, local in zip(drops["capacity"], drops["arrived"], drops["local_experts"]):
                assert 0 < arrived <= cap * local * 2, drops  # at most `cap` per expert from each of the 2 ranks
    # trained at ep=2 (experts as DTensors on the ep mesh), exported to safetensors: transformers loads every trained
    # weight exactly, from the tensors it writes itself for the unsharded model (names and shapes)
    exports = {r["model"]: r for r in rows if r["kind"] == "hf_export" and r["rank"] == 0}
    assert exports.keys() == {"qwen3_moe", "mixtral"}, exports
    for r in exports.values():
        assert r["same_names"] and r["diff"] == 0.0 and r["not_loaded"] == [] and r["own_layout"], r
        assert r["expert_tensors"] == 2 * 4 * 3, r  # 2 layers x 4 experts x (gate, up, down)


def test_moe_and_expert_parallelism_4_processes():
    pytest.importorskip("transformers")
    rows = results(run_torchrun("moe_parity.py", nproc=4, timeout=600))
    cases = {"hsdp2x2", "tp2_dp_shard2", "ep4", "ep2_dp_shard2", "hsdp2x2_ep2", "tp2_ep4", "cp2_sac", "cp2_ep4"}
    for r in _rows([r for r in rows if r.get("model") != "pack_moe_idle"], 4, cases, {"global"}):
        assert r["diff"] <= TOL, r
        ep = {"ep4": 4, "ep2_dp_shard2": 2, "hsdp2x2_ep2": 2, "tp2_ep4": 4, "cp2_ep4": 4}.get(r["case"], 1)
        assert r.get("ep", 1) == ep, r
        if r.get("ep", 1) > 1:  # the ep self-check ran (ep4, ep with dp_replicate, ep x tp) and found the copies equal
            assert r["ep_check"]["modules"] == 2 and r["ep_check"]["worst"] <= TOL, r
        if r["case"].startswith("tp2"):  # and the tp self-check, its block copies with whole experts under tp2 x ep4
            assert r["tp_check"]["blocks"] == 2 and r["tp_check"]["worst"] <= TOL, r
    # expert parallelism with a rank whose experts are never chosen: it receives no token, and stays exact
    idle = sorted((r for r in rows if r.get("model") == "pack_moe_idle"), key=lambda r: r["rank"])
    assert len(idle) == 4 and all(r["diff"] <= TOL for r in idle), idle
    assert idle[3]["arrived"] == [0, 0] and all(min(r["arrived"]) > 0 for r in idle[:3]), idle
    # pp2 x tp2 x ep2: each stage's experts split over its two tp ranks; every rank's parameters as one device's
    piped = [r for r in rows if r["kind"] == "moe_pp"]
    assert sorted((r["model"], r["rank"]) for r in piped) == sorted((m, k) for m in MODELS for k in range(4)), piped
    assert all(r["diff"] <= TOL and r["ep"] == 2 and r["held"] > 0 for r in piped), piped
    # the ep self-check ran through the schedule on each stage's experts module (one per stage) and found them exact
    assert all(r["ep_check"]["modules"] == 1 and r["ep_check"]["worst"] <= TOL for r in piped), piped
    # experts that scale their input by a routing weight: pipelined with ep, refused by that check on every rank
    refused = [r for r in rows if r["kind"] == "refusal" and r["case"] == "pp_ep_scaled_input"]
    assert len(refused) == 4 and all("under PipelineStrategy: the setup self-check" in r["error"] for r in refused)
    assert all("mlp.experts" in r["error"] for r in refused), refused
    _pipelined_router_loss(rows, 4, {"pp2_dp2", "pp2_ep2", "pp2_cp2_ep2", "pp2_dp2_local"})
    # sharded at ep=4, resumed at ep=2, consolidated for one device: every state arrives exactly
    (ck,) = [r for r in rows if r["kind"] == "ep_checkpoint" and r["rank"] == 0]
    assert ck["trained_diff"] <= TOL and ck["ep2_loaded_diff"] == 0.0 and ck["ep2_adam_steps"] == [3.0], ck
    assert ck["single_diff"] == 0.0, ck
