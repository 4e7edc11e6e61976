"""Fault-tolerant replica groups (torchft): each replica group a separate process tree on loopback, started here.

No failure: 2 groups x 2 ranks and 2 groups x 1 rank equal plain hsdp 2 x 2 / 2 x 1 (float64, 3 AdamW steps), and
the single-device reference. A lighthouse unreachable at start-up or killed mid-run: every rank fails with its
address within the timeout. A group SIGKILLed: the other steps on alone; restarted, it heals from it.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from _harness import ROOT, SCENARIOS, _env, reap_survivors, results

from lightning_dist._compat import torchft_available

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torchft_available(), reason="torchft (the `fault-tolerance` extra) is not installed"),
]

SCRIPT = str(SCENARIOS / "ft_replica_groups.py")


def launch(*args: str, port: int, marker: str) -> subprocess.Popen:
    """One process tree (Lightning's launcher spawns the other ranks), its own rendezvous port."""
    env = _env({"LD_FAULT_MARKER": marker, "MASTER_PORT": str(port)})
    return subprocess.Popen(
        [sys.executable, SCRIPT, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[subprocess.CompletedProcess]:
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


def replica_groups(groups: int, shard: int, out, *, lighthouse_port: int, first_port: int) -> list[dict]:
    marker = uuid.uuid4().hex
    procs = [
        launch(
            "group", str(g), str(groups), str(shard), str(out), str(lighthouse_port), port=first_port + g, marker=marker
        )
        for g in range(groups)
    ]
    done = finish(procs)
    for d in done:
        assert d.returncode == 0, d.stderr[-6000:]
    assert reap_survivors(marker) == []
    return [r for d in done for r in results(d)]


def test_replica_groups_without_failure_equal_plain_hsdp(tmp_path):
    sys.path.insert(0, str(SCENARIOS))
    from _common import max_rel_diff, reference

    rows = replica_groups(2, 2, tmp_path, lighthouse_port=29641, first_port=29652)  # also trains plain 2 x 1
    rows += replica_groups(2, 1, tmp_path, lighthouse_port=29642, first_port=29654)
    marker = uuid.uuid4().hex
    (plain,) = finish([launch("plain", "2", "2", str(tmp_path), port=29656, marker=marker)])
    assert plain.returncode == 0, plain.stderr[-6000:]
    assert reap_survivors(marker) == []

    ft = [r for r in rows if r["kind"] == "ft"]
    assert len(ft) == 2 * 2 + 2 * 1, rows
    for r in ft:
        # the job's own mesh: dp_replicate=1; the sampler spans every group's ranks, this rank at its global dp rank
        assert r["shape"] == [1, 1, r["shard"], 1, 1], r
        dp = r["group"] * r["shard"] + r["rank"]
        assert r["sampler"] == {"num_replicas": 2 * r["shard"], "rank": dp}, r
        assert r["eval_sampler"] == {"num_replicas": r["shard"], "rank": r["rank"]}, r  # each group scores all
        assert r["seen"] == 3 * 16 // (2 * r["shard"]), r
        # every step asked the quorum, both groups took part, every step committed
        assert r["steps"] == [{"step": k, "participants": 2, "committed": True} for k in (1, 2, 3)], r
    load = lambda name: torch.load(tmp_path / f"{name}.pt", weights_only=True)  # noqa: E731
    ref = reference(3)
    for shard in (2, 1):
        hsdp = load(f"plain_2x{shard}")
        assert max_rel_diff(hsdp, ref) <= 1e-12
        for group in (0, 1):
            mine = load(f"ft_2x{shard}_g{group}")
            assert max_rel_diff(mine, hsdp) <= 1e-12, (shard, group)
        # the two groups hold bitwise-identical weights (with one rank, group 1 started from another seed)
        g0, g1 = load(f"ft_2x{shard}_g0"), load(f"ft_2x{shard}_g1")
        assert all(torch.equal(g0[k], g1[k]) for k in g0), shard


def test_unreachable_or_killed_lighthouse_fails_every_rank_with_its_address_within_the_timeout(tmp_path):
    """At start-up (connect_timeout 3 s), and mid-run: `torchft_lighthouse` killed under a stepping group
    (quorum_timeout 5 s)."""
    address = "http://127.0.0.1:29649"  # nothing listens there
    marker = uuid.uuid4().hex
    start = time.monotonic()
    (done,) = finish([launch("unreachable", address, port=29657, marker=marker)], timeout=120)
    elapsed = time.monotonic() - start
    assert done.returncode != 0, done.stdout[-3000:]
    for rank in (0, 1):
        assert f"replica group 1 rank {rank}: the torchft lighthouse at {address} did not answer within 3 s" in (
            done.stderr
        ), done.stderr[-6000:]
    assert "unexpected-success" not in done.stdout
    assert elapsed < 60, elapsed  # connect_timeout=3 s, plus start-up and teardown on a loaded machine
    assert reap_survivors(marker) == []

    marker = uuid.uuid4().hex
    lighthouse = subprocess.Popen(
        [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1", "--bind", "127.0.0.1:29644"],
        env=_env({"LD_FAULT_MARKER": marker}), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        group = launch("orphan", str(tmp_path), "http://127.0.0.1:29644", port=29663, marker=marker)
        deadline = time.monotonic() + 120
        while not (tmp_path / "stepping").exists() and group.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    killed = time.monotonic()
    (done,) = finish([group], timeout=120)
    elapsed = time.monotonic() - killed
    assert (tmp_path / "stepping").exists(), done.stderr[-6000:]
    assert done.returncode != 0 and "unexpected-success" not in done.stdout
    for rank in (0, 1):
        assert (
            f"replica group 0 rank {rank}: no quorum from the torchft lighthouse at http://127.0.0.1:29644 within"
            " quorum_timeout=5 s" in done.stderr
        ), done.stderr[-6000:]
    assert elapsed < 5 + 25, elapsed  # quorum_timeout, plus teardown on a loaded machine
    assert reap_survivors(marker) == []


@pytest.mark.parametrize("shard", [1, 2], ids=["ddp-groups-of-1", "fsdp2-groups-of-2"])
def test_killed_group_leaves_the_other_stepping_then_heals_from_it(tmp_path, shard):
    """The cluster way on loopback: `torchft_lighthouse` as its own process. Group 1 is SIGKILLed (its rank 0, the
    launcher; its other rank dies with it) after committed step 3 (or later); group 0 keeps stepping alone; group 1
    restarted receives weights, AdamW state and the step counter from group 0, and both end on the same committed
    step with bitwise-identical weights and AdamW state. Groups of one rank replicate with DDP (plain tensors),
    groups of two shard with FSDP2 (DTensor shards, uneven for the 5-row head)."""
    marker = uuid.uuid4().hex
    address, total = "http://127.0.0.1:29643", 60
    lighthouse = subprocess.Popen(
        [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1", "--bind", "127.0.0.1:29643",
         "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "2000"],
        env=_env({"LD_FAULT_MARKER": marker}), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        args = (str(tmp_path), address, str(total))
        group0 = launch("heal", "0", *args, "0", str(shard), port=29660, marker=marker)
        (first,) = finish([launch("heal", "1", *args, "3", str(shard), port=29661, marker=marker)])
        assert first.returncode == -9, first.stderr[-6000:]  # SIGKILL: no teardown, no goodbye to the lighthouse
        restarted = launch("heal", "1", *args, "0", str(shard), port=29662, marker=marker)
        done = finish([group0, restarted])
    finally:
        lighthouse.kill()
        lighthouse.wait()
    for d in done:
        assert d.returncode == 0, d.stderr[-6000:]
    assert reap_survivors(marker) == []
    (killed,) = results(first)  # its rank 0's
    alive, healed = (next(r for r in results(d) if r["rank"] == 0) for d in done)
    assert all(r["steps"] == alive["steps"] for r in results(done[0])), "the ranks of a group step alike"
    steps0, steps1 = alive["steps"], healed["steps"]
    assert all(s["committed"] for s in killed["steps"] + steps0 + steps1)
    # group 0 never stopped (min_replicas=1: whichever group starts first may step alone until the other joins and
    # heals from it, so group 0's first step may be later than 1)
    first = steps0[0]["step"]
    assert [s["step"] for s in steps0] == list(range(first, first + len(steps0))), steps0
    kill = killed["steps"][-1]["step"]
    assert kill >= 3 and killed["steps"][-1]["participants"] == 2, killed
    outage = [s["step"] for s in steps0 if s["step"] > kill and s["participants"] == 1]
    # the outage: group 0 stepped on by itself from the step after the kill until the restarted group joined ...
    assert outage == list(range(kill + 1, outage[-1] + 1)) and outage, (kill, steps0)
    # ... which then continued from group 0's step counter (healed), not from 1, and both ended on the same step
    assert steps1[0]["step"] == outage[-1] + 1 and steps1[-1]["step"] == steps0[-1]["step"] >= total, (steps0, steps1)
    assert all(s["participants"] == 2 for s in steps1)
    g0 = torch.load(tmp_path / "heal_g0.pt", weights_only=True)
    g1 = torch.load(tmp_path / "heal_g1.pt", weights_only=True)
    assert g0.keys() == g1.keys() and any(k.startswith("opt.") for k in g0)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)  # weights and AdamW moments and step counts
    print(f"group 1 killed after step {kill}; group 0 alone for {len(outage)} steps; group 1 healed at {outage[-1]}")
