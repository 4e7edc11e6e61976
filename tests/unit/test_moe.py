"""The pack's mixture-of-experts layers and its router load-balancing loss (one process)."""

import pytest
import torch
import torch.nn.functional as F

from lightning_dist.models import MoE, MoEGPT
from lightning_dist.parallelize.moe import RouterStats, balance_loss


@pytest.mark.parametrize("router,n_shared", [("softmax", 0), ("sigmoid", 1)])
def test_moe_is_the_weighted_sum_of_each_tokens_chosen_experts(router, n_shared):
    torch.manual_seed(0)
    moe = MoE(dim=8, n_experts=6, top_k=2, hidden=4, n_shared=n_shared, router=router).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    flat = x.reshape(-1, 8)
    chosen, weights, probs = moe.route(flat)
    assert torch.allclose(weights.sum(-1), torch.ones(15, dtype=torch.float64))  # the chosen weights sum to one
    expected = torch.stack(
        [
            sum(w * moe.experts.expert(int(e), t[None])[0] for e, w in zip(c, ws))
            + (moe.shared.expert(0, t[None])[0] if n_shared else 0)
            for t, c, ws in zip(flat, chosen, weights)
        ]
    )
    assert torch.allclose(moe(x).reshape(-1, 8), expected, atol=1e-12)
    logits = moe.router(flat)
    scores = logits.softmax(-1) if router == "softmax" else logits.sigmoid()
    assert torch.equal(chosen, scores.topk(2, dim=-1).indices)


def test_balance_loss_is_the_switch_loss_and_pipelines_are_refused():
    torch.manual_seed(0)
    model = MoEGPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, n_experts=4, top_k=2, expert_hidden=4)
    model(torch.randint(0, 16, (2, 8)))
    expected = 0.0
    for block in model.blocks:
        s = block.mlp.stats
        expected += 4 * torch.sum((s.counts / s.rows) * (s.probs / s.rows))
    assert torch.allclose(model.aux_loss(), expected)
    # two halves of a batch do not give the whole batch's loss as the mean of theirs (why it is reduced over dp)
    probs = F.softmax(torch.randn(8, 4, dtype=torch.float64), -1)
    chosen = probs.topk(2, dim=-1).indices
    whole = balance_loss(RouterStats.of(chosen, probs, 4))
    halves = [balance_loss(RouterStats.of(chosen[i : i + 4], probs[i : i + 4], 4)) for i in (0, 4)]
    assert not torch.allclose(whole, sum(halves) / 2)
    model.blocks = model.blocks[:1]  # a pipeline stage holds some blocks
    with pytest.raises(RuntimeError, match="pipeline stage: it holds 1 of the 2 blocks"):
        model.aux_loss()
