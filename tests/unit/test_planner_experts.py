"""Expert parallelism in the planner: states per rank and all-to-all bytes against hand-computed values, the ep
layouts, reading a mixture of experts off a model, and `lightning-dist plan --experts`."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_dist import inputs, planner
from lightning_dist.cli import main
from lightning_dist.dryrun import DryRunConfig, simulate_rank
from lightning_dist.models.moe import MoEGPT
from lightning_dist.parallelize.counts import count_params
from lightning_dist.planner import Collective, MoEShape, StateBytes

FP32 = StateBytes.fp32_adam()  # 4 + 4 + 8 = 16 bytes per parameter; gathers and reductions in 4
# a small MoE: 2 layers of 8 experts, each layer's experts as (8, 16, 32) and (8, 32, 8): 6144 parameters a layer
SHAPES = ((8, 16, 32), (8, 32, 8)) * 2
MOE = MoEShape(experts=8, top_k=2, hidden=32, layers=2, expert_params=12_288, expert_shapes=SHAPES)
DENSE = 10_000


def test_states_per_rank_closed_form():
    # S = 4, ep = 2: dense 10000 / 4 = 2500 elements; experts 12288 / 2 = 6144 per ep rank, / (4 / 2) = 3072
    dense, experts = planner.ep_state_bytes(DENSE, MOE.expert_params, shard_size=4, ep=2, state=FP32)
    assert (dense.params, dense.grads, dense.optimizer) == (2500 * 4, 2500 * 4, 2500 * 8)
    assert (experts.params, experts.grads, experts.optimizer) == (3072 * 4, 3072 * 4, 3072 * 8)
    assert experts.total == 49_152 and dense.total == 40_000
    # ep = S: every rank its E / ep experts whole (nothing left to shard them over)
    _, whole = planner.ep_state_bytes(DENSE, MOE.expert_params, shard_size=4, ep=4, state=FP32)
    assert whole.total == 12_288 / 4 * 16
    with pytest.raises(ValueError, match="ep=3"):
        planner.ep_state_bytes(DENSE, MOE.expert_params, shard_size=4, ep=3, state=FP32)


def test_states_per_rank_exact_shards():
    # 6 experts of (4, 5) at ep = 2 over dp_shard = 4: each ep rank 3 experts, FSDP2 over 2 ranks in chunks of 2 rows
    # -> the first rank of dp_shard_mod_ep holds 2 experts (40 elements), the second 1 (20); ranks 0, 1 form ep group 0
    for shard_rank, rows in ((0, 2), (1, 2), (2, 1), (3, 1)):
        dense, experts = planner.ep_state_bytes_exact(
            [(10, 3)], [(6, 4, 5)], shard_size=4, ep=2, shard_rank=shard_rank, state=FP32
        )
        assert experts.params == rows * 20 * 4, shard_rank
        assert experts.optimizer == rows * 20 * 8
        assert dense.params == [3, 3, 3, 1][shard_rank] * 3 * 4  # 10 rows in chunks of 3 over 4 ranks
    # the small MoE at ep = 2, S = 4: (4, 16, 32) and (4, 32, 8) over 2 ranks, 2 experts each: 1536 a layer, as closed
    _, experts = planner.ep_state_bytes_exact((), SHAPES, shard_size=4, ep=2, shard_rank=3, state=FP32)
    assert experts.total == 2 * 1536 * 16 == 49_152
    assert planner.ep_local_shape((8, 16, 32), 4) == (2, 16, 32)


def test_all_to_all_bytes_per_layer():
    # N = 32 tokens x top-2 = 64 rows of 32 x 2 bytes (bf16) = 4096 B; counts 8 x 8 experts = 64 B; 3 layers, ep = 4
    rows = planner.ep_all_to_all(rows=64, hidden=32, bytes_per_element=2, experts=8, ep=4, layers=3)
    assert [c.payload_bytes for c in rows] == [3 * 64, 3 * 4096, 3 * 4096, 3 * 8192]
    assert all(c.op == "all_to_all" and c.dim == "ep" and c.group_size == 4 for c in rows)
    assert sum(c.payload_bytes for c in rows) == 49_344
    # wire: each rank keeps its 1/4 and sends 3/4
    assert sum(c.wire_bytes for c in rows) == 49_344 * 3 / 4
    # the routing a run had: 100 rows arrived at this rank's experts -> combine and the dispatch's gradient carry 100
    skewed = planner.ep_all_to_all(rows=64, hidden=32, bytes_per_element=2, experts=8, ep=4, received=100)
    assert [c.payload_bytes for c in skewed] == [64, 4096, 6400, 4096 + 6400]
    assert planner.ep_all_to_all(rows=64, hidden=32, bytes_per_element=2, experts=8, ep=1) == []
    assert "uniform routing" in planner.UNIFORM_ROUTING and "(ep-1)/ep" in planner.UNIFORM_ROUTING


def test_fsdp_traffic_under_ep():
    # HSDP 2 x 4, ep = 2: dense as without ep; each rank's 6144 experts gathered twice and reduce-scattered over the
    # 2 ranks of dp_shard_mod_ep, their gradient shards (6144 / 2) all-reduced over dp_replicate
    got = planner.ep_fsdp_traffic(DENSE, MOE.expert_params, state=FP32, shard_size=4, replicate_size=2, ep=2)
    assert [(c.op, c.dim, c.group_size, c.payload_bytes) for c in got] == [
        ("all_gather", "dp_shard", 4, 2 * DENSE * 4),
        ("reduce_scatter", "dp_shard", 4, DENSE * 4),
        ("all_reduce", "dp_replicate", 2, DENSE / 4 * 4),
        ("all_gather", "dp_shard_mod_ep", 2, 2 * 6144 * 4),
        ("reduce_scatter", "dp_shard_mod_ep", 2, 6144 * 4),
        ("all_reduce", "dp_replicate", 2, 3072 * 4),
    ]
    # ep = dp_shard: the experts are not sharded further (FSDP2 runs nothing over one rank)
    got = planner.ep_fsdp_traffic(DENSE, MOE.expert_params, state=FP32, shard_size=4, replicate_size=1, ep=4)
    assert [c.dim for c in got] == ["dp_shard", "dp_shard"]


def test_ep_layouts():
    assert planner.ep_degrees(8, 8) == [2, 4, 8] and planner.ep_degrees(6, 4) == [2]
    layouts = planner.ep_layouts(
        DENSE + MOE.expert_params, MOE, world_size=4, state=FP32, tokens=32, bytes_per_element=2
    )
    assert [(lay.name, lay.dp_replicate, lay.dp_shard, lay.ep) for lay in layouts] == [
        ("hsdp-2-ep2", 2, 2, 2),
        ("fsdp-ep2", 1, 4, 2),
        ("fsdp-ep4", 1, 4, 4),
    ]
    by = {lay.name: lay for lay in layouts}
    assert by["fsdp-ep2"].experts_per_rank == 4 and by["fsdp-ep4"].experts_per_rank == 2
    assert by["hsdp-2-ep2"].experts.total == 6144 * 16  # 4 experts a layer on each rank, whole (2 / 2 = 1 left)
    assert by["fsdp-ep2"].experts.total == by["fsdp-ep4"].experts.total == 3072 * 16
    assert by["fsdp-ep2"].dense.total == DENSE / 4 * 16
    # per layer: 64 + 2 x 64 rows x 32 x 2 B forward, both again backward
    assert sum(c.payload_bytes for c in by["fsdp-ep2"].per_layer) == 64 + 4 * 4096
    assert sum(c.payload_bytes for c in by["fsdp-ep2"].all_to_all) == 2 * (64 + 4 * 4096)
    fits = planner.ep_layouts(
        DENSE + MOE.expert_params, MOE, world_size=4, state=FP32, device_memory=100_000, tokens=None
    )
    assert [lay.fits for lay in fits] == [False, True, True] and fits[0].all_to_all == ()
    with pytest.raises(ValueError, match="top_k=9"):
        MoEShape(experts=8, top_k=9, hidden=32, layers=1, expert_params=1)
    with pytest.raises(ValueError, match="expert_shapes"):
        MoEShape(experts=8, top_k=2, hidden=32, layers=1, expert_params=1, expert_shapes=((4, 2),))
    assert isinstance(by["fsdp-ep2"].fsdp[0], Collective) and by["fsdp-ep2"].to_dict()["mesh"]["ep"] == 2


def test_ep_spanning_tp():
    # ep a multiple of tp: the ep groups take every tp rank, ep / tp of them must divide dp_shard; else ep | dp_shard
    assert planner.ep_degrees(8, 2, tp=2) == [2, 4] and planner.ep_degrees(8, 2, tp=4) == [2, 4, 8]
    assert planner.ep_degrees(8, 4, tp=2) == [2, 4, 8] and planner.ep_degrees(6, 3, tp=2) == [2, 3, 6]
    assert planner.ep_degrees(8, 3, tp=4) == [4]  # 2: no multiple of tp 4, not dividing 3; 8: 8 / 4 = 2 neither
    # the experts' FSDP2 mesh: dp_shard x tp / ep ranks when ep spans tp, dp_shard / ep otherwise
    assert planner.ep_fsdp_size(2, 2, tp=2) == 2 and planner.ep_fsdp_size(4, 8, tp=2) == 1
    assert planner.ep_fsdp_size(4, 2, tp=4) == 2  # ep 2 < tp 4: the old layout, inside dp_shard
    with pytest.raises(ValueError, match="ep / tp=4"):
        planner.ep_fsdp_size(2, 8, tp=2)
    # S = 2, tp = 2, ep = 2: 6144 experts per rank over 2 ranks, as fsdp-ep2 on 4 data-parallel ranks
    _, experts = planner.ep_state_bytes(DENSE, MOE.expert_params, shard_size=2, ep=2, state=FP32, tp=2)
    assert experts.total == 3072 * 16
    # exact: 6 experts / ep 2 = 3 rows over the 2 ranks of the experts' mesh in chunks of 2; rank (dp_shard d, tp t)
    # is number 2 d + t of dp_shard x tp, so number (2 d + t) // 2 = d of that mesh: 2 rows on d = 0, 1 on d = 1
    for shard_rank, tp_rank, rows in ((0, 0, 2), (0, 1, 2), (1, 0, 1), (1, 1, 1)):
        _, experts = planner.ep_state_bytes_exact(
            (), [(6, 4, 5)], shard_size=2, ep=2, shard_rank=shard_rank, tp=2, tp_rank=tp_rank, state=FP32
        )
        assert experts.params == rows * 20 * 4, (shard_rank, tp_rank)
    # rows dispatched: each tp rank's tensor_split share of the N tokens, x top_k
    assert planner.ep_rows(33, 2, ep=4, tp=2) == 34 and planner.ep_rows(33, 2, ep=4, tp=2, tp_rank=1) == 32
    assert planner.ep_rows(33, 2, ep=2, tp=4) == 66  # not spanning: all its tokens
    # tp all-gathers per layer: forward output and backward hidden gradient tp x ceil(N/tp) x C x a, weights x k
    got = planner.ep_tp_gathers(tokens=33, hidden=8, top_k=2, tp=2, bytes_per_element=2, weight_bytes=4, layers=3)
    assert [c.payload_bytes for c in got] == [3 * 34 * 16, 3 * 34 * 16, 3 * 34 * 8]
    assert all((c.op, c.dim, c.group_size) == ("all_gather", "tp", 2) for c in got)
    assert planner.ep_tp_gathers(tokens=33, hidden=8, top_k=2, tp=1, bytes_per_element=2) == []
    # the layouts: tp2 x ep2 and tp2 x ep4 on 4 ranks (dp_shard 2; ep4: E / 4 experts whole, 2 x 2 / 4 = 1 rank),
    # half the rows and the tp gathers
    rows = planner.ep_layouts(
        DENSE + MOE.expert_params, MOE, world_size=4, state=FP32, tokens=32, bytes_per_element=2, tp_sharded_params=0
    )
    by = {lay.name: lay for lay in rows}
    assert [n for n in by if n.startswith("tp")] == ["tp2-fsdp-ep2", "tp2-fsdp-ep4"]
    assert by["tp2-fsdp-ep4"].experts_per_rank == 2 and by["tp2-fsdp-ep4"].experts.total == 12_288 / 4 * 16
    assert [c.payload_bytes for c in by["tp2-fsdp-ep2"].per_layer] == [64, 2048, 2048, 4096]  # 16 tokens x 2
    assert sum(c.payload_bytes for c in by["tp2-fsdp-ep2"].tp_gathers) == 2 * 32 * (32 + 32 + 2) * 2
    assert by["fsdp-ep2"].tp_gathers == () and by["tp2-fsdp-ep2"].to_dict()["tp_all_gather"]


def test_moe_read_off_models():
    from lightning_dist.models import GPT
    from lightning_dist.models.moe import MoEGPT

    with torch.device("meta"):
        pack = MoEGPT(
            vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32, n_experts=8, top_k=2, expert_hidden=8
        )
        dense = GPT(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32)
    spec = inputs.moe_spec(pack)
    assert spec == {
        "experts": 8,
        "top_k": 2,
        "hidden": 32,
        "layers": 2,
        "expert_params": 12_288,
        "expert_shapes": SHAPES,
    }
    assert inputs.moe_spec(pack, top_k=4)["top_k"] == 4  # overrides
    assert inputs.moe_spec(dense) is None
    with pytest.raises(ValueError, match="no experts module"):
        inputs.moe_spec(dense, experts=8)
    tf = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    with torch.device("meta"):
        qwen = tf.Qwen3MoeForCausalLM(
            tf.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=16)
        )
        mixtral = tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    q, m = inputs.moe_spec(qwen), inputs.moe_spec(mixtral)
    # Qwen3-MoE: gate_up (4, 2 x 16, 32) + down (4, 32, 16) a layer; Mixtral: (4, 2 x 64, 32) + (4, 32, 64)
    assert (q["experts"], q["top_k"], q["hidden"], q["layers"], q["expert_params"]) == (4, 3, 32, 2, 2 * 4 * 1536)
    assert (m["experts"], m["top_k"], m["hidden"], m["layers"], m["expert_params"]) == (4, 2, 32, 2, 2 * 4 * 6144)


def test_cli_plan_ep_from_a_config(tmp_path, capsys):
    config = tmp_path / "moe.yaml"
    config.write_text(
        "model:\n  class_path: lightning_dist.models.moe.MoEGPT\n  init_args: {vocab_size: 64, block_size: 8,"
        " n_layer: 2, n_head: 4, n_embd: 32, n_experts: 8, top_k: 2, expert_hidden: 8}\n"
    )
    args = ["plan", "--config", str(config), "--world-size", "4", "--precision", "64-true"]
    assert main([*args, "--batch-size", "4", "--seq-len", "8", "--hidden-size", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["moe"]["experts"] == 8 and out["moe"]["expert_params"] == 12_288
    assert "uniform routing" in out["routing"]
    names = [lay["name"] for lay in out["ep_layouts"]]
    assert names == ["hsdp-2-ep2", "fsdp-ep2", "fsdp-ep4", "tp2-fsdp-ep2", "tp2-fsdp-ep4"]
    # 4 x 8 = 32 tokens per rank x top-2 = 64 rows of 32 float64: 16384 B each way, counts 8 x 8 B
    per_layer = [c["payload_bytes"] for c in out["ep_layouts"][1]["all_to_all_per_layer"]]
    assert per_layer == [64, 16_384, 16_384, 32_768]
    assert main([*args, "--batch-size", "4", "--seq-len", "8", "--hidden-size", "32"]) == 0
    text = capsys.readouterr().out
    assert "fsdp-ep4" in text and "assuming uniform routing" in text and "16,384 B" in text
    assert "tp2-fsdp-ep2" in text and "1x2x2x2" in text  # rep x shard x tp x ep


def test_cli_plan_ep_with_params(capsys):
    args = ["plan", "--params", "22288", "--world-size", "4", "--precision", "32-true"]
    moe = ["--experts", "8", "--top-k", "2", "--expert-params", "12288", "--hidden-size", "32", "--layers", "2"]
    assert main([*args, *moe, "--batch-size", "4", "--seq-len", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fsdp_ep2 = {lay["name"]: lay for lay in out["ep_layouts"]}["fsdp-ep2"]
    assert fsdp_ep2["experts"]["total"] == 3072 * 16 and fsdp_ep2["dense"]["total"] == DENSE / 4 * 16
    with pytest.raises(SystemExit):
        main([*args, "--experts", "8", "--top-k", "2"])  # no --expert-params, --hidden-size, --layers
    assert "--expert-params, --hidden-size, --layers" in capsys.readouterr().err


class TPMoE(pl.LightningModule):
    """The pack's MoE GPT with a plain cross-entropy step (what ``TensorParallelStrategy(ep=...)`` trains)."""

    def __init__(self, **sizes) -> None:
        super().__init__()
        self.model = MoEGPT(**sizes)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


