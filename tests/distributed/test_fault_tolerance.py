"""Fault-tolerant replica groups (torchft): each replica group a separate process tree on loopback, started here.

No failure: 2 groups x 2 ranks and 2 groups x 1 rank equal plain hsdp 2 x 2 / 2 x 1 (float64, 3 AdamW steps), and
the single-device reference. A lighthouse unreachable at start-up or killed mid-run: every rank fails with its
address within the timeout. A group that fails (SIGKILLed, or one of its ranks): the other steps on alone;
restarted, it heals from it, and the committed steps equal a single-device replay of exactly their samples.
DiLoCo (``sync="diloco"``) on 2 groups equals an outer loop written with torch, and resumed from a Lightning checkpoint
between two syncs (its outer optimizer, global weights, inner steps and torchft's step counter in it) ends where the
uninterrupted run does; a group SIGKILLed under DiLoCo (after a sync, and between two) heals in its first sync and both
groups end equal to DiLoCo written with torch over the committed syncs. What the user sees rides along: the
``ft/`` figures of the progress bar and the loggers, and the ledger's row of the all-reduce across the groups.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _harness import ROOT, SCENARIOS, _env, collect, reap_survivors, results

from lightning_dist import planner
from lightning_dist._compat import torchft_available

sys.path.insert(0, str(SCENARIOS))
from _common import MLP, dataset, max_rel_diff, reference  # noqa: E402  (the scenarios' model and data)

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
    return collect(procs, timeout)


def all_ok(done: list[subprocess.CompletedProcess], marker: str) -> list[subprocess.CompletedProcess]:
    """Every launch exited 0, and nothing carrying `marker` is left (call it after the lighthouse is gone)."""
    for d in done:
        assert d.returncode == 0, d.stderr[-6000:]
    assert reap_survivors(marker) == []
    return done


def finish_ok(procs: list[subprocess.Popen], marker: str) -> list[subprocess.CompletedProcess]:
    return all_ok(finish(procs), marker)


@contextlib.contextmanager
def lighthouse(port: int, marker: str, *options: str) -> Iterator[str]:
    """`torchft_lighthouse` as its own process (the cluster way) on loopback: its address; killed on exit."""
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1", "--bind", f"127.0.0.1:{port}",
         *options],
        env=_env({"LD_FAULT_MARKER": marker}), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


def replica_groups(groups: int, shard: int, out, *, lighthouse_port: int, first_port: int) -> list[dict]:
    marker = uuid.uuid4().hex
    procs = [
        launch(
            "group", str(g), str(groups), str(shard), str(out), str(lighthouse_port), port=first_port + g, marker=marker
        )
        for g in range(groups)
    ]
    return [r for d in finish_ok(procs, marker) for r in results(d)]


def cross_group_payload(shard: int) -> tuple[int, int]:
    """(calls, bytes) per step of one rank's all-reduce across the groups, for the scenarios' float64 MLP: a group of
    one rank (DDP) sends every gradient in one bucket; a group of `shard` ranks (FSDP2) each unit's padded dim-0 shard
    (3 blocks and the root)."""
    shapes = [p.shape for p in MLP().parameters()]
    if shard == 1:
        return 1, 8 * sum(math.prod(s) for s in shapes)
    return 4, 8 * sum(-(-s[0] // shard) * math.prod(s[1:]) for s in shapes)


def test_replica_groups_without_failure_equal_plain_hsdp(tmp_path):
    rows = replica_groups(2, 2, tmp_path, lighthouse_port=29641, first_port=29652)  # also trains plain 2 x 1
    rows += replica_groups(2, 1, tmp_path, lighthouse_port=29642, first_port=29654)
    marker = uuid.uuid4().hex
    finish_ok([launch("plain", "2", "2", str(tmp_path), port=29656, marker=marker)], marker)

    ft = [r for r in rows if r["kind"] == "ft"]
    assert len(ft) == 2 * 2 + 2 * 1, rows
    for r in ft:
        # the job's own mesh: dp_replicate=1; the sampler spans every group's ranks, this rank at its global dp rank
        assert r["shape"] == [1, 1, r["shard"], 1, 1], r
        dp = r["group"] * r["shard"] + r["rank"]
        assert r["sampler"] == {"num_replicas": 2 * r["shard"], "rank": dp}, r
        assert r["eval_sampler"] == {"num_replicas": r["shard"], "rank": r["rank"]}, r  # each group scores all
        assert r["seen"] == 3 * 16 // (2 * r["shard"]), r
        # every step asked the quorum, both groups took part, every step committed, on global batches 0, 1, 2
        expected = [{"step": k, "participants": 2, "committed": True, "epoch": 0, "batch": [k - 1]} for k in (1, 2, 3)]
        assert r["steps"] == expected, r
        # the ledger: torchft's all-reduce across the groups as its own row, every step, as planned; MemoryReport too
        calls, nbytes = cross_group_payload(r["shard"])
        assert r["cross"] == [[calls, nbytes]] * 3, r
        summary = r["cross_summary"]
        assert summary["bytes"] == summary["planned_bytes"] == nbytes and summary["wire_bytes"] == nbytes, summary
        assert r["memory_ratio"] == 1.0, r
        # the progress bar and the loggers: both groups took part, no failure
        assert r["shown"]["bar"] == r["shown"]["logged"], r
        assert r["shown"]["bar"]["ft/participants"] == 2 and r["shown"]["bar"]["ft/failures"] == 0, r
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


DILOCO_SHARD = 1  # ranks per replica group; 2 (FSDP2 inside each group) passes too (3.1e-16) but costs 20-40 s more


def test_diloco_on_two_groups_equals_an_outer_loop_written_with_torch_and_resumes_exactly(tmp_path):
    """2 replica groups under sync="diloco", sync_every=2, 6 AdamW steps (3 syncs, the default outer SGD-Nesterov):
    no per-step average; each group's weights, at the end of a sync, equal (fp64, <= 1e-12) two local copies trained on
    their groups' batches, their pseudo-gradients averaged and stepped by torch's SGD on a global copy. Resumed in
    fresh processes (from another initial model) from the checkpoints of step 3, one inner step past a sync, the run
    ends on the same weights (<= 1e-12), torchft's step counter and DiLoCo's inner steps going on from the saved."""
    marker, shard = uuid.uuid4().hex, DILOCO_SHARD
    args = (str(shard), str(tmp_path), "29645")
    done = finish_ok([launch("diloco", str(g), *args, port=29664 + g, marker=marker) for g in (0, 1)], marker)
    rows = [r for d in done for r in results(d) if r["kind"] == "diloco"]
    assert len(rows) == 2 * shard, rows
    for r in rows:
        # one record per sync: after inner steps 2, 4, 6 (batches 1, 3, 5), both groups, committed
        expected = [
            {"step": k, "participants": 2, "committed": True, "epoch": 0, "batch": [2 * k - 1]} for k in (1, 2, 3)
        ]
        assert r["steps"] == expected, r
        assert r["seen"] == 6 * 16 // (2 * shard), r
        # the ledger: the pseudo-gradients' all-reduce across the groups at the syncs only (each parameter's local
        # shard, one call each), and its plan: the planner's DiLoCo row, bytes per sync / sync_every per step
        calls, per_sync = _diloco_sync_payload(shard, r["rank"])
        assert r["cross"] == [None, [calls, per_sync]] * 3, r
        summary = r["cross_summary"]
        planned = planner.diloco_sync_traffic(per_sync / 8, param_bytes=8, inner_steps=2, replica_groups=2)
        assert summary["bytes"] == summary["planned_bytes"] == planned.payload_bytes == per_sync / 2, summary
        assert summary["ratio"] == 1.0 and summary["count"] == calls / 2, summary
        if r["group"] == 0:
            print(f"DiLoCo ledger row: {summary['bytes']:,.0f} B per step measured, {summary['planned_bytes']:,.0f}"
                  f" planned ({per_sync:,} B per sync, {calls} calls), ratio {summary['ratio']:.3f}")  # fmt: skip
    g0, g1 = (torch.load(tmp_path / f"diloco_2x{shard}_g{g}.pt", weights_only=True) for g in (0, 1))
    assert all(torch.equal(g0[k], g1[k]) for k in g0)  # after a sync every group holds the global weights
    by_hand = _diloco_reference(shard, steps=6, every=2)
    assert max_rel_diff(g0, by_hand) <= 1e-12
    # not the synchronous run: the same 6 global batches averaged every step end elsewhere
    assert max_rel_diff(g0, reference(6)) > 1e-3
    print(f"DiLoCo 2 x {shard}: {max_rel_diff(g0, by_hand):.1e} from the torch outer loop; {rows[0]['seconds']:.1f} s")
    _check_diloco_resume(tmp_path, shard, rows)


def _diloco_sync_payload(shard: int, rank: int) -> tuple[int, int]:
    """(calls, bytes) of one rank's DiLoCo sync for the scenarios' float64 MLP: every parameter's local shard (torch's
    dim-0 chunks under FSDP2), one all-reduce each."""
    params = list(MLP().parameters())
    rows = lambda n, rank: len(range(n)[rank * -(-n // shard) :][: -(-n // shard)])  # noqa: E731
    return len(params), 8 * sum(rows(p.shape[0], rank) * math.prod(p.shape[1:]) for p in params)


def _check_diloco_resume(out: Path, shard: int, uninterrupted: list[dict]) -> None:
    """The checkpoints of steps 2 (a sync) and 3 carry DiLoCo's state (weights_only); resumed from step 3 each group
    ends on the uninterrupted run's weights, torchft's counters going on from the checkpoint's."""
    for g in (0, 1):
        two, three = (
            torch.load(out / f"diloco_g{g}_step{k}.ckpt" / "meta.pt", weights_only=True)["fault_tolerance"]
            for k in (2, 3)
        )
        assert two["sync"] == three["sync"] == "diloco", two
        assert two["manager"] == three["manager"] == {"step": 1, "batches_committed": 2}, (two, three)
        assert (two["diloco"]["inner_steps"], three["diloco"]["inner_steps"]) == (2, 3)
        momentum = [s["momentum_buffer"] for s in three["diloco"]["outer_optimizer"]["state"].values()]
        assert momentum and all(m.abs().max() > 0 for m in momentum)  # the outer step at the sync left momentum
        weights = three["diloco"]["global_weights"]
        assert all(torch.equal(weights[k], two["diloco"]["global_weights"][k]) for k in weights)  # no sync between
    marker = uuid.uuid4().hex
    args = (str(shard), str(out), "29646", "3")
    done = finish_ok([launch("diloco_resume", str(g), *args, port=29666 + g, marker=marker) for g in (0, 1)], marker)
    rows = [r for d in done for r in results(d) if r["kind"] == "diloco_resume"]
    assert len(rows) == 2 * shard, rows
    whole = {r["group"]: r for r in uninterrupted}
    for r in rows:
        assert r["first"] == {"step": 1, "inner_steps": 3}, r  # the checkpoint's, not 0
        # the syncs after inner steps 4 and 6 (not 5: the inner steps went on), torchft's steps 2 and 3
        assert [(s["step"], s["participants"], s["committed"]) for s in r["steps"]] == [(2, 2, True), (3, 2, True)], r
        assert r["batches_committed"] == whole[r["group"]]["batches_committed"] == 6, (r, whole)
        assert r["seen"] == 3 * 16 // (2 * shard), r  # steps 4-6 only
    for g in (0, 1):
        resumed = torch.load(out / f"diloco_resumed_2x{shard}_g{g}.pt", weights_only=True)
        reference_ = torch.load(out / f"diloco_2x{shard}_g{g}.pt", weights_only=True)
        diff = max_rel_diff(resumed, reference_)
        assert diff <= 1e-12, (g, diff)
        print(f"DiLoCo 2 x {shard} group {g} resumed from step 3: {diff:.1e} from the uninterrupted run")


