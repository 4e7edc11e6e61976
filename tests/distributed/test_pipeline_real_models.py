"""Issue 14: PipelineStrategy on unmodified HF Llama, Qwen2 (GQA), GPT-2 (tied head) and the pack's tied GPT;
issue 24: litgpt's GPT unchanged (its block list inside a child ModuleDict) at pp=2, 1F1B and interleaved;
issue 40: user GPTs written the nanoGPT way (tests/scenarios/_nanogpt.py) at pp=2, pp=2 x dp=2 and pp=2 x tp=2.

Two torchrun launches of tests/scenarios/pipeline_real_models.py (2 and 4 processes), float64, each rank
against a single-device reference on the global batch trained in the same process.
"""

from __future__ import annotations

import importlib.util

import pytest
from _harness import results, run_torchrun

TOL = 1e-12
MODELS = ("llama", "qwen2_gqa", "gpt2_tied", "pack_gpt_tied")
USER_GPTS = ("nanogpt_tied", "flat_gpt")


@pytest.fixture(scope="module")
def pp2() -> dict[str, list[dict]]:
    return _by_tag(results(run_torchrun("pipeline_real_models.py", "pp2", nproc=2, timeout=900)))


@pytest.fixture(scope="module")
def pp4() -> dict[str, list[dict]]:
    return _by_tag(results(run_torchrun("pipeline_real_models.py", "pp4", nproc=4, timeout=1500)))


def _by_tag(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["tag"], []).append(r)
    return out


def _check(rows: list[dict], world: int, pp: int) -> None:
    assert sorted(r["rank"] for r in rows) == list(range(world))
    for r in rows:
        assert r["diff"] <= TOL, (r["tag"], r["rank"], r["diff"])
        assert r["shape"][0] == pp
        # the loss training_step logged (HF: out.loss) is the single-device loss of the last step
        assert r["logged"] == pytest.approx(r["ref_losses"][-1], rel=TOL, abs=0), (r["tag"], r["logged"])
        # validation runs forward-only programs through the stages (keyword inputs too): the single-device value
        assert r["val"] == pytest.approx(r["ref_val"], rel=TOL, abs=0), (r["tag"], r["val"], r["ref_val"])
    # the pp ranks of one replica hold every parameter name of the model once (a tied head under its own name)
    dp = world // pp
    for replica in range(dp):
        keys = [k for r in rows if r["rank"] % dp == replica for k in r["keys"]]
        assert sorted(keys) == rows[0]["all_keys"], (rows[0]["tag"], replica)
    if rows[0]["model"] in ("gpt2_tied", "pack_gpt_tied", "nanogpt_tied"):
        assert len(rows[0]["tied"]) == 1  # the head tied to the token embedding, on the first and last stage


@pytest.mark.distributed
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("schedule", ("1f1b", "interleaved"))
def test_pp2_parity(pp2, schedule, model):
    rows = pp2[f"pp2_{schedule}_{model}"]
    _check(rows, world=2, pp=2)
    for r in rows:  # with no data parallelism every rank's training_step saw the global batch's loss
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=TOL, abs=0)
        assert len(r["stages"]) == (2 if schedule == "interleaved" else 1)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "tag",
    (
        "pp2_1f1b_llama_ac_selective",
        "pp2_interleaved_llama_ac_every2",
        "pp2_1f1b_pack_gpt_tied_ac_selective",
        "pp2_zero_bubble_llama_ac_full",
        "pp2_interleaved_zero_bubble_qwen2_gqa_ac_every2",
    ),
)
def test_pp2_activation_checkpointing_modes_keep_parity(pp2, tag):
    rows = pp2[tag]
    _check(rows, world=2, pp=2)  # selective / every-2nd-block AC per stage: the single-device update
    for r in rows:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=TOL, abs=0)


@pytest.mark.distributed
@pytest.mark.skipif(
    importlib.util.find_spec("litgpt") is None, reason="litgpt is not installed (make install adds it --no-deps)"
)
@pytest.mark.parametrize("schedule", ("1f1b", "interleaved"))
def test_pp2_parity_on_unmodified_litgpt(pp2, schedule):
    rows = pp2[f"pp2_{schedule}_litgpt"]
    _check(rows, world=2, pp=2)  # parameters, logged train loss and validation loss == one device (float64)
    for r in rows:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=TOL, abs=0)
        assert len(r["stages"]) == (2 if schedule == "interleaved" else 1)
        # the stages hold litgpt's own names: the embedding on the first stage, lm_head on the last
        first = "model.transformer.wte.weight" in r["keys"]
        assert first == (r["rank"] == 0) and ("model.lm_head.weight" in r["keys"]) == (r["rank"] == 1)
    assert rows[0]["split"] == ([[0, 1], [2, 3]] if schedule == "1f1b" else [[0], [1], [2], [3]])