TP_MOE = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=32, n_experts=8, top_k=2, expert_hidden=32)


def _tp_ep_against_the_dry_run(*, tp: int, ep: int, world: int, name: str):
    """(the dry run of rank 0 of ``TensorParallelStrategy(tp, ep)`` on `world` ranks, the planner's row `name`, the
    planner's ``fsdp-ep2`` row on the same world) for :data:`TP_MOE` with batch 4 x 32 tokens in float32."""
    config = DryRunConfig(
        model=f"{__name__}.TPMoE",
        init_args=TP_MOE,
        strategy="tp",
        strategy_args={"tp": tp, "ep": ep, "dp_replicate": 1},
        world_size=world,
        devices_per_node=world,
        precision="32-true",
        batch_size=4,
    )
    measured = simulate_rank(config, 0)
    model = MoEGPT(**TP_MOE)
    counts = count_params(model)
    moe = MoEShape(**inputs.moe_spec(model))
    # what the auto tp plan splits: count_params counts every Linear and Embedding, the plan keeps the token embedding
    # and the routers whole (left in, the planner's states come out 5.7% short here)
    whole = model.tok_emb.weight.numel() + sum(b.mlp.router.weight.numel() for b in model.blocks)
    rows = planner.ep_layouts(
        counts.total,
        moe,
        world_size=world,
        state=FP32,
        tokens=4 * 32,  # batch x sequence per data-parallel rank: what each tp group holds alike
        bytes_per_element=4,
        tp_sharded_params=counts.tp_sharded_params - whole,
    )
    by = {lay.name: lay for lay in rows}
    got = {(c["op"], c["dim"]): c for c in measured["collectives"]}
    return got, measured, by[name], by.get("fsdp-ep2"), moe


