"""Lightning's script launcher, with a job that ends with all of its processes and any rank's failure.

Lightning's ``SubprocessScriptLauncher`` runs rank 0 in the launching process and starts the other local
ranks as child processes; a thread checks the children every 5 s. Three gaps, each filled here:

* rank 0 fails (an exception): Lightning re-raises and the launcher exits while its children still wait
  in a collective for the dead peer, until the collective timeout: they outlive the job, holding their
  device and port. :class:`JobLauncher` kills them (SIGKILL: a rank blocked in a collective does not run
  Python signal handlers) and waits for them before the exception leaves ``fit``.
* a child fails: the observer kills the other children, *waits for them*, then kills rank 0 (the launcher
  exits non-zero); it looks every 0.5 s, not 5 s.
* rank 0 finishes while a child failed (e.g. a rank that ran out of data early and died): Lightning's
  launcher exits 0. At interpreter exit rank 0 now waits for its children and exits 1 if any failed.

Children also ask the kernel to kill them when the launcher dies (``PR_SET_PDEATHSIG`` on Linux), so a
launcher killed from outside (SIGKILL, OOM) leaves no rank behind. Under torchrun or SLURM the agent owns
the processes and none of this applies.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

from typing_extensions import override

from lightning_dist._integrations.lightning import SubprocessScriptLauncher, _set_num_threads_if_needed

__all__ = ["JobLauncher", "die_with_launcher"]

_LAUNCHER_PID = "LIGHTNING_DIST_LAUNCHER_PID"
"""Set by :class:`JobLauncher` in its children's environment: the pid they must not outlive."""
_GRACE_S = 2.0  # a child that failed first gets this long to finish printing its own error
_POLL_S = 0.5


def _kill_and_wait(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Let `procs` exit by themselves for up to `grace_s`, then SIGKILL the rest; return once all are reaped."""
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


class _Observer(threading.Thread):
    """Watches the children: on the first failure, ends the others, then rank 0 itself (exit non-zero)."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        super().__init__(daemon=True, name="lightning-dist-child-observer")
        self.procs = procs
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(_POLL_S):
            failed = [p for p in self.procs if p.poll() not in (None, 0)]
            if failed and not self.stopped.is_set():
                sys.stderr.write(f"lightning_dist: a rank process (pid {failed[0].pid}) exited with code"
                                 f" {failed[0].returncode}; ending the job's other processes.\n")
                sys.stderr.flush()
                _kill_and_wait(self.procs, _GRACE_S)
                os.kill(os.getpid(), signal.SIGKILL)  # rank 0 may be blocked in a collective: no gentler way
            if all(p.poll() == 0 for p in self.procs):
                return


class _Children:
    """The rank processes this process started (once per job: later Trainers' launchers find the ranks
    already running, ``creates_processes_externally``), and their observer."""

    procs: list[subprocess.Popen] = []
    observer: Optional[_Observer] = None
    ended = False  # rank 0 failed and ended them itself


class JobLauncher(SubprocessScriptLauncher):
    """``SubprocessScriptLauncher`` whose job ends with all of its processes (see the module docstring)."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            os.environ[_LAUNCHER_PID] = str(os.getpid())  # copied into the children's environment
            self._call_children_scripts()
            _Children.procs = self.procs
            _Children.observer = _Observer(self.procs)
            _Children.observer.start()
            atexit.register(_exit_with_children)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException:
            # rank 0 failed: its children would wait in a collective for it until the timeout
            _end_children()
            raise


def _end_children() -> None:
    if _Children.observer is not None:
        _Children.observer.stopped.set()  # the children killed below must not look like a failure to it
    _Children.ended = True
    _kill_and_wait(_Children.procs, _GRACE_S)


def _exit_with_children() -> None:
    """At rank 0's interpreter exit: wait for the children; exit 1 when one of them failed."""
    for p in _Children.procs:
        p.wait()
    if _Children.observer is not None:
        _Children.observer.stopped.set()
    failed = [p for p in _Children.procs if p.returncode != 0]
    if failed and not _Children.ended:
        sys.stderr.write(f"lightning_dist: rank process(es) {[p.pid for p in failed]} failed (exit codes"
                         f" {[p.returncode for p in failed]}); the job exits 1.\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # the only way to set the exit code from an exit handler


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
