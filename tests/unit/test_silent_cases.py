"""Issue 20 in one process: the pieces that keep a distributed run equal to one device or make it refuse.

The multi-process halves: tests/distributed/test_hsdp.py and test_tensor_parallel.py (no seed),
test_pipeline.py::test_pp2_silent_cases_match_one_device_or_refuse_on_every_rank.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dist.parallelize.fsdp import unshared_blocks
from lightning_dist.parallelize.pipeline.checks import (
    check_staged_forward,
    shared_across_stages,
    staged_forward_problem,
)
from lightning_dist.parallelize.pipeline.split import build_stage_module, plan_split
from lightning_dist.parallelize.sync import broadcast_module_states, materialize_in_sync


def _meta_net() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))


def test_meta_materialization_is_the_same_whatever_each_rank_seeded():
    torch.manual_seed(1)
    a = _meta_net()
    materialize_in_sync(a, torch.device("cpu"), seed=5)
    torch.manual_seed(2)  # another rank, another RNG state
    torch.randn(7)
    b = _meta_net()
    materialize_in_sync(b, torch.device("cpu"), seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = _meta_net()
    materialize_in_sync(c, torch.device("cpu"), seed=6)
    assert not torch.equal(a[0].weight, c[0].weight)  # the shared seed, not a constant, decides
    assert a[0].weight.std() > 0.1  # really initialized (reset_parameters ran), not left as empty memory


def test_broadcast_is_a_no_op_without_a_process_group():
    net = nn.Linear(2, 2)
    before = net.weight.clone()
    assert broadcast_module_states(net) == 0 and torch.equal(net.weight, before)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)  # the residual add the stages would drop
        return self.head(x)


def test_a_forward_doing_work_outside_its_children_is_refused_with_the_reason():
    with pytest.raises(ValueError) as info:
        check_staged_forward(_Residual(), torch.randn(4, 4))
    message = str(info.value)
    assert "Cannot split _Residual into pipeline stages: the stages compute another function" in message
    assert "a residual add outside the blocks" in message and "move such work into a child module" in message


def _shared_sequential() -> tuple[nn.Sequential, nn.Linear]:
    lin = nn.Linear(6, 6)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), lin, nn.Tanh(), lin, nn.Tanh(), nn.Linear(6, 2)), lin


def test_a_module_used_twice_in_one_stage_runs_twice_and_stays_with_the_stage_root():
    net, lin = _shared_sequential()
    x = torch.randn(5, 3, dtype=torch.float64)
    net = net.double()
    assert staged_forward_problem(net, x) is None  # the staged composition applies the shared Linear twice
    split = plan_split(net, 2, split=[5])
    assert shared_across_stages(net, split) == []  # both uses on stage 0: allowed
    stage0 = build_stage_module(net, split, [0])
    expected = net[:5](x)
    assert torch.equal(stage0.run_local(x), expected)
    # gradients of the shared weight add both uses, as on one device
    stage0.run_local(x).sum().backward()
    staged = lin.weight.grad.clone()
    lin.weight.grad = None
    net[:5](x).sum().backward()
    assert torch.equal(staged, lin.weight.grad)
    # FSDP units: a block used twice (or sharing a parameter) is left to the stage's root unit
    block, other = nn.Linear(2, 2), nn.Linear(2, 2)
    holder = nn.Module()
    holder.blocks = nn.ModuleDict({"0": block, "1": other, "2": block})
    assert unshared_blocks([block, other, block], holder) == [other]
    tied = nn.Linear(2, 2)
    tied.weight = other.weight
    holder.blocks = nn.ModuleDict({"0": block, "1": other, "2": tied})
    assert unshared_blocks([block, other, tied], holder) == [block]


def test_a_module_shared_across_stages_is_still_refused_naming_it():
    net, _ = _shared_sequential()
    split = plan_split(net, 2, split=[3])
    assert shared_across_stages(net, split) == [("2.weight", "4.weight"), ("2.bias", "4.bias")]


def test_returned_loss_terms_on_parameters_get_gradients_and_output_terms_are_flagged():
    import torch.nn.functional as F

    from lightning_dist.strategies.pipeline.step import returned_loss_gradients

    w = nn.Parameter(torch.randn(3, dtype=torch.float64))
    target = torch.randint(0, 5, (8,))
    logits = torch.randn(8, 5, dtype=torch.float64)

    def run(make_loss, scale=1.0):
        out = logits.clone().requires_grad_()
        return returned_loss_gradients(
            make_loss(out), out, target, n_microbatches=4, scale=scale, pipeline_loss=F.cross_entropy, params=[w]
        )

    differs, extra = run(lambda out: F.cross_entropy(out, target) + 0.1 * w.pow(2).sum())
    assert not differs and len(extra) == 1 and torch.allclose(extra[0][1], 0.2 * w.detach(), rtol=1e-15, atol=0)
    # Lightning divides the loss by accumulate_grad_batches: the same scale on both sides
    assert not run(lambda out: F.cross_entropy(out, target) / 2, scale=0.5)[0]
    assert run(lambda out: 2 * F.cross_entropy(out, target))[0]  # the schedule back-propagated 1x
    assert run(lambda out: F.cross_entropy(out, target) + out.pow(2).mean())[0]  # a term on the output
    assert run(lambda out: w.sum())[0]  # the output's loss left out entirely


def test_every_strategy_takes_timeout_as_seconds_or_timedelta():
    from datetime import timedelta

    from lightning_dist.strategies import (
        FSDP2OffloadStrategy,
        FullyShardStrategy,
        HybridShardStrategy,
        OffloadStrategy,
        PipelineStrategy,
    )
    from lightning_dist.strategies.tp import TensorParallelStrategy

    for cls in (
        HybridShardStrategy,
        FullyShardStrategy,
        TensorParallelStrategy,
        PipelineStrategy,
        FSDP2OffloadStrategy,
        OffloadStrategy,
    ):
        assert cls(timeout=30)._timeout == timedelta(seconds=30), cls
        assert cls(timeout=2.5)._timeout == timedelta(seconds=2.5), cls
        assert cls(timeout=timedelta(minutes=1))._timeout == timedelta(minutes=1), cls
        with pytest.raises(ValueError, match="positive, finite"):
            cls(timeout=0)
        with pytest.raises(TypeError, match="seconds as a number or a datetime.timedelta"):
            cls(timeout="30")


def test_output_term_check_tolerates_bf16_rounding():
    import torch.nn.functional as F

    from lightning_dist.strategies.pipeline.step import returned_loss_gradients

    target = torch.randint(0, 5, (8,))
    out = torch.randn(8, 5).bfloat16().requires_grad_()
    differs, _ = returned_loss_gradients(
        F.cross_entropy(out, target), out, target, n_microbatches=4, scale=1.0, pipeline_loss=F.cross_entropy, params=[]
    )
    assert not differs  # whole-batch mean vs mean of micro-batch means: bf16 rounding only
    out2 = out.detach().clone().requires_grad_()
    assert returned_loss_gradients(
        2 * F.cross_entropy(out2, target),
        out2,
        target,
        n_microbatches=4,
        scale=1.0,
        pipeline_loss=F.cross_entropy,
        params=[],
    )[0]


def test_staged_forward_check_is_not_fooled_by_dropout():
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    assert staged_forward_problem(net, torch.randn(16, 4)) is None and net.training
