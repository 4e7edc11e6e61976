"""Pipelines of a mixture of experts in one process: the dry run (fake process group, fake tensors; the experts run
on the routing it states, uniform, with expert parallelism inside the stages or without it), the pack's
``CharMoEGPT`` with its router loss (the counting pass), and a bare stage refusing the whole model's methods."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_dist import _compat, planner
from lightning_dist.dryrun import DryRunConfig, UniformRouting, simulate_rank
from lightning_dist.dryrun_report import DryRunReport
from lightning_dist.models.moe import MoEGPT
from lightning_dist.parallelize.ep import stand_in_choices

SIZES = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=32, n_experts=8, top_k=2, expert_hidden=32)


class PipedMoE(pl.LightningModule):
    """The pack's MoE GPT for a pipeline: the cross-entropy per micro-batch, no router loss."""

    def __init__(self, **sizes) -> None:
        super().__init__()
        self.model = MoEGPT(**sizes)

    def forward(self, x):
        return self.model(x)

    def pipeline_loss(self, out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_the_stand_in_choices_route_each_expert_its_rows_and_a_token_no_expert_twice():
    choices = stand_in_choices(UniformRouting(), 10, 3, 8)  # 30 rows over 8 experts: 4 each, the first 6 one more
    assert choices.shape == (10, 3)
    assert torch.bincount(choices.flatten(), minlength=8).tolist() == [4] * 6 + [3] * 2
    assert all(len(set(row.tolist())) == 3 for row in choices)


@pytest.mark.parametrize("ep,rank", [(1, 0), (2, 3)], ids=["pp2", "pp2_ep2_last_stage"])
def test_a_pipeline_of_a_mixture_of_experts_dry_runs(fake_world, ep, rank):
    micro, batch = 2, 4
    config = DryRunConfig(
        model=f"{__name__}.PipedMoE",
        init_args=SIZES,
        strategy="pipeline_1f1b",
        strategy_args={"pp": 2, "ep": ep, "n_microbatches": micro},
        world_size=4,
        devices_per_node=4,
        precision="32-true",
        batch_size=batch,
    )
    if not _compat.torch_pipelining_exchanges_meta():  # torch 2.11/2.12: refused with the reason, no raw error
        with pytest.raises(RuntimeError, match="needs torch's stage metadata exchange"):
            simulate_rank(config, rank)
        assert not dist.is_initialized()
        return
    result = simulate_rank(config, rank)
    assert not dist.is_initialized()
    assert result["stages"] == [rank // 2] and "uniform routing" in result["routing"]
    calls = {(c["op"], c["dim"]): c for c in result["collectives"]}
    a2a = calls.get(("all_to_all", "dp_shard"))  # ep == dp_shard: the group keeps the mesh's name
    if ep == 1:
        assert a2a is None and ("all_gather", "dp_shard") in calls
    else:  # the stage's one MoE layer, per micro-batch: the counts, dispatch and combine, and the two in backward
        tokens = batch // micro * SIZES["block_size"]
        planned = planner.ep_all_to_all(
            rows=tokens * SIZES["top_k"], hidden=SIZES["n_embd"], bytes_per_element=4, experts=8, ep=ep
        )
        assert a2a["calls"] == micro * 5
        assert a2a["payload_bytes"] == micro * sum(c.payload_bytes for c in planned)  # the uniform routing's bytes
    assert result["states"]["total"] > 0 and result["peak_total_bytes"] > 0
    assert "uniform routing" in " ".join(DryRunReport(config=config, ranks=[result]).format(width=200).split())


@pytest.mark.parametrize("rank", [0, 3], ids=["first_stage", "last_stage"])
def test_char_moe_gpt_with_its_router_loss_dry_runs_under_a_pipeline(fake_world, rank):
    """The router's counting pass before the schedule (its statistics summed over dp_shard, the loss over pp), on
    fake tensors; the parity of the real run is tests/distributed/test_moe.py's."""
    config = DryRunConfig(
        model="lightning_dist.models.moe.CharMoEGPT",
        init_args=dict(n_layer=2, n_head=2, n_embd=16, block_size=8, expert_hidden=8, aux_loss_coef=0.01),
        strategy="pipeline_1f1b",
        strategy_args={"pp": 2, "n_microbatches": 2},
        world_size=4,
        devices_per_node=4,
        precision="32-true",
        batch_size=4,
    )
    if not _compat.torch_pipelining_exchanges_meta():
        pytest.skip("torch's stage metadata exchange is needed by the pipeline dry run (torch >= 2.13)")
    result = simulate_rank(config, rank)
    calls = {(c["op"], c["dim"]): c for c in result["collectives"]}
    # the stage's one MoE layer: 8 counts, 8 probabilities and the rows, float64, in one all-reduce over dp_shard
    assert calls[("all_reduce", "dp_shard")]["calls"] == 1
    assert calls[("all_reduce", "dp_shard")]["payload_bytes"] == (2 * 8 + 1) * 8
    assert calls[("all_reduce", "pp")]["calls"] == 2  # the router loss over the stages; the returned loss's terms


def test_moe_gpt_aux_loss_on_a_pipeline_stage_is_refused_naming_the_call_and_the_fix():
    import pickle

    from lightning_dist.parallelize.pipeline.pruned import model_class_copy
    from lightning_dist.parallelize.pipeline.split import build_stage_module, join_stages, plan_split

    model = MoEGPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, n_experts=4, top_k=2, expert_hidden=4)
    split = plan_split(model, 2)
    # what the LightningModule holds on each pp rank after the split (every rank refuses alike: no rank is left waiting)
    first, last = (build_stage_module(model, split, [s]) for s in (0, 1))
    assert len(last.blocks) == 1 and last.blocks[0] is model.blocks[1]  # outside a run: the stage's own, by position
    for stage in (first, last):  # a stage is the model with 1 of its 2 blocks: its own check refuses
        with pytest.raises(RuntimeError, match=r"MoEGPT.aux_loss\(\) on a pipeline stage: it holds 1 of the 2 blocks"):
            stage.aux_loss()
    with pytest.raises(RuntimeError, match="`tok_emb` is on the first pipeline stage, not on this one"):
        last.tok_emb(torch.zeros(2, 8, dtype=torch.long))  # a part another stage holds, called outside the stage run
    with pytest.raises(RuntimeError, match="`lm_head` is on the last pipeline stage, not on this one"):
        first.lm_head(torch.zeros(2, 8, 8))
    # its parameters too (a stage's forward may read their dtype and shape; outside it, as if it had none)
    with pytest.raises(AttributeError, match=r"`lm_head.weight`: `lm_head` is on the last pipeline stage"):
        first.lm_head.weight.norm()
    assert not hasattr(first.lm_head, "weight") and hasattr(last.lm_head, "weight")
    # the stages' plain copies pickle (the reference model gathers them) and join into the whole network
    whole = join_stages(split, [pickle.loads(pickle.dumps(model_class_copy(s))) for s in (first, last)])
    x = torch.randint(0, 16, (2, 8))
    model.eval()
    whole.eval()
    assert type(whole) is MoEGPT and torch.equal(whole(x), model(x))
