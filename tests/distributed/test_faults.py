"""Faults: a failing or killed rank ends the whole job promptly with exit status 1, the job's summary names
the rank that failed first and its error, no process is left behind, and the job resumes from its last
checkpoint (by hand, or by torchrun's ``--max-restarts``).

Every launch carries a unique environment marker; after the launcher exits, no process on the machine
may still carry it (psutil), which catches children re-parented to init as well as direct children.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid

import pytest
from _harness import ROOT, SCENARIOS, _env, free_port, reap_survivors, results
from _harness import survivors as _survivors

pytestmark = pytest.mark.distributed

TIMEOUT_S = 90  # the strategy's `timeout` in fault_raise.py
# the documented bound: the collective timeout, plus Lightning's child-process observer period (5 s),
# plus process teardown on a loaded CPU machine
BOUND_S = TIMEOUT_S + 5 + 25


def launch(
    where: str,
    rank: int,
    out,
    *,
    torchrun: bool = False,
    extra: tuple[str, ...] = (),
    devices: int = 2,
    strategy: str = "hsdp",
):
    """Run fault_raise.py; return (returncode, stdout, stderr, exit time, processes left behind)."""
    marker = uuid.uuid4().hex
    script = [str(SCENARIOS / "fault_raise.py"), where, str(rank), str(devices), str(out), strategy]
    if torchrun:
        rdzv = (
            (f"--rdzv-endpoint=127.0.0.1:{free_port()}",)
            if "--rdzv-backend=c10d" in extra
            else ("--master-addr=127.0.0.1", f"--master-port={free_port()}")
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={devices}",
            *rdzv,
            "--monitor-interval=1",
            *extra,
            *script,
        ]
    else:
        cmd = [sys.executable, *script]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env({"LD_FAULT_MARKER": marker}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        for p in [proc, *_survivors(marker)]:
            p.kill()
        pytest.fail(f"{where} on rank {rank} hung: the job did not end in 300 s")
    ended = time.time()
    survivors = reap_survivors(marker, wait_s=0.0)  # none may outlive the launcher's exit
    return proc.returncode, stdout, stderr, ended, survivors


def _fault_time(stdout: str, stderr: str = "") -> float:
    times = [float(t) for t in re.findall(r"^FAULT ([0-9.]+)$", stdout, flags=re.M)]
    assert times, f"the fault was never injected\n{stdout[-3000:]}\n--- stderr\n{stderr[-5000:]}"
    return min(times)


def summary(stderr: str) -> str:
    """The launcher's lines about the job's failure."""
    return "\n".join(line for line in stderr.splitlines() if line.startswith("lightning_dist: "))


def assert_first_failure(stderr: str, rank: int, error: str, torchrun: bool) -> None:
    """The job's summary names `rank` as the first failure, with `error`."""
    if torchrun:  # torchelastic's summary, with the error file the strategy wrote
        # the root-cause block runs to torchelastic's next ==== rule; its entry is labelled [<rank>]:, so it is not
        # cut at "[1]:" (with rank 1 the root cause, that cut left nothing before it)
        root = stderr.split("Root Cause (first observed failure):", 1)[-1].split("=====", 1)[0]
        assert re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)", root) and error in root, stderr[-4000:]
    else:
        print(summary(stderr))
        assert f"lightning_dist: rank {rank} failed first: {error}" in stderr, (summary(stderr), stderr[-2000:])


CASES = [
    # (where, failing rank, torchrun, strategy, devices): under Lightning's launcher rank 0 is the launching
    # process, ranks 1.. its children. 4 ranks: the launcher must end children that wait for a dead rank 0,
    # and a failed child (rank 2) must take rank 0 and the other children with it before the job exits.
    ("training_step", 0, False, "hsdp", 4),
    ("training_step", 2, False, "hsdp", 4),
    ("setup", 1, False, "hsdp", 2),
    ("configure_model", 0, False, "hsdp", 2),
    ("training_step", 1, True, "hsdp", 2),
    ("setup", 0, True, "hsdp", 2),
    ("configure_model", 1, True, "hsdp", 2),
    # the other MeshStrategy subclasses share the process handling (strategies/_processes.py): one case each, a
    # child failing under Lightning's launcher with rank 0 and another child to end (the hsdp cases above cover the
    # launchers and phases), and DeepSpeed's offload strategy, whose engine keeps its own process group
    ("training_step", 2, False, "tp", 4),
    ("training_step", 2, False, "pipeline", 4),
    ("training_step", 1, False, "offload", 2),  # DeepSpeed ZeRO-3 with CPU optimizer (float32)
]


