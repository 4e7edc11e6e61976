"""HuggingFace safetensors folders into models sharded by tp and fsdp2, and back out (one 2-process launch)."""

import pytest

from tests._harness import results, run_torchrun

pytestmark = pytest.mark.distributed


def test_load_sharded_and_export_hf_folders_exactly():
    pytest.importorskip("transformers")
    rows = results(run_torchrun("hf_weights.py", nproc=2, timeout=600))
    assert {(r["model"], r["strategy"]) for r in rows} == {(m, s) for m in ("gpt2", "llama") for s in ("tp2", "fsdp2")}
    assert len(rows) == 8
    for r in rows:
        assert r["loaded_diff"] == 0.0, r  # every parameter equals the folder's, bit for bit
        assert r["local_numel"] < r["total_numel"], r  # each rank holds (and read) a part only
        if r["rank"] == 0:
            assert r["export_diff"] == 0.0 and r["export_tied"], r  # from_pretrained of the export: the source
