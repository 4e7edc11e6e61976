"""Pipeline plans in one process: stage split arithmetic, printing, stage modules, schedule checks, bad input."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.mesh import MeshSpec
from lightning_dist.parallelize.pipeline.checks import batchnorm_modules, shared_across_stages, tied_stages
from lightning_dist.parallelize.pipeline.schedule import schedule_problems
from lightning_dist.parallelize.pipeline.split import (
    PrunedLayout,
    build_stage_module,
    network_layout,
    plan_split,
    profile_costs,
)
from lightning_dist.rules import bubble_theory, partition, stage_ranks
from lightning_dist.strategies import REGISTERED
from lightning_dist.strategies.pipeline.strategy import PipelineStrategy


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, depth: int = 8, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _brute_force(costs, stages, first, last):
    n, best = len(costs), float("inf")
    for points in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *points, n]
        worst = max(
            sum(costs[bounds[s] : bounds[s + 1]]) + (first if s == 0 else 0) + (last if s == stages - 1 else 0)
            for s in range(stages)
        )
        best = min(best, worst)
    return best


def _max_cost(costs, points, first, last):
    bounds = [0, *points, len(costs)]
    s_count = len(bounds) - 1
    return max(
        sum(costs[bounds[s] : bounds[s + 1]]) + (first if s == 0 else 0) + (last if s == s_count - 1 else 0)
        for s in range(s_count)
    )


def test_layout_of_stem_blocks_head_and_sequential():
    lay = network_layout(Net(depth=3))
    assert (lay.stem, lay.block_list, lay.blocks, lay.head) == (("stem",), "blocks", ("0", "1", "2"), ("head",))
    seq = network_layout(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
    assert (seq.stem, seq.block_list, seq.blocks, seq.head) == ((), None, ("0", "1", "2"), ())


def test_layout_refuses_unsplittable_networks():
    with pytest.raises(TypeError, match="taken out of the child holding them: it has no nn.ModuleList of blocks"):
        network_layout(nn.Linear(2, 2))

    class Direct(Net):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

    with pytest.raises(TypeError, match=r"holds parameters directly \(\['scale'\]\)"):
        network_layout(Direct())


def test_partition_is_optimal_and_simple_cases():
    assert partition([1, 1, 1, 1], 2) == [2]
    assert partition([1, 1, 1, 1], 2, first=2) == [1]  # the stem weighs on stage 0
    assert partition([1, 1, 1, 9], 2) == [3]
    assert (
        partition([5, 1, 1, 1, 1, 1], 3)[0] == 1
        and _max_cost([5, 1, 1, 1, 1, 1], partition([5, 1, 1, 1, 1, 1], 3), 0, 0) == 5
    )
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(2, 8)
        s = rng.randint(1, n)
        costs = [rng.uniform(0.1, 5) for _ in range(n)]
        first, last = rng.uniform(0, 3), rng.uniform(0, 3)
        points = partition(costs, s, first=first, last=last)
        assert len(points) == s - 1 and points == sorted(set(points)) and all(0 < p < n for p in points)
        assert _max_cost(costs, points, first, last) == pytest.approx(_brute_force(costs, s, first, last))


def test_params_split_covers_every_block_once():
    net = Net(depth=8)
    split = plan_split(net, 4, split="params")
    blocks = [b for s in split.stages for b in s.blocks]
    assert blocks == list(range(8))
    assert split.stages[0].stem and split.stages[-1].head and not split.stages[1].stem
    assert sum(s.params for s in split.stages) == sum(p.numel() for p in net.parameters())
    assert split.method == "params" and split.num_stages == 4
    assert split.stage_of_block(7) == 3


def test_manual_and_balanced_splits():
    net = Net(depth=6)
    manual = plan_split(net, 3, split=[1, 4])
    assert [s.blocks for s in manual.stages] == [(0,), (1, 2, 3), (4, 5)]
    # measured costs (ms): the heavy last block gets a stage of its own
    balanced = plan_split(net, 2, split="balanced", costs=(0.0, [1, 1, 1, 1, 1, 6], 0.5))
    assert [s.blocks for s in balanced.stages] == [(0, 1, 2, 3, 4), (5,)]
    assert balanced.stages[1].cost == pytest.approx(6.5) and balanced.cost_unit == "ms"
    assert balanced.imbalance() == pytest.approx(6.5 / ((5 + 6.5) / 2))


def test_profile_costs_measures_every_part_and_checks_forward_order():
    net = Net(depth=3).double()
    stem, blocks, head = profile_costs(net, network_layout(net), torch.randn(4, 4, dtype=torch.float64))
    assert len(blocks) == 3 and all(t > 0 for t in (stem, head, *blocks))
    assert all(p.grad is None for p in net.parameters())  # profiling leaves no gradients behind

    class Residual(Net):
        def forward(self, x):  # not its children in order: a skip around everything
            return super().forward(x) + self.head(self.stem(x))

    with pytest.raises(ValueError, match="a residual add outside the blocks"):
        plan_split(Residual(depth=2), 2, split="balanced", sample=torch.randn(2, 4))


def test_bad_splits_raise_with_the_numbers():
    net = Net(depth=3)
    with pytest.raises(ValueError, match="into 4 pipeline stages: it has only 3 blocks"):
        plan_split(net, 4)
    with pytest.raises(ValueError, match=r"Manual split points \[2, 1\] must be 2 strictly increasing"):
        plan_split(net, 3, split=[2, 1])
    with pytest.raises(ValueError, match="must be 1 strictly increasing"):
        plan_split(net, 2, split=[1, 2])
    with pytest.raises(ValueError, match="example_input_array"):
        plan_split(net, 2, split="balanced")
    with pytest.raises(ValueError, match='must be "balanced", "params"'):
        plan_split(net, 2, split="fast")


def test_split_prints_as_a_table():
    split = plan_split(Net(depth=8), 2, split="params")
    text = split.format(stage_ranks=[0, 1])
    assert "Pipeline split (params, 2 stages" in text
    assert "stem + blocks.0..3" in text and "blocks.4..7 + head" in text
    rows = split.rows()
    assert [r["stage"] for r in rows] == [0, 1] and rows[0]["params"] == split.stages[0].params
    assert f"{rows[1]['params']:,}" in text


def test_stage_modules_keep_original_names_and_compose_to_the_network():
    torch.manual_seed(0)
    net = Net(depth=8).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    expected = net(x)
    full_keys = set(net.state_dict())
    split = plan_split(net, 4, split="params")
    mods = [build_stage_module(net, split, [s]) for s in range(4)]
    keys = [set(m.state_dict()) for m in mods]
    assert set().union(*keys) == full_keys and sum(len(k) for k in keys) == len(full_keys)
    assert "stem.weight" in keys[0] and "head.weight" in keys[3]
    assert all(k.startswith(f"blocks.{i}.") for k in keys[1] for i in [int(k.split(".")[1])])
    y = x
    for m in mods:
        y = m(y)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    # a rank with two stages (interleaved: 0 and 2) holds the union under the same names
    both = build_stage_module(net, split, [0, 2])
    assert set(both.state_dict()) == keys[0] | keys[2]


def test_sequential_stage_modules():
    seq = nn.Sequential(*(nn.Linear(3, 3) for _ in range(4)))
    split = plan_split(seq, 2, split=[1])
    first, rest = build_stage_module(seq, split, [0]), build_stage_module(seq, split, [1])
    assert set(first.state_dict()) == {"0.weight", "0.bias"}
    assert set(rest.state_dict()) == {f"{i}.{p}" for i in (1, 2, 3) for p in ("weight", "bias")}
    x = torch.randn(2, 3)
    torch.testing.assert_close(rest(first(x)), seq(x))


def test_tied_weights_across_stages_are_named():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    net[3].weight = net[0].weight
    across = shared_across_stages(net, plan_split(net, 2, split=[2]))
    assert across == [("0.weight", "3.weight")]
    net2 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    net2[1].weight = net2[0].weight
    assert shared_across_stages(net2, plan_split(net2, 2, split=[2])) == []  # tied inside one stage is fine


def test_a_tied_weight_is_saved_once_under_the_unsplit_name_and_every_copy_reads_it():
    from lightning_dist.checkpoint import _alias_flat_optimizer
    from lightning_dist.parallelize.pipeline.tied import save_tied_once, tied_aliases, tied_checkpoint_keys

    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    net[3].weight = net[0].weight
    tied = tied_stages(net, plan_split(net, 2, split=[2]))
    first, last = (tied_checkpoint_keys(net, tied, [0, 1], pp_rank=r, prefix="model.") for r in (0, 1))
    assert first == [("model.0.weight", ("model.0.weight", "model.3.weight"), True)]  # the lowest holder saves
    assert last == [("model.0.weight", ("model.0.weight", "model.3.weight"), False)]
    assert tied_aliases(last) == {"model.3.weight": "model.0.weight"}
    w = "w"  # the values are passed through untouched
    # the last stage holds the tied copy under the head's name: it saves nothing of it; the first saves it once
    assert save_tied_once({"model.3.weight": w, "model.3.bias": "b"}, last) == {"model.3.bias": "b"}
    assert save_tied_once({"model.0.weight": w}, first) == {"model.0.weight": w}
    # one rank holding both stages: one key, under the unsplit model's name
    both = [(k, n, True) for k, n, _ in last]
    assert list(save_tied_once({"model.3.weight": w, "model.0.weight": w}, both)) == ["model.0.weight"]
    osd = {"state.model.3.weight.exp_avg": w, "param_groups.model.3.weight.lr": 0.1, "state.model.3.bias.step": 1}
    assert save_tied_once(osd, last, optimizer=True) == {"state.model.3.bias.step": 1}
    assert save_tied_once(osd, both, optimizer=True) == {
        "state.model.0.weight.exp_avg": w,
        "param_groups.model.0.weight.lr": 0.1,
        "state.model.3.bias.step": 1,
    }
    # loading: the copy's optimizer keys read the saved entries
    assert _alias_flat_optimizer(osd, tied_aliases(last)) == {
        "state.model.3.weight.exp_avg": "state.model.0.weight.exp_avg",
        "param_groups.model.3.weight.lr": "param_groups.model.0.weight.lr",
        "state.model.3.bias.step": "state.model.3.bias.step",
    }


def test_stage_ranks_loop_and_v():
    assert stage_ranks(4, 2, "loop") == [0, 1, 0, 1]
    assert stage_ranks(4, 2, "v") == [0, 1, 1, 0]
    assert stage_ranks(8, 4, "v") == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="do not divide"):
        stage_ranks(5, 2)


def test_schedule_problems():
    assert schedule_problems("1f1b", 2, 4, 1) == []
    assert schedule_problems("gpipe", 4, 1, 1) == []
    assert "n_microbatches >= pp = 4" in schedule_problems("1f1b", 4, 2, 1)[0]
    assert "stages_per_rank=2" in " ".join(schedule_problems("zero_bubble", 2, 4, 3))
    assert "2*pp-1 = 7" in " ".join(schedule_problems("zero_bubble", 4, 4, 2))
    assert (
        "multiple of the rounds" in " ".join(schedule_problems("interleaved_1f1b", 4, 10, 2))
        or schedule_problems("interleaved_1f1b", 4, 10, 2) == []
    )  # 10 // 4 = 2 rounds: 10 % 2 == 0 is fine
    assert "multiple of the rounds" in " ".join(schedule_problems("interleaved_1f1b", 2, 5, 2))
    assert "one stage per rank" in " ".join(schedule_problems("1f1b", 2, 4, 2))
    assert "must be one of" in schedule_problems("pipedream", 2, 4, 1)[0]
    assert bubble_theory(2, 4) == pytest.approx(1 / 5)


class _Module(__import__("lightning.pytorch", fromlist=["LightningModule"]).LightningModule):
    def __init__(self, net=None, loss=True):
        super().__init__()
        self.model = net if net is not None else Net(depth=4)
        if loss:
            self.pipeline_loss = lambda out, y: torch.nn.functional.cross_entropy(out, y)


def _validate(module, **kw):
    strategy = PipelineStrategy(pp=2, split="params", **kw)
    strategy.connect(module)
    strategy.validate_config(MeshSpec(world_size=2, devices_per_node=2, pp=2).resolve())
    return strategy


def test_module_contract_is_checked_before_any_collective():
    _validate(_Module())  # fine
    with pytest.raises(ValueError, match=r"has no `pipeline_loss\(output, target\)`"):
        _validate(_Module(loss=False))
    with pytest.raises(ValueError, match="schedule='1f1b' needs n_microbatches >= pp = 2"):
        _validate(_Module(), n_microbatches=1)
    with pytest.raises(ValueError, match="only 4 blocks"):
        _validate(_Module(), schedule="interleaved_1f1b", stages_per_rank=3)
    strategy = PipelineStrategy(pp=2, split="params", network="backbone")
    strategy.connect(_Module())
    with pytest.raises(ValueError, match=r"_Module.backbone must be the network to pipeline"):
        strategy.validate_config(MeshSpec(world_size=2, devices_per_node=2, pp=2).resolve())
    auto = PipelineStrategy(pp=2)  # split="auto": by parameters without a sample micro-batch
    auto.connect(_Module())
    auto.validate_config(MeshSpec(world_size=2, devices_per_node=2, pp=2).resolve())
    assert auto.split_mode() == "params"
    balanced = PipelineStrategy(pp=2, split="balanced")
    balanced.connect(_Module())
    with pytest.raises(ValueError, match="example_input_array"):
        balanced.validate_config(MeshSpec(world_size=2, devices_per_node=2, pp=2).resolve())


def test_tied_weights_are_trained_across_stages_and_batchnorm_refused_with_names():
    tied = Net(depth=4, width=4)
    tied.stem = nn.Linear(4, 4)
    tied.head = nn.Linear(4, 4)
    tied.head.weight = tied.stem.weight
    _validate(_Module(net=tied))  # issue 14: a copy on each holding stage, gradients summed every step
    assert tied_stages(tied, plan_split(tied, 2, split=[2])) == [(("stem.weight", "head.weight"), (0, 1))]
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    assert batchnorm_modules(bn) == ["1"]
    with pytest.raises(ValueError, match=r"BatchNorm layers \['1'\] would normalize each micro-batch"):
        _validate(_Module(net=bn))
    with pytest.warns(UserWarning, match="Pipelining BatchNorm"):
        _validate(_Module(net=bn), allow_batchnorm=True)


def test_options_and_registration():
    with pytest.raises(ValueError, match="must be one of"):
        PipelineStrategy(schedule="pipedream")
    with pytest.raises(ValueError, match="sharded checkpoints"):
        PipelineStrategy(save_distributed_checkpoint=False)
    s = PipelineStrategy(pp=4, schedule="zero_bubble")
    assert s.stages_per_rank == 2 and s.num_stages == 8 and s.n_microbatches == 8
    names = {
        "pipeline": "1f1b",
        "pipeline_1f1b": "1f1b",
        "pipeline_gpipe": "gpipe",
        "pipeline_interleaved": "interleaved_1f1b",
        "pipeline_zero_bubble": "zero_bubble",
    }
    for name, schedule in names.items():
        cls, _, params = REGISTERED[name]
        assert cls is PipelineStrategy and params.get("schedule", "1f1b") == schedule


def _fake_step(p: int, m: int, tf: float = 1.0, tb: float = 2.0) -> list[dict]:
    """Per-rank records of an ideal GPipe step (equal stages, free communication)."""
    records = []
    for r in range(p):
        events = [(r, "F", i, (r + i) * tf, (r + i + 1) * tf) for i in range(m)]
        b0 = (m + p - 1) * tf + (p - 1 - r) * tb
        events += [(r, "B", i, b0 + i * tb, b0 + (i + 1) * tb) for i in range(m)]
        records.append(
            {
                "rank": r,
                "start": 0.0,
                "end": (m + p - 1) * (tf + tb),
                "events": events,
                "n_microbatches": m,
                "peak_held": {r: m},
            }
        )
    return records


def test_bubble_stats_match_theory_on_an_ideal_schedule(tmp_path):
    from lightning_dist.callbacks.pipeline_bubble import bubble_stats, save_gantt

    for p, m in ((2, 2), (2, 8), (4, 4)):
        stats = bubble_stats(_fake_step(p, m), p)
        assert stats["idle_fraction"] == pytest.approx((p - 1) / (m + p - 1))
        assert stats["ratio"] == pytest.approx(1.0) and stats["peak_held"] == {r: m for r in range(p)}
    pytest.importorskip("matplotlib", reason="matplotlib (the `plot` extra) is not installed")
    path = save_gantt(_fake_step(2, 4), tmp_path / "gantt.png", title="ideal GPipe")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_bubble_chart_without_matplotlib_is_refused_at_construction(monkeypatch, tmp_path):
    from lightning_dist.callbacks import pipeline_bubble

    monkeypatch.setattr(pipeline_bubble, "matplotlib_available", lambda: False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-dist\[plot\]'"):
        pipeline_bubble.PipelineBubble(gantt_path=tmp_path / "g.png")
    assert pipeline_bubble.PipelineBubble(gantt_path=None).gantt_path is None  # no chart: no matplotlib needed


def test_replay_removes_latency_but_keeps_the_schedule_bubble():
    from lightning_dist.callbacks.pipeline_bubble import bubble_stats, replay_idle

    p, m = 2, 4
    ideal = _fake_step(p, m)
    assert replay_idle(ideal) == pytest.approx((p - 1) / (m + p - 1))
    # the same actions, with 0.5 of message latency before every action of rank 1: wall idle grows, replay does not
    late = [
        dict(
            r,
            events=[
                (s, k, mb, t0 + 0.5 * (r["rank"] == 1) * (i + 1), t1 + 0.5 * (r["rank"] == 1) * (i + 1))
                for i, (s, k, mb, t0, t1) in enumerate(r["events"])
            ],
            end=r["end"] + 4.0,
        )
        for r in ideal
    ]
    assert bubble_stats(late, p)["idle_fraction"] > (p - 1) / (m + p - 1) + 0.05
    assert replay_idle(late) == pytest.approx((p - 1) / (m + p - 1))


def _validate_tp(module, tp_plan):
    strategy = PipelineStrategy(pp=2, tp=2, split="params", tp_plan=tp_plan)
    strategy.connect(module)
    strategy.validate_config(MeshSpec(world_size=4, devices_per_node=4, pp=2, tp=2).resolve())
    return strategy


def test_tp_plan_inside_stages_is_checked_on_the_whole_network():
    net = Net(depth=4, width=8)
    net.head = nn.Linear(8, 4)
    # a pattern that matches on one stage only (head) is fine: the plan is checked on the whole network
    _validate_tp(_Module(net=net), {"blocks.*.fc": "colwise_gather", "head": "colwise_gather"})
    with pytest.raises(ValueError, match=r"'blocks\.\*\.attn' \(colwise\) matches no module"):
        _validate_tp(_Module(net=net), {"blocks.*.attn": "colwise"})
    # the loss needs whole outputs: a column-sharded last layer is refused with the fix
    with pytest.raises(ValueError, match=r"model\.head \(Linear, colwise\) leaves its output split.*colwise_gather"):
        _validate_tp(_Module(net=net), {"head": "colwise"})
    with pytest.raises(ValueError, match=r"hidden|divisible|not divide"):
        _validate_tp(_Module(net=Net(depth=4, width=8)), {"head": "colwise_gather"})  # 3 outputs over tp=2
    with pytest.raises(ValueError, match="`tp_plan` must be .auto., a built-in plan name or a mapping.*got int"):
        PipelineStrategy(pp=2, tp=2, tp_plan=3)


def test_global_grad_norm_of_plain_gradients_matches_torch():
    from lightning_dist.grads import global_grad_norm

    grads = [torch.randn(3, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    want = torch.nn.utils.get_total_norm(grads)
    assert global_grad_norm(grads, None, device=torch.device("cpu")).item() == pytest.approx(want.item(), rel=1e-15)


def test_the_pipeline_view_is_what_callbacks_read():
    from lightning_dist.parallelize.pipeline.split import PipelineView, pipeline_view
    from lightning_dist.strategies import FullyShardStrategy

    s = PipelineStrategy(pp=2)
    view = pipeline_view(s)
    assert isinstance(view, PipelineView) and view.stage_modules == [] and view.network == "model"
    s.timelines.append({"events": []})
    assert view.pop_timelines() == [{"events": []}] and view.pop_timelines() == []
    assert pipeline_view(FullyShardStrategy()) is None and pipeline_view(object()) is None
    import inspect

    import lightning_dist.callbacks.gradient_parity as gp
    import lightning_dist.callbacks.pipeline_bubble as pb

    for module in (gp, pb):  # callbacks never import a strategy class
        src = inspect.getsource(module)
        assert "from lightning_dist.strategies" not in src and "import lightning_dist.strategies" not in src
        assert "_runner" not in src and ".timelines" not in src


def test_bubble_theory_takes_the_stages_per_rank():
    assert bubble_theory(2, 4, 1) == bubble_theory(2, 4) == pytest.approx(1 / 5)
    assert bubble_theory(2, 4, 2) == pytest.approx(1 / 9)  # interleaving: the warm-up is v times shorter
    assert bubble_theory(4, 8, 2) == pytest.approx(3 / 19)


def test_tied_weights_on_two_stages_of_one_rank_are_refused_under_fsdp():
    from lightning_dist.parallelize.pipeline.tied import tied_problems

    tied = [(("stem.weight", "head.weight"), (0, 3))]
    assert tied_problems(tied, [0, 1, 1, 0], dp_size=1) == []  # ZBV: one rank, one tensor, no FSDP
    (problem,) = tied_problems(tied, [0, 1, 1, 0], dp_size=2)
    assert "held by stages [0, 3], two of them on one rank" in problem
    assert tied_problems(tied, [0, 1, 0, 1], dp_size=2) == []  # interleaved: ranks 0 and 1 hold a copy each
    (problem,) = tied_problems(tied, [0, 1, 0, 1], dp_size=1, tp_size=2)
    assert "tied across pipeline stages [0, 3] and tp=2" in problem and "Untie it, or use tp=1" in problem


def _litgpt(**kw):
    litgpt = pytest.importorskip("litgpt", reason="litgpt is not installed (make install adds it --no-deps)")
    torch.manual_seed(0)
    config = dict(n_layer=4, n_head=2, n_embd=32, block_size=32, vocab_size=64, padded_vocab_size=64)
    return litgpt.GPT(litgpt.Config(**{**config, **kw})).double()


def test_litgpt_gpt_splits_as_the_model_with_the_blocks_it_does_not_own_taken_out():
    import copy

    from lightning_dist.parallelize.pipeline.checks import staged_forward_problem
    from lightning_dist.parallelize.pipeline.split import PrunedLayout, join_stages

    net = _litgpt()
    lay = network_layout(net)  # the block list inside the ModuleDict `transformer`, lm_head registered first
    assert (lay.block_list, lay.blocks, lay.stem, lay.head, type(lay)) == (
        "transformer.h",
        ("0", "1", "2", "3"),
        ("transformer.wte",),
        ("transformer.ln_f", "lm_head"),
        PrunedLayout,
    )
    x = torch.randint(0, 64, (2, 8))
    assert staged_forward_problem(net, x) is None  # every block boundary handed over, against the model
    split = plan_split(net, 2, split="params")
    first, last = (build_stage_module(net, split, [s]) for s in (0, 1))
    # each stage holds its parts under the single-device names, nothing else
    assert sorted({".".join(n.split(".")[:2]) for n, _ in first.named_parameters()}) == [
        "transformer.h",
        "transformer.wte",
    ]
    assert [k for k in last.get_submodule("transformer.h")._modules] == ["2", "3"]
    assert sorted(n for s in (first, last) for n, _ in s.named_parameters()) == sorted(
        n for n, _ in net.named_parameters()
    )
    with torch.no_grad():  # stage 0: ids in, hidden states out; stage 1: hidden states in, logits out
        hidden = first.run_local(x)
        assert hidden.shape == (2, 8, 32) and torch.equal(last.run_local(hidden), net(x))
    whole = join_stages(split, [copy.deepcopy(first), copy.deepcopy(last)])  # what GradientParityCheck gathers
    assert type(whole) is type(net) and torch.equal(whole(x), net(x))
    stem, blocks, head = profile_costs(net, lay, x, repeats=1)  # split="balanced": timed inside its own forward
    assert len(blocks) == 4 and all(b > 0 for b in blocks)


def test_litgpt_forward_with_work_between_its_parts_splits():
    from lightning_dist.parallelize.pipeline.checks import staged_forward_problem

    # Gemma's embedding scale, x * sqrt(n_embd) after the lookup: each stage runs litgpt's forward on the ids, a later
    # stage's first block takes the activation handed on, so the scale is applied once, on the first stage
    assert staged_forward_problem(_litgpt(scale_embeddings=True), torch.randint(0, 64, (2, 8))) is None


def test_lightning_demo_transformer_is_refused_as_an_encoder_decoder_with_two_inputs():
    from lightning.pytorch.demos import Transformer

    with pytest.raises(TypeError) as err:
        network_layout(Transformer(vocab_size=33, ninp=16, nhead=2, nhid=16, nlayers=2))
    text = str(err.value)
    assert "2 block lists ('transformer.encoder.layers', 'transformer.decoder.layers')" in text
    assert "its forward takes 2 inputs (inputs, target): an encoder-decoder" in text
    assert "an nn.Sequential (its children are the blocks): it is not one" in text


def test_nested_block_list_refusals_name_the_route_and_why():
    class NoForward(nn.Module):  # litgpt's shape without a forward
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(8, 10)
            self.transformer = nn.ModuleDict(
                dict(wte=nn.Embedding(10, 8), h=nn.ModuleList(nn.Linear(8, 8) for _ in range(4)))
            )

    class TwoInputs(NoForward):
        def forward(self, ids, positions):
            return self.lm_head(self.transformer.h[0](self.transformer.wte(ids + positions)))

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Module()
            self.body.inner = nn.Module()
            self.body.inner.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            return x

    for net, why in (
        (NoForward(), "NoForward defines no forward"),
        (TwoInputs(), "its forward takes 2 required inputs (ids, positions)"),
    ):
        with pytest.raises(TypeError) as err:
            network_layout(net)
        assert f"taken out of the child holding them: {why}" in str(err.value), str(err.value)
    # a block list at any depth is cut out of the module holding it; a forward that never runs it is refused
    deep = network_layout(Deep())
    assert (deep.parts[0], deep.block_list, deep.stem, deep.head) == ("body.inner", "body.inner.layers", (), ())
    problem = deep.forward_problem(Deep(), torch.randn(2, 8))
    assert "Deep.forward did not call the last block of this pipeline stage (body.inner.layers.0)" in problem


def test_staged_check_compares_gradients_not_only_outputs():
    """A forward that detaches after its first block: the stages compute the same output, but a stage hands on the
    block's output before the detach, so the gradient reaches the first block and the stem, which one device never
    trains. The staged check looks at the gradients and refuses."""
    from lightning_dist.parallelize.pipeline.checks import staged_forward_problem

    class Detaching(nn.Module):
        detach = True

        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(8, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            x = self.blocks[0](self.stem(x))
            x = x.detach() if self.detach else x * 1.0
            return self.head(self.blocks[1](x))

    class Kept(Detaching):  # the same network without the detach: splits
        detach = False

    torch.manual_seed(0)
    net, x = Detaching().double(), torch.randn(4, 8, dtype=torch.float64)
    assert isinstance(network_layout(net), PrunedLayout)  # not its children in order: the model's own forward
    problem = staged_forward_problem(net, x)
    assert problem is not None and "gradients do not" in problem and "stem.weight" in problem, problem
    assert staged_forward_problem(Kept().double(), x) is None


def test_user_gpts_with_learned_positions_split_as_the_model_with_the_blocks_it_does_not_own_taken_out():
    """Issue 40: nanoGPT's pattern (`tok_emb(idx) + pos_emb(arange(t))`, `b, t = idx.size()`) is not its children
    in order, so it takes the route that runs the user's own forward on every stage: blocks in nanoGPT's ModuleDict
    `transformer.h` (head tied to `wte`), and blocks directly on the model, as the pack's GPT."""
    import copy

    from scenarios._nanogpt import FlatGPT, NanoGPT

    from lightning_dist.models import GPT
    from lightning_dist.parallelize.pipeline.checks import staged_forward_problem
    from lightning_dist.parallelize.pipeline.pruned import MODEL_INPUT
    from lightning_dist.parallelize.pipeline.split import join_stages

    torch.manual_seed(0)
    x = torch.randint(0, 32, (2, 8))
    for net, parts in (
        (
            NanoGPT().double(),
            (
                "transformer",
                "transformer.h",
                ("transformer.wte", "transformer.wpe", "transformer.drop"),
                ("transformer.ln_f", "lm_head"),
            ),
        ),
        (FlatGPT().double(), ("", "blocks", ("tok_emb", "pos_emb", "drop"), ("ln_f", "head"))),
    ):
        lay = network_layout(net)
        assert type(lay) is PrunedLayout and lay.parts == parts, lay
        assert staged_forward_problem(net, x) is None  # every block boundary handed over, against the model
        split = plan_split(net, 2, split="params")
        first, last = (build_stage_module(net, split, [s]) for s in (0, 1))
        assert sorted(n for s in (first, last) for n, _ in s.named_parameters(remove_duplicate=False)) == sorted(
            n for n, _ in net.named_parameters(remove_duplicate=False)
        )  # the single-device names, each on one stage (a tied weight under each of its names)
        with torch.no_grad():  # stage 1 runs the user's forward on the ids, the hidden states put into its first block
            hidden = first.run_local(x, **{MODEL_INPUT: x})
            assert hidden.shape == (2, 8, 16) and torch.equal(last.run_local(hidden, **{MODEL_INPUT: x}), net(x))
        whole = join_stages(split, [copy.deepcopy(first), copy.deepcopy(last)])
        assert type(whole) is type(net) and torch.equal(whole(x), net(x))
    tied = tied_stages(NanoGPT(), plan_split(NanoGPT(), 2, split="params"))
    assert tied == [(("transformer.wte.weight", "lm_head.weight"), (0, 1))]  # summed over both stages' ranks
    pack = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8)
    assert type(network_layout(pack)) is PrunedLayout  # the pack's own GPT takes the same route