def _diloco_reference(shard: int, *, steps: int, every: int) -> dict[str, torch.Tensor]:
    """DiLoCo by hand: per group a local copy trained with AdamW on the group's part of each global batch (16 of 96,
    in order: torch's DistributedSampler over both groups' ranks); every `every` steps the pseudo-gradients (global
    - local) averaged, torch's SGD (lr 0.7, momentum 0.9, Nesterov) steps the global copy, the local copies reset."""
    import copy

    import torch.nn.functional as F
    from torch.utils.data import DistributedSampler

    torch.manual_seed(0)
    global_model = MLP().double()
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    local = [copy.deepcopy(global_model) for _ in range(2)]
    inner = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for m in local]
    x, y = dataset(96).tensors
    width, per_rank = 2 * shard, 16 // (2 * shard)
    samplers = [list(DistributedSampler(range(96), num_replicas=width, rank=r, shuffle=False)) for r in range(width)]
    for k in range(steps):
        for g in range(2):
            index = torch.tensor(
                [i for r in range(g * shard, (g + 1) * shard) for i in samplers[r][k * per_rank :][:per_rank]]
            )
            inner[g].zero_grad()
            F.cross_entropy(local[g](x[index]), y[index]).backward()
            inner[g].step()
        if (k + 1) % every == 0:
            for p, *copies in zip(global_model.parameters(), *(m.parameters() for m in local)):
                p.grad = ((p.detach() - copies[0].detach()) + (p.detach() - copies[1].detach())) / 2
            outer.step()
            outer.zero_grad()
            for m in local:
                m.load_state_dict(global_model.state_dict())
    return {f"model.{n}": p.detach().clone() for n, p in global_model.named_parameters()}


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
    with lighthouse(29644, marker) as address:
        group = launch("orphan", str(tmp_path), address, port=29663, marker=marker)
        deadline = time.monotonic() + 120
        while not (tmp_path / "stepping").exists() and group.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
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


