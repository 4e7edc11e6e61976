"""plan="auto" on real models (HF Llama, Qwen2 GQA, GPT-2 tied, GPT-NeoX; a user GPT; the pack's tied GPT).

Two launches in all (one per mesh), every model in each: float64 parity with single-device training on
the global batch after 3 AdamW steps, GradientParityCheck at step 0 (no false alarm on tied models), and
tied weights still one parameter after sharding.
"""

import pytest

from tests._harness import results, run_torchrun

pytestmark = pytest.mark.distributed

TOL = 1e-12
MODELS = {"llama", "qwen2_gqa", "gpt2_tied", "gpt_neox", "user_gpt", "pack_gpt_tied"}


def _check(rows: list[dict], world: int, mesh: list[int]) -> None:
    assert len(rows) == world * len(MODELS) and {r["model"] for r in rows} == MODELS
    for r in rows:
        assert r["diff"] <= TOL, r
        assert r["grad_parity"] <= 1e-12, r
        assert r["mesh"] == mesh, r
        assert r["n_split"] >= 6, r  # the plan really split layers (attention and/or MLP, head)
    tied = {r["model"]: r["tied"] for r in rows if r["rank"] == 0}
    # the tie survived sharding: one parameter under both names, as the user built it
    assert tied["gpt2_tied"] == [["model.transformer.wte.weight", "model.lm_head.weight"]]
    assert tied["pack_gpt_tied"] == [["model.tok_emb.weight", "model.lm_head.weight"]]


def test_auto_plan_on_real_models_tp2():
    pytest.importorskip("transformers")
    _check(results(run_torchrun("tp_real_models.py", nproc=2, timeout=600)), 2, [1, 1, 1, 2])


def test_auto_plan_on_real_models_tp2_dp_shard2():
    pytest.importorskip("transformers")
    _check(results(run_torchrun("tp_real_models.py", nproc=4, timeout=900)), 4, [1, 1, 2, 2])