def test_a_forward_no_route_can_split_is_refused_with_the_reason():
    """A skip from the stem to the head carries a second value across every stage boundary beside the activation:
    the model's own forward on pruned stages cannot hand it on."""
    from lightning_dist.parallelize.pipeline.checks import staged_forward_problem

    class LongSkip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(4, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            h = x = self.stem(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x + h)

    problem = staged_forward_problem(LongSkip().double(), torch.randn(4, 4, dtype=torch.float64))
    assert problem.startswith("Cannot split LongSkip into pipeline stages: the stages compute another function"), (
        problem
    )
    assert "Tried: a stage = the model with the blocks of blocks it does not own taken out" in problem
    assert "a skip connection from the stem to the head) cannot be handed between stages" in problem


class _KindBlock(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind  # read by the model's forward, as HF reads `decoder_layer.attention_type`
        self.fc = nn.Linear(8, 8)

    def forward(self, x, scale):
        return torch.tanh(self.fc(x)) * scale


class _KindNet(nn.Module):
    """A forward that reads an attribute of every block, the ones a stage does not own too, to pick an input."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(_KindBlock(k) for k in ("a", "b", "a", "b"))
        self.head = nn.Linear(8, 16)

    def forward(self, idx):
        x = self.emb(idx)
        scales = {"a": 1.0, "b": 0.5}
        for block in self.blocks:
            x = block(x, scales[block.kind])
        return self.head(x)


def test_a_forward_reading_the_attributes_of_blocks_a_stage_does_not_own_still_splits():
    from lightning_dist.parallelize.pipeline.checks import staged_forward_problem

    torch.manual_seed(0)
    net = _KindNet().double()
    assert staged_forward_problem(net, torch.randint(0, 16, (2, 5))) is None  # every boundary, against the model


class _StateBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, state=None):
        return torch.tanh(self.fc(x)), state  # (hidden, state handed from block to block), as HF's Kolibri 1.1


class _StateNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(_StateBlock() for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, idx):
        x, state = self.emb(idx), None
        for block in self.blocks:
            x, state = block(x, state)
        return self.head(x)


def test_a_forward_unpacking_block_tuples_is_checked_on_one_row():
    """A later stage's skipped blocks give the activation's stand-in (one tensor): a forward that unpacks each block's
    (hidden, state) from it unpacks a 2-row sample by chance (rows as values) and trained until a micro-batch of
    another size failed on one rank, mid-step (HF Kolibri 1.1 at pp=2). The check runs one row of the example: refused
    at setup, on every rank alike."""
    from lightning_dist.strategies.pipeline.setup import plan_pipeline

    torch.manual_seed(0)
    module = _Module(_StateNet().double())
    module.example_input_array = torch.randint(0, 16, (2, 5))
    with pytest.raises(ValueError, match=r"its forward fails on a stage without the parts it does not own"):
        plan_pipeline(module, module.model, 2, "params", allow_batchnorm=False)