@pytest.mark.parametrize(
    "layout",
    ["1", "2", "pp2"],
    ids=["ddp-groups-of-1-group-killed", "fsdp2-groups-of-2-one-rank-killed", "pipeline-groups-of-2-one-stage-killed"],
)
def test_killed_group_heals_and_every_committed_step_trains_its_samples_once(tmp_path, layout):
    """The cluster way on loopback: `torchft_lighthouse` as its own process. Group 1 loses a rank after committed step
    3 (or later): with one rank per group that is the whole group (SIGKILL), with two its rank 1 (a failure inside the
    group's shard dim: the launcher ends the group, exit 1). Group 0 keeps stepping alone; group 1 restarted heals from
    it (weights, AdamW state, torchft's step, Lightning's loop progress, the LR scheduler, the loader position, the
    RNG) and both end on the same step. Every committed step trained the participating groups' parts of one global
    batch, no sample twice, nothing dropped but the absent group's parts; both groups hold bitwise-identical weights
    and AdamW state, equal to a single-device replay of exactly those samples. Groups of one rank replicate with
    DDP, of two shard with FSDP2 (uneven shards for the 5-row head); a group of two pipeline stages (1F1B) averages
    each stage's gradients across the groups after its schedule, and heals stage by stage."""
    marker, total = uuid.uuid4().hex, 10
    pipeline = layout == "pp2"
    ranks, shard = (2, 1) if pipeline else (int(layout),) * 2  # a group's ranks; those reading distinct samples
    with lighthouse(29643, marker, "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "2000") as address:
        args = (str(tmp_path), address, str(total))
        group0 = launch("heal", "0", *args, "0", layout, port=29660, marker=marker)
        (first,) = finish([launch("heal", "1", *args, "3", layout, port=29661, marker=marker)])
        # SIGKILL of the group's only rank; a group of two: the launcher ends it when its rank 1 is killed
        assert first.returncode == (-9 if ranks == 1 else 1), first.stderr[-6000:]
        restarted = launch("heal", "1", *args, "0", layout, port=29662, marker=marker)
        done = finish([group0, restarted])
    all_ok(done, marker)

    launches = {"killed": results(first), "alive": results(done[0]), "healed": results(done[1])}
    steps = {name: _steps_by_rank0(rows, ranks) for name, rows in launches.items()}
    killed, alive, healed = steps["killed"], steps["alive"], steps["healed"]
    assert all(s["committed"] for s in killed + alive + healed)
    # group 0 never stopped (min_replicas=1: whichever group starts first may step alone until the other joins and
    # heals from it, so group 0's first step may be later than 1)
    first_step = alive[0]["step"]
    assert [s["step"] for s in alive] == list(range(first_step, first_step + len(alive))), alive
    kill = killed[-1]["step"]
    assert kill >= 3 and killed[-1]["participants"] == 2, killed
    outage = [s["step"] for s in alive if s["step"] > kill and s["participants"] == 1]
    # the outage: group 0 stepped on by itself from the step after the kill until the restarted group joined ...
    assert outage == list(range(kill + 1, outage[-1] + 1)) and outage, (kill, alive)
    # ... which then continued from group 0's step (healed), not from 1, and both ended on the same step
    assert healed[0]["step"] == outage[-1] + 1 and healed[-1]["step"] == alive[-1]["step"] >= total, (alive, healed)
    assert all(s["participants"] == 2 for s in healed)
    # the restarted group continued exactly where group 0 was: the same global batch, global step, LR and random
    # draw as group 0 in every step they took together (the loader position, loop progress, scheduler and RNG healed)
    same = ("step", "epoch", "batch", "global_step", "lr", "draw")
    together = {s["step"]: s for s in alive if s["step"] >= healed[0]["step"]}
    assert [{k: s[k] for k in same} for s in healed] == [{k: together[s["step"]][k] for k in same} for s in healed]
    assert healed[0]["global_step"] == healed[0]["step"], healed[0]  # Lightning's step: every step committed
    ends = {name: next(r for r in rows if r["kind"] == "heal" and r["rank"] == 0) for name, rows in launches.items()
            if name != "killed"}  # fmt: skip
    for key in ("global_step", "scheduler", "rng"):
        assert ends["alive"][key] == ends["healed"][key], key

    # what the user sees: the progress bar and the loggers show the same ft/ figures each step; group 0's
    # participants dropped to 1 for exactly the outage, its failures count the lost group from the step after the
    # kill; the healed group shows its heal time from its first step and no failure
    for s in killed + alive + healed:
        assert s["bar"] == s["logged"] and s["bar"]["ft/participants"] == s["participants"], s
    assert [s["step"] for s in alive if s["bar"]["ft/participants"] == 1 and s["step"] > kill] == outage
    assert [s["bar"]["ft/failures"] for s in alive] == [int(s["step"] > kill) for s in alive], alive
    (heal_s,) = {s["bar"]["ft/heal_s"] for s in healed}
    assert 0 < heal_s < 60, healed
    assert all(s["bar"]["ft/failures"] == 0 for s in healed)
    # the ledger: torchft's all-reduce across the groups, every step, one rank's gradient payload (fp64) whether
    # one group took part or two (a group of one rank: one DDP bucket; of two: each FSDP2 unit's padded shard; a
    # pipeline stage: its gradients in one call after the schedule)
    payload = lambda s: [1, s["stage_bytes"]] if pipeline else list(cross_group_payload(shard))  # noqa: E731
    assert all(s["cross"] == payload(s) for s in killed + alive + healed)

    # data accounting: committed step k trained the participants' parts of global batch k - 1 (32 an epoch, shuffled
    # per epoch), nothing else; a step with one group drops the other's part, no other sample is dropped
    samples = _committed_samples(launches, shard)
    last = max(samples)
    assert list(samples) == list(range(1, last + 1)), "every step up to the last committed, each once"
    start = min(s["step"] for s in killed + alive if s["participants"] == 2)
    trained, dropped = [], []
    for k, parts in samples.items():
        epoch, index = divmod(k - 1, 32)
        records = [s for s in alive + killed + healed if s["step"] == k]
        assert all(s["epoch"] == epoch and s["batch"] == [index] for s in records), (k, records)
        assert len(parts) == records[0]["participants"], (k, parts)
        if sorted(parts) != [0, 1]:  # one group: the outage, or the start before the other group joined
            assert k in outage or k < start, (k, sorted(parts))
        for g in (0, 1):
            own = _part(g, shard, epoch, index)
            assert sorted(parts.get(g, own)) == own, (k, g)
            (trained if g in parts else dropped).extend((epoch, i) for i in own)
    assert len(trained) == len(set(trained)), "no sample trained twice in an epoch"
    assert len(trained) + len(dropped) == 16 * last and set(trained).isdisjoint(dropped)

    g0, g1 = (_heal_state(tmp_path, g, ranks if pipeline else 1) for g in (0, 1))
    assert g0.keys() == g1.keys() and any(k.startswith("opt.") for k in g0)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)  # weights and AdamW moments and step counts
    replay = _replay(samples)
    assert replay.keys() == g0.keys()
    floats = [k for k in g0 if g0[k].is_floating_point() and g0[k].dim() > 0]
    assert max_rel_diff({k: g0[k] for k in floats}, {k: replay[k] for k in floats}) <= 1e-12
    print(f"group 1 failed after step {kill}; group 0 alone for {len(outage)} steps; group 1 healed at {outage[-1]};"
          f" {last} committed steps, {len(trained)} samples trained, {len(dropped)} dropped; progress bar: group 0"
          f" {alive[-1]['bar']} at the end, group 1 {healed[0]['bar']} after its heal")  # fmt: skip