# the tp all-gather of the lm_head's colwise_gather output: batch x seq x vocab float32 (not expert parallelism's)
HEAD_GATHER = 4 * 32 * 128 * 4


def test_tp_ep_rows_against_the_dry_run_of_the_runtime(fake_world):
    # tp2 x ep2 on 4 ranks (dp_shard 2): the ep groups span tp (ep a multiple of tp), here each ep group is a tp group,
    # so the recorder labels its all-to-alls `tp` (a group is named by its ranks; tp first) and the experts' FSDP2
    # group, dp_shard x tp / ep = 2 ranks, is the dp_shard group. The planner's row against the dry run of
    # TensorParallelStrategy(tp=2, ep=2) (its fake process group runs the real strategy): the all-to-alls and the tp
    # all-gathers exactly (uniform routing), the states within 5% (0.1% here)
    got, measured, row, plain, moe = _tp_ep_against_the_dry_run(tp=2, ep=2, world=4, name="tp2-fsdp-ep2")
    assert (row.dp_replicate, row.dp_shard, row.tp, row.ep) == (1, 2, 2, 2) and row.experts_per_rank == 4
    assert ("all_to_all", "ep") not in got and got[("all_to_all", "tp")]["group_size"] == 2
    # each tp rank dispatches its 64 of the 128 tokens x top-2: 128 rows of 64 float32 = 32768 B each way, per layer
    assert [c.payload_bytes for c in row.per_layer] == [64, 32_768, 32_768, 65_536]
    assert got[("all_to_all", "tp")]["payload_bytes"] == sum(c.payload_bytes for c in row.all_to_all)
    # per layer: the combined output (2 x 64 rows x 64 x 4 B) forward, its hidden gradient and the routing weights'
    # (2 x 64 rows x top-2 x 4 B) backward
    assert sum(c.payload_bytes for c in row.tp_gathers) == 2 * (32_768 + 32_768 + 1_024)
    assert all(c.op == "all_gather" and c.dim == "tp" and c.group_size == 2 for c in row.tp_gathers)
    assert got[("all_gather", "tp")]["payload_bytes"] == HEAD_GATHER + sum(c.payload_bytes for c in row.tp_gathers)
    assert abs(row.total / measured["states"]["total"] - 1) <= 0.05, (row.total, measured["states"])
    # E / ep = 4 experts per rank over dp_shard x tp / ep = 2 ranks: as fsdp-ep2 (4 experts over dp_shard 4 / ep 2)
    assert row.experts.total == plain.experts.total
    assert [c.dim for c in row.fsdp if c.dim == "dp_shard_mod_ep"] == ["dp_shard_mod_ep"] * 2
    assert all(c.group_size == 2 for c in row.fsdp if c.dim == "dp_shard_mod_ep")


