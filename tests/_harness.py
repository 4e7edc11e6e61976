"""A small harness for multi-process tests (no dependency on torch.testing._internal).

Lightning's launcher re-executes ``sys.argv`` for every rank, so a distributed test starts a scenario
script in a subprocess: plain ``python script.py`` (Lightning's own launcher spawns the other ranks) or
``torchrun``. Scenario scripts print one line ``RESULT <json>`` per rank; tests parse and assert on them.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dist._compat import deepspeed_available, matplotlib_available

ROOT = Path(__file__).resolve().parents[1]

# optional dependencies (extras): tests that need one skip with the reason where it is not installed
needs_deepspeed = pytest.mark.skipif(
    not deepspeed_available(), reason="DeepSpeed (the `deepspeed` extra) is not installed"
)
needs_matplotlib = pytest.mark.skipif(
    not matplotlib_available(), reason="matplotlib (the `plot` extra) is not installed"
)
SCENARIOS = ROOT / "tests" / "scenarios"


def tiny_qwen3_moe(transformers, **kw):
    """An unmodified transformers Qwen3-MoE small enough for CPU (4 experts, top-2, 2 layers); `kw`: its config's."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        **kw,
    )
    return transformers.Qwen3MoeForCausalLM(cfg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        }
    )
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)  # never inherit a launcher's variables into a fresh job
    env.update(extra or {})
    return env


def scenario_path(script: str | Path) -> Path:
    """`script` as given when absolute, else a file of tests/scenarios/."""
    path = Path(script)
    return path if path.is_absolute() else SCENARIOS / path


class ScenarioError(AssertionError):
    pass


def _report(what: str, proc: subprocess.CompletedProcess) -> str:
    """Failure text: the first error lines (usually the root cause) and the tail of both streams."""
    first = [i for i, line in enumerate(proc.stderr.splitlines()) if "Error" in line or "Traceback" in line][:1]
    lines = proc.stderr.splitlines()
    head = "\n".join(lines[max(0, first[0] - 5) : first[0] + 40]) if first else ""
    return (
        f"{what} exited {proc.returncode}\n--- first error\n{head}\n--- stdout (tail)\n{proc.stdout[-4000:]}"
        f"\n--- stderr (tail)\n{proc.stderr[-6000:]}"
    )


def _run(cmd: list[str], timeout: float, env: dict | None, cwd: Path | None) -> subprocess.CompletedProcess:
    """Run `cmd` to its end; a job still running after `timeout` s fails the test with every one of its processes'
    Python stacks (faulthandler, on SIGABRT), so a hang names the line each rank waits on."""
    import signal

    import psutil

    env = _env({"PYTHONFAULTHANDLER": "1", **(env or {})})
    proc = subprocess.Popen(cmd, cwd=cwd or ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                child.send_signal(signal.SIGABRT)
            except psutil.NoSuchProcess:
                pass
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            stdout, stderr = proc.communicate()
        pytest.fail(
            f"{' '.join(map(str, cmd))} did not end in {timeout:g} s (a hang: each process's stack below)\n"
            f"--- stdout (tail)\n{stdout[-3000:]}\n--- stderr (tail)\n{stderr[-12000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def results(proc: subprocess.CompletedProcess) -> list[dict]:
    """The ``RESULT {...}`` lines printed by the ranks, sorted by their ``rank`` key when present."""
    decoder = json.JSONDecoder()
    out = []
    for match in re.finditer(r"RESULT ", proc.stdout):  # robust to two ranks' lines run together
        try:
            obj, _ = decoder.raw_decode(proc.stdout, match.end())
        except json.JSONDecodeError:
            continue
        out.append(obj)
    return sorted(out, key=lambda r: r.get("rank", 0))


def run_script(
    script: str | Path,
    *args: str,
    timeout: float = 300,
    env: dict | None = None,
    expect_ok: bool = True,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """``python script args...``: Lightning's launcher spawns the other ranks itself."""
    path = scenario_path(script)
    proc = _run([sys.executable, str(path), *args], timeout, env, cwd)
    if expect_ok and proc.returncode != 0:
        raise ScenarioError(_report(f"{path.name} {' '.join(args)}", proc))
    return proc


def run_torchrun(
    script: str | Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 300,
    env: dict | None = None,
    expect_ok: bool = True,
    extra_torchrun: tuple[str, ...] = (),
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N script args...`` on loopback."""
    path = scenario_path(script)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        *extra_torchrun,
        str(path),
        *args,
    ]
    proc = _run(cmd, timeout, env, cwd)
    if expect_ok and proc.returncode != 0:
        raise ScenarioError(_report(f"torchrun {path.name} {' '.join(args)}", proc))
    return proc


def run_torchrun_nodes(
    script: str | Path,
    *args: str,
    nnodes: int = 2,
    nproc: int = 2,
    timeout: float = 300,
    env: dict | None = None,
) -> list[subprocess.CompletedProcess]:
    """Simulate `nnodes` machines on this one: one torchrun per node rank, rendezvous on loopback."""
    path = scenario_path(script)
    port = free_port()
    procs = []
    for node_rank in range(nnodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(path),
            *args,
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    done = collect(procs, timeout)
    for d in done:
        if d.returncode != 0:
            raise ScenarioError(_report("node", d))
    return done


def collect(procs: list[subprocess.Popen], timeout: float) -> list[subprocess.CompletedProcess]:
    """Wait for each of `procs` (started with piped text output) in turn, up to `timeout` seconds each; on a timeout
    every one is killed and the ``TimeoutExpired`` raised."""
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def survivors(marker: str) -> list:
    """Live processes whose environment carries ``LD_FAULT_MARKER=marker`` (what a launch left behind)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("LD_FAULT_MARKER") == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def reap_survivors(marker: str, *, wait_s: float = 5.0) -> list:
    """The processes of a finished launch still alive after `wait_s` (a SIGKILLed child may take a moment
    to be reaped); they are killed before returning, so a failing test leaves nothing behind."""
    import time

    left = survivors(marker)
    deadline = time.monotonic() + wait_s
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = survivors(marker)
    for p in left:
        p.kill()
    return left
