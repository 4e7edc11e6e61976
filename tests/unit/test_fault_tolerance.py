"""fault_tolerance= in one process: the configuration, the job's own mesh, the lighthouse address, the heal state."""

from __future__ import annotations

import pytest
import torch

from lightning_dist import _compat
from lightning_dist.strategies import FullyShardStrategy, HybridShardStrategy
from lightning_dist.strategies.fault_tolerance import FaultTolerance, _load_optimizer, _local_module_state, _local_tree

needs_torchft = pytest.mark.skipif(
    not _compat.torchft_available(), reason="torchft (the `fault-tolerance` extra) is not installed"
)


@needs_torchft
def test_replicate_dim_becomes_replica_groups_and_the_job_mesh_has_one():
    strategy = HybridShardStrategy(dp_replicate=3, dp_shard=2, fault_tolerance=FaultTolerance(replica_group=2))
    assert strategy._sizes["dp_replicate"] == 1 and strategy._ft_groups == 3
    assert strategy.fault_tolerance == FaultTolerance(replica_group=2)
    # a dict of the fields (LightningCLI YAML) and fsdp2 with replica groups
    fsdp2 = FullyShardStrategy(dp_replicate=2, fault_tolerance={"replica_group": 1, "min_replicas": 2})
    assert fsdp2.fault_tolerance.min_replicas == 2 and fsdp2._sizes["dp_replicate"] == 1
    assert HybridShardStrategy().fault_tolerance is None


@needs_torchft
def test_every_configuration_problem_is_listed_at_once():
    bad = FaultTolerance(replica_group=2, min_replicas=3, timeout=0, lighthouse="lighthouse:29510", lighthouse_port=0)
    with pytest.raises(ValueError) as err:
        HybridShardStrategy(dp_replicate=2, fault_tolerance=bad)
    text = str(err.value)
    for needle in (
        "replica_group=2)` is outside dp_replicate=2: the groups are 0 .. 1",
        "min_replicas=3)` exceeds dp_replicate=2",
        "timeout=0)` must be a positive number of seconds",
        "lighthouse='lighthouse:29510')` must be the lighthouse's URL",
        "lighthouse_port=0)` must be a port number",
    ):
        assert needle in text, text
    with pytest.raises(ValueError, match=r"dp_replicate` to be the number of replica groups .* not 'auto'"):
        HybridShardStrategy(fault_tolerance=FaultTolerance(replica_group=0))
    with pytest.raises(ValueError, match="zero_stage=1 is not supported yet .*: pass zero_stage=2 or 3"):
        HybridShardStrategy(dp_replicate=2, zero_stage=1, fault_tolerance=FaultTolerance(replica_group=0))
    with pytest.raises(ValueError, match=r"unknown keys \['group'\]"):
        HybridShardStrategy(dp_replicate=2, fault_tolerance={"group": 0})
    with pytest.raises(ValueError, match="must be a FaultTolerance"):
        HybridShardStrategy(dp_replicate=2, fault_tolerance=True)


@needs_torchft
def test_lighthouse_address_argument_then_environment_then_embedded(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    embedded = HybridShardStrategy(
        dp_replicate=2, fault_tolerance=FaultTolerance(replica_group=0, lighthouse_port=29611)
    )
    assert embedded.lighthouse_address() == ("http://127.0.0.1:29611", True)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lh:29510")
    assert embedded.lighthouse_address() == ("http://lh:29510", False)
    given = HybridShardStrategy(
        dp_replicate=2, fault_tolerance=FaultTolerance(replica_group=1, lighthouse="http://x:1")
    )
    assert given.lighthouse_address() == ("http://x:1", False)


def test_torchft_outside_the_tested_range_is_refused_with_the_range():
    _compat.require_torchft(version="0.2.0")
    with pytest.raises(RuntimeError, match=r"torchft>=0\.2\.0,<0\.3\.0; found torchft 0\.3\.1"):
        _compat.require_torchft(version="0.3.1")


def test_heal_state_round_trips_weights_and_adamw_state():
    """What a healthy group sends (local tensors) and a healing one loads: equal weights, moments and step counts."""

    def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(seed + 1):
            model(torch.randn(5, 4)).square().mean().backward()
            opt.step()
        return model, opt

    healthy, healthy_opt = trained(2)
    healing, healing_opt = trained(0)
    state = _local_module_state(healthy)
    assert "1.running_mean" in state  # buffers travel too (BatchNorm statistics)
    from lightning_dist.strategies.fault_tolerance import _load_module

    _load_module(healing, state)
    _load_optimizer(healing_opt, _local_tree(healthy_opt.state_dict()))
    for a, b in zip(healthy.state_dict().values(), healing.state_dict().values()):
        assert torch.equal(a, b)
    for p, q in zip(healthy.parameters(), healing.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(healthy_opt.state[p][key], healing_opt.state[q][key])
