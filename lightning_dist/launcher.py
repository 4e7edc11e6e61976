"""Lightning's script launcher, with a job that ends with all of its processes and exits 1 when a rank failed.

Notes: docs/internals.md, "lightning_dist/launcher.py"."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

from typing_extensions import override

from lightning_dist._integrations.lightning import SubprocessScriptLauncher, set_num_threads_if_needed

__all__ = ["JobLauncher", "die_with_launcher", "record_rank_error"]

_LAUNCHER_PID = "LIGHTNING_DIST_LAUNCHER_PID"
"""Set by :class:`JobLauncher` in its children's environment: the pid they must not outlive."""
_ERROR_DIR = "LIGHTNING_DIST_ERROR_DIR"
"""Set by :class:`JobLauncher` in its children's environment: where a failing child records its error."""
_GRACE_S = 2.0  # a child that failed first gets this long to finish printing its own error


class _Child:
    """One child rank: its process, and when it exited (stamped by a thread blocked in ``wait``)."""

    def __init__(self, proc: subprocess.Popen, rank: int, exited: threading.Event) -> None:
        self.proc, self.rank = proc, rank
        self.exited_at: Optional[float] = None
        self.done = threading.Event()
        self.ended = False  # killed by the launcher, not failed by itself
        # a waiting thread rather than polling: the exit time orders a signal-killed child among recorded errors
        threading.Thread(target=self._wait, args=(exited,), daemon=True, name=f"lightning-dist-rank{rank}").start()

    def _wait(self, exited: threading.Event) -> None:
        self.proc.wait()
        self.exited_at = time.time()
        self.done.set()
        exited.set()

    def failure(self, record: Optional[dict]) -> tuple[bool, float, int, str]:
        """This child's failure as an ordering key: (raised by a collective, time, rank, error)."""
        if record is None:
            assert self.exited_at is not None
            return (False, self.exited_at, self.rank, self.error(None))
        return (record["collective"], record["time"], self.rank, record["error"])

    @property
    def failed(self) -> bool:
        return self.done.is_set() and self.proc.returncode != 0 and not self.ended

    def error(self, record: Optional[dict]) -> str:
        if record is not None:
            return record["error"]
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"killed by signal {signal.Signals(-code).name} (exit code {code})"
        return f"exited with code {code}"


class _Job:
    """The rank processes this process started (once per job: later Trainers' launchers find the ranks
    already running, ``creates_processes_externally``), and what ends them."""

    children: list[_Child] = []
    error_dir: Optional[str] = None
    exited = threading.Event()  # set whenever a child exits
    ending = threading.Lock()  # held by whichever of rank 0's exception and the observer ends the job
    ended = False  # the job's failure was already handled and reported


def _records() -> dict[int, dict]:
    """The errors the children recorded, by process id."""
    found: dict[int, dict] = {}
    if _Job.error_dir is None:
        return found
    for child in _Job.children:
        try:
            with open(os.path.join(_Job.error_dir, f"{child.proc.pid}.json")) as f:
                found[child.proc.pid] = json.load(f)
        except (OSError, ValueError):
            continue
    return found


def _end_children(grace_s: float) -> None:
    """Let the children exit by themselves for up to `grace_s`, then SIGKILL the rest; return once all are reaped."""
    deadline = time.monotonic() + grace_s
    for child in _Job.children:
        child.done.wait(max(0.0, deadline - time.monotonic()))
    for child in _Job.children:
        if not child.done.is_set():
            child.ended = True
            child.proc.kill()
    for child in _Job.children:
        child.done.wait()


def _from_collective(exception: BaseException) -> bool:
    """Whether `exception` was raised inside torch.distributed (a collective or its store: a peer went away)."""
    tb = exception.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("torch.distributed")


def _report(rank0_failure: Optional[tuple[bool, float, int, str]]) -> None:
    """Print which rank failed first and its error, and what became of the others (all have exited)."""
    records = _records()
    failures = [] if rank0_failure is None else [rank0_failure]
    failures += [child.failure(records.get(child.proc.pid)) for child in _Job.children if child.failed]
    if not failures:
        return
    failures.sort()  # failures not raised by a collective first, each group by time
    _, _, first, error = failures[0]
    after = [f"rank {rank}: {error}" for _, _, rank, error in failures[1:]]
    ended = [child.rank for child in _Job.children if child.ended]
    lines = [f"lightning_dist: rank {first} failed first: {error}"]
    if after:
        lines.append(f"lightning_dist: failed after it: {'; '.join(after)}")
    if ended:
        lines.append(f"lightning_dist: ranks {ended} were ended by the launcher")
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()


