"""The job launcher's failure records and report, in one process (the launches are in
tests/distributed/test_faults.py)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from lightning_dist import launcher


def _raise_and_record(rank: int) -> None:
    try:
        raise ValueError("bad batch")
    except ValueError as e:
        launcher.record_rank_error(e, rank)


def test_record_under_torchrun_writes_torchelastics_error_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    _raise_and_record(1)
    data = json.loads((tmp_path / "error.json").read_text())["message"]  # the format torchrun's summary reads
    assert data["message"] == "ValueError: bad batch"
    assert "raise ValueError" in data["extraInfo"]["py_callstack"]


def test_record_in_a_child_of_the_launcher_and_not_in_the_launcher(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setenv(launcher._ERROR_DIR, str(tmp_path))
    monkeypatch.setenv(launcher._LAUNCHER_PID, str(os.getpid()))
    _raise_and_record(0)  # the launcher reports its own exception
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(launcher._LAUNCHER_PID, str(os.getpid() + 1))
    before = time.time()
    _raise_and_record(2)
    record = json.loads((tmp_path / f"{os.getpid()}.json").read_text())
    assert (
        record["rank"] == 2 and record["error"] == "ValueError: bad batch" and before <= record["time"] <= time.time()
    )


def test_report_names_the_earliest_failure(tmp_path, monkeypatch, capsys):
    """A child killed by a signal before another child's recorded exception is the first failure; the recorded
    error is named for the rank that recorded it, and rank 0's later exception comes last."""
    exited = threading.Event()
    killed = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    killed.wait()
    time.sleep(0.05)
    raised = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
    children = [launcher._Child(killed, 1, exited), launcher._Child(raised, 2, exited)]
    for child in children:
        child.done.wait(30)
    monkeypatch.setattr(launcher._Job, "children", children)
    monkeypatch.setattr(launcher._Job, "error_dir", str(tmp_path))
    (tmp_path / f"{raised.pid}.json").write_text(
        json.dumps({"rank": 2, "error": "ValueError: bad batch", "time": time.time(), "collective": False})
    )
    # rank 0's collective failed before the kill was seen (the kernel closes a dying process's sockets before
    # its parent can reap it): a collective's failure comes after every other
    launcher._report((True, time.time() - 10, 0, "RuntimeError: Connection reset by peer"))
    err = capsys.readouterr().err
    assert "rank 1 failed first: killed by signal SIGKILL (exit code -9)" in err, err
    assert "failed after it: rank 2: ValueError: bad batch; rank 0: RuntimeError: Connection reset by peer" in err, err


def test_a_collectives_failure_is_told_apart():
    import torch.distributed as dist

    with pytest.raises(Exception) as inside:
        dist.get_rank(group=object())  # raises inside torch.distributed
    assert launcher._from_collective(inside.value)
    with pytest.raises(ValueError) as outside:
        raise ValueError("user code")
    assert not launcher._from_collective(outside.value)