def _steps_by_rank0(rows: list[dict], shard: int) -> list[dict]:
    """One launch's step records, rank 0's; every rank of the group took the same steps on the same batch."""
    mine = [r for r in rows if r["kind"] == "step" and r["rank"] == 0]
    for rank in range(1, shard):
        theirs = [r for r in rows if r["kind"] == "step" and r["rank"] == rank]
        keys = ("step", "participants", "committed", "batch", "global_step", "lr")
        assert [{k: r[k] for k in keys} for r in theirs] == [{k: r[k] for k in keys} for r in mine[: len(theirs)]]
    return mine


def _heal_state(out: Path, group: int, files: int) -> dict[str, torch.Tensor]:
    """A group's saved weights and AdamW state: one file, or one per pipeline rank (its stage's), joined."""
    if files == 1:
        return torch.load(out / f"heal_g{group}.pt", weights_only=True)
    state: dict[str, torch.Tensor] = {}
    for rank in range(files):
        state.update(torch.load(out / f"heal_g{group}_r{rank}.pt", weights_only=True))
    return state


def _committed_samples(launches: dict[str, list[dict]], readers: int) -> dict[int, dict[int, list[int]]]:
    """committed step -> replica group -> the sample indices its `readers` data-parallel ranks trained in it (a
    pipeline's stages read the same batch: its rank 0 counts)."""
    out: dict[int, dict[int, list[int]]] = {}
    for rows in launches.values():
        for r in rows:
            if r["kind"] == "step" and r["committed"] and r["rank"] < readers:
                part = out.setdefault(r["step"], {}).setdefault(r["group"], [])
                assert not set(part) & set(r["indices"]), ("trained twice", r)
                part += r["indices"]
    return dict(sorted(out.items()))