@pytest.mark.distributed
@pytest.mark.parametrize("model", ("llama", "gpt2_tied"))
def test_pp2_checkpoint_resumes_in_another_layout_and_loads_on_one_device(pp2, model):
    rows = pp2[f"resume_{model}"]
    assert len(rows) == 2
    for r in rows:
        assert r["global_step"] == 4 and len(r["stages"]) == 2  # saved under 1F1B, resumed interleaved
        assert r["diff"] <= TOL  # 3 steps + resume for 1 == 4 uninterrupted single-device steps
    single = next(r["single_diff"] for r in rows if r["rank"] == 0)
    assert single is not None and single <= TOL  # consolidated: a strict load into the plain HF model
    stored = next(r["stored"] for r in rows if r["rank"] == 0)
    assert stored["optimizer_params"] == stored["model_params"]  # the consolidated optimizer: one entry per parameter
    if model == "gpt2_tied":  # the head tied to the token embedding is saved once, under the embedding's name
        saved = next(r["saved"] for r in rows if r["rank"] == 0)
        assert len(saved) == 2 and all(s == {"model": 1, "optimizer": 1} for s in saved.values()), saved
        assert stored["names"] == 2 and stored["storages"] == 1, stored  # both names, one tensor


@pytest.mark.distributed
@pytest.mark.parametrize("model", MODELS)
def test_pp2_x_dp2_parity(pp4, model):
    rows = pp4[f"pp2xdp2_1f1b_{model}"]
    assert all(r["shape"] == [2, 1, 2, 1, 1] for r in rows)  # pp=2 x dp_shard=2 (FSDP2 on dp)
    _check(rows, world=4, pp=2)


@pytest.mark.distributed
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("schedule", ("1f1b", "interleaved"))
def test_pp4_parity(pp4, schedule, model):
    rows = pp4[f"pp4_{schedule}_{model}"]
    _check(rows, world=4, pp=4)


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["llama", "qwen3", "olmo2"])
def test_pp2_x_tp2_parity_on_hf_models(pp4, model):
    """The built-in plan inside each stage: Llama's, Qwen3's per-head norms summed over tp, OLMo 2's q/k/v gathered."""
    rows = pp4[f"pp2xtp2_1f1b_{model}"]
    assert all(r["shape"] == [2, 1, 1, 1, 2] for r in rows)  # pp=2 x tp=2
    _check(rows, world=4, pp=2)


@pytest.mark.distributed
def test_pp2_gradient_parity_check_and_bubble_on_hf_llama(pp2):
    rows = pp2["callbacks_llama"]
    assert len(rows) == 2
    for r in rows:
        # the check's reference computes HF's `labels` loss as the pipeline does (float64): no false alarm
        # (with HF's own loss, which casts the logits to float32, the reference differs by ~8e-8: hf_own_loss_rel)
        assert len(r["parity"]) == 2 and all(ok and rel <= 1e-12 and tol == 1e-10 for rel, tol, ok in r["parity"]), r
        # a gradient scaled by 1.001 on one rank after backward is caught
        assert len(r["planted"]) == 1 and r["planted"][0][0] > 1e-10 and r["planted"][0][1] is False, r["planted"]
        # PipelineBubble reports an idle fraction for every step of the HF pipeline
        assert len(r["idle"]) == 3 and all(0.0 < f < 1.0 for f in r["idle"]), r["idle"]


@pytest.mark.distributed
@pytest.mark.parametrize("model", USER_GPTS)
@pytest.mark.parametrize("schedule", ("1f1b", "interleaved"))
def test_pp2_parity_on_unmodified_user_gpts(pp2, schedule, model):
    """nanoGPT's forward (learned positions added to the token embedding) runs every stage, unchanged."""
    rows = pp2[f"pp2_{schedule}_{model}"]
    _check(rows, world=2, pp=2)  # parameters, logged train loss and validation loss == one device (float64)
    for r in rows:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=TOL, abs=0)
        assert len(r["stages"]) == (2 if schedule == "interleaved" else 1)
    assert rows[0]["split"] == ([[0, 1], [2, 3]] if schedule == "1f1b" else [[0], [1], [2], [3]])


@pytest.mark.distributed
@pytest.mark.parametrize("model", ("granite", "olmo"))
@pytest.mark.parametrize("schedule", ("1f1b", "interleaved"))
def test_pp2_parity_on_hf_models_computing_around_their_blocks(pp2, schedule, model):
    """Granite scales the embeddings and the logits in its forward, OLMo's final norm has no parameters: a stage hands
    on its last block's output and the next takes it at its first block, so that arithmetic runs once, as on one
    device (before: refused, the stages computing another function)."""
    rows = pp2[f"pp2_{schedule}_{model}"]
    _check(rows, world=2, pp=2)
    for r in rows:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=TOL, abs=0)


@pytest.mark.distributed
@pytest.mark.parametrize("tag", ("pp2xdp2_1f1b_nanogpt_tied", "pp2xdp2_1f1b_flat_gpt", "pp2xtp2_1f1b_flat_gpt"))
def test_pp2_x_dp2_and_tp2_parity_on_unmodified_user_gpts(pp4, tag):
    rows = pp4[tag]
    assert all(r["shape"] == ([2, 1, 1, 1, 2] if "tp2" in tag else [2, 1, 2, 1, 1]) for r in rows)
    _check(rows, world=4, pp=2)
