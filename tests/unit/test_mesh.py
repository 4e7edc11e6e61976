"""MeshSpec: arithmetic, "auto" resolution, validation messages and plan printing (one process)."""

import pytest

from lightning_dist.mesh import DIM_NAMES, DP, DP_CP, DP_SHARD_CP, MeshSpec


def spec(**kw):
    kw.setdefault("world_size", 4)
    kw.setdefault("devices_per_node", 4)
    return MeshSpec(**kw).resolve()


def test_dim_names_order():
    assert DIM_NAMES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@pytest.mark.parametrize(
    ("kw", "shape"),
    [
        ({}, (1, 1, 4, 1, 1)),  # one node: shard inside it
        ({"world_size": 8, "devices_per_node": 4}, (1, 2, 4, 1, 1)),  # 2 nodes: replicate across them
        ({"world_size": 8, "devices_per_node": 4, "tp": 2}, (1, 2, 2, 1, 2)),
        ({"world_size": 8, "devices_per_node": 4, "pp": 2}, (2, 1, 4, 1, 1)),
        ({"world_size": 8, "devices_per_node": 4, "cp": 2}, (1, 2, 2, 2, 1)),  # cp inside a node, like tp
        ({"dp_replicate": 2}, (1, 2, 2, 1, 1)),
        ({"dp_shard": 1}, (1, 4, 1, 1, 1)),
        ({"dp_replicate": 1}, (1, 1, 4, 1, 1)),
        ({"world_size": 6, "devices_per_node": 4}, (1, 3, 2, 1, 1)),  # gcd keeps the shard group inside a node
    ],
)
def test_auto_resolution(kw, shape):
    assert spec(**kw).shape == shape


def test_coordinates_and_groups_follow_row_major_layout():
    s = spec(world_size=8, devices_per_node=8, pp=2, tp=2, dp_replicate=1)
    assert s.shape == (2, 1, 2, 1, 2)
    assert s.coords(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1, DP: 0}
    assert s.group_ranks(5, "tp") == [4, 5]
    assert s.group_ranks(5, "dp_shard") == [5, 7]
    assert s.group_ranks(5, "pp") == [1, 5]
    assert s.group_ranks(5, DP) == [5, 7]
    hsdp = spec(dp_replicate=2)
    assert hsdp.group_ranks(1, "dp_replicate") == [1, 3] and hsdp.group_ranks(1, DP) == [0, 1, 2, 3]
    assert [hsdp.coords(r)[DP] for r in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("kw", "messages"),
    [
        ({"dp_replicate": 3, "dp_shard": 2}, ["3 x 2", "!= world_size=4"]),
        ({"tp": 3}, ["pp x tp = 1 x 3 = 3 does not divide world_size=4"]),
        ({"dp_shard": 3}, ["`dp_shard=3` does not divide the 4 data-parallel ranks"]),
        ({"pp": 0}, ["`pp=0` must be >= 1"]),
        ({"tp": "two"}, ["`tp='two'` must be an integer >= 1"]),
        ({"dp_shard": 1.5}, ['`dp_shard=1.5` must be an integer >= 1 or "auto"']),
        ({"world_size": 0}, ["`world_size=0` must be an integer >= 1"]),
        (
            {"world_size": 8, "devices_per_node": 2, "tp": 4},
            ["tp=4` is larger than devices_per_node=2", "allow_cross_node_tp"],
        ),
        (
            {"world_size": 6, "devices_per_node": 3, "tp": 2, "dp_shard": 3, "dp_replicate": 1},
            ["tp=2` does not divide devices_per_node=3"],
        ),
    ],
)
def test_validation_messages_name_values_and_fix(kw, messages):
    kw.setdefault("world_size", 4)
    kw.setdefault("devices_per_node", 4)
    with pytest.raises(ValueError) as err:
        MeshSpec(**kw)
    for m in messages:
        assert m in str(err.value)


def test_validation_collects_every_problem():
    with pytest.raises(ValueError) as err:
        MeshSpec(world_size=4, devices_per_node=4, pp=0, tp=-1, dp_shard="x")
    text = str(err.value)
    assert "`pp=0`" in text and "`tp=-1`" in text and "`dp_shard='x'`" in text


def test_cross_node_tp_opt_in():
    s = MeshSpec(world_size=8, devices_per_node=2, tp=4, allow_cross_node_tp=True).resolve()
    assert s.shape == (1, 2, 1, 1, 4)  # no device of a node is left for sharding: replicate


def test_shapes_need_resolution():
    with pytest.raises(RuntimeError, match="resolve"):
        MeshSpec(world_size=4, devices_per_node=4).shape


def test_plan_prints_every_rank():
    s = spec(dp_replicate=2)
    text = s.format_plan()
    assert "dp_replicate=2 x dp_shard=2" in text
    rows = s.plan_rows()
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert [(r["dp_replicate"], r["dp_shard"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        assert f"│    {r['rank']} │" in text


def test_unknown_dim():
    with pytest.raises(ValueError, match="Unknown mesh dim 'sp'"):
        spec().size("sp")


def test_context_parallel_dims_and_flattened_groups():
    s = spec(world_size=8, devices_per_node=8, cp=2, tp=2, dp_replicate=1)
    assert s.shape == (1, 1, 2, 2, 2)
    assert s.coords(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1, DP: 1}
    assert s.group_ranks(5, "cp") == [5, 7]  # tp innermost, then cp
    assert s.group_ranks(5, DP) == [1, 5]  # the sampler's ranks: cp peers read the same samples
    assert s.group_ranks(5, DP_SHARD_CP) == [1, 3, 5, 7]  # FSDP2 shards over dp_shard x cp
    assert s.group_ranks(5, DP_CP) == [1, 3, 5, 7]
    assert s.size(DP) == 2 and s.size(DP_SHARD_CP) == 4 and s.size(DP_CP) == 4
    hsdp = spec(world_size=8, devices_per_node=8, cp=2, dp_replicate=2)
    assert hsdp.shape == (1, 2, 2, 2, 1) and hsdp.size(DP_SHARD_CP) == 4 and hsdp.size(DP_CP) == 8
    assert "dp_shard=2 x cp=2" in hsdp.format_plan()


def test_context_parallel_validation():
    with pytest.raises(ValueError, match=r"pp x cp x tp = 1 x 3 x 1 = 3 does not divide world_size=4"):
        MeshSpec(world_size=4, devices_per_node=4, cp=3)
    with pytest.raises(ValueError, match=r"`cp=0` must be >= 1"):
        MeshSpec(world_size=4, devices_per_node=4, cp=0)