def test_tp_ep_spanning_tp_and_dp_shard_against_the_dry_run(fake_world):
    # tp2 x ep4 on 8 ranks (dp_shard 4): an ep group is 4 consecutive ranks of dp_shard x tp (two data-parallel ranks'
    # tp pairs, named `ep`), the experts' FSDP2 groups every 4th rank (dp_shard x tp / ep = 2: `dp_shard_mod_ep`)
    got, measured, row, _, _ = _tp_ep_against_the_dry_run(tp=2, ep=4, world=8, name="tp2-fsdp-ep4")
    assert (row.dp_replicate, row.dp_shard, row.tp, row.ep) == (1, 4, 2, 4) and row.experts_per_rank == 2
    assert got[("all_to_all", "ep")]["group_size"] == 4
    assert got[("all_to_all", "ep")]["payload_bytes"] == sum(c.payload_bytes for c in row.all_to_all)
    assert got[("all_gather", "tp")]["payload_bytes"] == HEAD_GATHER + sum(c.payload_bytes for c in row.tp_gathers)
    for op in ("all_gather", "reduce_scatter"):  # the experts' FSDP2: their own label, exactly the plan's
        planned = [c for c in row.fsdp if c.op == op and c.dim == "dp_shard_mod_ep"]
        assert got[(op, "dp_shard_mod_ep")]["group_size"] == planned[0].group_size == 2
        assert got[(op, "dp_shard_mod_ep")]["payload_bytes"] == sum(c.payload_bytes for c in planned)
    assert abs(row.total / measured["states"]["total"] - 1) <= 0.05, (row.total, measured["states"])
    assert not [k for k in got if k[1].startswith("ranks")]  # every group named by a mesh dim