def _exit_failed() -> None:
    """End the process with status 1 from any thread, without interpreter shutdown (rank 0 may be blocked
    in a collective, and other threads hold no lock this needs)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    _remove_error_dir()
    os._exit(1)


def _observe() -> None:
    """On the first failed child: end the other children, report, exit 1 (rank 0 included)."""
    while True:
        _Job.exited.wait()
        _Job.exited.clear()
        if any(child.failed for child in _Job.children):
            if not _Job.ending.acquire(blocking=False):
                return  # rank 0's own exception is ending the job
            if _Job.ended:
                _Job.ending.release()
                return
            sys.stderr.write("lightning_dist: a rank failed; ending the job's other processes.\n")
            _end_children(_GRACE_S)
            _report(None)
            _exit_failed()
        if all(child.done.is_set() for child in _Job.children):
            return


def _remove_error_dir() -> None:
    if _Job.error_dir is not None:
        shutil.rmtree(_Job.error_dir, ignore_errors=True)


class JobLauncher(SubprocessScriptLauncher):
    """``SubprocessScriptLauncher`` whose job ends with all of its processes (see the module docstring)."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            os.environ[_LAUNCHER_PID] = str(os.getpid())  # copied into the children's environment
            _Job.error_dir = os.environ[_ERROR_DIR] = tempfile.mkdtemp(prefix="lightning-dist-errors-")
            self._call_children_scripts()
            first = self.cluster_environment.node_rank() * self.num_processes + 1  # Lightning starts local ranks 1..
            _Job.children = [_Child(p, first + i, _Job.exited) for i, p in enumerate(self.procs)]
            threading.Thread(target=_observe, daemon=True, name="lightning-dist-child-observer").start()
            atexit.register(_exit_with_children)
        set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException as exception:
            if _Job.children:
                # rank 0 failed, or saw a child's failure first: its children could wait in a collective until the
                # timeout
                failed_at = time.time()
                with _Job.ending:  # when the observer holds it, it is ending the process: this waits for that
                    if not _Job.ended:
                        _Job.ended = True
                        _end_children(_GRACE_S)
                        _report((_from_collective(exception), failed_at, 0, _describe(exception)))
            raise


def _exit_with_children() -> None:
    """At rank 0's interpreter exit: wait for the children; exit 1 when one of them failed."""
    with _Job.ending:
        for child in _Job.children:
            child.done.wait()
        if not _Job.ended and any(child.failed for child in _Job.children):
            _Job.ended = True
            _report(None)
            _exit_failed()  # the only way to set the exit code from an exit handler
        _remove_error_dir()


def _describe(exception: BaseException) -> str:
    return f"{type(exception).__name__}: {exception}"


def record_rank_error(exception: BaseException, rank: int) -> None:
    """Record this rank's failure for whoever reports the job's failure; call while handling `exception`.

    Under :class:`JobLauncher` (a child rank): a small JSON file in the launcher's folder. Under torchrun:
    torchelastic's error file (``TORCHELASTIC_ERROR_FILE``), which torchrun's failure summary prints.
    """
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        if _from_collective(exception):
            # A collective fails because a peer went away, and that peer recorded its error before its sockets
            # closed. torchelastic's root cause is the smallest timestamp, in whole seconds, ties going to the
            # lower rank: recorded in the same second, this consequence would be named the cause. Recording it
            # in the next second keeps the order in which the two failures really happened (<= 1 s, on a
            # failing rank only).
            time.sleep(1.0 - time.time() % 1.0 + 0.01)
        # written whole or not at all: torchelastic writes the file in place, and its agent, which ends the other
        # ranks once one failed, parses every error file it finds; a rank ended in the middle of that write left
        # half a JSON document, on which the agent itself failed (and with it torchrun's --max-restarts)
        final = os.environ["TORCHELASTIC_ERROR_FILE"]
        staged = f"{final}.{os.getpid()}.tmp"
        os.environ["TORCHELASTIC_ERROR_FILE"] = staged
        try:
            get_error_handler().record_exception(exception)
        finally:
            os.environ["TORCHELASTIC_ERROR_FILE"] = final
        if os.path.exists(staged):
            os.replace(staged, final)
        return
    folder = os.environ.get(_ERROR_DIR)
    if not folder or os.environ.get(_LAUNCHER_PID) == str(os.getpid()) or not os.path.isdir(folder):
        return  # no launcher to read it, or this is the launcher (it reports its own exception)
    record = {
        "rank": rank,
        "error": _describe(exception),
        "time": time.time(),
        "collective": _from_collective(exception),
    }
    path = os.path.join(folder, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # the launcher never reads half a record


def die_with_launcher() -> None:
    """In a child started by :class:`JobLauncher`: have the kernel SIGKILL this process when the launcher
    dies (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere a no-op). Exits at once if the launcher is gone."""
    expected = os.environ.get(_LAUNCHER_PID)
    if not expected or int(expected) == os.getpid() or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(expected):  # the launcher died before the request took effect
        os._exit(1)