def _part(group: int, shard: int, epoch: int, index: int) -> list[int]:
    """Replica group `group`'s part of global batch `index` of `epoch` (16 samples of 512): its ranks' batches of
    torch's DistributedSampler over both groups' ranks, as plain hsdp 2 x `shard` reads them."""
    from torch.utils.data import DistributedSampler

    width, per_rank = 2 * shard, 16 // (2 * shard)
    out = []
    for rank in range(group * shard, (group + 1) * shard):
        sampler = DistributedSampler(range(512), num_replicas=width, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        out += list(sampler)[index * per_rank : (index + 1) * per_rank]
    return sorted(out)


def _replay(samples: dict[int, dict[int, list[int]]]) -> dict[str, torch.Tensor]:
    """One device, committed step by committed step: AdamW on the union of the participating groups' samples (their
    mean loss), StepLR(16, 0.7) stepped after each, as the scenario's `Indexed` module."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = MLP().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=16, gamma=0.7)
    x, y = dataset(512).tensors
    for parts in samples.values():
        index = torch.tensor(sorted(i for indices in parts.values() for i in indices))
        opt.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        opt.step()
        sched.step()
    state = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    state.update({f"opt.model.{n}.{k}": v for n, p in model.named_parameters() for k, v in opt.state[p].items()})
    return state


DILOCO_EVERY = 2  # the heal_diloco scenario's sync_every


def test_killed_group_heals_under_diloco_and_equals_the_outer_loop_of_the_committed_syncs(tmp_path):
    """``sync="diloco"`` (sync_every 2, 2 groups of 1 rank, the cluster way on loopback): group 1 SIGKILLed right
    after a sync, restarted, healed, SIGKILLed again one inner step past a sync, restarted, healed; group 0 syncs on
    alone through both outages. Each restarted group trains its own first interval, then heals in its first sync
    from group 0 (local weights, inner AdamW, DiLoCo's global weights and outer momentum, DiLoCo's inner steps,
    Lightning's loop, the LR scheduler, the loader position, the RNG) and from then on reads and trains group 0's
    global batches, its own parts. At the end both groups hold bitwise-identical weights, global weights and outer
    optimizer state, equal (fp64, <= 1e-12) to DiLoCo written with torch over exactly the committed syncs: each
    sync's participants' intervals (a healing group contributes a copy of its source's pseudo-gradient), and the inner
    AdamW states of both groups equal the replay's."""
    marker, total = uuid.uuid4().hex, 10
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, group: int, kill: str, port: int) -> tuple[subprocess.Popen, str]:
        # output to files: group 0 prints a few hundred lines while its pipe would not be read
        env = _env({"LD_FAULT_MARKER": marker, "MASTER_PORT": str(port)})
        argv = [sys.executable, SCRIPT, "heal_diloco", str(group), str(tmp_path), address, str(total), kill]
        with open(logs / f"{name}.out", "w") as out, open(logs / f"{name}.err", "w") as err:
            started.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=err, text=True))
        return started[-1], name

    def wait(*procs: tuple[subprocess.Popen, str], timeout: float = 240) -> list[subprocess.CompletedProcess]:
        for p, _ in procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q, _ in procs:
                    q.kill()
                raise
        read = lambda name, kind: (logs / f"{name}.{kind}").read_text()  # noqa: E731
        return [subprocess.CompletedProcess(p.args, p.returncode, read(n, "out"), read(n, "err")) for p, n in procs]

    started: list[subprocess.Popen] = []
    with lighthouse(29648, marker, "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "2000") as address:
        began = time.monotonic()
        try:
            group0 = start("alive", 0, "none", 29670)
            (first,) = wait(start("at_sync", 1, "sync", 29671))
            assert first.returncode == -9, first.stderr[-6000:]
            (second,) = wait(start("between", 1, "between", 29672))
            assert second.returncode == -9, second.stderr[-6000:]
            done = wait(group0, start("healed", 1, "none", 29673), timeout=420)
        finally:
            for p in started:  # a failed assertion above: nothing left running
                if p.poll() is None:
                    p.kill()
                    p.wait()
    all_ok(done, marker)
    _check_diloco_heal(tmp_path, total=total, seconds=time.monotonic() - began)


def _check_diloco_heal(out: Path, *, total: int, seconds: float) -> None:
    """The checks of the DiLoCo kill-and-heal test on its launches' output (OUT/logs/{name}.out) and saved states."""
    read = lambda name: subprocess.CompletedProcess([], 0, (out / "logs" / f"{name}.out").read_text(), "")  # noqa: E731
    launches = {name: results(read(name)) for name in ("at_sync", "between", "alive", "healed")}
    inner = {name: [r for r in rows if r["kind"] == "inner"] for name, rows in launches.items()}
    syncs = {name: [r for r in rows if r["sync"] is not None] for name, rows in inner.items()}
    alive = syncs["alive"]
    assert all(r["sync"]["committed"] for rows in syncs.values() for r in rows)
    steps = [r["sync"]["step"] for r in alive]
    assert steps == list(range(steps[0], steps[0] + len(steps))), steps  # group 0 never stopped syncing

    # the two kills: right after a sync both groups took; one inner step past one
    at_sync, between = inner["at_sync"], inner["between"]
    assert at_sync[-1]["sync"] is not None and at_sync[-1]["sync"]["participants"] == 2, at_sync[-1]
    assert at_sync[-1]["sync"]["step"] >= 3
    assert between[-1]["sync"] is None and between[-1]["inner_steps"] % DILOCO_EVERY == 1, between[-1]
    assert syncs["between"][-1]["sync"]["participants"] == 2 and len(syncs["between"]) >= 2
    kills = [at_sync[-1]["sync"]["step"], syncs["between"][-1]["sync"]["step"]]
    # each restarted launch: its own first interval (global batches 0 and 1 of epoch 0), then a heal in its first
    # sync, the one after group 0's last sync alone; group 0 synced alone from the sync after the kill until then
    outages = []
    for name, kill in zip(("between", "healed"), kills):
        rows = inner[name]
        own, heal = rows[:DILOCO_EVERY], rows[DILOCO_EVERY - 1]
        assert [(r["epoch"], r["batch"]) for r in own] == [(0, 0), (0, 1)] and own[0]["global_step"] == 1, own
        assert heal["sync"] is not None and heal["heals"] == 1 and heal["sync"]["participants"] == 2, heal
        assert 0 < heal["bar"]["ft/heal_s"] < 60, heal
        outage = [r["sync"]["step"] for r in alive if kill < r["sync"]["step"] < heal["sync"]["step"]]
        assert outage == list(range(kill + 1, heal["sync"]["step"])) and outage, (kill, heal["sync"])
        assert all(r["sync"]["participants"] == 1 for r in alive if r["sync"]["step"] in outage)
        outages.append(outage)
        # healed in the sync: from there on the same global batch, Lightning global step, DiLoCo inner steps,
        # loader position, LR and random draw as group 0 at every inner step
        by_step = {r["global_step"]: r for r in inner["alive"]}
        same = ("epoch", "batch", "global_step", "inner_steps", "position", "lr", "draw")
        after = rows[DILOCO_EVERY:]
        assert after and [{k: r[k] for k in same} for r in after] == [
            {k: by_step[r["global_step"]][k] for k in same} for r in after
        ]
        assert {k: heal[k] for k in ("global_step", "inner_steps", "position")} == {
            k: by_step[heal["global_step"]][k] for k in ("global_step", "inner_steps", "position")
        }, heal
        assert all(r["sync"]["participants"] == 2 for r in rows if r["sync"] is not None)
    assert syncs["healed"][-1]["sync"]["step"] == alive[-1]["sync"]["step"] >= total
    # what the user sees: the progress bar and the loggers agree at every sync; participants as the quorum's
    for rows in syncs.values():
        for r in rows:
            assert r["bar"] == r["logged"] and r["bar"]["ft/participants"] == r["sync"]["participants"], r
    # the ledger: the pseudo-gradients' all-reduce across the groups at each sync (every parameter, its own call),
    # nothing across the groups between syncs
    params = list(MLP().parameters())
    payload = [len(params), 8 * sum(p.numel() for p in params)]
    for rows in inner.values():
        assert all(r["cross"] == (payload if r["sync"] is not None else None) for r in rows), rows
    # every inner step read this group's part of the global batch it says (torch's DistributedSampler, shuffled)
    for rows in inner.values():
        for r in rows:
            assert sorted(r["indices"]) == _part(r["group"], 1, r["epoch"], r["batch"]), r

    g0 = torch.load(out / "heal_diloco_g0.pt", weights_only=True)
    g1 = torch.load(out / "heal_diloco_g1.pt", weights_only=True)
    assert g0.keys() == g1.keys()
    shared = [k for k in g0 if not k.startswith("opt.")]  # the inner AdamW state is each group's own since its heal
    assert any(k.startswith("outer.") for k in shared) and any(k.startswith("global.") for k in shared)
    assert all(torch.equal(g0[k], g1[k]) for k in shared)  # weights, global weights, outer momentum
    assert all(g0[k].abs().max() > 0 for k in shared if k.startswith("outer."))
    trace: dict[int, float] = {}
    replay = _diloco_heal_replay([inner[name] for name in ("at_sync", "between", "alive", "healed")], trace)
    for rows in syncs.values():  # after every sync of every launch, its weights are the replay's global weights
        for r in rows:
            want = trace[r["sync"]["step"]]
            assert abs(r["weights"] - want) <= 1e-12 * want, (r["sync"], r["weights"], want)
    diffs = {}
    for g, state in ((0, g0), (1, g1)):
        want = replay[g]
        assert want.keys() == state.keys(), (sorted(want), sorted(state))
        floats = [k for k in state if state[k].is_floating_point() and state[k].dim() > 0]
        diffs[g] = max_rel_diff({k: state[k] for k in floats}, {k: want[k] for k in floats})
        assert diffs[g] <= 1e-12, (g, diffs[g])
        assert all(torch.equal(state[k], want[k]) for k in state if k not in floats)  # AdamW step counts
    heal_s = [inner[name][DILOCO_EVERY - 1]["bar"]["ft/heal_s"] for name in ("between", "healed")]
    print(f"DiLoCo kill and heal: group 1 killed after sync {kills[0]} and between syncs after {kills[1]}; group 0"
          f" synced alone {len(outages[0])} and {len(outages[1])} times; healed at syncs"
          f" {[o[-1] + 1 for o in outages]} in {heal_s[0]:.2f} s and {heal_s[1]:.2f} s; {alive[-1]['sync']['step']}"
          f" syncs; replay {diffs[0]:.1e} / {diffs[1]:.1e}; {seconds:.0f} s")  # fmt: skip


def _diloco_heal_replay(
    launches: list[list[dict]], trace: dict[int, float] | None = None
) -> dict[int, dict[str, torch.Tensor]]:
    """DiLoCo by hand over the committed syncs of `launches` (each launch's inner-step records, in order): per group a
    local copy with its AdamW and StepLR(16, 0.7); at each sync its participants' intervals trained on the recorded
    samples, a healing group's local copy, AdamW and StepLR replaced by its source's after the source's interval (its
    own interval dropped), the pseudo-gradients averaged over the participants, torch's SGD (lr 0.7, momentum 0.9,
    Nesterov) on the global copy, the participants' copies reset to it. A killed launch's steps after its last sync
    are in no sync. Returns per group what the scenario saves: weights, inner AdamW state, global weights, outer
    momentum. `trace`: filled with the sum of the global weights' magnitudes after each sync, by torchft's step."""
    import copy

    import torch.nn.functional as F

    committed: dict[int, dict[int, tuple[list[dict], bool, int]]] = {}
    for rows in launches:
        interval, heals = [], 0
        for r in rows:
            interval.append(r)
            if r["sync"] is not None:
                healed, heals = r["heals"] > heals, r["heals"]
                committed.setdefault(r["sync"]["step"], {})[r["group"]] = (interval, healed, r["sync"]["participants"])
                interval = []
    assert sorted(committed) == list(range(1, max(committed) + 1)), sorted(committed)
    torch.manual_seed(0)
    global_model = MLP().double()
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    x, y = dataset(512).tensors

    def fresh():
        model = copy.deepcopy(global_model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=16, gamma=0.7)

    local = {0: fresh(), 1: fresh()}
    taken: set[int] = set()  # groups in the last sync
    for step in sorted(committed):
        parts = committed[step]
        assert {n for _, _, n in parts.values()} == {len(parts)}, (step, parts)
        sources = [g for g, (_, healed, _) in parts.items() if not healed]
        assert sources, (step, parts)
        for g in sources:
            interval = parts[g][0]
            assert len(interval) == DILOCO_EVERY, (step, g, interval)
            assert g in taken or step == 1, (step, g)  # a group not in the last sync heals (or it is the first)
            model, opt, sched = local[g]
            for r in interval:
                index = torch.tensor(r["indices"])
                opt.zero_grad()
                F.cross_entropy(model(x[index]), y[index]).backward()
                opt.step()
                sched.step()
        for g in parts:
            if g not in sources:  # healing: the source's local copy, inner optimizer and schedule
                model, opt, sched = fresh()
                src = local[sources[0]]
                model.load_state_dict(src[0].state_dict())
                opt.load_state_dict(copy.deepcopy(src[1].state_dict()))  # torch would alias the source's tensors
                sched.load_state_dict(src[2].state_dict())
                local[g] = (model, opt, sched)
        with torch.no_grad():
            for name, p in global_model.named_parameters():
                copies = [dict(local[g][0].named_parameters())[name] for g in parts]
                p.grad = sum(p - q for q in copies) / len(copies)
        outer.step()
        outer.zero_grad()
        for g in parts:
            local[g][0].load_state_dict(global_model.state_dict())
        taken = set(parts)
        if trace is not None:
            trace[step] = sum(p.detach().abs().sum().item() for p in global_model.parameters())
    out = {}
    for g, (model, opt, _) in local.items():
        state = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
        state.update({f"opt.model.{n}.{k}": v for n, p in model.named_parameters() for k, v in opt.state[p].items()})
        state.update({f"global.model.{n}": p.detach().clone() for n, p in global_model.named_parameters()})
        state.update(
            {f"outer.model.{n}.{k}": v for n, p in global_model.named_parameters() for k, v in outer.state[p].items()}
        )
        out[g] = state
    return out
