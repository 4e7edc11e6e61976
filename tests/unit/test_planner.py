"""Planner formulas against hand-computed values, candidate layouts, model counting and the `plan` CLI."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch import nn

from lightning_dist import inputs, planner
from lightning_dist.cli import main
from lightning_dist.parallelize.counts import count_params
from lightning_dist.planner import (
    ActivationShape,
    Collective,
    Layout,
    MemoryBreakdown,
    OffloadTiers,
    ParamCounts,
    StateBytes,
)

GB = 1e9
PSI = 1_500_000_000  # DeepSpeed's ZeRO tutorial example (GPT-2 1.5B)
MIXED = StateBytes.mixed_adam()
FP32 = StateBytes.fp32_adam()


# ---- bytes per parameter ----------------------------------------------------------------------------------
def test_presets_and_precision_flags():
    assert (MIXED.param, MIXED.grad, MIXED.optimizer) == (2, 2, 12)
    assert (FP32.param, FP32.grad, FP32.optimizer) == (4, 4, 8)
    fp64 = StateBytes.fp64_adam()
    assert (fp64.param, fp64.grad, fp64.optimizer) == (8, 8, 16)
    assert planner.state_bytes(precision="32-true", optimizer="adamw") == FP32
    assert planner.state_bytes(precision="64-true", optimizer="adam") == fp64
    # Lightning's bf16-mixed keeps fp32 params/grads and fp32 Adam states; only the gathered copy is 16-bit
    bf16 = planner.state_bytes(precision="bf16-mixed", optimizer="adamw")
    assert (bf16.param, bf16.grad, bf16.optimizer, bf16.gather, bf16.reduce) == (4, 4, 8, 2, 4)
    # ZeRO's convention: 16-bit params + grads, fp32 master + 2 moments
    master = planner.state_bytes(precision="bf16-mixed", optimizer="adamw", master_weights=True)
    assert (master.param, master.grad, master.optimizer) == (MIXED.param, MIXED.grad, MIXED.optimizer)
    assert planner.state_bytes(precision="bf16-true", optimizer="adam").optimizer == 2 * 2  # states in bf16
    assert planner.state_bytes(precision="32-true", optimizer="sgd").optimizer == 0
    assert planner.state_bytes(precision="32-true", optimizer="sgd-momentum").optimizer == 4  # one buffer
    assert planner.state_bytes(precision="16-mixed", optimizer="sgd", master_weights=True).optimizer == 4  # master
    assert planner.state_bytes(precision="32-true", optimizer="sgd", optimizer_state_bytes=6.5).optimizer == 6.5


# ---- model-state memory -------------------------------------------------------------------------------------
def test_seed_numbers_for_1_5b_mixed_precision_adam_on_8_ranks():
    n = 8
    ddp = planner.ddp_bytes(PSI, state=MIXED)
    z1, z2, z3 = (planner.zero_bytes(PSI, stage=s, world_size=n, state=MIXED) for s in (1, 2, 3))
    # formulas: DDP (2+2+12) P; ZeRO-1 (2+2) P + 12 P/N; ZeRO-2 2 P + (2+12) P/N; ZeRO-3 (2+2+12) P/N
    assert ddp.total == pytest.approx((2 + 2 + 12) * PSI)
    assert z1.total == pytest.approx((2 + 2) * PSI + 12 * PSI / n)
    assert z2.total == pytest.approx(2 * PSI + (2 + 12) * PSI / n)
    assert z3.total == pytest.approx((2 + 2 + 12) * PSI / n)
    # the seed's table (1 GB = 1e9 B) and DeepSpeed tutorial's 18 GB of Adam states, 2.25 GB after stage 1
    assert [f"{m.total / GB:.2f}" for m in (ddp, z1, z2, z3)] == ["24.00", "8.25", "5.62", "3.00"]
    assert ddp.optimizer / GB == pytest.approx(18.0) and z1.optimizer / GB == pytest.approx(2.25)
    # what each stage shards
    assert (z1.params, z1.grads) == (ddp.params, ddp.grads)
    assert (z2.params, z2.grads) == (ddp.params, ddp.grads / n)
    assert (z3.params, z3.grads, z3.optimizer) == (ddp.params / n, ddp.grads / n, ddp.optimizer / n)


def test_hsdp_shards_over_the_shard_group_only():
    p = 1_000_003
    for world, shard in ((8, 1), (8, 2), (8, 4), (8, 8), (12, 3)):
        m = planner.hsdp_bytes(p, shard_size=shard, world_size=world, state=FP32)
        assert m.total == pytest.approx((4 + 4 + 8) * p / shard)
        assert m == planner.zero_bytes(p, stage=3, world_size=shard, state=FP32)  # replicas add nothing
    assert planner.hsdp_bytes(p, shard_size=8, world_size=8, state=FP32) == planner.zero_bytes(
        p, stage=3, world_size=8, state=FP32
    )
    assert planner.hsdp_bytes(p, shard_size=1, world_size=8, state=FP32) == planner.ddp_bytes(p, state=FP32)
    z2 = planner.hsdp_bytes(p, shard_size=4, world_size=8, state=FP32, zero_stage=2)
    assert (z2.params, z2.grads, z2.optimizer) == (4 * p, 4 * p / 4, 8 * p / 4)


def test_tensor_parallel_divides_only_the_sharded_params():
    assert planner.tp_local_params(tp_sharded_params=900, replicated_params=100, tp=4) == 900 / 4 + 100
    m = planner.tp_bytes(tp_sharded_params=900, replicated_params=100, tp=4, state=FP32)
    assert m.total == (900 / 4 + 100) * 16
    m = planner.tp_bytes(tp_sharded_params=900, replicated_params=100, tp=4, state=FP32, zero_stage=3, dp_shard=2)
    assert m.total == (900 / 4 + 100) * 16 / 2


def test_pipeline_stages_from_an_uneven_split():
    # 5 blocks into 2 stages: 3 + 2 blocks; embeddings (7) on the first, head (11) on the last
    stages = planner.split_stages([10, 20, 30, 40, 50], 2, pre_params=7, post_params=11)
    assert stages == [10 + 20 + 30 + 7, 40 + 50 + 11]
    mems = planner.pipeline_bytes(stages, state=FP32)
    assert [m.total for m in mems] == [67 * 16, 101 * 16]
    assert max(mems, key=lambda m: m.total).total == 101 * 16
    # the runtime's split (lightning_dist.rules.partition): the largest stage as small as possible, ties to
    # the earliest split points (not a count split, [3, 2, 2], which the runtime never runs)
    assert planner.split_stages([1] * 7, 3) == [2, 2, 3]
    counts = ParamCounts(total=101)
    assert counts.stage_params(4) == [26, 25, 25, 25]  # no block list: even split of the total


def test_offload_tiers_move_parts_off_the_device():
    p, s = 4000, 4
    m = planner.model_state_bytes(
        p, state=FP32, zero_stage=3, shard_size=s, offload=OffloadTiers(params="nvme", optimizer="host")
    )
    assert (m.params, m.grads, m.optimizer) == (0, 4 * p / s, 0)
    assert (m.host, m.nvme) == (8 * p / s, 4 * p / s)
    assert m.total == 4 * p / s
    # ZeRO-Offload (stage 2, grads + optimizer on host): the device keeps the replicated parameters
    m = planner.zero_bytes(p, stage=2, world_size=s, state=MIXED, offload=OffloadTiers(grads="host", optimizer="host"))
    assert m.total == 2 * p and m.host == (2 + 12) * p / s


# ---- exact FSDP2 / ZeroRedundancyOptimizer partitions ---------------------------------------------------------
def test_per_parameter_shards_hand_counted():
    shapes = [(5, 3), (6,), (1, 7), (8, 2)]
    # ceil(5/4)=2 rows: 2,2,1,0 rows of 3 | ceil(6/4)=2: 2,2,2,0 | 1 row: rank 0 only | 2 rows each
    assert planner.per_parameter_shards(shapes, 4) == [6 + 2 + 7 + 4, 6 + 2 + 0 + 4, 3 + 2 + 0 + 4, 0 + 0 + 0 + 4]
    assert planner.per_parameter_shards(shapes, 4, padded=True) == [6 + 2 + 7 + 4] * 4
    assert sum(planner.per_parameter_shards(shapes, 4)) == sum(math.prod(s) for s in shapes)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8])
def test_per_parameter_shards_match_torch_chunk(world):
    # FSDP2 shards with torch.chunk along dim 0 and pads the list with empty chunks
    g = torch.Generator().manual_seed(world)
    shapes = [
        tuple(int(d) for d in torch.randint(1, 13, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g))
        for _ in range(20)
    ]
    expected = [0] * world
    for shape in shapes:
        chunks = torch.chunk(torch.empty(shape, device="meta"), world, dim=0)
        for rank, chunk in enumerate(chunks):
            expected[rank] += chunk.numel()
    assert planner.per_parameter_shards(shapes, world) == expected
    assert sum(expected) == sum(math.prod(s) for s in shapes)


def test_fsdp2_state_bytes_and_zero_redundancy_partition():
    shapes = [(5, 3), (6,), (1, 7), (8, 2)]
    local = planner.per_parameter_shards(shapes, 4)
    for rank in range(4):
        m = planner.fsdp2_state_bytes(shapes, shard_size=4, rank=rank, state=FP32)
        assert (m.params, m.grads, m.optimizer) == (4 * local[rank], 4 * local[rank], 8 * local[rank])
    assert planner.fsdp2_state_bytes(shapes, shard_size=4, state=FP32, zero_stage=2) == planner.fsdp2_state_bytes(
        shapes, shard_size=4, state=FP32, zero_stage=3
    )
    # greedy, largest first: 16->r0, 15->r1, 7->r1 (15<16), 6->r0 (16<22)
    assert planner.zero_redundancy_partition([15, 6, 7, 16], 2) == [22, 22]
    assert planner.zero_redundancy_partition([10, 7, 5, 3, 1], 2) == [10 + 3, 7 + 5 + 1]
    z1 = planner.fsdp2_state_bytes(shapes, shard_size=2, rank=1, state=FP32, zero_stage=1)
    assert (z1.params, z1.grads, z1.optimizer) == (4 * 44, 4 * 44, 8 * 22)
    assert planner.zero_redundancy_owners([15, 6, 7, 16], 2) == [1, 0, 1, 0]
    # Adam's float32 `step` per parameter tensor: every FSDP2 rank holds all 4; ZeRO-1 rank 1 owns 2
    m = planner.fsdp2_state_bytes(shapes, shard_size=4, rank=3, state=FP32, step_bytes=4)
    assert m.optimizer == 8 * local[3] + 4 * 4
    z1 = planner.fsdp2_state_bytes(shapes, shard_size=2, rank=1, state=FP32, zero_stage=1, step_bytes=4)
    assert z1.optimizer == 8 * 22 + 2 * 4


# ---- communication -------------------------------------------------------------------------------------------
def test_ring_collective_volumes():
    assert planner.ring_all_reduce_bytes(800, 8) == 2 * 7 / 8 * 800
    assert planner.ring_all_gather_bytes(800, 8) == 7 / 8 * 800
    assert Collective(op="reduce_scatter", dim="dp", group_size=4, payload_bytes=100).wire_bytes == 75
    assert Collective(op="send_recv", dim="pp", group_size=4, payload_bytes=100).wire_bytes == 100


@pytest.mark.parametrize("world", [2, 4, 8, 64])
def test_data_parallel_traffic(world):
    p = 1000
    ddp = planner.data_parallel_traffic(p, state=FP32, zero_stage=0, shard_size=1, replicate_size=world)
    assert sum(c.wire_bytes for c in ddp) == pytest.approx(2 * (world - 1) / world * 4 * p)
    fsdp = planner.data_parallel_traffic(p, state=FP32, zero_stage=3, shard_size=world)
    assert sum(c.wire_bytes for c in fsdp) == pytest.approx(3 * (world - 1) / world * 4 * p)
    assert sum(c.wire_bytes for c in fsdp) / sum(c.wire_bytes for c in ddp) == pytest.approx(1.5)
    z2 = planner.data_parallel_traffic(p, state=FP32, zero_stage=2, shard_size=world)
    assert sum(c.wire_bytes for c in z2) == pytest.approx(2 * (world - 1) / world * 4 * p)
    # ZeroRedundancyOptimizer: the gradient all-reduce plus the broadcast of updated partitions
    z1 = planner.data_parallel_traffic(p, state=FP32, zero_stage=1, shard_size=world)
    assert [c.op for c in z1] == ["all_reduce", "broadcast"]
    assert sum(c.wire_bytes for c in z1) == pytest.approx(3 * (world - 1) / world * 4 * p)


def test_hsdp_traffic_splits_shard_and_replica_dims():
    p, s, r = 1200, 4, 3
    out = {
        (c.op, c.dim): c
        for c in planner.data_parallel_traffic(p, state=FP32, zero_stage=3, shard_size=s, replicate_size=r)
    }
    assert out["all_gather", "dp_shard"].wire_bytes == pytest.approx(2 * (s - 1) / s * 4 * p)
    assert out["reduce_scatter", "dp_shard"].wire_bytes == pytest.approx((s - 1) / s * 4 * p)
    assert out["all_reduce", "dp_replicate"].wire_bytes == pytest.approx(2 * (r - 1) / r * 4 * p / s)
    # mixed precision: gathers in the compute dtype, reduction in the gradient dtype
    bf16 = planner.state_bytes(precision="bf16-mixed")
    out = {c.op: c for c in planner.data_parallel_traffic(p, state=bf16, zero_stage=3, shard_size=s)}
    assert out["all_gather"].payload_bytes == 2 * p * 2 and out["reduce_scatter"].payload_bytes == p * 4
    # FSDP2 does not reshard the root unit after forward: its parameters are gathered once
    out = {c.op: c for c in planner.data_parallel_traffic(p, state=FP32, zero_stage=3, shard_size=s, root_params=200)}
    assert out["all_gather"].payload_bytes == (2 * p - 200) * 4


def test_fsdp2_traffic_counts_padding_and_the_root_unit():
    # (5, 3) in a block: 4 ranks x ceil(5/4)=2 rows x 3 = 24 elements; (2, 9) on the root: 4 x 1 x 9 = 36
    out = {
        c.op: c
        for c in planner.fsdp2_traffic([(5, 3)], root_shapes=[(2, 9)], shard_size=4, replicate_size=2, state=FP32)
    }
    assert out["all_gather"].payload_bytes == (2 * 24 + 36) * 4  # root gathered once (not resharded)
    assert out["reduce_scatter"].payload_bytes == (24 + 36) * 4
    assert out["all_reduce"].payload_bytes == (24 + 36) / 4 * 4 and out["all_reduce"].dim == "dp_replicate"
    z2 = {
        c.op: c for c in planner.fsdp2_traffic([(5, 3)], root_shapes=[(2, 9)], shard_size=4, state=FP32, zero_stage=2)
    }
    assert z2["all_gather"].payload_bytes == (24 + 36) * 4 and "all_reduce" not in z2
    # evenly divisible shapes and no root: the closed form exactly
    even = planner.fsdp2_traffic([(8, 3), (4,)], shard_size=4, state=FP32)
    closed = planner.data_parallel_traffic(28, state=FP32, zero_stage=3, shard_size=4)
    assert [(c.op, c.payload_bytes) for c in even] == [(c.op, c.payload_bytes) for c in closed]


def test_tensor_parallel_activation_traffic():
    b, s, h, blocks, t, a = 2, 16, 32, 3, 4, 2
    act = b * s * h * a
    (ar,) = planner.tp_activation_traffic(batch=b, seq=s, hidden=h, blocks=blocks, tp=t, bytes_per_element=a)
    # 2 row-parallel linears per block, each: 1 all-reduce forward + 1 backward
    assert (ar.op, ar.dim, ar.payload_bytes) == ("all_reduce", "tp", 2 * 2 * blocks * act)
    assert ar.wire_bytes == pytest.approx(2 * (t - 1) / t * 4 * blocks * act)
    sp = planner.tp_activation_traffic(
        batch=b, seq=s, hidden=h, blocks=blocks, tp=t, bytes_per_element=a, sequence_parallel=True
    )
    assert sorted(c.op for c in sp) == ["all_gather", "reduce_scatter"]
    assert sum(c.wire_bytes for c in sp) == pytest.approx(ar.wire_bytes)  # same volume, different collectives


def test_pipeline_idle_fraction_and_p2p():
    assert planner.pipeline_idle_fraction(stages=4, micro_batches=32) == pytest.approx(3 / 35)  # seed: 8.6%
    assert f"{planner.pipeline_idle_fraction(stages=4, micro_batches=32, schedule='gpipe'):.1%}" == "8.6%"
    assert planner.pipeline_idle_fraction(
        stages=4, micro_batches=8, schedule="interleaved-1f1b", virtual_stages=2
    ) == pytest.approx(3 / (2 * 8 + 3))
    assert planner.pipeline_idle_fraction(stages=1, micro_batches=1) == 0
    c, loss = planner.pipeline_p2p_traffic(activation_bytes=1000, micro_batches=8, stages=4, virtual_stages=2)
    assert (c.op, c.dim, c.wire_bytes) == ("send_recv", "pp", 2 * 8 * 2 * 1000)
    # the batch loss: an interior rank receives it from the last stage's rank, which sends one copy to each other rank
    assert (loss.op, loss.dim, loss.payload_bytes, loss.wire_bytes) == ("recv", "pp", 4, 4)
    last = planner.pipeline_loss_transfer(4, last_stage=True)
    assert (last.op, last.payload_bytes) == ("send", 3 * 4)
    with pytest.raises(ValueError, match="pp"):
        planner.pipeline_loss_transfer(0)
    assert planner.pipeline_p2p_traffic(activation_bytes=1000, micro_batches=8, stages=1) == []


# ---- layouts and recommendation ----------------------------------------------------------------------------
def test_candidate_layouts_enumeration():
    layouts = planner.candidate_layouts(PSI, world_size=8, devices_per_node=4, state=MIXED)
    names = [lay.name for lay in layouts]
    assert names == [
        "ddp",
        "zero1",
        "zero2",
        "hsdp-2",
        "hsdp-4",
        "fsdp",
        "tp2-ddp4",
        "tp2-fsdp4",
        "tp4-ddp2",
        "tp4-fsdp2",
        "pp2-ddp4",
        "pp4-ddp2",
        "pp8",
        "zero-offload",
        "fsdp-offload",
    ]
    by = {lay.name: lay for lay in layouts}
    assert all(lay.fits is None for lay in layouts)
    assert by["hsdp-4"].mesh == {"pp": 1, "dp_replicate": 2, "dp_shard": 4, "cp": 1, "tp": 1}
    assert by["hsdp-4"].memory.total == pytest.approx(16 * PSI / 4)
    assert by["tp2-fsdp4"].memory.total == pytest.approx(16 * PSI / 2 / 4)
    assert by["pp4-ddp2"].idle_fraction == pytest.approx(3 / (8 + 3))
    assert not by["tp2-ddp4"].activations_counted and by["ddp"].activations_counted
    # every product of the mesh is the world size
    assert all(math.prod(lay.mesh.values()) == 8 for lay in layouts)
    json.dumps([lay.to_dict() for lay in layouts])  # serialisable


@pytest.mark.parametrize(
    "memory, expected", [(None, "ddp"), ("30GB", "ddp"), ("8GB", "zero2"), ("5GB", "fsdp"), ("1GB", "fsdp-offload")]
)
def test_recommend_least_parallelism_that_fits(memory, expected):
    device_memory = inputs.parse_bytes(memory) if memory else None
    layouts = planner.candidate_layouts(PSI, world_size=8, devices_per_node=4, state=MIXED, device_memory=device_memory)
    best = planner.recommend(layouts)
    assert (best.name if best else None) == expected
    if best is not None and device_memory is not None:
        assert best.memory.total <= device_memory
        # nothing earlier in the order fits
        rank = planner.KIND_ORDER.index(best.kind)
        assert not any(lay.fits for lay in layouts if planner.KIND_ORDER.index(lay.kind) < rank)


def test_recommend_none_when_nothing_fits():
    layouts = planner.candidate_layouts(PSI, world_size=8, devices_per_node=4, state=MIXED, device_memory=1e9)
    assert planner.recommend([lay for lay in layouts if lay.kind != "offload"]) is None
    assert all(lay.fits is False for lay in layouts if lay.kind != "offload")


def test_recommend_breaks_ties_by_traffic():
    def lay(name, wire):
        traffic = (Collective(op="send_recv", dim="dp", group_size=2, payload_bytes=wire),)
        return Layout(
            name=name,
            kind="hsdp",
            mesh={},
            zero_stage=3,
            traffic=traffic,
            fits=True,
            memory=MemoryBreakdown(params=1, grads=1, optimizer=1),
        )

    assert planner.recommend([lay("a", 10), lay("b", 5), lay("c", 7)]).name == "b"
    layouts = planner.candidate_layouts(PSI, world_size=8, devices_per_node=4, state=MIXED)
    hsdp = [x for x in layouts if x.kind == "hsdp"]
    assert planner.recommend(hsdp).name == "hsdp-2"  # smaller shard group: less traffic


def test_tp_and_pp_activation_traffic_in_layouts():
    counts = ParamCounts(total=1000, tp_sharded=800, layer_params=(200,) * 4, pre_params=100, post_params=100)
    act = ActivationShape(batch=8, seq=16, hidden=32, bytes_per_element=2)
    layouts = {
        x.name: x
        for x in planner.candidate_layouts(
            counts, world_size=4, devices_per_node=4, state=FP32, activation=act, micro_batches=4
        )
    }
    tp = layouts["tp2-ddp2"]
    assert tp.memory.total == (800 / 2 + 200) * 16
    dims = tp.wire_bytes_by_dim()
    assert dims["tp"] == pytest.approx(2 * (2 - 1) / 2 * 4 * 4 * 8 * 16 * 32 * 2)
    assert dims["dp"] == pytest.approx(2 * (2 - 1) / 2 * (800 / 2 + 200) * 4)
    pp = layouts["pp2-ddp2"]
    assert pp.memory.total == (100 + 400) * 16  # stages [500, 500]: 2 blocks each + embeddings / head
    # boundary activations and gradients, plus the loss (4 B received from the last stage's rank)
    assert pp.wire_bytes_by_dim()["pp"] == 2 * 4 * (8 / 4) * 16 * 32 * 2 + 4
    assert "pp8" not in layouts and "pp4" in layouts  # no more stages than blocks
    # interleaved 1F1B runs 2 stages per rank: each micro-batch crosses twice as many rank boundaries, the bubble
    # shrinks, and 4 blocks allow pp2 only (pp4 would need 8 stages)
    inter = {
        x.name: x
        for x in planner.candidate_layouts(
            counts,
            world_size=4,
            devices_per_node=4,
            state=FP32,
            activation=act,
            micro_batches=4,
            schedule="interleaved_1f1b",
        )
    }
    assert "pp4" not in inter and "pp2-ddp2" in inter
    ipp = inter["pp2-ddp2"]
    assert ipp.wire_bytes_by_dim()["pp"] == 2 * 2 * 4 * (8 / 4) * 16 * 32 * 2 + 4
    assert ipp.idle_fraction == pytest.approx((2 - 1) / (2 * 4 + 2 - 1))
    assert ipp.idle_fraction < pp.idle_fraction


# ---- models ------------------------------------------------------------------------------------------------
class TiedLM(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 8, layers: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim)) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied: counted once

    def forward(self, x):
        x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module, extra: int = 3):
        super().__init__()
        self.inner = inner
        self.extra = nn.Parameter(torch.zeros(extra))


def _lightning_module_class():
    from lightning.pytorch import LightningModule

    class Lazy(LightningModule):
        """Creates its layers in configure_model, as models of the pack do."""

        def __init__(self, width: int = 4):
            super().__init__()
            self.width, self.net = width, None

        def configure_model(self):
            if self.net is None:
                self.net = nn.Linear(self.width, self.width)

    return Lazy


LazyLit = _lightning_module_class()


def test_count_params_on_meta_device():
    model = inputs.build_meta_model(f"{__name__}.TiedLM", '{"vocab": 50, "dim": 8, "layers": 3}')
    assert all(p.is_meta for p in model.parameters())
    counts = count_params(model)
    block = 2 * 8 + 8 * 8 + 8
    assert counts.total == 50 * 8 + 3 * block + 2 * 8
    assert counts.layer_params == (block,) * 3
    # the tied embedding / head weight counts on both end stages: a pipeline holds a copy on each (their
    # gradients summed every step); the total counts it once
    assert (counts.pre_params, counts.post_params) == (50 * 8, 2 * 8 + 50 * 8)
    assert counts.tp_sharded == 50 * 8 + 3 * (8 * 8 + 8)  # Embedding + Linear; norms replicated
    assert sorted(counts.shapes) == sorted(tuple(p.shape) for p in model.parameters())
    lazy = inputs.build_meta_model(f"{__name__}.LazyLit", {"width": 5})
    assert count_params(lazy).total == 5 * 5 + 5  # configure_model ran, on meta


def test_model_from_lightning_cli_config(tmp_path):
    cfg = tmp_path / "cli.yaml"
    cfg.write_text(
        "trainer:\n  max_epochs: 1\nmodel:\n"
        f"  class_path: {__name__}.Wrapper\n  init_args:\n    extra: 7\n"
        "    inner:\n      class_path: torch.nn.Linear\n      init_args: {in_features: 10, out_features: 5}\n"
    )
    path, init_args = inputs.model_spec_from_config(str(cfg))
    assert path == f"{__name__}.Wrapper" and init_args["extra"] == 7
    assert count_params(inputs.build_meta_model(path, init_args)).total == 10 * 5 + 5 + 7
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {}\n")
    with pytest.raises(ValueError, match="model:"):
        inputs.model_spec_from_config(str(bad))


# ---- parsing and errors ------------------------------------------------------------------------------------
def test_parse_bytes_and_counts():
    assert inputs.parse_bytes("80GB") == 80 * 10**9
    assert inputs.parse_bytes("24GiB") == 24 * 2**30
    assert inputs.parse_bytes("512 MiB") == 512 * 2**20
    assert inputs.parse_bytes("1.5tb") == 1_500_000_000_000
    assert inputs.parse_bytes("123456") == 123456 == inputs.parse_bytes(123456)
    assert inputs.parse_count("1.5B") == PSI == inputs.parse_count("1.5e9")
    assert inputs.parse_count("125M") == 125_000_000


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: planner.candidate_layouts(10, world_size=6, devices_per_node=4, state=FP32), "not divisible"),
        (
            lambda: planner.hsdp_bytes(10, shard_size=3, world_size=8, state=FP32),
            r"shard_size=3.*pick one of \[1, 2, 4, 8\]",
        ),
        (lambda: planner.ddp_bytes(-5, state=FP32), "num_params=-5"),
        (lambda: inputs.parse_count("-5"), "must be >= 0"),
        (lambda: planner.ParamCounts(total=-1), "total=-1"),
        (lambda: planner.state_bytes(precision="fp8"), "Unknown precision 'fp8'"),
        (lambda: planner.state_bytes(optimizer="lion"), "Unknown optimizer 'lion'.*optimizer_state_bytes"),
        (lambda: planner.state_bytes(precision="32-true", master_weights=True), "16-bit"),
        (lambda: inputs.parse_bytes("80 gigs"), "Cannot parse memory size '80 gigs'"),
        (lambda: inputs.parse_bytes("0GB"), "positive"),
        (lambda: planner.zero_bytes(10, stage=4, world_size=2, state=FP32), "zero_stage=4"),
        (lambda: planner.per_parameter_shards([()], 2), "0-dim"),
        (lambda: planner.split_stages([1, 2], 3), "stages=3"),
        (lambda: planner.pipeline_idle_fraction(stages=2, micro_batches=4, schedule="zb"), "Unknown pipeline schedule"),
        (lambda: planner.pipeline_idle_fraction(stages=2, micro_batches=4, virtual_stages=2), "interleaved"),
        (lambda: OffloadTiers(params="disk"), "params='disk'"),
        (lambda: inputs.build_meta_model("torch.nn.NoSuchThing"), "no class 'NoSuchThing'"),
        (lambda: inputs.build_meta_model("Linear"), "dotted"),
        (lambda: inputs.build_meta_model("torch.nn.Linear", "{not json"), "not valid JSON"),
    ],
)
def test_bad_inputs_raise_clear_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_non_module_class_is_a_type_error():
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        inputs.build_meta_model("collections.OrderedDict")


# ---- CLI ---------------------------------------------------------------------------------------------------
def test_cli_plan_with_params(capsys):
    assert (
        main(
            [
                "plan",
                "--params",
                "1.5B",
                "--world-size",
                "8",
                "--devices-per-node",
                "4",
                "--device-memory",
                "8GB",
                "--precision",
                "bf16-mixed",
                "--master-weights",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert re.search(r"zero2 \*", out)
    # with --params only, the recommendation line itself says what it could not count, and how to
    assert (
        "Recommended (least parallelism whose model states fit; activations NOT counted: give --batch-size,"
        " --seq-len, --hidden-size and --layers): zero2"
    ) in out
    assert re.search(r"ddp\s.*\b24\b.*\bno\b", out)


# the case: 8e9 parameters on 64 x 80 GB, one 8192-token sequence of width 4096 per rank
LLAMA_8B_SHAPE = [
    "plan", "--params", "8e9", "--world-size", "64", "--devices-per-node", "8", "--device-memory", "80GB",
    "--precision", "bf16-mixed", "--batch-size", "1", "--seq-len", "8192", "--hidden-size", "4096",
]  # fmt: skip


def test_cli_plan_with_shapes_says_on_every_row_why_activations_are_missing(capsys):
    assert main([*LLAMA_8B_SHAPE, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layouts"] and all(
        lay["activations"] is None and lay["activations_missing"] == "blocks unknown" for lay in data["layouts"]
    )
    assert "activations NOT counted: give --layers" in data["recommendation"]
    assert main(LLAMA_8B_SHAPE) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert len(rows) == len(data["layouts"]) and all("needs --layers" in row for row in rows)


def test_cli_plan_with_shapes_and_layers_counts_activations_on_every_row(capsys):
    assert main([*LLAMA_8B_SHAPE, "--layers", "32", "--micro-batches", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by = {lay["name"]: lay for lay in data["layouts"]}
    for lay in data["layouts"]:
        # every row counts them, or says why: a pipeline cannot split one sequence into pp micro-batches
        assert lay["activations"] is not None or lay["activations_missing"].endswith("micro-batches > batch 1"), lay
        assert lay["activations_counted"] or lay["kind"] == "pp", lay  # tp / cp traffic counts activations too
    states, act = by["zero1"]["memory"]["total"], by["zero1"]["activations"]
    assert states == pytest.approx(65e9, rel=0.01) and act > 15e9  # 32 blocks x 8192 tokens: no longer fits 80 GB
    assert by["zero1"]["fits"] is False and data["recommended"] != "zero1"
    # tensor parallelism splits a block's activations (not the norms' inputs): less per device, more with tp
    assert by["tp2-fsdp32"]["activations"] < by["fsdp"]["activations"]
    assert by["tp8-fsdp8"]["activations"] < by["tp2-fsdp32"]["activations"]
    assert by["cp2-fsdp32"]["activations"] == pytest.approx(by["fsdp"]["activations"] / 2, rel=1e-3)
    assert "model states + activations fit" in data["recommendation"]
    best = by[data["recommended"]]
    assert best["memory"]["total"] + best["activations"] <= 80e9


def test_cli_plan_model_json(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "torch.nn.Linear",
                "--init-args",
                '{"in_features": 10, "out_features": 5}',
                "--world-size",
                "2",
                "--precision",
                "32-true",
                "--optimizer",
                "sgd-momentum",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == 55 and data["recommended"] == "ddp"
    ddp = next(lay for lay in data["layouts"] if lay["name"] == "ddp")
    assert ddp["memory"]["total"] == 55 * (4 + 4 + 4)
    assert ddp["wire_bytes"] == pytest.approx(2 * 1 / 2 * 55 * 4)


def test_cli_plan_model_from_a_file_or_the_working_folder(tmp_path):
    """`--model ./my_model.py`, `./my_model.py:Net`, `my_model.Net` and `my_model:Net` from the folder holding the
    file, as LightningCLI users type them (issue 29: 'the package argument is required' / 'No module named').
    Run as the console script runs (`-P`: the working folder is not on sys.path by itself)."""
    import subprocess
    import sys

    (tmp_path / "my_model.py").write_text(
        "from torch import nn\n\nclass Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(10, 5)\n"
    )
    (tmp_path / "two.py").write_text("from torch import nn\nclass A(nn.Linear): pass\nclass B(nn.Linear): pass\n")
    code = (
        "import json, sys; from lightning_dist.cli import main;"
        " sys.exit(main(['plan', '--model', sys.argv[1], '--world-size', '2', '--json']))"
    )
    good = [
        "./my_model.py",
        "./my_model.py:Net",
        str(tmp_path / "my_model.py") + ":Net",
        "my_model.Net",
        "my_model:Net",
    ]
    bad = [
        ("./two.py", "defines 2 nn.Module classes ['A', 'B']; name the one to build: './two.py:B'"),
        ("./absent.py:Net", "'./absent.py' is not a Python file (not found)"),
        ("absent.Net", "No module named 'absent' (searched sys.path and the working folder"),
    ]
    # one fresh process per form, all started at once (each pays torch's import)
    procs = {
        model: subprocess.Popen(
            [sys.executable, "-P", "-c", code, model],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for model in [*good, *(m for m, _ in bad)]
    }
    runs = {}
    for model, proc in procs.items():
        out, err = proc.communicate(timeout=300)  # reads both pipes while waiting: no full-pipe stall
        runs[model] = (proc.returncode, out, err)
    for model in good:
        rc, out, err = runs[model]
        assert rc == 0, (model, err)
        assert json.loads(out)["params"] == 55, model
    for model, needle in bad:
        rc, _, err = runs[model]
        assert rc == 2 and needle in err, (model, err)
        assert "./my_model.py:Net" in err or "two.py" in model  # the accepted forms are shown


def test_cli_plan_config_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib (the `plot` extra) is not installed")
    cfg = tmp_path / "cli.yaml"
    cfg.write_text("model:\n  class_path: torch.nn.Linear\n  init_args:\n    in_features: 64\n    out_features: 64\n")
    png = tmp_path / "mem.png"
    assert (
        main(
            [
                "plan",
                "--config",
                str(cfg),
                "--world-size",
                "4",
                "--devices-per-node",
                "2",
                "--device-memory",
                "20KiB",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "64 * 64" not in out and "4,160 params" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--params", "1B", "--world-size", "8", "--device-memory", "lots"], "Cannot parse memory size 'lots'"),
        (["--params", "1B", "--world-size", "6", "--devices-per-node", "4"], "not divisible"),
        (["--params", "-3", "--world-size", "2"], "must be >= 0"),
        (["--params", "1B", "--world-size", "2", "--batch-size", "4"], "--hidden-size"),
    ],
)
def test_cli_plan_errors_exit_2_with_the_message(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *argv])
    assert exc.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_console_script_points_at_main():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "lightning-dist"]
    assert ep.load() is main


def test_cli_rejects_unknown_precision(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--params", "1B", "--world-size", "2", "--precision", "fp8"])
    assert exc.value.code == 2 and "fp8" in capsys.readouterr().err


# ---- DeepSpeed's own estimators -----------------------------------------------------------------------------
def _deepspeed_rows(out: str) -> list[tuple[float, float, str]]:
    """(per CPU GiB, per GPU GiB, options) rows of an estimate_*_all_cold printout."""
    rows = re.findall(r"^\s*([0-9.]+)GB \|\s*([0-9.]+)GB \| (.*)$", out, flags=re.M)
    return [(float(c), float(g), opts) for c, g, opts in rows]


def test_planner_matches_deepspeed_estimators(capsys):
    pytest.importorskip("deepspeed")
    # imported here: deepspeed's import probes accelerators and logs (slow, noisy)
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs,
        estimate_zero3_model_states_mem_needs_all_cold,
    )
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero2_model_states_mem_needs_all_cold,
    )

    # Conventions the comparison accounts for:
    # * DeepSpeed prints GB = 2**30 bytes with 2 decimals (we use 1e9 in the tables): compare in GiB at 0.005.
    # * Its per-GPU ZeRO-2/3 figure counts 18 sharded bytes per parameter: 16-bit grads + an fp32 gradient
    #   partition + fp32 master + 2 moments. The planner's mixed-precision Adam is 2 + 2 + 12 (no fp32
    #   gradient copy), so DeepSpeed = planner + 4 P / N (ZeRO-2: 2 P replicated + (2 + 4 + 12) P / N) and,
    #   ZeRO-3 (2 + 4 + 12 vs 2 + 2 + 12 sharded), DeepSpeed = planner + 2 P / N + 4 L.
    # * ZeRO-3 adds 4 bytes x the largest layer L (the gathered working copy); the planner counts model
    #   states at rest only.
    # * The per-CPU column is per node, with an additional_buffer_factor (1.5) and minimums: not comparable
    #   with the planner's per-rank host bytes, so only the per-GPU column is compared.
    # * int() truncation of 18 P / N: compare bytes with 1 byte tolerance.
    psi, largest = PSI, 50_000_000
    for gpus, nodes in ((8, 1), (4, 2), (2, 1)):
        n = gpus * nodes
        z2_rows, z3_rows = [], []
        estimate_zero2_model_states_mem_needs_all_cold(psi, num_gpus_per_node=gpus, num_nodes=nodes)
        z2_rows = _deepspeed_rows(capsys.readouterr().out)
        estimate_zero3_model_states_mem_needs_all_cold(psi, largest, num_gpus_per_node=gpus, num_nodes=nodes)
        z3_rows = _deepspeed_rows(capsys.readouterr().out)
        assert len(z2_rows) == 2 and len(z3_rows) == 6

        for cpu_offload in (True, False):
            tiers = OffloadTiers(grads="host", optimizer="host") if cpu_offload else None
            ours = planner.zero_bytes(psi, stage=2, world_size=n, state=MIXED, offload=tiers).total
            expected_ds = ours + (0 if cpu_offload else 4 * psi / n)
            _, gpu_bytes = estimate_zero2_model_states_mem_needs(psi, gpus, nodes, cpu_offload=cpu_offload)
            assert gpu_bytes == pytest.approx(expected_ds, abs=1)
            (row,) = [r for r in z2_rows if ("offload_optimizer=none" in r[2]) != cpu_offload]
            assert row[1] == pytest.approx(expected_ds / 2**30, abs=0.005)

        for offload_opt, offload_params in ((True, True), (True, False), (False, False)):
            tiers = OffloadTiers(
                params="host" if offload_params else "device",
                grads="host" if offload_opt else "device",
                optimizer="host" if offload_opt else "device",
            )
            ours = planner.zero_bytes(psi, stage=3, world_size=n, state=MIXED, offload=tiers).total
            expected_ds = ours + 4 * largest + (0 if offload_opt else 2 * psi / n)
            for zero_init in (True, False):
                _, gpu_bytes, _ = estimate_zero3_model_states_mem_needs(
                    psi,
                    largest,
                    gpus,
                    nodes,
                    cpu_offload=offload_opt,
                    cpu_offload_params=offload_params,
                    zero_init=zero_init,
                )
                assert gpu_bytes == pytest.approx(expected_ds, abs=1)
            rows = [
                r
                for r in z3_rows
                if ("offload_optimizer=none" not in r[2]) == offload_opt
                and ("offload_param=none" not in r[2]) == offload_params
            ]
            assert len(rows) == 2 and all(r[1] == pytest.approx(expected_ds / 2**30, abs=0.005) for r in rows)


def test_tp_traffic_counts_a_gathered_head():
    from lightning_dist import planner

    kw = dict(batch=2, seq=4, hidden=8, blocks=1, tp=2, bytes_per_element=8)
    base = {c.op: c.payload_bytes for c in planner.tp_activation_traffic(**kw)}
    head = {c.op: c.payload_bytes for c in planner.tp_activation_traffic(**kw, gathered=[(256, 64)])}
    # the head's input gradient joins the all-reduce, its gathered output is an all-gather of its own
    assert head == {"all_reduce": base["all_reduce"] + 256, "all_gather": 64}
    sp = {
        c.op: c.payload_bytes for c in planner.tp_activation_traffic(**kw, sequence_parallel=True, gathered=[(256, 64)])
    }
    assert sp["all_reduce"] == 256 and sp["all_gather"] == sp["reduce_scatter"] + 64


def test_cp_attention_traffic_counts_each_exchange():
    from lightning_dist import planner

    base = dict(batch=2, seq=64, heads=8, head_dim=16, attention_calls=3, bytes_per_element=2)
    assert planner.cp_attention_traffic(**base, cp=1) == []
    (mha,) = planner.cp_attention_traffic(**base, cp=2)
    assert (mha.op, mha.dim, mha.group_size) == ("all_to_all", "cp", 2)
    # every call: q, k, v and the output of this rank's seq / cp tokens, forward and backward
    local = base["batch"] * base["seq"] // 2 * base["heads"] * base["head_dim"] * base["bytes_per_element"]
    assert mha.payload_bytes == 3 * 2 * 4 * local
    assert mha.wire_bytes == mha.payload_bytes / 2  # each rank keeps its own half
    # grouped key/value heads that divide by cp are sent as they are; those that do not are repeated first
    (gqa,) = planner.cp_attention_traffic(**base, cp=2, kv_heads=2)
    assert gqa.payload_bytes == 3 * 2 * (2 + 2 * 2 / 8) * local
    (repeated,) = planner.cp_attention_traffic(**base, cp=4, kv_heads=2)
    (mha4,) = planner.cp_attention_traffic(**base, cp=4)
    assert repeated.payload_bytes == mha4.payload_bytes
    # a block recomputed by full activation checkpointing repeats its forward exchanges
    (ac,) = planner.cp_attention_traffic(**base, cp=2, recomputed_calls=3)
    assert ac.payload_bytes == 1.5 * mha.payload_bytes
    # tensor parallelism inside: each tp rank exchanges its own heads
    (tp,) = planner.cp_attention_traffic(**base, cp=2, tp=2)
    assert tp.payload_bytes == mha.payload_bytes / 2
    with pytest.raises(ValueError, match="cp"):
        planner.cp_attention_traffic(**base, cp=0)
    # the ring: this rank's keys and values (grouped heads repeated to the query heads) gathered forward and backward
    # (payload: the gathered output, cp x theirs; a recomputed forward gathers again), and cp all-to-alls of their
    # gradients per backward
    gather, rotate = planner.cp_attention_traffic(**base, cp=4, kv_heads=2, recomputed_calls=1, style="ring")
    kv4 = 2 * base["batch"] * base["seq"] // 4 * base["heads"] * base["head_dim"] * base["bytes_per_element"]
    assert (gather.op, gather.dim, gather.payload_bytes) == ("all_gather", "cp", (2 * 3 + 1) * 4 * kv4)
    assert (rotate.op, rotate.dim, rotate.payload_bytes) == ("all_to_all", "cp", 3 * 4 * kv4)
    with pytest.raises(ValueError, match="style='zigzag'"):
        planner.cp_attention_traffic(**base, cp=2, style="zigzag")


def test_with_cp_dims_moves_data_parallel_traffic_to_the_cp_flattened_dims():
    from lightning_dist import planner

    state = planner.state_bytes(precision="32-true", optimizer="adamw")
    fsdp = planner.data_parallel_traffic(1000, state=state, zero_stage=3, shard_size=4, replicate_size=2)
    assert planner.with_cp_dims(fsdp, 1) == fsdp
    moved = planner.with_cp_dims(fsdp, 2)
    assert [c.dim for c in moved] == ["dp_shard_cp", "dp_shard_cp", "dp_replicate"]
    assert [c.payload_bytes for c in moved] == [c.payload_bytes for c in fsdp]
    ddp = planner.data_parallel_traffic(1000, state=state, zero_stage=0, shard_size=4)
    assert [c.dim for c in planner.with_cp_dims(ddp, 2)] == ["dp_cp"]


def test_count_activations_per_layout_kind():
    counts = planner.ParamCounts(total=8 * 12 * 32 * 32, layer_params=(12 * 32 * 32,) * 8)
    shape = planner.ActivationShape(batch=8, seq=16, hidden=32, bytes_per_element=4)
    state = planner.state_bytes(precision="32-true")

    def by_name(schedule: str) -> dict:
        layouts = planner.candidate_layouts(counts, world_size=4, devices_per_node=4, state=state, activation=shape)
        counted = planner.count_activations(layouts, counts, activation=shape, state=state, schedule=schedule)
        return {lay.name: lay for lay in counted}

    by = by_name("1f1b")
    whole = planner.activation_bytes(
        planner.BlockShape(hidden=32, heads=1, mlp_hidden=128), tokens=128, blocks=8, bytes_per_element=4
    )
    assert by["ddp"].activations == pytest.approx(whole) and by["fsdp"].activations == by["ddp"].activations
    assert by["tp2-fsdp2"].activations < by["fsdp"].activations  # the split activations are 1/tp
    # 1F1B: stage 0 holds its 4 blocks for the 2 micro-batches in flight (of 8, one sample each), not the whole batch
    assert by["pp2-ddp2"].activations < by["ddp"].activations / 4
    assert by_name("gpipe")["pp2-ddp2"].activations > by["pp2-ddp2"].activations  # GPipe holds all 8
    # without an activation shape nothing is counted, and each layout says why
    bare = planner.count_activations(list(by.values()), counts, activation=None, state=state)
    assert all(lay.activations is None and lay.activations_missing == "no activation shape" for lay in bare)
