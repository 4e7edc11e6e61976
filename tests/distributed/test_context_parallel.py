"""Context parallelism (Ulysses) under Lightning's launcher: float64 parity with single-device training on the global
batch (3 AdamW steps) on the pack's GPT (GQA), unmodified HF Llama and HF Qwen2 (GQA).

Two launches: 2 processes (cp2, and cp2 with activation checkpointing, whose recomputation must run the exchange
too) and 4 processes (cp2 x dp_shard2, cp2 x tp2, cp4). HF models also train through their own ``labels=`` loss
(shifted before the split, averaged over tokens). Each row: parameters at float64 round-off, the logged loss equal to
the reference's, the attention calls served by the all-to-all (the split ran), the sampler over dp only and FSDP2 over
dp_shard x cp.
"""

import math

import pytest

from tests._harness import results, run_script

pytestmark = pytest.mark.distributed

TOL = 1e-12


def _check(rows: list[dict], world: int, expected: set[tuple[str, str]]) -> None:
    rows = [r for r in rows if r["kind"] == "cp"]
    assert {(r["name"], r["model"]) for r in rows} == expected
    assert len(rows) == world * len(expected)
    for r in rows:
        assert r["diff"] <= TOL, r
        # HF's own loss runs in float32 inside the model (logits.float()): its logged value to float32 round-off
        assert math.isclose(r["loss"], r["ref_loss"], rel_tol=1e-6 if r["hf_labels"] else 1e-12), r
        assert r["attention_calls"] == 2 * 3, r  # 2 layers x 3 steps went through the all-to-all
        cp, tp = r["shape"][3], r["shape"][4]
        dp = world // (cp * tp)
        assert r["sampler"]["num_replicas"] == dp, r  # cp peers read the same samples
        assert r["fsdp_size"] == dp * cp, r  # parameters sharded over dp_shard x cp


def test_context_parallel_2_processes():
    rows = results(run_script("cp_parity.py", "--devices", "2", timeout=900))
    models = ("gpt_gqa", "llama", "qwen2_gqa")
    expected = {("cp2", m) for m in models} | {("hf_labels", m) for m in models[1:]} | {("cp2_ac", "gpt_gqa")}
    _check(rows, 2, expected)


def test_context_parallel_4_processes():
    rows = results(run_script("cp_parity.py", "--devices", "4", timeout=1500))
    models = ("gpt_gqa", "llama", "qwen2_gqa")
    expected = {(mesh, m) for mesh in ("cp2_dp2", "cp2_tp2") for m in models} | {("cp4", "gpt_gqa")}
    expected |= {("hf_labels", m) for m in models[1:]}
    _check(rows, 4, expected)
