"""HF DeepSeek-V3, gpt-oss and Ergo (tiny, float64) under fsdp2, ep2 and tp2 against one device: each case equals one
device or is refused before any collective with the module and the fix (tests/scenarios/moe_families.py, one launch)."""

import pytest

from tests._harness import results, run_torchrun

pytestmark = [pytest.mark.distributed]

TOL = 1e-12
CASES = {
    "deepseek_v3": {"fsdp2", "ep2", "tp2", "tp2_mla_heads", "tp2_mlp"},
    "gpt_oss": {"fsdp2", "ep2", "tp2", "fsdp2_local", "tp2_transformer"},
    "ergo": {"fsdp2", "ep2"},
}


def test_deepseek_v3_and_gpt_oss_2_processes():
    pytest.importorskip("transformers")
    rows = results(run_torchrun("moe_families.py", nproc=2, timeout=600))
    fam = [r for r in rows if r["kind"] == "family"]
    got = sorted((r["model"], r["case"], r["rank"]) for r in fam)
    assert got == sorted((m, c, k) for m, cases in CASES.items() for c in cases for k in (0, 1)), got
    row = {(r["model"], r["case"], r["rank"]): r for r in fam}
    # DeepSeek-V3's router computes in float32 whatever the model's dtype: one device on the batch split as the two
    # ranks hold it differs from one device on the whole batch (the model's own rounding, not the strategy's)
    (f32,) = [r for r in rows if r["kind"] == "float32_router" and r["rank"] == 0 and r["model"] == "deepseek_v3"]
    for k in (0, 1):
        # gpt-oss (experts with biases, sinks, sliding window, its Switch router loss taken over the global batch)
        for case in ("fsdp2", "ep2", "tp2"):
            r = row["gpt_oss", case, k]
            assert r["error"] is None and r["diff"] <= TOL and r["router_loss"], r
        assert row["gpt_oss", "ep2", k]["ep"] == 2 and row["gpt_oss", "ep2", k]["ep_check"]["modules"] == 2
        assert row["gpt_oss", "ep2", k]["ep_check"]["worst"] <= TOL
        assert row["gpt_oss", "fsdp2_local", k]["diff"] > 1e-3  # each rank's own router loss: not one device's
        sinks = row["gpt_oss", "tp2_transformer", k]["error"] or ""
        assert "self_attn (GptOssAttention) is a region the plan splits" in sinks and "['sinks']" in sinks, sinks
        assert "Leave this region whole" in sinks, sinks
        # DeepSeek-V3 (latent attention, group-limited sigmoid routing with a correction bias, a shared expert, the
        # first layer dense; no router loss in transformers)
        for case in ("fsdp2", "ep2"):
            r = row["deepseek_v3", case, k]
            assert r["error"] is None and r["split_diff"] <= TOL and not r["router_loss"], r
            assert r["diff"] <= (TOL if f32["split_vs_global"] <= TOL else 1e-6), r
        assert row["deepseek_v3", "ep2", k]["ep_check"]["modules"] == 1  # layer 0 dense
        assert row["deepseek_v3", "ep2", k]["ep_check"]["worst"] <= TOL
        assert row["deepseek_v3", "tp2_mlp", k]["diff"] <= TOL  # the dense and shared-expert MLPs split by hand
        auto = row["deepseek_v3", "tp2", k]["error"] or ""
        assert "'mla_kv_a_proj'" in auto and "differs in structure" in auto and "Pass tp_plan=" in auto, auto
        mla = row["deepseek_v3", "tp2_mla_heads", k]["error"] or ""
        assert "model.model.layers.1.self_attn.kv_b_proj -> copy_" in mla and "rotary key" in mla, mla
        assert "embed_tokens" not in mla, mla
        # Ergo: each expert's own norm scale is held by a child of the experts module, split with the experts (before
        # 2026-12-06 it stayed whole, each rank indexed it by its local expert ids, and the ep self-check refused 2.1)
        for case in ("fsdp2", "ep2"):
            r = row["ergo", case, k]
            assert r["error"] is None and r["split_diff"] <= TOL, r
            assert r["diff"] <= 1e-6, r  # its router computes in float32, as DeepSeek-V3's
        assert row["ergo", "ep2", k]["ep"] == 2 and row["ergo", "ep2", k]["ep_check"]["modules"] == 1
        assert row["ergo", "ep2", k]["ep_check"]["worst"] <= TOL
    assert 1e-9 < f32["split_vs_global"] < 1e-6, f32