def test_tp_ep_rows_count_linear_experts_once():
    # experts held as nn.Linear modules: count_params counts them with the Linear weights tp splits; the tp x ep row
    # takes them out of those (tp_sharded_expert_params) and counts them once, as experts
    class LinearMoE(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(16, 8)  # 128, split by tp
            self.norm = torch.nn.LayerNorm(8)  # 16, whole on every tp rank
            self.router = torch.nn.Linear(8, 4, bias=False)  # 32, split by tp
            self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))  # 4 x 72 = 288

    model = LinearMoE()
    counts = count_params(model)
    assert (counts.total, counts.tp_sharded_params) == (464, 448)  # the Linear experts among the split parameters
    moe = MoEShape(experts=4, top_k=2, hidden=8, layers=1, expert_params=288)
    common = dict(world_size=4, state=FP32, tp_sharded_params=counts.tp_sharded_params)
    rows = planner.ep_layouts(counts.total, moe, tp_sharded_expert_params=288, **common)
    row = {lay.name: lay for lay in rows}["tp2-fsdp-ep2"]
    assert (row.dp_shard, row.tp, row.ep) == (2, 2, 2)
    # dense: (128 + 32) / tp 2 + 16 = 96 per tp rank, / dp_shard 2; experts (ep spans tp): 288 / ep 2 = 144, FSDP2
    # over dp_shard x tp / ep = 2 ranks
    assert row.dense.total == 96 / 2 * 16 and row.experts.total == 72 * 16
    assert row.total == (48 + 72) * 16
    # the experts counted in neither part: they cannot fit in the 16 parameters tp does not split
    with pytest.raises(ValueError, match="tp_sharded_expert_params"):
        planner.ep_layouts(counts.total, moe, **common)
    # everything split (ParamCounts(tp_sharded=None), --params): the experts among them, the dense split whole
    everything = planner.ep_layouts(464, moe, world_size=4, state=FP32, tp_sharded_params=464)
    assert {lay.name: lay for lay in everything}["tp2-fsdp-ep2"].dense.total == 176 / 2 / 2 * 16


