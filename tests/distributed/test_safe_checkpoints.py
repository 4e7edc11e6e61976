"""Safe checkpoints: SIGKILL during a save keeps the previous checkpoint loadable; loads are weights-only;
single-node rendezvous listens on the loopback address only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from _harness import ROOT, SCENARIOS, _env, reap_survivors, results, run_script

pytestmark = pytest.mark.distributed


def _kill_while_saving(mode: str, out) -> tuple[float, list]:
    """Start fault_save.py, SIGKILL rank 0 once it reports it is inside the writer; return (exit time, leftovers)."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, str(SCENARIOS / "fault_save.py"), mode, str(out)],
        cwd=ROOT,
        env=_env({"LD_FAULT_MARKER": marker}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    deadline = time.time() + 300
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("SAVING "):
            os.kill(int(line.split()[1]), signal.SIGKILL)
            break
        if time.time() > deadline:
            break
    else:
        pytest.fail("the scenario ended without reaching the stalled save:\n" + "".join(lines[-60:]))
    killed = time.time()
    try:
        proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the job hung after its rank 0 was killed during a save")
    ended = time.time() - killed
    survivors = reap_survivors(marker)
    assert proc.returncode != 0
    return ended, survivors


@pytest.mark.parametrize("mode", ["dir_write", "dir_swap", "file_write"])
def test_kill_during_save_keeps_previous_checkpoint(tmp_path, mode):
    sys.path.insert(0, str(SCENARIOS))
    from _common import Classifier, max_rel_diff, reference

    from lightning_dist import checkpoint as ckpt

    ended, survivors = _kill_while_saving(mode, tmp_path)
    print(f"{mode}: the job ended {ended:.1f} s after rank 0 was killed mid-save")
    assert not survivors, f"processes left behind: {survivors}"
    assert ended < 60
    last = tmp_path / "last.ckpt"
    if mode == "dir_swap":  # killed between the renames: the good checkpoint waits at `.old`
        assert not last.exists() and (tmp_path / "last.ckpt.old").is_dir()
    found = ckpt.resolve_path(last)
    # the step-2 checkpoint loads (weights_only) in one process, with step-2 values
    torch.set_default_dtype(torch.float64)
    try:
        module = Classifier(n=64, schedule=True, width=64)
    finally:
        torch.set_default_dtype(torch.float32)
    meta = ckpt.load(found, model=module, weights_only=True)
    assert meta["global_step"] == 2, (found, meta["global_step"])
    params = {n: p.detach() for n, p in module.named_parameters()}
    assert max_rel_diff(params, reference(2, n=64, schedule=True, width=64)) <= 1e-12


def test_kill_during_background_write_keeps_previous_checkpoint_and_last_resumes(tmp_path):
    """async_checkpoint=True: rank 1 is killed while its background writer writes the step-6 save (rank 0 has
    written its shards and waits for rank 1's): nothing is renamed, `last.ckpt` stays the step-4 checkpoint,
    and `ckpt_path="last"` resumes from it to step 8 equal to single-device training."""
    sys.path.insert(0, str(SCENARIOS))
    from _common import Classifier, max_rel_diff, reference

    from lightning_dist import checkpoint as ckpt

    ended, survivors = _kill_while_saving("async_write", tmp_path)
    print(f"async_write: the job ended {ended:.1f} s after rank 1 was killed mid-write")
    assert not survivors, f"processes left behind: {survivors}"
    assert ended < 60
    last = tmp_path / "last.ckpt"
    assert last.is_dir() and (tmp_path / "last.ckpt.tmp").is_dir()  # the interrupted save never renamed
    torch.set_default_dtype(torch.float64)
    try:
        module = Classifier(n=64, schedule=True, width=64)
    finally:
        torch.set_default_dtype(torch.float32)
    meta = ckpt.load(last, model=module, weights_only=True)
    assert meta["global_step"] == 4, meta["global_step"]
    params = {n: p.detach() for n, p in module.named_parameters()}
    assert max_rel_diff(params, reference(4, n=64, schedule=True, width=64)) <= 1e-12

    rows = [
        r
        for r in results(run_script("fault_save.py", "async_resume", str(tmp_path), timeout=300))
        if r.get("kind") == "async_resume"
    ]
    assert len(rows) == 2, rows
    for r in rows:  # resumed from step 4 (the newest complete one), trained to 8 with async saves
        assert r["global_step"] == 8 and r["diff"] <= 1e-12, r
        assert "last.ckpt" in r["files"] and "last.ckpt.tmp" not in r["files"], r  # the end of fit waited
    meta = ckpt.load(last, model=module, weights_only=True)
    assert meta["global_step"] == 8


@pytest.mark.compat
def test_background_staging_copy_holds_the_state_at_save_time(tmp_path):
    """async_checkpoint=True, fsdp2 1x2, a staging copy made slow on purpose: the save returns before the copy is
    made, the next step's forward and backward overlap it, and the checkpoint still holds the state at save
    time (this rank's shards of parameters and AdamW states, bitwise, and a buffer the forward changes); the
    resume from it is bitwise. The controls show each guard is needed: without the strategy's wait for the
    copy the parameters in the checkpoint are the next step's, without the buffer clone the buffer is."""
    from lightning_dist._compat import dcp_async_staging

    rows = [r for r in results(run_script("async_staging.py", str(tmp_path), timeout=600)) if r.get("kind")]
    assert len(rows) == 2, rows
    background = dcp_async_staging()  # this torch can stage in the background (else the save copies first)
    for r in rows:
        assert r["staging_after_save"] is background, r
        assert r["checkpointing_changes_nothing"] and r["resumed_bitwise"] and r["resumed_step"] == 6, r
        assert r["loaded"]["params_optimizer"] and r["loaded"]["buffer"] and r["loaded_step"] == 3, r
        assert r["forwards"] == [3, 3, 6], r  # buffer at the save, after loading, after resuming to step 6
        if background:
            assert r["control_unguarded_staging"] and not r["control_unguarded"]["params_optimizer"], r
            assert r["control_unguarded"]["buffer"], r
            assert r["control_uncloned"]["params_optimizer"] and not r["control_uncloned"]["buffer"], r


def test_rendezvous_listens_on_loopback_only(tmp_path):
    """Lightning's launcher defaults MASTER_ADDR to 127.0.0.1; every listening socket of the job is loopback."""
    proc = run_script("fault_save.py", "listen", str(tmp_path), env={"MASTER_ADDR": ""}, timeout=300)
    rows = [r for r in results(proc) if "listening" in r]
    assert len(rows) == 2, proc.stdout[-3000:]
    for r in rows:
        assert r["master_addr"] == "127.0.0.1", r
        assert r["listening"] and all(addr in ("127.0.0.1", "::1") for addr in r["listening"]), r