@pytest.mark.parametrize(
    "where,rank,torchrun,strategy,devices",
    CASES,
    ids=[f"{s}-{w}-rank{r}-{'torchrun' if t else 'lightning'}-{d}" for w, r, t, s, d in CASES],
)
def test_raising_rank_ends_the_job(tmp_path, where, rank, torchrun, strategy, devices):
    rc, stdout, stderr, ended, survivors = launch(
        where, rank, tmp_path, torchrun=torchrun, strategy=strategy, devices=devices
    )
    # status 1 whichever rank failed (not 137: the launching rank 0 SIGKILLed by its own observer)
    assert rc == 1, (rc, stderr[-4000:])
    assert "RESULT" not in stdout, "a rank finished training although its peer failed"
    # the original error is shown, with its message, and the job's summary names the failed rank and its error
    error = f"InjectedFault: injected failure in {where} on rank {rank}"
    assert error in stderr, stderr[-4000:]
    assert_first_failure(stderr, rank, error, torchrun)
    elapsed = ended - _fault_time(stdout, stderr)
    print(
        f"{strategy} {where} rank {rank} {'torchrun' if torchrun else 'lightning'}:"
        f" all exited {elapsed:.1f} s after the fault"
    )
    assert elapsed < BOUND_S, f"the job took {elapsed:.1f} s to end after the fault (bound {BOUND_S} s)"
    assert not survivors, f"processes outlived the launcher: {survivors}"


@pytest.mark.parametrize("rank,torchrun", [(1, False), (0, True)], ids=["lightning-rank1", "torchrun-rank0"])
def test_rank_out_of_data_early_fails_the_job(tmp_path, rank, torchrun):
    """An IterableDataset that yields fewer batches on one rank: every rank stops with the reason at the
    batch where its data ends (before the step's collectives), the job exits non-zero, nothing remains."""
    rc, stdout, stderr, ended, survivors = launch("short_data", rank, tmp_path, torchrun=torchrun)
    assert rc == 1 and "RESULT" not in stdout, (rc, stdout[-2000:])
    assert f"training data of data-parallel rank(s) [{rank}] ends after batch 0" in stderr, stderr[-4000:]
    assert not survivors, f"processes outlived the launcher: {survivors}"


def test_child_failing_after_rank0_finished_fails_the_job(tmp_path):
    """Rank 0 (the launcher) finishes, a child rank exits 3 afterwards: the job exits non-zero (Lightning's
    launcher alone exits 0 here), after every rank has ended."""
    rc, stdout, stderr, ended, survivors = launch("exit_after_fit", 1, tmp_path)
    assert rc == 1, (rc, stderr[-3000:])
    assert "lightning_dist: rank 1 failed first: exited with code 3" in stderr, summary(stderr)
    assert '"rank": 0' in stdout
    assert not survivors, f"processes outlived the launcher: {survivors}"


def test_sigkill_mid_step_then_resume_from_last(tmp_path):
    rc, stdout, stderr, ended, survivors = launch("sigkill", 1, tmp_path)
    assert rc == 1, (rc, stderr[-3000:])
    # the killed rank is the first failure, though its peer's collective failed (and recorded an error) after it
    assert "lightning_dist: rank 1 failed first: killed by signal SIGKILL (exit code -9)" in stderr, summary(stderr)
    assert ended - _fault_time(stdout, stderr) < BOUND_S
    assert not survivors, f"processes left behind: {survivors}"
    assert (tmp_path / "step4.ckpt" / "meta.pt").exists() and not (tmp_path / "step6.ckpt").exists()

    rc, stdout, stderr, _, survivors = launch("resume", 1, tmp_path)
    assert rc == 0, stderr[-4000:]
    rows = results(subprocess.CompletedProcess([], rc, stdout, stderr))
    assert len(rows) == 2 and not survivors
    for r in rows:
        # resumed from step 4 and trained to 8: equal to uninterrupted single-device training
        assert r["global_step"] == 8 and r["diff"] <= 1e-12, r


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_torchrun_max_restarts_resumes_from_last_checkpoint(tmp_path, rdzv):
    # every attempt reuses torchrun's agent store: the strategy prefixes its keys with the attempt number
    # (lightning_dist.rendezvous.attempt_store), or the restarted ranks dial the dead attempt's addresses
    extra = ("--max-restarts=1",) + (("--rdzv-backend=c10d",) if rdzv == "c10d" else ())
    rc, stdout, stderr, _, survivors = launch("restart", 1, tmp_path, torchrun=True, extra=extra)
    assert rc == 0, stderr[-4000:]
    assert not survivors
    _fault_time(stdout, stderr)  # the first attempt did die
    rows = results(subprocess.CompletedProcess([], rc, stdout, stderr))
    assert len(rows) == 2, stdout[-3000:]
    for r in rows:
        assert r["restart"] == "1", r  # the second attempt finished the job
        assert r["global_step"] == 8 and r["diff"] <= 1e-12, r