@pytest.mark.parametrize("tp,ep,world", [(2, 2, 4), (2, 4, 4), (4, 2, 8)], ids=["ep-is-tp", "ep-spans-tp", "ep-in-dp"])
def test_tp_ep_dry_run_plans_every_row_it_measures(fake_world, tp, ep, world):
    # the dry run's own plan (plan_rank) against what its fake step sent, row by row: ep groups that take the tp ranks
    # (tp2 x ep2, tp2 x ep4: the tp all-gathers, 1/tp of the all-to-all rows) and the layout at each tp coordinate
    # (tp4 x ep2 over dp_shard 2); an MoE block has one row-parallel layer (attention), the experts are whole on tp
    sizes = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=32, n_experts=8, top_k=2, expert_hidden=32)
    config = DryRunConfig(
        model=f"{__name__}.TPMoE",
        init_args=sizes,
        strategy="tp",
        strategy_args={"tp": tp, "ep": ep, "dp_replicate": 1},
        world_size=world,
        devices_per_node=world,
        precision="32-true",
        batch_size=4,
    )
    measured = simulate_rank(config, 0)
    got = {(c["op"], c["dim"]): c["payload_bytes"] for c in measured["collectives"]}
    planned = {(c["op"], c["dim"]): c["payload_bytes"] for c in measured["planned"]["collectives"]}
    assert got == planned, (got, planned)
    assert ("all_to_all", "dp_shard" if ep == 2 and tp == 4 else "tp" if ep == tp else "ep") in got, got
    assert (("all_gather", "tp") in got) and measured["states"]["total"] == measured["planned"]["states"]["total"]
